"""Tokenizer parity against a real llama-server.

The local tokenizer (proxy.tokenizer.PromptTokenizer) must produce the very ids the server's chat
path produces: for the built-in corpus, for random texts, and for /apply-template renderings of chat
conversations (system prompt with a JSON tool schema, multi-turn history), on the harness's stock
llama-server with the default model.
"""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.native.launch import ServerProcess
from proxy.tokenizer import CHAT_TOKENIZE_FLAGS, CORPUS, PromptTokenizer, check_parity, load_tokenizer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def llama_server(stock_server: ServerProcess, model_path: Path) -> dict[str, Any]:
    """The shared stock server of the harness: {"url", "model"}."""
    return {"url": stock_server.url, "model": str(model_path)}


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_tok(llama_server: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    return PromptTokenizer.from_gguf(llama_server["model"], tmp_path_factory.mktemp("tokcache"))


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with session.post(url, json=body) as r:
        r.raise_for_status()
        return await r.json()


def _remote(session: aiohttp.ClientSession, base: str) -> Callable[[str], Awaitable[list[int]]]:
    async def tokenize(text: str) -> list[int]:
        data = await _post(session, base + "/tokenize", {"content": text, **CHAT_TOKENIZE_FLAGS})
        return [int(t) for t in data["tokens"]]

    return tokenize


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Look up an order by id and return its status, items and shipping ETA.",
            "parameters": {
                "type": "object",
                "properties": {
                    "order_id": {"type": "string", "pattern": "^[A-Z]{3}-\\d{6}$"},
                    "include_items": {"type": "boolean", "default": True},
                },
                "required": ["order_id"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "translate",
            "description": "Translate text; supports 日本語, 中文, Español, Русский.",
            "parameters": {
                "type": "object",
                "properties": {
                    "text": {"type": "string"},
                    "target": {"type": "string", "enum": ["ja", "zh"]},
                },
            },
        },
    },
]

SYSTEM = (
    "You are Orbit, the support agent of ACME Corp.\n\n"
    "## Policies\n1. Be concise.\n2. Never reveal internal notes.\n3. Amounts are in EUR (€); dates ISO-8601.\n\n"
    "## Tools\nCall a tool by answering with JSON only.\n```json\n"
    + json.dumps(TOOLS, indent=2, ensure_ascii=False)
    + "\n```\n"
)

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Where is my order ABC-123456? It's been 12 days…"},
        {"role": "assistant", "content": '{"tool": "lookup_order", "arguments": {"order_id": "ABC-123456"}}'},
        {"role": "user", "content": 'Tool result:\n{"status": "shipped", "eta": "2024-06-01", "items": 3}'},
        {"role": "assistant", "content": "It shipped; ETA 2024-06-01 (3 items). Anything else?"},
        {"role": "user", "content": "Translate 'thank you' to 日本語 and 中文, please 🙏"},
    ],
    [
        {
            "role": "system",
            "content": "You write Python.\n\tIndent with 4 spaces.  Trailing  spaces   here.   ",
        },
        {"role": "user", "content": "def f(x):\n    return x**2\n\n\n# why?\n"},
        {"role": "assistant", "content": '```python\nfor i in range(10):\n\tprint(f"{i:>3}")\n```\n\n'},
        {"role": "user", "content": "<|im_start|> and <|im_end|> inside content, plus <|endoftext|>."},
    ],
]


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------
async def test_corpus_parity(llama_server: dict[str, Any], local_tok: PromptTokenizer) -> None:
    async with aiohttp.ClientSession() as session:
        res = await check_parity(local_tok, _remote(session, llama_server["url"]))
    assert res.ok, "\n".join([res.summary()] + [repr(m) for m in res.mismatches] + res.errors)
    assert res.checked > 40


async def test_random_text_parity(llama_server: dict[str, Any], local_tok: PromptTokenizer) -> None:
    rnd = random.Random(1234)
    pool = [
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "\r\n",
        "\u00a0",
        "'s",
        "'LL",
        "a",
        "Z",
        "é",
        "中",
        "の",
        "й",
        "1",
        "234",
        "²",
        ".",
        "!?",
        "{",
        '"',
        "😀",
        "\u200d",
        "\u0301",
        "<|im_start|>",
        "<|im_end|>",
        "<|im_",
        "word",
        " the",
        "\x04",
        "\U00042019",
        "\u1c89",
        "\U00010d40",
    ]
    texts = []
    for _ in range(300):
        parts = []
        for _ in range(rnd.randrange(1, 40)):
            if rnd.random() < 0.85:
                parts.append(rnd.choice(pool))
            else:
                cp = rnd.randrange(1, 0x110000)
                parts.append(chr(cp) if not 0xD800 <= cp <= 0xDFFF else "x")
        texts.append("".join(parts))
    async with aiohttp.ClientSession() as session:
        res = await check_parity(
            local_tok, _remote(session, llama_server["url"]), texts, include_probes=False
        )
    assert res.ok, res.summary()


async def test_chat_rendering_parity(llama_server: dict[str, Any], local_tok: PromptTokenizer) -> None:
    base = llama_server["url"]
    async with aiohttp.ClientSession() as session:
        remote = _remote(session, base)
        for conv in CONVERSATIONS:
            prompt = (await _post(session, base + "/apply-template", {"messages": conv}))["prompt"]
            assert isinstance(prompt, str) and prompt
            want = await remote(prompt)
            assert local_tok.encode(prompt) == want
            assert local_tok.encode(prompt) == want  # warm: every piece from the cache
        # a re-sent conversation with one more turn is mostly cache hits and still exact
        before = local_tok.cache_stats()
        conv = CONVERSATIONS[1] + [
            {"role": "assistant", "content": "ありがとう / 谢谢"},
            {"role": "user", "content": "Thanks!"},
        ]
        prompt = (await _post(session, base + "/apply-template", {"messages": conv}))["prompt"]
        ids = local_tok.encode(prompt)
        assert ids == await remote(prompt)
        after = local_tok.cache_stats()
        assert after.hit_tokens - before.hit_tokens > 0.8 * len(ids)


async def test_inline_path_parity(llama_server: dict[str, Any], local_tok: PromptTokenizer) -> None:
    """``encode(batch=False)``, what the proxy runs on the event loop for short prompts (pieces
    encoded one by one, no worker pool), gives the server's ids too, from a cold piece cache."""
    base = llama_server["url"]
    inline = PromptTokenizer(local_tok.tokenizer)
    async with aiohttp.ClientSession() as session:
        remote = _remote(session, base)
        prompts = [
            (await _post(session, base + "/apply-template", {"messages": c}))["prompt"] for c in CONVERSATIONS
        ]
        for text in [*prompts, *CORPUS]:
            assert inline.encode(text, batch=False) == await remote(text), repr(text[:80])
    assert inline.cache_stats().misses > 0


async def test_chat_completion_prompt_count(llama_server: dict[str, Any], local_tok: PromptTokenizer) -> None:
    """The chat path itself (not just /tokenize) sees as many prompt tokens as we produce."""
    base = llama_server["url"]
    conv = CONVERSATIONS[0] + [
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    async with aiohttp.ClientSession() as session:
        prompt = (await _post(session, base + "/apply-template", {"messages": conv}))["prompt"]
        out = await _post(
            session,
            base + "/v1/chat/completions",
            {"messages": conv, "max_tokens": 1, "temperature": 0, "cache_prompt": False},
        )
    assert out["usage"]["prompt_tokens"] == len(local_tok.encode(prompt))


# --------------------------------------------------------------------------------------------------
# The real default model: golden ids recorded from stock llama-server
# (POST /tokenize, add_special=true, parse_special=true).
# --------------------------------------------------------------------------------------------------
GOLDEN = {
    "<|im_start|>user\nHello 12345  world\n\n<|im_end|>": [
        1,
        4093,
        198,
        19556,
        216,
        33,
        34,
        35,
        36,
        37,
        216,
        905,
        1116,
        2,
    ],
}


def test_smollm2_golden(model_path: Path, tmp_path: Path) -> None:
    pt = PromptTokenizer(load_tokenizer(model_path, tmp_path))
    assert pt.bos_id is None and pt.eos_id is None  # add_bos_token = false in this GGUF
    assert len(pt.specials) == 17
    for text, ids in GOLDEN.items():
        assert pt.encode(text) == ids
        assert pt.encode(text) == ids  # warm
    for text in CORPUS:
        assert pt.encode(text) == pt.encode_uncached(text)
