"""A request's ``lora`` field through the proxy, against a real patched llama-server.

The proxy checks the field against the server's adapters (from its compatibility key) before
anything is leased or sent: a malformed entry, or an adapter the server does not have, is a 400
in the API's own error shape, and the next request is served as usual. The effective scales are
the namespace part of the cache key (proxy/core/adapters.py, tests/unit/test_adapters.py); reuse
under adapters, on a server that loaded two, is in test_lora.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ProxyThread, ServerFactory, chat_body, post, proxy_config
from tests.tinymodels import tiny_model

FAMILY = "llama-h128"


@pytest.fixture(scope="module")
def plain_proxy(start_server: ServerFactory, patched_bin: Path) -> Iterator[ProxyThread]:
    # No adapters: every "lora" naming one is refused by the proxy before the server sees it.
    patched = start_server(patched_bin, model=tiny_model(FAMILY), ctx_size=4096, threads=1)
    proxy = ProxyThread(proxy_config(patched)).start()
    yield proxy
    proxy.stop()
    patched.stop()


@pytest.mark.parametrize(
    "lora",
    [
        "x",
        [{"id": 0, "scale": 1.0}],
        [{"id": -1, "scale": 1.0}],
        [{"id": 0, "scale": "big"}],
        [{"id": True, "scale": 1.0}],
        [7],
    ],
    ids=["not-a-list", "no-adapters", "negative-id", "scale-not-a-number", "id-bool", "entry-not-object"],
)
def test_a_bad_lora_field_is_a_400(plain_proxy: ProxyThread, lora: Any) -> None:
    proxy = plain_proxy
    reply = post(
        f"{proxy.url}/v1/chat/completions", chat_body([{"role": "user", "content": "hi"}], 4, lora=lora)
    )
    assert reply.status == 400, reply.body
    assert "lora" in reply.body["error"]["message"], reply.body
    # Nothing reached the server: a valid request right after is answered as usual.
    ok = post(f"{proxy.url}/v1/chat/completions", chat_body([{"role": "user", "content": "hi"}], 4))
    assert ok.status == 200, ok.body
