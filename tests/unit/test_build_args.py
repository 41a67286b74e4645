"""CMake arguments of the native build: AMX kernels off on x86-64 (they crash at the pinned
commit on CPUs with AMX), nothing extra elsewhere, and the cache key follows the flags."""

from __future__ import annotations

import platform

import pytest

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
