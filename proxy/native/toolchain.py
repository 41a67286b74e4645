"""What the CUDA and the cross-compiled (aarch64) builds need beyond BuildSpec's flags.

CUDA (docs/devices.md, ``make cuda-check``): ggml-cuda links cuBLAS and, unless
``GGML_CUDA_NO_VMM``, the driver library (``CUDA::cuda_driver``). A toolkit installed from
PyPI's ``nvidia-cuda-nvcc`` and friends (this project's machines) has neither: the build then
takes cuBLAS from ``$RADIX_CUBLAS_DIR`` (a directory with ``include/cublas_v2.h`` and
``lib/libcublas.so*``, e.g. a Python environment's ``site-packages/nvidia/cu13``) or from
PyPI's ``nvidia-cublas`` wheel, fetched with pip into the cache (sha256 pinned, CUDA 13 only);
the driver from the system's ``libcuda.so.1`` where the toolkit has no stub, and where there is
none at all (a machine without a GPU driver) it builds with ``GGML_CUDA_NO_VMM=ON``, which only
drops ggml's virtual-memory pool. Each of these choices is a CMake argument, so it is part of
the build's key and of its ``build.json``.

Cross (``--cross aarch64``, ``make arm64-check``): Debian's ``g++-aarch64-linux-gnu``, the
binary run under ``qemu-aarch64-static`` with the cross sysroot as its library prefix.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import zipfile
from dataclasses import dataclass
from pathlib import Path

from proxy.errors import BuildError
from proxy.native.fetch import cache_root, file_lock, pip_download, say, staging_dir


@dataclass(frozen=True)
class WheelPin:
    package: str
    version: str
    filename: str
    sha256: str
    prefix: str  # the wheel's directory holding include/ and lib/
    cuda_major: int


CUBLAS = WheelPin(
    package="nvidia-cublas",
    version="13.0.2.14",
    filename="nvidia_cublas-13.0.2.14-py3-none-manylinux_2_27_x86_64.whl",
    sha256="0cf238ffdbe46c00cb9aa98e7bca745c223a5ca5a53e686ac8b3e5a08fe80d6c",
    prefix="nvidia/cu13/",
    cuda_major=13,
)

# Where a driver library may be when the toolkit has no stub (ldconfig's directories, the
# NVIDIA container toolkit's mount).
DRIVER_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/nvidia/lib64",
    "/usr/local/nvidia/lib",
)


def toolkit_root() -> Path | None:
    """The CUDA toolkit the build will use: ``$CUDAToolkit_ROOT``/``$CUDA_PATH``/``$CUDA_HOME``,
    else the one whose nvcc is on PATH."""
    for name in ("CUDAToolkit_ROOT", "CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(name):
            return Path(os.environ[name])
    nvcc = shutil.which("nvcc")
    return Path(nvcc).resolve().parents[1] if nvcc else None


def _toolkit_dirs(root: Path, sub: str) -> list[Path]:
    return [root / sub, *(Path(p) for p in sorted(glob.glob(str(root / "targets" / "*" / sub))))]


def toolkit_has_cublas(root: Path) -> bool:
    return any((d / "cublas_v2.h").exists() for d in _toolkit_dirs(root, "include"))


def toolkit_has_driver_stub(root: Path) -> bool:
    libs = [*_toolkit_dirs(root, "lib"), *_toolkit_dirs(root, "lib64")]
    return any((d / "stubs" / "libcuda.so").exists() or (d / "libcuda.so").exists() for d in libs)


def system_driver() -> Path | None:
    for directory in DRIVER_DIRS:
        for name in ("libcuda.so", "libcuda.so.1"):
            if (Path(directory) / name).exists():
                return Path(directory) / name
    return None


def fetched_cublas_dir() -> Path:
    return cache_root() / "cuda" / f"cublas-{CUBLAS.version}"


def cublas_dir() -> Path:
    env = os.environ.get("RADIX_CUBLAS_DIR")
    return Path(env) if env else fetched_cublas_dir()


def _lib(directory: Path, name: str) -> Path:
    """``libX.so`` if there, else its versioned file (a wheel ships only ``libX.so.13``)."""
    plain = directory / name
    found = sorted(directory.glob(f"{name}.*"))
    return plain if plain.exists() or not found else found[0]


def cuda_args() -> list[str]:
    """The CMake arguments the toolkit found here needs (nothing for a complete toolkit)."""
    root = toolkit_root()
    if root is None:
        return []
    args: list[str] = []
    if not toolkit_has_cublas(root):
        cub = cublas_dir()
        args += [
            f"-DCUDA_cublas_LIBRARY={_lib(cub / 'lib', 'libcublas.so')}",
            f"-DCUDA_cublasLt_LIBRARY={_lib(cub / 'lib', 'libcublasLt.so')}",
            f"-DCMAKE_CUDA_FLAGS=-I{cub / 'include'}",
        ]
    if not toolkit_has_driver_stub(root):
        driver = system_driver()
        args += [f"-DCUDA_cuda_driver_LIBRARY={driver}"] if driver else ["-DGGML_CUDA_NO_VMM=ON"]
    return args


def ensure_cuda() -> None:
    """Check the toolkit and fetch cuBLAS where the build takes the pinned wheel's."""
    root = toolkit_root()
    if root is None or not (root / "bin" / "nvcc").exists():
        raise BuildError(
            "cannot build the CUDA llama-server: no CUDA toolkit (nvcc) found",
            fix="install the CUDA toolkit and put nvcc on PATH, or set CUDAToolkit_ROOT",
        )
    if toolkit_has_cublas(root) or os.environ.get("RADIX_CUBLAS_DIR"):
        return
    if not (fetched_cublas_dir() / "include" / "cublas_v2.h").exists():
        major = _nvcc_major(root)
        if major != CUBLAS.cuda_major:
            raise BuildError(
                f"the CUDA {major} toolkit at {root} has no cuBLAS, and the pinned wheel is for CUDA {CUBLAS.cuda_major}",
                fix="install the toolkit's cuBLAS, or set RADIX_CUBLAS_DIR to a directory with include/ and lib/ of it",
            )
        fetch_cublas()
    if system_driver() is None and not toolkit_has_driver_stub(root):
        say("no CUDA driver library here: building with GGML_CUDA_NO_VMM=ON (compile check only)")


def _nvcc_major(root: Path) -> int | None:
    out = subprocess.run([str(root / "bin" / "nvcc"), "--version"], capture_output=True, text=True).stdout
    for word in out.replace(",", " ").split():
        if word.startswith("V") and word[1:2].isdigit():
            return int(word[1:].split(".")[0])
    return None


def fetch_cublas() -> Path:
    """PyPI's nvidia-cublas wheel (about 420 MB), its include/ and lib/ unpacked under the cache."""
    final = fetched_cublas_dir()
    with file_lock(final.parent / f".{final.name}.lock"):
        if (final / "include" / "cublas_v2.h").exists():
            return final
        wheel = pip_download(
            f"{CUBLAS.package}=={CUBLAS.version}", CUBLAS.filename, CUBLAS.sha256, sdist=False
        )
        with staging_dir(final) as tmp, zipfile.ZipFile(wheel) as archive:
            for member in archive.infolist():
                rel = (
                    member.filename[len(CUBLAS.prefix) :] if member.filename.startswith(CUBLAS.prefix) else ""
                )
                if not rel.startswith(("include/", "lib/")) or member.is_dir() or ".." in rel.split("/"):
                    continue
                out = tmp / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(member) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            os.replace(tmp, final)
    say(f"cuBLAS {CUBLAS.version}: {final}")
    return final


# --- cross builds -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CrossTarget:
    triplet: str
    processor: str
    qemu: str
    cmake_args: tuple[str, ...]
    debian_packages: tuple[str, ...]

    @property
    def sysroot(self) -> Path:
        return Path("/usr") / self.triplet


# aarch64: ARMv8.2-A with dot product and fp16 arithmetic, what the seed's Kunpeng 920 (and
# every Neoverse N1 or later: Graviton 2+, Ampere Altra) has; qemu's default CPU has them too.
CROSS: dict[str, CrossTarget] = {
    "aarch64": CrossTarget(
        triplet="aarch64-linux-gnu",
        processor="aarch64",
        qemu="qemu-aarch64-static",
        cmake_args=("-DGGML_NATIVE=OFF", "-DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16"),
        debian_packages=("gcc-aarch64-linux-gnu", "g++-aarch64-linux-gnu", "qemu-user-static"),
    ),
}


def cross_args(name: str) -> list[str]:
    t = CROSS[name]
    return [
        "-DCMAKE_SYSTEM_NAME=Linux",
        f"-DCMAKE_SYSTEM_PROCESSOR={t.processor}",
        f"-DCMAKE_C_COMPILER={t.triplet}-gcc",
        f"-DCMAKE_CXX_COMPILER={t.triplet}-g++",
        f"-DCMAKE_FIND_ROOT_PATH={t.sysroot}",
        "-DCMAKE_FIND_ROOT_PATH_MODE_PROGRAM=NEVER",
        "-DCMAKE_FIND_ROOT_PATH_MODE_LIBRARY=ONLY",
        "-DCMAKE_FIND_ROOT_PATH_MODE_INCLUDE=ONLY",
        *t.cmake_args,
    ]


def cross_missing(name: str) -> list[str]:
    t = CROSS[name]
    return [tool for tool in (f"{t.triplet}-gcc", f"{t.triplet}-g++") if shutil.which(tool) is None]


def emulated_command(name: str, binary: Path) -> list[str]:
    """How to run a cross-built binary here: under qemu-user with the cross sysroot."""
    t = CROSS[name]
    return [t.qemu, "-L", str(t.sysroot), str(binary)]


def write_emulated_wrapper(name: str, binary: Path, out: Path) -> Path:
    """A ``llama-server`` script that runs ``binary`` under qemu (no binfmt_misc needed)."""
    cmd = " ".join(f"'{part}'" for part in emulated_command(name, binary))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f'#!/bin/sh\nexec {cmd} "$@"\n')
    out.chmod(0o755)
    return out
