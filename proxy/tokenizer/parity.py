"""Parity check of :class:`PromptTokenizer` against the server's ``/tokenize``, and :func:`probe`,
which loads the local tokenizer and keeps it only when parity holds."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from proxy.tokenizer.errors import UnsupportedTokenizerError
from proxy.tokenizer.prompt import PromptTokenizer
from proxy.tokenizer.vocab import load_tokenizer

__all__ = ["CORPUS", "ParityMismatch", "ParityResult", "ProbeResult", "check_parity", "probe"]

#: The server's ``POST /tokenize`` with :data:`CHAT_TOKENIZE_FLAGS` (add_special, parse_special).
RemoteTokenize = Callable[[str], Awaitable[list[int]]]


# --------------------------------------------------------------------------------------------------
# Parity check against the server
# --------------------------------------------------------------------------------------------------
_TOOLS_JSON = json.dumps(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get the current weather for a city, in °C or °F.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "description": "City name, e.g. 'São Paulo' or '東京'"},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 14},
                    },
                    "required": ["city"],
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "search_docs",
                "description": "Full-text search over the knowledge base; returns the top-k passages.",
                "parameters": {
                    "type": "object",
                    "properties": {"query": {"type": "string"}, "k": {"type": "integer", "default": 5}},
                    "required": ["query"],
                },
            },
        },
    ],
    indent=2,
    ensure_ascii=False,
)

#: Built-in parity corpus: each entry is tokenized locally and by the server and must match.
CORPUS: tuple[str, ...] = (
    "",
    "Hello, world!",
    " leading space",
    "trailing space ",
    "trailing spaces and newline   \n",
    "  two leading spaces",
    "I'm sure you're right, they've said we'll see; it's John's and I'd know. I'M SURE YOU'RE RIGHT.",
    "don't won't can't shouldn't y'all 'tis ''quoted'' 'single' \"double\" ’curly’ ‘s",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1e-9 0x1F 1,000,000 2024-05-17 12:34:56",
    "Long digit run: 3141592653589793238462643383279502884197169399375105820974944592307816406286",
    "Fullwidth ０１２３ superscript x² x³ fractions ½ ¾ roman Ⅻ circled ① arabic-indic ٠١٢٣ devanagari ४२",
    "tabs\tbetween\t\twords\t\t\t\nand\ttrailing\t",
    "lines\n\nwith\n\n\nblank\n \n  \n\t\nlines\r\nand CRLF\r\n\r\nend\n",
    "\n\n\n",
    "          ten spaces then text",
    "mixed   \t \u00a0 whitespace\u3000ideographic\u2003em\u2009thin\u202fnarrow\u200bzwsp\u0085nel",
    "vertical\x0btab\x0cformfeed",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    '#include <stdio.h>\nint main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}\n',
    "const f = async (x) => { await fetch(`/api/${x}?q=1&r=2`); return x ?? null; }; // ok\n",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%son' ORDER BY id DESC LIMIT 10;",
    "<html><body><div class=\"a b\" id='c'>&nbsp;&amp;</div></body></html>",
    "URLs: https://example.com/path/to/page?query=1&lang=en#frag http://127.0.0.1:8080/v1/chat "
    "mailto:someone@example.org ftp://files.example.net/pub/file_v2.tar.gz www.x.io/a-b_c~d",
    "中文测试：你好，世界！这是一个用于分词的句子。繁體中文也要測試。",
    "日本語のテキスト、ひらがなとカタカナ。東京都。한국어 텍스트입니다. 안녕하세요!",
    "Русский текст, Ελληνικά, עברית, العربية, हिन्दी, ไทย, Tiếng Việt, Türkçe, Ελλάδα",
    "Emoji: 😀😃😄 👍🏽 👩‍👩‍👧‍👦 🇺🇸🇯🇵 ❤️ 🏳️‍🌈 ✅ ⭐ 🤖🦙 and text😀text",
    "Combining: e\u0301 a\u0308 n\u0303 Z\u0351\u0352\u0353algo; precomposed é ä ñ; Hangul jamo \u1100\u1161",
    "Math ∑∫∂√∞ ≠ ≤ ≥ ± × ÷ → ⇒ ∀x∃y: x ∈ ℝ; α β γ δ ε; ∮ ℵ₀; 𝔸𝔹ℂ 𝐀𝐁𝐂",
    "Symbols ©®™ § ¶ † ‡ • … ‰ ′ ″ € £ ¥ ₹ ₿ ¢ ¤ ¦ ¨ ¬ ¯ ° ´ µ · ¸ ¿ ¡",
    "Unicode 16 letters llama.cpp does not know: x\u1c89y \u1c89\u1c8a ab\ua7cbcd\ua7cc \U000105c0\U000105c1a "
    "Garay digits 1\U00010d40\U00010d412 x\U00010d45y 7\U00010d49",
    "Rare planes: \U00020000\U0002a6d6 \U0001f9ff \U000e0041 private \ue000\U000f0000 unassigned \U0003fffe",
    "control chars: \x01\x02\x1b[0m\x7f bell\x07 nul-free",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\n",
    "special tokens glued<|im_end|><|im_start|>and<|endoftext|>inside words<|im_start|>user",
    "partial specials: <|im_start <|im_end |im_start|> <|im_sta rt|> <|IM_START|> < |im_end| >",
    "<repo_name>repo<file_sep>a.py<filename>b.py<gh_stars>100<jupyter_code>print(1)<empty_output>",
    "JSON tool schema:\n" + _TOOLS_JSON,
    '{"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather",'
    '"arguments":"{\\"city\\": \\"Paris\\", \\"unit\\": \\"celsius\\"}"}}]}',
    "Markdown: # Title\n\n## Sub\n\n- item 1\n- item 2\n  - nested\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
    "```python\nprint('x')\n```\n> quote\n**bold** _it_ ~~s~~ `code`",
    "Punctuation runs: ... !!! ??? --- === *** ### $$$ %%% ^^^ &&& ||| ~~~ ``` ''' \"\"\" ;;; ::: ,,, ...\n",
    "Apostrophes 's 't 're 've 'm 'll 'd 'S 'T 'RE 'Ve 'LL x's y'T",
    "a" * 300 + " " + "ab" * 150 + " " + "😀" * 20,
    "Mixed: Hello世界123abcДобрый день!🙂 mañana-niño_año über straße Œuvre ﬁ ligature ǅ titlecase",
)


class ParityMismatch(NamedTuple):
    text: str  # truncated
    local: list[int]  # window around the first difference
    remote: list[int]


@dataclass
class ParityResult:
    ok: bool
    checked: int = 0
    mismatches: list[ParityMismatch] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.ok:
            return f"tokenizer parity ok ({self.checked} texts)"
        return (
            f"tokenizer parity FAILED: {len(self.mismatches)} mismatches, {len(self.errors)} errors "
            f"out of {self.checked} texts; first: "
            + (repr(self.mismatches[0]) if self.mismatches else repr(self.errors[:1]))
        )


def _mismatch(text: str, local: list[int], remote: list[int]) -> ParityMismatch:
    d = next((i for i, (a, b) in enumerate(zip(local, remote, strict=False)) if a != b), None)
    if d is None:
        d = min(len(local), len(remote))
    lo = max(0, d - 8)
    t = text if len(text) <= 300 else text[:300] + "..."
    return ParityMismatch(t, local[lo : d + 24], remote[lo : d + 24])


async def check_parity(
    local: PromptTokenizer,
    remote_tokenize: RemoteTokenize,
    corpus: Iterable[str] = CORPUS,
    *,
    include_probes: bool = True,
    max_mismatches: int = 10,
    concurrency: int = 4,
) -> ParityResult:
    """Compare ``local.encode`` with the server's tokenization for each text of ``corpus``.

    ``remote_tokenize`` must call the server's ``POST /tokenize`` with :data:`CHAT_TOKENIZE_FLAGS`.
    ``include_probes`` adds :meth:`PromptTokenizer.probe_texts` (every special token text). Any
    mismatch or remote error makes ``ok`` false: the caller should then use the server's tokenizer.
    """
    texts = list(corpus)
    if include_probes:
        texts += local.probe_texts()
    loop = asyncio.get_running_loop()
    locals_ = await loop.run_in_executor(None, lambda: [local.encode(t) for t in texts])
    sem = asyncio.Semaphore(max(1, concurrency))

    async def _remote(t: str) -> list[int] | BaseException:
        async with sem:
            try:
                return list(await remote_tokenize(t))
            except Exception as e:  # reported, not raised
                return e

    remotes = await asyncio.gather(*(_remote(t) for t in texts))
    res = ParityResult(ok=True, checked=len(texts))
    for t, loc, rem in zip(texts, locals_, remotes, strict=True):
        if isinstance(rem, BaseException):
            res.ok = False
            if len(res.errors) < max_mismatches:
                res.errors.append(f"{type(rem).__name__}: {rem} (text {t[:60]!r})")
        elif loc != rem:
            res.ok = False
            if len(res.mismatches) < max_mismatches:
                res.mismatches.append(_mismatch(t, loc, rem))
    return res


# --------------------------------------------------------------------------------------------------
# The probe: the proxy at startup and `radixctl doctor` decide the same way
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeResult:
    """What :func:`probe` found: the tokenizer to use locally (None: use the server's), and why."""

    tokenizer: PromptTokenizer | None
    error: str = ""  # why no local tokenizer could be built ("" when one was)
    parity: ParityResult | None = None  # None when there was no local tokenizer to compare

    @property
    def mismatches(self) -> int:
        """Corpus texts tokenized differently (at most ``check_parity``'s ``max_mismatches``)."""
        return len(self.parity.mismatches) if self.parity else 0

    @property
    def note(self) -> str:
        """One line for /radix/stats and `radixctl up`: ``local``, or ``server (why)``."""
        if self.tokenizer is not None:
            return "local"
        if self.parity is None:
            return f"server (local tokenizer unavailable: {self.error})"
        return f"server ({self.mismatches} corpus mismatches)"


async def probe(
    model_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str], remote: RemoteTokenize
) -> ProbeResult:
    """Build the local tokenizer of the GGUF at ``model_path`` and keep it only if it tokenizes
    :data:`CORPUS` (plus every special token text) exactly as ``remote`` does.

    Never raises for a model it cannot read or reproduce: the caller then tokenizes through the
    server, which is slower but always right.
    """
    try:
        tokenizer = PromptTokenizer(await asyncio.to_thread(load_tokenizer, model_path, cache_dir))
    except (OSError, ValueError, UnsupportedTokenizerError) as exc:
        return ProbeResult(None, error=str(exc))
    parity = await check_parity(tokenizer, remote, CORPUS)
    return ProbeResult(tokenizer if parity.ok else None, parity=parity)
