"""The host <-> device copy rate of pinned memory on CUDA device 0: the limit a host restore is read
against (issue 45: a 4k-token restore of the 8B shape within 2x the copy time of its bytes).

Python's standard library only (ctypes over the CUDA runtime the server links), so it runs on a
GPU machine without the project's environment:

    python3 deploy/gpu/pcie_probe.py --mib 512 --out pcie.json

Prints and writes {"mib", "h2d_gb_s", "d2h_gb_s", "h2d_pageable_gb_s", "d2h_pageable_gb_s"} (the
best of --reps copies each way; pageable: from ordinary malloc'd memory, as an unregistered
buffer is copied). Exits 1 with the reason where no CUDA runtime or device is found.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import glob
import json
import time
from pathlib import Path

H2D, D2H = 1, 2  # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost


def _runtime() -> ctypes.CDLL:
    names = [ctypes.util.find_library("cudart") or ""]
    for pattern in ("/usr/local/cuda*/targets/*/lib/libcudart.so*", "/usr/local/cuda*/lib64/libcudart.so*"):
        names += sorted(glob.glob(pattern), reverse=True)
    for name in filter(None, names):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("pcie_probe: no CUDA runtime (libcudart) found")


def _check(rt: ctypes.CDLL, status: int, what: str) -> None:
    if status != 0:
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        raise SystemExit(f"pcie_probe: {what} failed: {rt.cudaGetErrorString(status).decode()}")


def _rate(rt: ctypes.CDLL, dst: ctypes.c_void_p, src: ctypes.c_void_p, n: int, kind: int, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        _check(rt, rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        t0 = time.perf_counter()
        _check(rt, rt.cudaMemcpy(dst, src, ctypes.c_size_t(n), kind), "cudaMemcpy")
        _check(rt, rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        best = min(best, time.perf_counter() - t0)
    return n / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="bytes per copy, in MiB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rt = _runtime()
    count = ctypes.c_int(0)
    _check(rt, rt.cudaGetDeviceCount(ctypes.byref(count)), "cudaGetDeviceCount")
    if count.value < 1:
        raise SystemExit("pcie_probe: no CUDA device")
    n = args.mib << 20
    dev, pinned = ctypes.c_void_p(), ctypes.c_void_p()
    _check(rt, rt.cudaMalloc(ctypes.byref(dev), ctypes.c_size_t(n)), "cudaMalloc")
    _check(rt, rt.cudaMallocHost(ctypes.byref(pinned), ctypes.c_size_t(n)), "cudaMallocHost")
    pageable = ctypes.create_string_buffer(n)
    ctypes.memset(pinned, 1, n)
    page = ctypes.cast(pageable, ctypes.c_void_p)
    result = {
        "mib": args.mib,
        "h2d_gb_s": round(_rate(rt, dev, pinned, n, H2D, args.reps), 2),
        "d2h_gb_s": round(_rate(rt, pinned, dev, n, D2H, args.reps), 2),
        "h2d_pageable_gb_s": round(_rate(rt, dev, page, n, H2D, args.reps), 2),
        "d2h_pageable_gb_s": round(_rate(rt, page, dev, n, D2H, args.reps), 2),
    }
    rt.cudaFreeHost(pinned)
    rt.cudaFree(dev)
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
