"""The layout check's verdicts: what turns moves off, what only defers the check, and the
retries and per-instance memory of LayoutChecks (the round trip itself runs against real servers
in tests/integration/test_layout_check.py and test_architectures.py)."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import aiohttp
import pytest

from proxy.errors import BackendError, FallbackCause, KvMoveError, PayloadError, RadixError
from proxy.server.dataplane import layoutcheck
from proxy.server.dataplane.layoutcheck import LayoutCheckDeferred, LayoutChecks, check_layout

BACKEND = types.SimpleNamespace(url="http://127.0.0.1:1")  # only its url is logged
DEFERRED: list[BaseException] = [
    LayoutCheckDeferred("every slot is busy"),
    KvMoveError(FallbackCause.TRANSPORT, "connection reset"),
    KvMoveError(FallbackCause.TIMEOUT, "deadline"),
    KvMoveError(FallbackCause.CONFLICT, "409"),
    KvMoveError(FallbackCause.INSTANCE, "restarted"),
    KvMoveError(FallbackCause.NO_SPACE, "shm full"),
    BackendError("overloaded", backend_status=503),
    BackendError("no answer", backend_status=0),
    BackendError("too many", backend_status=429),
    aiohttp.ClientConnectionError("refused"),
    TimeoutError(),
]
VERDICT: list[BaseException] = [
    KvMoveError(FallbackCause.IMPORT, "layout mismatch"),
    KvMoveError(FallbackCause.PAYLOAD, "truncated V"),
    KvMoveError(FallbackCause.VERIFY, "sha mismatch"),
    BackendError("bad request", backend_status=400),
    PayloadError("cannot parse"),
]


def _failing(exc: BaseException) -> Any:
    async def round_trip(backend: Any, mover: Any) -> tuple[str, ...]:
        raise exc

    return round_trip


@pytest.mark.parametrize("exc", DEFERRED, ids=lambda e: f"{type(e).__name__}-{e}")
def test_a_busy_or_unreachable_server_gets_no_verdict(
    exc: BaseException, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(layoutcheck, "_round_trip", _failing(exc))
    with pytest.raises(LayoutCheckDeferred):
        asyncio.run(check_layout(None, None))  # type: ignore[arg-type]


@pytest.mark.parametrize("exc", VERDICT, ids=lambda e: f"{type(e).__name__}-{e}")
def test_a_failed_move_turns_moves_off(exc: RadixError, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layoutcheck, "_round_trip", _failing(exc))
    reasons = asyncio.run(check_layout(None, None))  # type: ignore[arg-type]
    assert len(reasons) == 1 and exc.message in reasons[0]


class _Script:
    """check_layout answering from a script: an exception is raised, a tuple returned."""

    def __init__(self, *steps: Any) -> None:
        self.steps, self.calls = list(steps), 0

    async def __call__(self, backend: Any, mover: Any) -> tuple[str, ...]:
        self.calls += 1
        step = self.steps.pop(0)
        if isinstance(step, BaseException):
            raise step
        return tuple(step)


@pytest.fixture
def no_sleep() -> list[float]:
    """The pauses LayoutChecks took (none is waited)."""
    return []


def _checks(slept: list[float]) -> LayoutChecks:
    async def pause(seconds: float) -> None:
        slept.append(seconds)

    return LayoutChecks(pause)


def test_a_deferred_check_is_retried_and_its_verdict_kept(
    monkeypatch: pytest.MonkeyPatch, no_sleep: list[float]
) -> None:
    busy = LayoutCheckDeferred("every slot is busy")
    script = _Script(busy, busy, ())
    monkeypatch.setattr(layoutcheck, "check_layout", script)
    checks = _checks(no_sleep)
    assert asyncio.run(checks.verdict("i1", BACKEND, None)) == ()  # type: ignore[arg-type]
    assert script.calls == 3 and no_sleep == [0.5, 1.0]
    # The same instance again (its slots were read and something failed after): not checked again.
    assert asyncio.run(checks.verdict("i1", BACKEND, None)) == ()  # type: ignore[arg-type]
    assert script.calls == 3


def test_no_verdict_in_every_try_is_raised_and_not_kept(
    monkeypatch: pytest.MonkeyPatch, no_sleep: list[float]
) -> None:
    busy = LayoutCheckDeferred("every slot is busy")
    script = _Script(*[busy] * LayoutChecks.TRIES, ("a test move failed",))
    monkeypatch.setattr(layoutcheck, "check_layout", script)
    checks = _checks(no_sleep)
    with pytest.raises(LayoutCheckDeferred):
        asyncio.run(checks.verdict("i1", BACKEND, None))  # type: ignore[arg-type]
    assert script.calls == LayoutChecks.TRIES
    assert asyncio.run(checks.verdict("i1", BACKEND, None)) == ("a test move failed",)  # type: ignore[arg-type]


def test_a_forgotten_or_new_instance_is_checked_again(
    monkeypatch: pytest.MonkeyPatch, no_sleep: list[float]
) -> None:
    script = _Script((), ("moved bytes differ",), ())
    monkeypatch.setattr(layoutcheck, "check_layout", script)
    checks = _checks(no_sleep)
    assert asyncio.run(checks.verdict("i1", BACKEND, None)) == ()  # type: ignore[arg-type]
    assert asyncio.run(checks.verdict("i2", BACKEND, None)) == ("moved bytes differ",)  # type: ignore[arg-type]
    checks.forget("i1")
    assert asyncio.run(checks.verdict("i1", BACKEND, None)) == ()  # type: ignore[arg-type]
    assert script.calls == 3
