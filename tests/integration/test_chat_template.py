"""The chat template rendered in the proxy, against a real llama-server's /apply-template.

The local rendering is kept only when it is byte-equal to the server's on the parity
conversations; a template that renders differently, or one that depends on what the proxy
cannot see, falls back to the server. Through the proxy, plain requests are rendered
locally (no /apply-template call) and others by the server, with the same tokens either way.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.native.launch import ServerProcess
from proxy.tokenizer import CORPUS
from proxy.tokenizer.template import ChatTemplate, check_template_parity, parity_conversations, probe_template
from tests.helpers import ProxyThread, ServerFactory, get, post, proxy_config

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def props(stock_server: ServerProcess) -> dict[str, Any]:
    reply = get(stock_server.url + "/props")
    assert reply.status == 200
    return dict(reply.body)


def _probe(url: str, source: str, props: dict[str, Any]) -> Any:
    async def run() -> Any:
        async with aiohttp.ClientSession() as session:

            async def remote(messages: list[dict[str, str]]) -> str:
                async with session.post(url + "/apply-template", json={"messages": messages}) as r:
                    r.raise_for_status()
                    return str((await r.json())["prompt"])

            # SmolLM2's vocab adds no BOS/EOS (checked in test_probe_finds_the_template_local).
            return await probe_template(source, props["bos_token"], props["eos_token"], False, False, remote)

    return asyncio.run(run())


def test_probe_finds_the_template_local(stock_server: ServerProcess, props: dict[str, Any]) -> None:
    tokens = post(stock_server.url + "/tokenize", {"content": "", "add_special": True}).body["tokens"]
    assert tokens == []  # no BOS/EOS added by this vocab
    result = _probe(stock_server.url, props["chat_template"], props)
    assert result.template is not None, result.parity
    assert result.note == "local"
    assert result.parity is not None and result.parity.checked == len(parity_conversations()) > 50


def test_random_conversations_render_alike(stock_server: ServerProcess, props: dict[str, Any]) -> None:
    template = ChatTemplate(
        props["chat_template"], props["bos_token"], props["eos_token"], add_bos=False, add_eos=False
    )
    rng = random.Random(7)
    texts = [t for t in CORPUS if t]
    for _ in range(40):
        n = rng.randint(1, 6)
        messages = [{"role": "system", "content": rng.choice(texts)}] if rng.random() < 0.5 else []
        for k in range(n):
            role = "user" if k % 2 == 0 else "assistant"
            messages.append({"role": role, "content": rng.choice(texts)[: rng.randint(0, 200)]})
        if messages[-1]["role"] == "assistant":
            messages.append({"role": "user", "content": "and?"})
        body = {"messages": messages, "max_tokens": 4, "temperature": 0}
        assert template.render(body) == post(stock_server.url + "/apply-template", body).body["prompt"]


def test_a_template_that_renders_differently_falls_back(
    stock_server: ServerProcess, props: dict[str, Any]
) -> None:
    # What a difference between jinja2 and llama.cpp's engine would look like: the same
    # template, but content trimmed (Python strips more whitespace kinds than ASCII).
    source = props["chat_template"].replace("message['content']", "message['content'] | trim")
    assert source != props["chat_template"]
    result = _probe(stock_server.url, source, props)
    assert result.template is None
    assert result.parity is not None and not result.parity.ok and result.parity.mismatches
    assert result.note.startswith("server (")


def test_an_unknown_template_is_not_rendered_locally(
    stock_server: ServerProcess, props: dict[str, Any]
) -> None:
    source = "{{ strftime_now('%Y') }}" + props["chat_template"]
    result = _probe(stock_server.url, source, props)
    assert result.template is None and result.parity is None
    assert "strftime_now" in result.reason


def test_parity_reports_a_mismatch_per_conversation(
    stock_server: ServerProcess, props: dict[str, Any]
) -> None:
    template = ChatTemplate(props["chat_template"] + "x", "", "", add_bos=False, add_eos=False)

    async def run() -> Any:
        async with aiohttp.ClientSession() as session:

            async def remote(messages: list[dict[str, str]]) -> str:
                async with session.post(
                    stock_server.url + "/apply-template", json={"messages": messages}
                ) as r:
                    return str((await r.json())["prompt"])

            return await check_template_parity(template, remote, parity_conversations()[:3])

    parity = asyncio.run(run())
    assert not parity.ok and len(parity.mismatches) == 3


# ---- through the proxy -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    return start_server(patched_bin)


@pytest.fixture(scope="module")
def proxy(backend: ServerProcess) -> Iterator[ProxyThread]:
    thread = ProxyThread(proxy_config(backend)).start()
    yield thread
    thread.stop()


def _count_apply_template(runtime: Any) -> list[int]:
    """Wrap the backend's apply_template to count calls (the real call still runs)."""
    calls = [0]
    for server in runtime.coordinator.servers:
        real = server.backend.apply_template

        async def counted(body: Any, headers: Any, real: Any = real) -> str:
            calls[0] += 1
            return str(await real(body, headers))

        server.backend.apply_template = counted
    return calls


def test_proxy_renders_plain_requests_locally(proxy: ProxyThread, stock_server: ServerProcess) -> None:
    assert proxy.call(lambda rt: rt.template_note) == "local"
    assert get(proxy.url + "/radix/stats").body["chat_template"] == "local"
    metrics = get(proxy.url + "/metrics").body
    assert "radix_chat_template_server_fallback 0.0" in metrics
    calls = proxy.call(_count_apply_template)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    plain = post(
        proxy.url + "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0}
    )
    assert plain.status == 200 and calls[0] == 0
    # Same prompt tokens as the server counts for the same body sent to it directly.
    direct = post(
        stock_server.url + "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0}
    )
    assert plain.body["usage"]["prompt_tokens"] == direct.body["usage"]["prompt_tokens"]
    # A field that reaches the template: the server renders it.
    other = post(
        proxy.url + "/v1/chat/completions",
        {"messages": messages, "max_tokens": 4, "temperature": 0, "chat_template_kwargs": {"x": 1}},
    )
    assert other.status == 200 and calls[0] == 1
    # An assistant message last is continued by the server, not rendered here.
    prefill = messages + [{"role": "assistant", "content": "The color is"}]
    cont = post(proxy.url + "/v1/chat/completions", {"messages": prefill, "max_tokens": 4, "temperature": 0})
    assert cont.status == 200 and calls[0] == 2
