"""The CUDA and cross (aarch64) builds' CMake arguments (proxy/native/toolchain.py): what a
toolkit without cuBLAS or a driver stub gets, that each gets its own build tree and key, and
that the keys of the native builds do not change."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest

from proxy.bench.arms import ArmSettings
from proxy.errors import BuildError
from proxy.native import build, toolchain

pytestmark = pytest.mark.unit


def _toolkit(root: Path, cublas: bool, stub: bool) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "nvcc").write_text("")
    (root / "include").mkdir()
    if cublas:
        (root / "include" / "cublas_v2.h").write_text("")
    if stub:
        (root / "lib64" / "stubs").mkdir(parents=True)
        (root / "lib64" / "stubs" / "libcuda.so").write_text("")
    return root


def test_a_complete_toolkit_needs_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CUDAToolkit_ROOT", str(_toolkit(tmp_path / "cuda", cublas=True, stub=True)))
    assert toolchain.cuda_args() == []
    assert build._cmake_args(build.BuildSpec(backend="cuda"))[-2:] == [
        "-DGGML_CUDA=ON",
        "-DLLAMA_KVCTL_FAULT_INJECT=OFF",
    ]


def test_pypi_toolkit_takes_cublas_from_the_cache_and_the_system_driver(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CUDAToolkit_ROOT", str(_toolkit(tmp_path / "cuda", cublas=False, stub=False)))
    monkeypatch.setenv("RADIX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RADIX_CUBLAS_DIR", raising=False)
    lib = tmp_path / "cache" / "cuda" / f"cublas-{toolchain.CUBLAS.version}" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcublas.so.13").write_text("")
    (lib / "libcublasLt.so.13").write_text("")
    driver = tmp_path / "driver"
    driver.mkdir()
    (driver / "libcuda.so.1").write_text("")
    monkeypatch.setattr(toolchain, "DRIVER_DIRS", (str(driver),))
    args = toolchain.cuda_args()
    assert f"-DCUDA_cublas_LIBRARY={lib / 'libcublas.so.13'}" in args
    assert f"-DCUDA_cublasLt_LIBRARY={lib / 'libcublasLt.so.13'}" in args
    assert f"-DCMAKE_CUDA_FLAGS=-I{lib.parent / 'include'}" in args
    assert f"-DCUDA_cuda_driver_LIBRARY={driver / 'libcuda.so.1'}" in args
    # No driver at all (no GPU here): ggml's VMM pool off, so nothing links libcuda.
    monkeypatch.setattr(toolchain, "DRIVER_DIRS", (str(tmp_path / "none"),))
    assert toolchain.cuda_args()[-1] == "-DGGML_CUDA_NO_VMM=ON"
    # A cuBLAS the caller names (a Python environment's nvidia/cu13) wins over the cache.
    monkeypatch.setenv("RADIX_CUBLAS_DIR", str(tmp_path / "site" / "nvidia" / "cu13"))
    assert (
        f"-DCMAKE_CUDA_FLAGS=-I{tmp_path / 'site' / 'nvidia' / 'cu13' / 'include'}" in toolchain.cuda_args()
    )


def test_no_toolkit_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CUDAToolkit_ROOT", str(tmp_path / "nothing"))
    with pytest.raises(BuildError, match="no CUDA toolkit"):
        toolchain.ensure_cuda()


def test_cross_build_has_its_own_tree_key_and_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    native, arm = build.BuildSpec(), build.BuildSpec(cross="aarch64")
    args = build._cmake_args(arm)
    assert "-DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++" in args
    assert "-DGGML_NATIVE=OFF" in args
    assert not any("-mno-amx" in a for a in args)  # x86 flags are the host's, not the target's
    assert build._key(arm, []) != build._key(native, [])
    assert build._base_key(arm) != build._base_key(native)
    # The native builds' keys are those of before (computed without a "cross" entry).
    assert "cross" not in str(build._cmake_args(native))
    with pytest.raises(BuildError, match="unknown cross target"):
        build.BuildSpec(cross="riscv64")


def test_cross_build_without_the_toolchain_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # The cross compilers are missing, nothing else.
    monkeypatch.setattr(shutil, "which", lambda tool: None if "aarch64" in tool else f"/usr/bin/{tool}")
    with pytest.raises(BuildError, match="aarch64-linux-gnu-g\\+\\+ not found"):
        build._check_tools("cpu", "aarch64")


def test_emulated_wrapper_runs_the_binary_under_qemu(tmp_path: Path) -> None:
    wrapper = toolchain.write_emulated_wrapper(
        "aarch64", Path("/c/llama-server"), tmp_path / "w" / "llama-server"
    )
    text = wrapper.read_text()
    assert "exec 'qemu-aarch64-static' '-L' '/usr/aarch64-linux-gnu' '/c/llama-server' \"$@\"" in text
    assert wrapper.stat().st_mode & 0o111


def test_gpu_layers_reach_every_bench_server(tmp_path: Path) -> None:
    plain = ArmSettings(model=tmp_path / "m.gguf", log_dir=tmp_path, n_parallel=4, ctx_size=4096)
    assert "-ngl" not in plain.common_args()
    offloaded = ArmSettings(
        model=tmp_path / "m.gguf", log_dir=tmp_path, n_parallel=4, ctx_size=4096, gpu_layers=99
    )
    assert offloaded.common_args()[-2:] == ("-ngl", "99")
