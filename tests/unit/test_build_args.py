"""CMake arguments of the native build: AMX kernels off on x86-64 (they crash at the pinned
commit on CPUs with AMX), nothing extra elsewhere, and the cache key follows the flags."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from proxy.errors import BuildError
from proxy.native import build

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("machine", "amx_off"), [("x86_64", True), ("AMD64", True), ("aarch64", False), ("arm64", False)]
)
def test_amx_is_off_on_x86_only(monkeypatch: pytest.MonkeyPatch, machine: str, amx_off: bool) -> None:
    monkeypatch.setattr(platform, "machine", lambda: machine)
    for backend in build.BACKENDS:
        args = build._cmake_args(build.BuildSpec(backend=backend))
        flags = [a for a in args if a.startswith(("-DCMAKE_C_FLAGS=", "-DCMAKE_CXX_FLAGS="))]
        if amx_off:
            assert len(flags) == 2 and all("-mno-amx-int8" in f and "-mno-amx-tile" in f for f in flags)
        else:
            assert flags == []


def test_operator_flags_come_after_and_change_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    mine = build.BuildSpec(cmake_args=("-DCMAKE_CXX_FLAGS=-O2",))
    args = build._cmake_args(mine)
    assert args.index("-DCMAKE_CXX_FLAGS=-O2") > args.index(f"-DCMAKE_CXX_FLAGS={build.NO_AMX_FLAGS}")
    assert build._key(mine, []) != build._key(build.BuildSpec(), [])


def test_the_environment_s_cmake_args_reach_every_backend_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """$RADIX_BUILD_CMAKE_ARGS (shell words) is part of what serving, the benches and the device
    tests build, so a bounded CUDA build (deploy/gpu/check.sh) has its own cache key."""
    monkeypatch.delenv(build.CMAKE_ARGS_ENV, raising=False)
    assert build.spec_for("stock", "cuda") == build.BuildSpec(variant="stock", backend="cuda")
    monkeypatch.setenv(build.CMAKE_ARGS_ENV, "-DCMAKE_CUDA_ARCHITECTURES=90-real  '-DX=a b'")
    spec = build.spec_for("patched", "cuda")
    assert spec.cmake_args == ("-DCMAKE_CUDA_ARCHITECTURES=90-real", "-DX=a b")
    assert build._cmake_args(spec)[-3:-1] == ["-DCMAKE_CUDA_ARCHITECTURES=90-real", "-DX=a b"]
    assert build._key(spec, []) != build._key(build.BuildSpec(backend="cuda"), [])


def _headers(root: Path, new: bool) -> Path:
    (root / "vulkan").mkdir(parents=True)
    (root / "vulkan" / "vulkan.hpp").write_text("")
    (root / "vulkan" / "vulkan_core.h").write_text("#define VK_EXT_layer_settings 1\n" if new else "")
    return root


def test_vulkan_builds_against_fetched_headers_where_the_systems_are_too_old(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Debian 12's headers lack VK_EXT_layer_settings (the pinned ggml-vulkan needs it): the
    build takes the ones native/vulkan/fetch-headers.sh unpacked under the cache, the cpu build
    and its key are unchanged, and with neither the build says what to run."""
    monkeypatch.setenv("RADIX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("VULKAN_SDK", raising=False)
    monkeypatch.setattr(build, "SYSTEM_INCLUDES", (_headers(tmp_path / "usr-include", new=False),))
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/bin/{tool}")
    cpu = build.BuildSpec()
    cpu_args, cpu_key = build._cmake_args(cpu), build._key(cpu, [])
    assert build._vulkan_header_args() == []
    with pytest.raises(BuildError, match="fetch-headers.sh"):
        build._check_tools("vulkan")

    fetched = _headers(tmp_path / "cache" / build.VULKAN_HEADERS_DIR / "1.4.309.0-1" / "include", new=True)
    args = build._cmake_args(build.BuildSpec(backend="vulkan"))
    assert args[args.index("-DGGML_VULKAN=ON") + 1] == f"-DVulkan_INCLUDE_DIR={fetched}"
    assert (build._cmake_args(cpu), build._key(cpu, [])) == (cpu_args, cpu_key)
    assert not any("Vulkan" in a for a in cpu_args)

    # New enough system headers (Debian 13): the compiler's own, no override.
    monkeypatch.setattr(build, "SYSTEM_INCLUDES", (_headers(tmp_path / "new-include", new=True),))
    assert not any("Vulkan_INCLUDE_DIR" in a for a in build._cmake_args(build.BuildSpec(backend="vulkan")))


def test_objects_of_maps_each_changed_source_to_its_own_object_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`radixctl build --objects-only` (make cuda-check) compiles the object files of exactly
    the sources the patch series changes: headers have none, and a file of the same name in
    another folder is not one of them."""
    listing = "\n".join(
        [
            "tools/server/CMakeFiles/server-context.dir/server-kvctl.cpp.o: CXX_COMPILER__server-context",
            "tools/server/CMakeFiles/llama-server-impl.dir/server.cpp.o: CXX_COMPILER__llama-server-impl",
            "tools/server/CMakeFiles/llama-server-impl.dir/server-http.cpp.o: CXX_COMPILER__llama-server-impl",
            "tools/mtmd/CMakeFiles/mtmd.dir/arg.cpp.o: CXX_COMPILER__mtmd",
            "common/CMakeFiles/llama-common.dir/arg.cpp.o: CXX_COMPILER__llama-common",
            "src/CMakeFiles/llama.dir/llama-kv-cache.cpp.o: CXX_COMPILER__llama",
            "bin/llama-server: CXX_EXECUTABLE_LINKER__llama-server",
        ]
    )
    monkeypatch.setattr(
        subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=listing, stderr="")
    )
    tree = build._WorkTree.__new__(build._WorkTree)
    tree.build = tmp_path
    changed = [
        "common/arg.cpp",
        "tools/server/server.cpp",
        "tools/server/server-kvctl.h",
        "src/llama-kv-cache.cpp",
    ]
    assert tree.objects_of(changed) == [
        "common/CMakeFiles/llama-common.dir/arg.cpp.o",
        "src/CMakeFiles/llama.dir/llama-kv-cache.cpp.o",
        "tools/server/CMakeFiles/llama-server-impl.dir/server.cpp.o",
    ]
