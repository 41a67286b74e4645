"""The proxy's event loop choice (proxy/server/ops/eventloop.py)."""

from __future__ import annotations

import asyncio
import builtins
from typing import Any

import pytest

from proxy.errors import ConfigError
from proxy.server.ops import eventloop

pytestmark = pytest.mark.unit


async def _which() -> str:
    await asyncio.sleep(0)
    await asyncio.to_thread(lambda: None)  # the worker-thread hop the mover and tokenizer use
    return eventloop.loop_name(asyncio.get_running_loop())


def test_auto_is_uvloop_when_installed() -> None:
    pytest.importorskip("uvloop")
    assert eventloop.run(_which(), "auto") == "uvloop"
    assert eventloop.run(_which(), "uvloop") == "uvloop"


def test_asyncio_is_asyncio() -> None:
    assert eventloop.run(_which(), "asyncio") == "asyncio"
    loop = eventloop.new_event_loop("asyncio")
    try:
        assert eventloop.loop_name(loop) == "asyncio"
    finally:
        loop.close()


def _without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def fake_import(name: str, *args: Any, **kw: Any) -> Any:
        if name == "uvloop":
            raise ImportError("no uvloop here")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", fake_import)


def test_auto_falls_back_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_uvloop(monkeypatch)
    assert eventloop.run(_which(), "auto") == "asyncio"


def test_uvloop_asked_for_but_missing_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_uvloop(monkeypatch)
    with pytest.raises(ConfigError) as err:
        eventloop.loop_factory("uvloop")
    assert "not installed" in err.value.message and "--event-loop asyncio" in err.value.fix


def test_unknown_kind_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        eventloop.loop_factory("trio")
