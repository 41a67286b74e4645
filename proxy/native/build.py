"""Build llama-server (patched or stock) from the pinned source, cached by content hash.

Layout under the cache root:

- ``src/llama.cpp-<commit>-<sha8>/``: the pristine source, extracted once from the sdist.
- ``work/<base-key>/``: one editable copy of the source plus its CMake build directory,
  shared by every variant (stock, patched, patched with fault injection) of the same
  backend and CMake flags. Switching variant restores the files the previous patch set
  touched and applies the new one, so only those files recompile (about 2 minutes for the
  server objects, against about 8 for a full build on 2 cores).
- ``bin/<variant>-<backend>-<key>/llama-server``: finished binaries, keyed by a hash of the
  source pin, the patch contents, the backend, the flags and the fault option. A build
  whose key already exists returns at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import tarfile
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.errors import BuildError
from proxy.native.archive import safe_extract
from proxy.native.fetch import cache_root, file_lock, pip_download, say, staging_dir, step
from proxy.native.pins import LLAMA_CPP
from proxy.native.toolchain import CROSS, cross_args, cross_missing, cuda_args, ensure_cuda

BACKENDS: dict[str, list[str]] = {
    "cpu": [],
    "cuda": ["-DGGML_CUDA=ON"],
    "cann": ["-DGGML_CANN=ON"],
    "metal": ["-DGGML_METAL=ON"],
    "vulkan": ["-DGGML_VULKAN=ON"],
}

# Static, no network at build time (the web UI would otherwise be fetched from a hub),
# no libcurl/openssl: the proxy talks plain HTTP on the same host.
BASE_CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    # The sdist has no git history; without this `--version` says "commit unknown".
    f"-DLLAMA_BUILD_COMMIT={LLAMA_CPP.commit}",
]

# x86-64: ggml's AMX kernels off. A native build on a CPU with AMX (Sapphire Rapids and later)
# compiles them in and repacks the model's weights for them, and at the pinned commit the
# first decode then dies with SIGSEGV in ggml_backend_amx_mul_mat (seen on this project's
# machines with SmolLM2 Q4_1; `--no-repack` avoids it too, at the cost of every other repack).
# Explicit -mno-* flags win over the -march=native that GGML_NATIVE adds, in GCC and clang.
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
X86_CMAKE_ARGS = [f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}"]

FAULT_OPTION = "LLAMA_KVCTL_FAULT_INJECT"

# Extra CMake arguments (shell words) for the builds that `radixctl serve`, `radixctl build`
# (without --cmake-arg), the benches' arms and the device tests ask for: e.g. one GPU
# architecture and no flash-attention kernels, which bound a CUDA build's time
# (deploy/gpu/check.sh, docs/devices.md). Part of each build's cache key like any CMake argument.
CMAKE_ARGS_ENV = "RADIX_BUILD_CMAKE_ARGS"


@dataclass(frozen=True)
class BuildSpec:
    variant: str = "patched"  # "patched" or "stock"
    backend: str = "cpu"
    cmake_args: tuple[str, ...] = ()
    fault_injection: bool = False
    cross: str = ""  # "" builds for this machine; "aarch64": Debian's cross toolchain (toolchain.py)
    jobs: int = field(default_factory=lambda: os.cpu_count() or 2, compare=False)

    def __post_init__(self) -> None:
        if self.variant not in ("patched", "stock"):
            raise BuildError(f"unknown variant {self.variant!r}", fix="use 'patched' or 'stock'")
        if self.backend not in BACKENDS:
            raise BuildError(f"unknown backend {self.backend!r}", fix=f"use one of {', '.join(BACKENDS)}")
        if self.cross and self.cross not in CROSS:
            raise BuildError(f"unknown cross target {self.cross!r}", fix=f"use one of {', '.join(CROSS)}")
        if self.fault_injection and self.variant != "patched":
            raise BuildError(
                "fault injection exists only in the patched server", fix="drop --fault-injection"
            )


def env_cmake_args() -> tuple[str, ...]:
    return tuple(shlex.split(os.environ.get(CMAKE_ARGS_ENV, "")))


def spec_for(variant: str, backend: str) -> BuildSpec:
    """The build of ``variant`` for ``backend`` that serving, the benches and the device tests
    use: the backend's own arguments plus ``$RADIX_BUILD_CMAKE_ARGS``."""
    return BuildSpec(variant=variant, backend=backend, cmake_args=env_cmake_args())


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


PATCH_SUBDIR = Path("native") / "llama-server-patch" / "patches"


def patch_dir() -> Path:
    """``$RADIX_PATCH_DIR``, else the series of the checkout this package runs from (editable
    install) or, after ``pip install .`` from a checkout (deploy/Dockerfile), of the current
    directory's checkout."""
    env = os.environ.get("RADIX_PATCH_DIR")
    if env:
        return Path(env)
    candidates = [repo_root() / PATCH_SUBDIR, Path.cwd() / PATCH_SUBDIR]
    return next((c for c in candidates if c.is_dir()), candidates[0])


def patch_files() -> list[Path]:
    return sorted(patch_dir().glob("*.patch"))


def _series() -> list[Path]:
    """The series for a patched build; never empty, so it can not silently be a stock one."""
    found = patch_files()
    if not found:
        raise BuildError(
            f"no llama-server patch series in {patch_dir()}",
            fix=f"run from the project checkout, or set RADIX_PATCH_DIR to its {PATCH_SUBDIR}",
        )
    return found


def server_path(spec: BuildSpec) -> Path:
    """Where the ``llama-server`` of ``spec`` is (or would be) cached; nothing is built."""
    patches = _series() if spec.variant == "patched" else []
    name = "-".join(
        [spec.variant, spec.backend, *([spec.cross] if spec.cross else []), _key(spec, patches)[:16]]
    )
    return cache_root() / "bin" / name / "llama-server"


def build_server(spec: BuildSpec) -> Path:
    """Return the path of a ``llama-server`` for ``spec``, building it if it is not cached."""
    patches = _series() if spec.variant == "patched" else []
    binary = server_path(spec)
    out_dir = binary.parent
    if binary.exists():
        return binary
    with _locked_tree(spec) as tree:
        if binary.exists():
            return binary
        args = tree.prepare(patches, _cmake_args(spec))
        tree.compile(spec.jobs)
        with staging_dir(out_dir) as tmp:
            shutil.copy2(tree.build / "bin" / "llama-server", tmp / "llama-server")
            info = {
                "variant": spec.variant,
                "backend": spec.backend,
                **({"cross": spec.cross} if spec.cross else {}),
                "cmake_args": args,
                "patches": [p.name for p in patches],
                "source": LLAMA_CPP.filename,
                "commit": LLAMA_CPP.commit,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
            (tmp / "build.json").write_text(json.dumps(info, indent=2))
            os.replace(tmp, out_dir)
    say(f"{spec.variant} llama-server ready: {binary}")
    return binary


def compile_patched_objects(spec: BuildSpec) -> list[str]:
    """Compile only the object files of the sources the patch series changes, configured as
    ``spec`` (its backend's flags and headers), and link nothing; return them. A bounded check
    that the series compiles for a backend (``make cuda-check``): a whole CUDA build takes hours
    on 2 cores, these files minutes. Needs Ninja (single object files as build targets)."""
    if spec.variant != "patched":
        raise BuildError("only the patched variant has patched sources", fix="drop --variant stock")
    if shutil.which("ninja") is None:
        raise BuildError("compiling single object files needs Ninja", fix="apt-get install -y ninja-build")
    with _locked_tree(spec) as tree:
        tree.prepare(_series(), _cmake_args(spec))
        objects = tree.objects_of(tree.state.get("touched", []))
        if not objects:
            raise BuildError(
                "no object file compiles a source the patch series changes", fix="check the series"
            )
        tree.compile(spec.jobs, objects)
    return objects


@contextlib.contextmanager
def _locked_tree(spec: BuildSpec) -> Iterator[_WorkTree]:
    """The shared work tree of ``spec``'s backend and flags, held under its lock; the tools
    checked first (and cuBLAS fetched where a CUDA build takes the pinned wheel's)."""
    _check_tools(spec.backend, spec.cross)
    if spec.backend == "cuda":
        ensure_cuda()
    source = pristine_source()
    work = cache_root() / "work" / _base_key(spec)[:16]
    with file_lock(work.parent / f".{work.name}.lock"):
        yield _WorkTree(work, source)


def _cmake_args(spec: BuildSpec) -> list[str]:
    if spec.cross:
        host = cross_args(spec.cross)
    else:
        host = X86_CMAKE_ARGS if platform.machine().lower() in ("x86_64", "amd64") else []
    backend = BACKENDS[spec.backend] + _backend_extra_args(spec.backend)
    args = BASE_CMAKE_ARGS + host + backend + list(spec.cmake_args)
    if spec.variant == "patched":
        # Always explicit: the build directory is shared, so a value left in CMakeCache.txt
        # by an earlier fault-injection build must be switched off again.
        args.append(f"-D{FAULT_OPTION}={'ON' if spec.fault_injection else 'OFF'}")
    return args


def _backend_extra_args(backend: str) -> list[str]:
    if backend == "vulkan":
        return _vulkan_header_args()
    if backend == "cuda":
        return cuda_args()
    return []


def _key(spec: BuildSpec, patches: list[Path]) -> str:
    material: dict[str, Any] = {
        "source": LLAMA_CPP.sha256,
        "variant": spec.variant,
        "backend": spec.backend,
        "cmake_args": _cmake_args(spec),
        "patches": [[p.name, hashlib.sha256(p.read_bytes()).hexdigest()] for p in patches],
    }
    if spec.cross:  # only when set: the keys of native builds stay what they were
        material["cross"] = spec.cross
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _base_key(spec: BuildSpec) -> str:
    material: dict[str, Any] = {
        "source": LLAMA_CPP.sha256,
        "backend": spec.backend,
        "cmake_args": list(spec.cmake_args),
    }
    if spec.cross:  # its own build tree: another compiler
        material["cross"] = spec.cross
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


# The Vulkan build's own needs (ggml/src/ggml-vulkan/CMakeLists.txt: the loader and its C++
# headers, glslc for the shaders, SPIR-V headers) and Mesa's lavapipe, the CPU Vulkan device
# the tests run on: Debian's packages, installed by `make vulkan-deps` (docs/devices.md).
VULKAN_DEBIAN_PACKAGES = ("libvulkan-dev", "glslc", "spirv-headers", "mesa-vulkan-drivers")


# What the pinned source's ggml-vulkan.cpp uses that older headers lack (vk::LayerSettingEXT,
# headers 1.3.261 and later). Debian 12 has 1.3.239: native/vulkan/fetch-headers.sh (run by
# `make vulkan-deps`) unpacks Debian 13's headers under the cache, and the build uses those.
VULKAN_NEEDED_DEFINE = "VK_EXT_layer_settings"
VULKAN_HEADERS_DIR = "vulkan-headers"


def _headers_ok(include: Path) -> bool:
    try:
        core = (include / "vulkan" / "vulkan_core.h").read_text(errors="replace")
    except OSError:
        return False
    return VULKAN_NEEDED_DEFINE in core and (include / "vulkan" / "vulkan.hpp").exists()


SYSTEM_INCLUDES = (Path("/usr/include"), Path("/usr/local/include"))


def _vulkan_include() -> Path | None:
    """The include directory to build against: None for the compiler's own (the system's or
    a VULKAN_SDK's are new enough, or nothing better is there), else the fetched headers."""
    if os.environ.get("VULKAN_SDK") or any(_headers_ok(d) for d in SYSTEM_INCLUDES):
        return None
    fetched = sorted((cache_root() / VULKAN_HEADERS_DIR).glob("*/include"), reverse=True)
    return next((d for d in fetched if _headers_ok(d)), None)


def _vulkan_header_args() -> list[str]:
    include = _vulkan_include()
    return [f"-DVulkan_INCLUDE_DIR={include}"] if include else []


def _vulkan_missing() -> list[str]:
    missing = [] if shutil.which("glslc") else ["glslc"]
    sdk = os.environ.get("VULKAN_SDK")
    if sdk:
        pass  # the SDK's headers and SPIR-V headers: CMake finds them there
    elif not any((d / "vulkan" / "vulkan.hpp").exists() for d in SYSTEM_INCLUDES):
        missing.append("the Vulkan headers (vulkan/vulkan.hpp)")
    elif not any(_headers_ok(d) for d in SYSTEM_INCLUDES) and _vulkan_include() is None:
        missing.append(
            f"Vulkan headers with {VULKAN_NEEDED_DEFINE} (the system's are too old for the pinned "
            "llama.cpp: native/vulkan/fetch-headers.sh fetches newer ones)"
        )
    # ggml-vulkan's find_package(SPIRV-Headers CONFIG REQUIRED); a LunarG SDK carries its own.
    cmake_dirs = [Path("/usr/share/cmake"), Path("/usr/local/share/cmake"), *Path("/usr/lib").glob("*/cmake")]
    if not sdk and not any((d / "SPIRV-Headers").is_dir() for d in cmake_dirs):
        missing.append("SPIRV-Headers' CMake package")
    return missing


def _check_tools(backend: str = "cpu", cross: str = "") -> None:
    missing = [tool for tool in ("cmake", "git") if shutil.which(tool) is None]
    if cross:
        missing += cross_missing(cross)
    elif not any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler")
    if cross and missing:
        raise BuildError(
            f"cannot cross-build llama-server for {cross}: {', '.join(missing)} not found",
            fix="run `make arm64-deps` (as root), or `apt-get install -y "
            + " ".join(CROSS[cross].debian_packages)
            + "`",
        )
    if missing:
        raise BuildError(
            f"cannot build llama-server: {', '.join(missing)} not found",
            fix="install them, e.g. `apt-get install -y cmake git build-essential ninja-build`",
        )
    if backend == "vulkan" and (missing := _vulkan_missing()):
        raise BuildError(
            f"cannot build the Vulkan llama-server: {', '.join(missing)} not found",
            fix="run `make vulkan-deps` (as root), or `apt-get install -y "
            + " ".join(VULKAN_DEBIAN_PACKAGES)
            + "`, or set VULKAN_SDK to a LunarG SDK",
        )


def pristine_source() -> Path:
    """The pinned llama.cpp source, downloaded, verified and extracted once (read-only use)."""
    final = cache_root() / "src" / f"llama.cpp-{LLAMA_CPP.commit}-{LLAMA_CPP.sha256[:8]}"
    with file_lock(final.parent / f".{final.name}.lock"):
        if final.exists():
            return final
        sdist = pip_download(
            f"{LLAMA_CPP.package}=={LLAMA_CPP.version}", LLAMA_CPP.filename, LLAMA_CPP.sha256, sdist=True
        )
        with staging_dir(final) as tmp, step(f"extract llama.cpp {LLAMA_CPP.commit} into {final}"):
            prefix = LLAMA_CPP.subdir + "/"
            with tarfile.open(sdist) as archive:
                # The vendored tree's `.git` is a submodule pointer to a directory the
                # sdist lacks; git would treat it as a broken repository.
                members = [
                    m for m in archive.getmembers() if m.name.startswith(prefix) and m.name != prefix + ".git"
                ]
                if not members:
                    raise BuildError(f"{sdist.name} has no {LLAMA_CPP.subdir}", fix="check the source pin")
                safe_extract(archive, tmp, members, what="extract")
            os.replace(tmp / LLAMA_CPP.subdir, final)
    return final


class _WorkTree:
    """The shared editable source copy and build directory of one backend and flag set."""

    def __init__(self, root: Path, pristine: Path) -> None:
        self.root = root
        self.pristine = pristine
        self.src = root / "src"
        self.build = root / "build"
        self.state_file = root / "state.json"
        if not self.src.exists():
            with staging_dir(self.src) as tmp, step("prepare build tree"):
                shutil.copytree(pristine, tmp / "src", symlinks=True, ignore=_ignore_git)
                os.replace(tmp / "src", self.src)
        self.state: dict[str, Any] = (
            json.loads(self.state_file.read_text()) if self.state_file.exists() else {}
        )

    def _save(self) -> None:
        self.state_file.write_text(json.dumps(self.state, indent=2))

    def switch_patches(self, patches: list[Path]) -> None:
        wanted = [[p.name, hashlib.sha256(p.read_bytes()).hexdigest()] for p in patches]
        if self.state.get("patches") == wanted and not self.state.get("dirty"):
            return
        self._restore()
        touched: list[str] = []
        for patch in patches:
            touched += self._git_apply(["--numstat"], patch).split("\n")
        self.state.update(
            touched=[line.split("\t")[-1] for line in touched if line.strip()], patches=None, dirty=True
        )
        self._save()
        for patch in patches:
            self._git_apply(["--check"], patch)
            self._git_apply([], patch)
            say(f"applied {patch.name}")
        self.state.update(patches=wanted, dirty=False)
        self._save()

    def _restore(self) -> None:
        # copyfile, not copy2: a restored file must look newer than its object file.
        for rel in self.state.get("touched", []):
            target, original = self.src / rel, self.pristine / rel
            if original.exists():
                shutil.copyfile(original, target)
            elif target.exists():
                target.unlink()
        self.state.update(touched=[], patches=[], dirty=False)
        self._save()

    def _git_apply(self, flags: list[str], patch: Path) -> str:
        # The ceiling keeps git from treating an enclosing repository as the patch root.
        env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(self.root))
        proc = subprocess.run(
            ["git", "apply", *flags, str(patch)], cwd=self.src, env=env, capture_output=True, text=True
        )
        if proc.returncode != 0:
            detail = " | ".join(proc.stderr.strip().splitlines()[:6])
            self._restore()
            raise BuildError(
                f"patch {patch.name} does not apply to llama.cpp {LLAMA_CPP.commit}: {detail}",
                fix="rebase the series with `radixctl patch checkout` / `radixctl patch export` "
                "(see native/llama-server-patch/README.md)",
            )
        return proc.stdout

    def prepare(self, patches: list[Path], args: list[str]) -> list[str]:
        """``patches`` applied (only those) and the build configured with ``args``; returns them."""
        self.switch_patches(patches)
        self.configure(args)
        return args

    def configure(self, args: list[str]) -> None:
        if self.state.get("configured") == args and (self.build / "CMakeCache.txt").exists():
            return
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        with step("cmake configure"):
            _run_logged(
                ["cmake", "-S", str(self.src), "-B", str(self.build), *generator, *args],
                "cmake configure failed",
                self.root / "configure.log",
            )
        self.state["configured"] = args
        self._save()

    def compile(self, jobs: int, targets: list[str] | None = None) -> None:
        what = f"{len(targets)} object files" if targets else "llama-server"
        with step(f"compile {what} (-j {jobs})"):
            _run_logged(
                [
                    "cmake",
                    "--build",
                    str(self.build),
                    "--target",
                    *(targets or ["llama-server"]),
                    "-j",
                    str(jobs),
                ],
                f"compiling {what} failed",
                self.root / "build.log",
                progress=True,
            )

    def objects_of(self, sources: list[str]) -> list[str]:
        """The build's object files (Ninja targets) that compile any of ``sources`` (paths
        relative to the source tree; headers have none of their own)."""
        listing = subprocess.run(
            ["ninja", "-C", str(self.build), "-t", "targets", "all"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        objects = [
            line.split(":", 1)[0] for line in listing.splitlines() if line.split(":", 1)[0].endswith(".o")
        ]
        found = []
        for src in sorted(set(sources)):
            folder, name = os.path.split(src)
            prefix = f"{folder}/CMakeFiles/" if folder else "CMakeFiles/"
            found += [o for o in objects if o.startswith(prefix) and o.endswith(f"/{name}.o")]
        return found


def _ignore_git(directory: str, names: list[str]) -> set[str]:
    return {".git"} & set(names) if Path(directory).name.startswith("llama.cpp-") else set()


_PROGRESS = re.compile(r"^\[\s*(\d+)/(\d+)\]|^\[\s*(\d+)%\]")


def _run_logged(cmd: list[str], what: str, log_path: Path, progress: bool = False) -> None:
    tail: deque[str] = deque(maxlen=30)
    started = last_report = time.monotonic()
    last_pct = -10
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            tail.append(line.rstrip())
            match = _PROGRESS.match(line) if progress else None
            if match:
                pct = (
                    int(match.group(3))
                    if match.group(3)
                    else 100 * int(match.group(1)) // int(match.group(2))
                )
                now = time.monotonic()
                if pct >= last_pct + 10 or now - last_report > 30:
                    say(f"  compile {pct:3d}%  ({now - started:.0f} s)")
                    last_pct, last_report = pct, now
        code = proc.wait()
    if code != 0:
        errors = [line for line in tail if "error" in line.lower()] or list(tail)[-8:]
        raise BuildError(
            f"{what} (exit {code}): " + " | ".join(errors[-8:]), fix=f"see the full log at {log_path}"
        )
