"""Vision behind the proxy (patches 0026, 0027): a server with a multimodal projector (`--mmproj`),
on tiny random-weight text models and a tiny random-weight llava projector made here
(tests/tinymmproj.py), against stock llama-server of the same commit with the same projector
computing from scratch, with f16 and q8_0 KV.

The proxy never guesses media tokens: a server tokenizes a request with images
(`/kvctl/tokenize`), each image's cells keyed by tokens below -1 made from its content hash. On
a model whose images take a position per cell (llama) the image is KV like text: saved,
restored from the host (route H) with the text around it, and the server's next request reuses
it by hash. Under M-RoPE (qwen2vl), whose image cells share their first position, the keyed part
ends at the first image: the text before it is restored, the server computes the image, and
on the slot that holds it reuses it itself (route A).
"""

from __future__ import annotations

import concurrent.futures
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

SYSTEM = "You are a careful analyst. Reference document:\n" + document(21, 200)
IMAGE_A, IMAGE_B, IMAGE_C = (image_part(tiny_png(seed)) for seed in (1, 2, 3))
Messages = list[dict[str, Any]]
# (family, KV config): llama moves its images, qwen2vl (M-RoPE) cannot.
CASES = [("llama-h128", "f16"), ("llama-h128", "q8_0-fa"), ("qwen2vl", "f16")]


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


def _total(reply: Reply) -> int:
    return int(reply.body["timings"]["prompt_n"]) + int(reply.body["timings"]["cache_n"])


class Vision:
    def __init__(
        self, proxy: ProxyThread, stock: ServerProcess, patched: ServerProcess, case: tuple[str, str]
    ) -> None:
        self.proxy, self.stock, self.patched, self.case = proxy, stock, patched, case
        self.movable = case[0] != "qwen2vl"

    def kvctl(self, method: str, path: str, body: Any = None, server: ServerProcess | None = None) -> Reply:
        server = server or self.patched
        key = {"Authorization": f"Bearer {server.spec.kvctl_key}"}
        return request(f"{server.url}{path}", method, body, headers=key)


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def vision(
    request: pytest.FixtureRequest, start_server: ServerFactory, patched_bin: Path, stock_bin: Path
) -> Iterator[Vision]:
    family, kv = request.param
    # One slot: a request with another prompt takes the slot's KV, so the next is a host restore.
    args = _mmproj_args(family, kv)
    common: dict[str, Any] = {
        "model": tiny_model(family),
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
    vision = Vision(proxy, stock, patched, (family, kv))
    # Caps say whether media moves, and why not (the proxy logs it, `radixctl up` prints it).
    mm = vision.kvctl("GET", "/kvctl/caps").body["multimodal"]
    assert mm["media_moves"] is vision.movable, mm
    assert vision.movable or "M-RoPE" in mm["media_fixed"], mm
    assert len(mm["media_keys"]) == 32 and mm["media_shared"] is vision.movable, mm
    assert proxy.call(lambda rt: rt.coordinator.servers[0].media_fixed) == mm.get("media_fixed", "")
    yield vision
    proxy.stop()
    patched.stop()
    stock.stop()


def test_an_image_on_several_turns_and_sessions_equals_stock(vision: Vision) -> None:
    proxy, stock = vision.proxy, vision.stock
    base = _fallbacks(proxy)
    first_turn: Messages = [{"role": "system", "content": SYSTEM}, _user("Describe the picture.", IMAGE_A)]
    # The image changes the answer: KV of another image reused would show.
    assert _text(_from_scratch(stock, first_turn)) != _text(
        _from_scratch(stock, [first_turn[0], _user("Describe the picture.", IMAGE_B)])
    )

    first = _ask(proxy, first_turn, "s1")
    assert_same_answer(first, _from_scratch(stock, first_turn))
    keyed = int(first.headers["X-Radix-Prompt-Tokens"])
    if vision.movable:  # every cell keyed, the image's too
        assert keyed == _total(first), (keyed, first.body["timings"])
    else:  # the text before the image
        assert 200 < keyed < _total(first) - N_IMAGE_TOKENS, (keyed, first.body["timings"])

    # The same session's next turn, the image in its history: the text, the image and the first
    # answer are reused, only the new turn computed. Where the image moves, the host holds all of
    # it and the slot was released when idle (--cache-idle-release, the default): route H. Else
    # the slot kept it (the host cannot restore it) and the server reuses it there: route A.
    reuse = "H" if vision.movable else "A"
    second_turn = [*first_turn, {"role": "assistant", "content": _text(first)}, _user("And its colours?")]
    second = _ask(proxy, second_turn, "s1")
    assert _route(second) == reuse, second.headers
    assert second.body["timings"]["cache_n"] >= _total(first) - 1, second.body["timings"]
    assert_same_answer(second, _from_scratch(stock, second_turn))

    # Another prompt takes the only slot; then another session sends the first turn again: a
    # host restore (route H) of the text and, where the image moves, of the image too (the
    # server then computes only the last token); else the server computes the image and the rest.
    other: Messages = [{"role": "user", "content": document(22, 150)}]
    assert_same_answer(_ask(proxy, other, "s2"), _from_scratch(stock, other))
    third = _ask(proxy, first_turn, "s3")
    assert _route(third) == "H", third.headers
    restored = int(third.headers["X-Radix-Cached-Tokens"])
    assert third.body["timings"]["cache_n"] >= restored, third.body["timings"]
    if vision.movable:
        assert restored >= _total(first) - 1 and third.body["timings"]["prompt_n"] <= 2, third.body["timings"]
    else:
        assert keyed - 1 <= restored < keyed + 1, (restored, keyed)
    assert_same_answer(third, _from_scratch(stock, first_turn))

    # Its next turn with another image: the text and the first image are reused,
    # the new image is computed (answers equal stock's: nothing of image A stands in for it).
    fourth_turn = [
        *first_turn,
        {"role": "assistant", "content": _text(third)},
        _user("And this one?", IMAGE_B),
    ]
    fourth = _ask(proxy, fourth_turn, "s3")
    assert _route(fourth) == reuse, fourth.headers
    assert fourth.body["timings"]["cache_n"] >= _total(first) - 1, fourth.body["timings"]
    assert_same_answer(fourth, _from_scratch(stock, fourth_turn))
    assert _fallbacks(proxy) == base


def test_a_move_of_an_image_is_bound_to_it_or_refused(vision: Vision) -> None:
    proxy = vision.proxy
    messages: Messages = [{"role": "system", "content": SYSTEM}, _user("Look.", IMAGE_B)]
    _ask(proxy, messages, "s4")
    recorded = proxy.call(lambda rt: len(rt.coordinator.servers[0].slots[0].tokens))
    unrecorded = proxy.call(lambda rt: rt.coordinator.servers[0].slots[0].unrecorded)
    # Past the proxy (the slot is then unknown to it): where the image moves, the slot was
    # released once the host held it; fill it again to look at it.
    proxy.call(lambda rt: setattr(rt.coordinator.servers[0].slots[0], "ns", None))
    direct = post(f"{vision.patched.url}/v1/chat/completions", chat_body(messages, 4, id_slot=0))
    assert direct.status == 200, direct.body
    slot = vision.kvctl("GET", "/kvctl/slots?tokens=1").body["slots"][0]
    media = slot["media"]
    assert [(m["n_tokens"], m["movable"]) for m in media] == [(N_IMAGE_TOKENS, vision.movable)], media
    at, tokens = media[0]["idx"], slot["tokens"]
    assert media[0]["id"]  # the server's content hash of the image
    image = tokens[at : at + N_IMAGE_TOKENS]
    assert all(t >= 0 for t in tokens[:at])
    assert all(t < -1 for t in image) if vision.movable else image == [-1] * N_IMAGE_TOKENS
    # /kvctl/tokenize keys the request's cells as the slot does.
    tokenized = vision.kvctl("POST", "/kvctl/tokenize", chat_body(messages, 1)).body
    assert tokenized["tokens"][: at + N_IMAGE_TOKENS] == tokens[: at + N_IMAGE_TOKENS]
    # The text before the image moves. The image moves only where its cells sit at a position each,
    # bound to it: the same cells claimed as another image's (or as -1) are refused.
    end = at + N_IMAGE_TOKENS
    before = {"slot": 0, "p0": 0, "p1": at, "expect_sha256": tokens_sha256(tokens[:at])}
    assert vision.kvctl("POST", "/kvctl/export", before).status == 200
    whole = vision.kvctl(
        "POST", "/kvctl/export", {**before, "p1": end, "expect_sha256": tokens_sha256(tokens[:end])}
    )
    if not vision.movable:
        assert whole.status == 409 and "media" in whole.body["error"]["message"], whole.body
        # The proxy had recorded the text before the image; the image and the rest as held.
        assert recorded == at and unrecorded >= N_IMAGE_TOKENS, (recorded, unrecorded, at)
        return
    assert whole.status == 200, whole.body
    other = [*tokens[:at], *[t - 1 if t < -2 else t + 1 for t in image]]
    assert other[at:end] != image
    claimed = vision.kvctl(
        "POST", "/kvctl/export", {**before, "p1": end, "expect_sha256": tokens_sha256(other)}
    )
    assert claimed.status == 409, claimed.body
    assert (recorded, unrecorded) == (0, 0)  # released: the host holds it all
    # An import naming the image's cells must carry its chunk, as /kvctl/tokenize gives it.
    compat = vision.kvctl("GET", "/kvctl/caps").body["compat_id"]
    body = {"slot": 0, "p0": 0, "p1": end, "tokens": tokens[:end], "compat": compat}
    body["segments"] = [{"data": whole.body["data"]}]
    bare = vision.kvctl("POST", "/kvctl/import", body)
    assert bare.status == 400 and "media" in bare.body["error"]["message"], bare.body
    chunk = [{"idx": at, "chunk": tokenized["media"][0]["chunk"]}]
    assert vision.kvctl("POST", "/kvctl/import", {**body, "media": chunk}).status == 200
    again = vision.kvctl("GET", "/kvctl/slots?tokens=1").body["slots"][0]
    assert again["tokens"] == tokens[:end] and again["media"][0]["id"] == media[0]["id"]

    # A chunk is kept, replaced, shared and attached whole: a cut inside one is refused, the
    # slot keeps what it held.
    cut = at + 2
    tail = vision.kvctl(
        "POST",
        "/kvctl/export",
        {**before, "p0": cut, "p1": end, "expect_sha256": tokens_sha256(tokens[:end])},
    )
    assert tail.status == 200, tail.body
    # (no entry of "media" can name cells of a chunk that starts before p0)
    inside = {**body, "p0": cut, "segments": [{"data": tail.body["data"]}]}
    refused = vision.kvctl("POST", "/kvctl/import", inside)
    assert refused.status in (400, 409) and "media" in refused.body["error"]["message"], refused.body
    owner = vision.kvctl("GET", "/kvctl/caps").body["owner_ids"][0]
    share = {"slot": 0, "owner": owner, "n": cut, "expect_sha256": tokens_sha256(tokens[:cut])}
    refused = vision.kvctl("POST", "/kvctl/publish", share)
    assert refused.status == 409 and "cuts a media chunk" in refused.body["error"]["message"], refused.body
    share = {**share, "n": end, "expect_sha256": tokens_sha256(tokens[:end])}
    assert vision.kvctl("POST", "/kvctl/publish", share).status == 200
    attach = {"owner": owner, "slot": 0, "m": cut, "expect_sha256": tokens_sha256(tokens[:cut])}
    refused = vision.kvctl("POST", "/kvctl/attach", attach)
    assert refused.status == 409 and "cuts a media chunk" in refused.body["error"]["message"], refused.body
    attach = {**attach, "m": end, "expect_sha256": tokens_sha256(tokens[:end])}
    attached = vision.kvctl("POST", "/kvctl/attach", attach)
    assert attached.status == 200, attached.body
    again = vision.kvctl("GET", "/kvctl/slots?tokens=1").body["slots"][0]
    assert again["tokens"] == tokens[:end] and again["media"][0]["id"] == media[0]["id"]  # the owner's
    assert vision.kvctl("POST", "/kvctl/release", {"owner": owner}).status == 200


def test_media_on_a_server_without_a_projector_is_a_clear_400(plain_proxy: ProxyThread) -> None:
    body = chat_body([_user("Describe the picture.", IMAGE_A)], 4)
    reply = post(f"{plain_proxy.url}/v1/chat/completions", body)
    assert reply.status == 400, reply.body
    assert "projector" in reply.body["error"]["message"], reply.body


def test_a_completion_prompt_with_multimodal_data_is_a_clear_400(vision: Vision) -> None:
    proxy = vision.proxy
    body = {"prompt": {"prompt_string": "Look: <__media__>", "multimodal_data": ["QUFB"]}, "n_predict": 4}
    reply = post(f"{proxy.url}/completion", body)
    assert reply.status == 400, reply.body
    assert "/v1/chat/completions" in reply.body["error"]["message"], reply.body


def test_another_image_in_the_same_place_is_computed_not_reused(vision: Vision) -> None:
    # The tree holds SYSTEM, the question and image A's cells; image C in A's place shares only
    # the text before it (its cells are keyed apart): the image is computed, answers equal stock.
    proxy, stock = vision.proxy, vision.stock
    base = _fallbacks(proxy)
    first: Messages = [{"role": "system", "content": SYSTEM}, _user("Describe the picture.", IMAGE_A)]
    _ask(proxy, first, "s5")
    swapped: Messages = [first[0], _user("Describe the picture.", IMAGE_C)]
    reply = _ask(proxy, swapped, "s6")
    at = vision.kvctl("POST", "/kvctl/tokenize", chat_body(swapped, 1)).body["media"][0]["idx"]
    assert reply.body["timings"]["cache_n"] <= at, (at, reply.body["timings"])
    assert reply.body["timings"]["prompt_n"] >= N_IMAGE_TOKENS, reply.body["timings"]
    assert_same_answer(reply, _from_scratch(stock, swapped))
    assert _fallbacks(proxy) == base


def test_the_cut_between_two_adjacent_images_is_reused(vision: Vision) -> None:
    # [T, A, B] then [T, A, C] on one slot: the server's own reuse keeps [T, A] (upstream's
    # keep_first refused that cut, checking the cell before it; patch 0027 checks the cell at it).
    stock, server = vision.stock, vision.patched
    vision.proxy.call(lambda rt: setattr(rt.coordinator.servers[0].slots[0], "ns", None))
    two = [{"role": "system", "content": SYSTEM}, _user("Two pictures.", IMAGE_A, IMAGE_B)]
    swapped = [two[0], _user("Two pictures.", IMAGE_A, IMAGE_C)]
    for messages in (two, swapped):
        direct = post(f"{server.url}/v1/chat/completions", chat_body(messages, 12, id_slot=0))
        assert direct.status == 200, direct.body
        assert_same_answer(direct, _from_scratch(stock, messages))
    tokenized = vision.kvctl("POST", "/kvctl/tokenize", chat_body(swapped, 1)).body["media"]
    assert direct.body["timings"]["cache_n"] >= tokenized[1]["idx"], (tokenized, direct.body["timings"])


def test_an_image_the_projector_cannot_load_is_a_400_and_nothing_changes(vision: Vision) -> None:
    proxy = vision.proxy
    base = _fallbacks(proxy)
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}
    reply = post(f"{proxy.url}/v1/chat/completions", chat_body([_user("Look.", broken)], 4))
    assert reply.status == 400, reply.body
    assert reply.body["error"]["type"] == "invalid_request_error", reply.body
    direct = vision.kvctl("POST", "/kvctl/tokenize", chat_body([_user("Look.", broken)], 4))
    assert direct.status == 400, direct.body
    messages: Messages = [{"role": "system", "content": SYSTEM}, _user("Look.", IMAGE_B)]
    assert_same_answer(_ask(proxy, messages, "s7"), _from_scratch(vision.stock, messages))
    assert _fallbacks(proxy) == base


def test_another_projector_keys_the_same_image_apart(
    vision: Vision, start_server: ServerFactory, patched_bin: Path
) -> None:
    # The KV of an image depends on the projector (and its image token limits): media keys name
    # it, so no tier holding KV from one projector restores it for another of the same shape.
    family, kv = _once(vision)
    other = start_server(patched_bin, **_one_slot(family), extra_args=_mmproj_args(family, kv, seed=1))
    try:
        body = chat_body([{"role": "system", "content": SYSTEM}, _user("Look.", IMAGE_A)], 1)
        mine = vision.kvctl("POST", "/kvctl/tokenize", body).body
        theirs = vision.kvctl("POST", "/kvctl/tokenize", body, server=other).body
        caps = [
            vision.kvctl("GET", "/kvctl/caps", server=s).body["multimodal"] for s in (vision.patched, other)
        ]
        assert caps[0]["media_keys"] != caps[1]["media_keys"], caps  # the proxy routes by it
        at = mine["media"][0]["idx"]
        assert theirs["media"][0]["id"] == mine["media"][0]["id"]  # the same image bytes
        assert theirs["tokens"][:at] == mine["tokens"][:at]  # the same text
        cells = zip(
            mine["tokens"][at : at + N_IMAGE_TOKENS], theirs["tokens"][at : at + N_IMAGE_TOKENS], strict=True
        )
        assert all(a < -1 and b < -1 and a != b for a, b in cells), (
            mine["tokens"][at:],
            theirs["tokens"][at:],
        )
        # A proxy in front of a server with each projector: a request with media goes only to a
        # server keying it as the one that tokenized it (two at once wait for it, one slot each),
        # else the import of its image keys into the other would fail (a fallback).
        key = {"kvctl_key": other.spec.kvctl_key}  # one proxy, one key for its servers
        first = start_server(patched_bin, **_one_slot(family), **key, extra_args=_mmproj_args(family, kv))
        proxy = ProxyThread(proxy_config(first, other)).start()
        try:
            asked = [[{"role": "system", "content": SYSTEM}, _user(q, IMAGE_A)] for q in ("Look.", "See.")]
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                replies = list(pool.map(lambda m: _ask(proxy, m[1], f"k{m[0]}"), enumerate(asked)))
            assert len({r.headers["X-Radix-Server"] for r in replies}) == 1, [r.headers for r in replies]
            assert _fallbacks(proxy) == 0
            for reply, messages in zip(replies, asked, strict=True):
                assert_same_answer(reply, _from_scratch(vision.stock, messages))
        finally:
            proxy.stop()
            first.stop()
    finally:
        other.stop()


def _once(vision: Vision) -> tuple[str, str]:
    """The case of a test that starts servers of its own: it runs in one case only."""
    if vision.case != ("llama-h128", "f16"):
        pytest.skip("once: a server of its own")
    return vision.case


def _one_slot(family: str) -> dict[str, Any]:
    return {"model": tiny_model(family), "ctx_size": 4096, "threads": 1, "n_parallel": 1}


def _mmproj_args(family: str, kv: str, seed: int = 0) -> tuple[str, ...]:
    return (*KV_CONFIGS[kv], "--mmproj", str(tiny_mmproj(FAMILIES[family].n_embd, seed=seed)))


def test_with_a_draft_model_media_does_not_move_and_says_why(
    vision: Vision, start_server: ServerFactory, patched_bin: Path
) -> None:
    family, kv = _once(vision)
    draft = (
        "--model-draft",
        str(tiny_model(family)),
        "--spec-type",
        "draft-simple",
        "--spec-draft-n-max",
        "4",
    )
    server = start_server(patched_bin, **_one_slot(family), extra_args=(*_mmproj_args(family, kv), *draft))
    try:
        mm = vision.kvctl("GET", "/kvctl/caps", server=server).body["multimodal"]
        assert mm["on"] and not mm["media_moves"] and "draft" in mm["media_fixed"], mm
        body = chat_body([{"role": "system", "content": SYSTEM}, _user("Look.", IMAGE_A)], 1)
        tokenized = vision.kvctl("POST", "/kvctl/tokenize", body, server=server).body
        at = tokenized["media"][0]["idx"]
        assert not tokenized["media"][0]["movable"]
        assert tokenized["tokens"][at : at + N_IMAGE_TOKENS] == [-1] * N_IMAGE_TOKENS
    finally:
        server.stop()


def test_an_image_is_shared_through_an_owner(
    start_server: ServerFactory, patched_bin: Path, stock_bin: Path
) -> None:
    # Patch 0028: an owner published from a slot keeps its images; a slot it is attached to
    # takes them (route S), so two sessions asking about one image at once compute it once.
    family = "llama-h128"
    args = _mmproj_args(family, "f16")
    common: dict[str, Any] = {"model": tiny_model(family), "ctx_size": 4096, "threads": 1, "extra_args": args}
    patched = start_server(patched_bin, **common)
    stock = start_server(stock_bin, kvctl=False, **common)
    proxy = ProxyThread(proxy_config(patched, kv_share=True)).start()
    try:
        assert proxy.call(lambda rt: rt.coordinator.servers[0].media_shared) is True

        def asking(question: str) -> Messages:
            content = [IMAGE_A, {"type": "text", "text": question}]
            return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]

        _ask(proxy, asking("Describe the picture."), "o1")
        pair = [asking("What is in its corner?"), asking("Name its main colour.")]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda m: _ask(proxy, m[1], f"o{m[0] + 2}"), enumerate(pair)))
        for reply, messages in zip(replies, pair, strict=True):
            assert_same_answer(reply, _from_scratch(stock, messages))
        tokenized = Vision(proxy, stock, patched, (family, "f16")).kvctl(
            "POST", "/kvctl/tokenize", chat_body(pair[0], 1)
        )
        image_end = tokenized.body["media"][0]["idx"] + N_IMAGE_TOKENS
        shared = [r for r in replies if _route(r).startswith("S")]
        assert shared, [_route(r) for r in replies]
        # The attached prefix reached past the image: the server reused it by hash.
        assert all(r.body["timings"]["cache_n"] >= image_end for r in shared), [
            r.body["timings"] for r in shared
        ]
        assert _fallbacks(proxy) == 0
    finally:
        proxy.stop()
        patched.stop()
        stock.stop()
