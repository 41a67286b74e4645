"""``/infill`` (editor completion) through the proxy, on real servers.

The default model has no FIM tokens, so the servers are told three of its control tokens are
FIM_PRE/SUF/MID (``--override-kv``), and in a second setup also FIM_REP/FIM_SEP with
``--spm-infill``: the prompt the server builds differs in each (snippet separators or the
repo-level pattern, prefix or suffix first). The reference is stock llama-server of the same
commit, started alike, answering its own ``/infill`` from scratch: the proxy's answer must be
the same (invariant 5) from a prompt of the same length, and a second request reuses the cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proxy.native.launch import ServerProcess
from tests.helpers import ProxyThread, Reply, ServerFactory, post, proxy_config
from tests.integration.test_kvctl import Completion, assert_error, assert_same_or_near_tie
from tests.integration.test_proxy import document

pytestmark = pytest.mark.integration

# <|im_start|>-like control tokens of SmolLM2 that its text never produces.
FIM = {"fim_pre": 8, "fim_suf": 9, "fim_mid": 10}
REPO = {"fim_rep": 3, "fim_sep": 5}
ONE = 1


def overrides(tokens: dict[str, int]) -> tuple[str, ...]:
    out: list[str] = []
    for name, tid in tokens.items():
        out += ["--override-kv", f"tokenizer.ggml.{name}_token_id=int:{tid}"]
    return tuple(out)


@dataclass
class Setup:
    name: str
    args: tuple[str, ...]


SETUPS = [
    Setup("fim", overrides(FIM)),
    Setup("repo-spm", (*overrides({**FIM, **REPO}), "--spm-infill")),
]


@dataclass
class Pair:
    proxy: ProxyThread
    stock: ServerProcess


@pytest.fixture(scope="module", params=SETUPS, ids=[s.name for s in SETUPS])
def pair(
    request: pytest.FixtureRequest, start_server: ServerFactory, patched_bin: Path, stock_bin: Path
) -> Iterator[Pair]:
    setup: Setup = request.param
    # Small batches so that the server cuts the prefix and the suffix, and a context that leaves
    # room for some of the extra chunks only: the cuts are part of what must match.
    args = (*setup.args, "-b", "256", "-ub", "256")
    backend = start_server(patched_bin, threads=ONE, n_parallel=2, ctx_size=2 * 1024, extra_args=args)
    stock = start_server(
        stock_bin, kvctl=False, threads=ONE, n_parallel=2, ctx_size=2 * 1024, extra_args=args
    )
    thread = ProxyThread(proxy_config(backend)).start()
    yield Pair(thread, stock)
    thread.stop()


def infill_body(prefix: Any, suffix: Any, extra: list[dict[str, str]], **more: Any) -> dict[str, Any]:
    return {
        "input_prefix": prefix,
        "input_suffix": suffix,
        "input_extra": extra,
        "temperature": 0,
        "n_predict": 12,
        "n_probs": 3,
        "return_tokens": True,
        **more,
    }


def completion(reply: Reply) -> Completion:
    assert reply.status == 200, str(reply.body)[:400]
    res = reply.body
    probs = [
        (p["id"], p["logprob"], [(t["id"], t["logprob"]) for t in p["top_logprobs"]])
        for p in res["completion_probabilities"]
    ]
    return Completion(res["tokens"], probs, res["timings"]["cache_n"], res["timings"]["prompt_n"], res)


EXTRA = [
    {"filename": "notes.txt", "text": document(71, 300)},
    {"text": document(72, 200)},  # filename defaults to "tmp"
    {"filename": "words.py", "text": "WORDS = " + repr(document(73, 80).split())},
]
PREFIX = "def count(words):\n    " + document(74, 200) + "\n    total = 0\n    for w in "
SUFFIX = "\n    return total\n\n" + document(75, 120)


def stock_answer(pair: Pair, body: dict[str, Any]) -> Completion:
    return completion(post(f"{pair.stock.spec.url}/infill", {**body, "cache_prompt": False}))


def test_infill_answers_like_stock_and_reuses_the_cache(pair: Pair) -> None:
    body = infill_body(PREFIX, SUFFIX, EXTRA, prompt="words")
    ref = stock_answer(pair, body)
    assert ref.prompt_n > 600  # the extra chunks are in, cut to the context left
    first = completion(post(f"{pair.proxy.url}/infill", body))
    assert_same_or_near_tie(first, ref)
    assert first.prompt_n + first.cache_n == ref.prompt_n  # the same prompt length
    assert first.raw["prompt"] == ref.raw["prompt"]  # the server's detokenized prompt: the same ids

    # The editor's next keystroke: the same files, the prefix grown by a word.
    nxt = infill_body(PREFIX + "words", SUFFIX, EXTRA, prompt="")
    again = post(f"{pair.proxy.url}/infill", nxt)
    got = completion(again)
    ref2 = stock_answer(pair, nxt)
    assert_same_or_near_tie(got, ref2)
    assert got.prompt_n + got.cache_n == ref2.prompt_n and got.raw["prompt"] == ref2.raw["prompt"]
    assert got.cache_n > 500 and again.headers["X-Radix-Route"] != "prefill", again.headers
    mismatch = pair.proxy.call(lambda rt: rt.metrics.prompt_mismatch.labels("infill")._value.get())
    assert mismatch == 0


def test_token_ids_in_prefix_and_suffix(pair: Pair) -> None:
    """input_prefix / input_suffix as strings and token ids mixed (the server's tokenize_mixed)."""
    body = infill_body(["x = ", 2, "count("], [")", 0], [], prompt="")
    ref = stock_answer(pair, body)
    got = completion(post(f"{pair.proxy.url}/infill", body))
    assert_same_or_near_tie(got, ref)
    assert got.prompt_n + got.cache_n == ref.prompt_n and got.raw["prompt"] == ref.raw["prompt"]


def test_token_ids_and_the_same_text_are_different_pieces(pair: Pair) -> None:
    """The ids [1, 2] and the text "[1, 2]" are tokenized apart (the piece cache keeps them apart)."""
    for prefix in ([1, 2], "[1, 2]", [1, 2]):
        body = infill_body(prefix, "", [], prompt="")
        ref = stock_answer(pair, body)
        got = completion(post(f"{pair.proxy.url}/infill", body))
        assert got.raw["prompt"] == ref.raw["prompt"] and got.prompt_n + got.cache_n == ref.prompt_n


def test_streamed_infill(pair: Pair) -> None:
    body = infill_body(PREFIX, SUFFIX, EXTRA[:1], stream=True, n_probs=0)
    reply = post(f"{pair.proxy.url}/infill", body)
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/event-stream")
    text = reply.body if isinstance(reply.body, str) else str(reply.body)
    assert text.count("data: ") >= 2 and '"stop":true' in text.replace(" ", "")


BAD: list[tuple[dict[str, Any], str]] = [
    ({"input_suffix": "x"}, '"input_prefix" is required'),
    ({"input_prefix": "x"}, '"input_suffix" is required'),
    ({"input_prefix": "x", "input_suffix": "y", "prompt": 3}, '"prompt" must be a string'),
    ({"input_prefix": {"a": 1}, "input_suffix": "y"}, '"input_prefix" must be a string or an array'),
    ({"input_prefix": [1 << 30], "input_suffix": "y"}, '"input_prefix" must be a string or an array'),
    ({"input_prefix": "x", "input_suffix": "y", "input_extra": {}}, '"input_extra" must be an array'),
    ({"input_prefix": "x", "input_suffix": "y", "input_extra": [{"filename": "a"}]}, '"text" field'),
    ({"input_prefix": "x", "input_suffix": "y", "input_extra": [{"text": "a", "filename": 1}]}, '"filename"'),
    ({"input_prefix": "x", "input_suffix": "y", "input_extra": [{"text": "a"}] * 1025}, "at most 1024"),
]


@pytest.mark.parametrize(("body", "needle"), BAD, ids=[b[1] for b in BAD])
def test_bad_input_is_a_400_in_the_servers_shape(pair: Pair, body: dict[str, Any], needle: str) -> None:
    assert_error(post(f"{pair.proxy.url}/infill", body), 400, "invalid_request_error", needle)


def test_model_without_fim_tokens_is_refused_as_the_server_refuses(
    plain_proxy: ProxyThread, stock_server: ServerProcess
) -> None:
    body = infill_body("a", "b", [])
    ref = post(f"{stock_server.spec.url}/infill", body)
    got = post(f"{plain_proxy.url}/infill", body)
    assert got.status == ref.status == 501
    assert got.body["error"]["message"] == ref.body["error"]["message"]
    assert "prefix token is missing" in got.body["error"]["message"]
