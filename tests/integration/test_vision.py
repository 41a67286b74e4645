"""Vision behind the proxy (patch 0026): a server with a multimodal projector (`--mmproj`), on a
tiny random-weight text model and a tiny random-weight llava projector made here
(tests/tinymmproj.py), against stock llama-server of the same commit with the same projector
computing from scratch, with f16 and q8_0 KV.

The proxy never guesses media tokens: a request with images is keyed by the text before its first
image (the server renders the prompt and libmtmd tokenizes that text alone), which is restored
from the host (route H) like any prompt; the server computes the image and what follows, and on
the slot that holds them reuses them itself (route A: it matches image chunks by content hash).
The server refuses any move of a range that holds an image, and lists the images a slot holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.core.payload import tokens_sha256
from proxy.native.launch import ServerProcess
from tests.helpers import (
    ProxyThread,
    Reply,
    ServerFactory,
    assert_same_answer,
    chat_body,
    post,
    proxy_config,
    request,
)
from tests.integration.test_architectures import KV_CONFIGS, _fallbacks
from tests.integration.test_proxy import document
from tests.tinymmproj import N_IMAGE_TOKENS, image_part, tiny_mmproj, tiny_png
from tests.tinymodels import FAMILIES, tiny_model

pytestmark = pytest.mark.integration

FAMILY = "llama-h128"
SYSTEM = "You are a careful analyst. Reference document:\n" + document(21, 200)
IMAGE_A, IMAGE_B = image_part(tiny_png(1)), image_part(tiny_png(2))
Messages = list[dict[str, Any]]


def _user(text: str, *images: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}, *images]}


def _ask(proxy: ProxyThread, messages: Messages, session: str) -> Reply:
    reply = post(
        f"{proxy.url}/v1/chat/completions", chat_body(messages, 12), headers={"X-Session-Id": session}
    )
    assert reply.status == 200, reply.body
    proxy.settle()
    return reply


def _from_scratch(stock: ServerProcess, messages: Messages) -> Reply:
    reply = post(f"{stock.url}/v1/chat/completions", chat_body(messages, 12, cache_prompt=False))
    assert reply.status == 200, reply.body
    return reply


def _route(reply: Reply) -> str:
    return str(reply.headers["X-Radix-Route"])


def _text(reply: Reply) -> str:
    return str(reply.body["choices"][0]["message"]["content"])


@pytest.fixture(scope="module", params=("f16", "q8_0-fa"))
def vision(
    request: pytest.FixtureRequest, start_server: ServerFactory, patched_bin: Path, stock_bin: Path
) -> Iterator[tuple[ProxyThread, ServerProcess, ServerProcess]]:
    # One slot: a request with another prompt takes the slot's KV, so the next is a host restore.
    args = (*KV_CONFIGS[request.param], "--mmproj", str(tiny_mmproj(FAMILIES[FAMILY].n_embd)))
    model = tiny_model(FAMILY)
    common: dict[str, Any] = {
        "model": model,
        "ctx_size": 4096,
        "threads": 1,
        "n_parallel": 1,
        "extra_args": args,
    }
    patched = start_server(patched_bin, **common)
    stock = start_server(stock_bin, kvctl=False, **common)
    proxy = ProxyThread(proxy_config(patched)).start()
    assert proxy.call(lambda rt: rt.coordinator.servers[0].moves) is True
    assert proxy.call(lambda rt: rt.coordinator.servers[0].media_marker) != ""
    yield proxy, stock, patched
    proxy.stop()
    patched.stop()
    stock.stop()


def test_an_image_on_several_turns_and_sessions_equals_stock(
    vision: tuple[ProxyThread, ServerProcess, ServerProcess],
) -> None:
    proxy, stock, _ = vision
    base = _fallbacks(proxy)
    first_turn: Messages = [{"role": "system", "content": SYSTEM}, _user("Describe the picture.", IMAGE_A)]
    # The image changes the answer: KV of another image reused would show.
    assert _text(_from_scratch(stock, first_turn)) != _text(
        _from_scratch(stock, [first_turn[0], _user("Describe the picture.", IMAGE_B)])
    )

    first = _ask(proxy, first_turn, "s1")
    assert_same_answer(first, _from_scratch(stock, first_turn))
    text_tokens = int(first.headers["X-Radix-Prompt-Tokens"])
    assert text_tokens > 200  # the system prompt and the user's text before the image
    assert first.body["timings"]["prompt_n"] + first.body["timings"]["cache_n"] > text_tokens + N_IMAGE_TOKENS

    # The same session's next turn, the image in its history: the slot holds it, the server
    # reuses the text, the image and the first answer (route A), and computes only the new turn.
    second_turn = [*first_turn, {"role": "assistant", "content": _text(first)}, _user("And its colours?")]
    second = _ask(proxy, second_turn, "s1")
    assert _route(second) == "A", second.headers
    assert second.body["timings"]["cache_n"] >= text_tokens + N_IMAGE_TOKENS, second.body["timings"]
    assert_same_answer(second, _from_scratch(stock, second_turn))

    # Another prompt takes the only slot; then another session sends the same text and image:
    # the text is restored from the host (route H), the server computes the image and the rest.
    other: Messages = [{"role": "user", "content": document(22, 150)}]
    assert_same_answer(_ask(proxy, other, "s2"), _from_scratch(stock, other))
    third_turn: Messages = [first_turn[0], _user("Describe the picture.", IMAGE_A)]
    third = _ask(proxy, third_turn, "s3")
    assert _route(third) == "H", third.headers
    cached = int(third.headers["X-Radix-Cached-Tokens"])
    assert cached >= text_tokens - 1, third.headers
    assert third.body["timings"]["cache_n"] >= cached, third.body["timings"]
    assert_same_answer(third, _from_scratch(stock, third_turn))

    # Its next turn with another image: the text and the first image are reused on the slot,
    # the new image is computed (answers equal stock's: nothing of image A stands in for it).
    fourth_turn = [
        *third_turn,
        {"role": "assistant", "content": _text(third)},
        _user("And this one?", IMAGE_B),
    ]
    fourth = _ask(proxy, fourth_turn, "s3")
    assert _route(fourth) == "A", fourth.headers
    assert fourth.body["timings"]["cache_n"] >= text_tokens + N_IMAGE_TOKENS, fourth.body["timings"]
    assert_same_answer(fourth, _from_scratch(stock, fourth_turn))
    assert _fallbacks(proxy) == base


def test_the_server_refuses_to_move_an_image_and_lists_it(
    vision: tuple[ProxyThread, ServerProcess, ServerProcess],
) -> None:
    proxy, _, patched = vision
    messages: Messages = [{"role": "system", "content": SYSTEM}, _user("Look.", IMAGE_B)]
    _ask(proxy, messages, "s4")
    key = {"Authorization": f"Bearer {patched.spec.kvctl_key}"}
    listing = request(f"{patched.url}/kvctl/slots?tokens=1", "GET", headers=key).body
    slot = listing["slots"][0]
    assert [m["n_tokens"] for m in slot["media"]] == [N_IMAGE_TOKENS], slot["media"]
    at = slot["media"][0]["idx"]
    assert slot["media"][0]["id"]  # the server's content hash of the image
    tokens = slot["tokens"]
    assert all(t >= 0 for t in tokens[:at]) and tokens[at : at + N_IMAGE_TOKENS] == [-1] * N_IMAGE_TOKENS
    # The text before the image moves; a range holding it is refused, whatever it claims.
    ok = request(
        f"{patched.url}/kvctl/export",
        "POST",
        {"slot": 0, "p0": 0, "p1": at, "expect_sha256": tokens_sha256(tokens[:at])},
        headers=key,
    )
    assert ok.status == 200, ok.body
    refused = request(
        f"{patched.url}/kvctl/export",
        "POST",
        {"slot": 0, "p0": 0, "p1": at + 1, "expect_sha256": tokens_sha256(tokens[: at + 1])},
        headers=key,
    )
    assert refused.status == 409, refused.body
    assert "media" in refused.body["error"]["message"], refused.body
    # The proxy recorded the slot's text only; the image and the rest count as held.
    recorded = proxy.call(lambda rt: len(rt.coordinator.servers[0].slots[0].tokens))
    unrecorded = proxy.call(lambda rt: rt.coordinator.servers[0].slots[0].unrecorded)
    assert recorded == at
    assert unrecorded >= N_IMAGE_TOKENS


def test_media_on_a_server_without_a_projector_is_a_clear_400(plain_proxy: ProxyThread) -> None:
    body = chat_body([_user("Describe the picture.", IMAGE_A)], 4)
    reply = post(f"{plain_proxy.url}/v1/chat/completions", body)
    assert reply.status == 400, reply.body
    assert "projector" in reply.body["error"]["message"], reply.body


def test_a_completion_prompt_with_multimodal_data_is_a_clear_400(
    vision: tuple[ProxyThread, ServerProcess, ServerProcess],
) -> None:
    proxy = vision[0]
    body = {"prompt": {"prompt_string": "Look: <__media__>", "multimodal_data": ["QUFB"]}, "n_predict": 4}
    reply = post(f"{proxy.url}/completion", body)
    assert reply.status == 400, reply.body
    assert "/v1/chat/completions" in reply.body["error"]["message"], reply.body
