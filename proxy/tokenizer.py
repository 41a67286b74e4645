"""Tokenize OpenAI chat prompts exactly as llama-server's chat path does.

The proxy matches token prefixes against its KV caches, so its tokens must be the server's tokens,
id for id. This module builds a ``tokenizers.Tokenizer`` from the GGUF vocabulary and wraps it in
:class:`PromptTokenizer`, which reproduces llama.cpp's tokenization of a rendered chat prompt.

How llama-server (commit 0c1e570) tokenizes a chat request
----------------------------------------------------------
``POST /v1/chat/completions`` renders the messages with the chat template
(``oaicompat_chat_params_parse``; ``common_chat_templates_apply`` strips a leading BOS text / trailing
EOS text from the rendering when the vocab adds them itself), then ``handle_completions_impl`` calls
``tokenize_input_prompts(vocab, mctx, prompt, add_special=true, parse_special=true)``, i.e.
``common_tokenize(vocab, prompt, true, true)`` -> ``llama_vocab::impl::tokenize``:

1. ``tokenizer_st_partition``: every vocab token whose attribute is CONTROL, USER_DEFINED or UNKNOWN
   is a "special" token. Taking them longest text first, each occurrence in the not yet partitioned
   text fragments is cut out and becomes that token's id (optionally stripping ASCII whitespace on
   the left / right for LSTRIP / RSTRIP tokens). BPE never merges across these cuts.
2. BPE (``llm_tokenizer_bpe_session``): if ``add_special`` and the vocab's ``add_bos``: BOS first.
   Each remaining text fragment is pre-tokenized with the regex list chosen by ``tokenizer.ggml.pre``
   (``unicode_regex_split``, with llama.cpp's own Unicode tables), byte-encoded GPT-2 style, and
   BPE-merged word by word (lowest merge rank first, leftmost on ties). Then EOS if ``add_eos``.

``POST /tokenize`` runs the same ``tokenize_mixed`` code with the flags from the request, so
``{"add_special": true, "parse_special": true}`` (see :data:`CHAT_TOKENIZE_FLAGS`) is the chat path.

Exactness
---------
* The pre-tokenizer regexes use explicit character classes built from llama.cpp's own Unicode
  tables (``src/unicode-data.cpp`` at the pinned commit, embedded below), not the regex engine's
  ``\\p{L}`` / ``\\p{N}``: Oniguruma in ``tokenizers`` 0.23 classifies ~4,300 more code points as
  letters and 80 more as digits (Unicode 16 additions such as U+1C89, U+A7CB, Garay digits
  U+10D40..) than llama.cpp's tables do; ``\\s`` is the same 25 code points in both.
* Byte symbols missing from the vocab (SmolLM2 lacks 21 of the 256, e.g. the bytes 0x04 and 0xF1)
  stay BPE barriers that are dropped afterwards, as in llama.cpp (the tokenizer's BPE model maps
  them to an unused special token as "unk", which :class:`PromptTokenizer` removes). A plain
  ``Tokenizer.encode`` on the built tokenizer keeps those unk ids.
* Special tokens are cut by our own port of ``tokenizer_st_partition`` (longest first), not by the
  ``tokenizers`` added-vocabulary matcher (leftmost-longest), which differs on overlapping tokens.
* Only pre-tokenizer families whose llama.cpp splitter is equivalent to its regex are supported
  (GPT-2, StarCoder/SmolLM, Llama-3, Qwen2 families); anything else raises
  :class:`UnsupportedTokenizerError` so the caller uses the server's ``/tokenize`` instead.
* Equal-length special tokens whose texts overlap in the input are ordered by id here; llama.cpp's
  ``std::sort`` leaves their order unspecified. Tokens that llama.cpp turns into CONTROL by text
  (EOT/EOM/FIM auto-detection picks the first match in ``unordered_map`` order) are all treated as
  special here. :func:`check_parity` probes every such text against the server at startup.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import hashlib
import json
import mmap
import os
import struct
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

__all__ = [
    "CHAT_TOKENIZE_FLAGS",
    "CORPUS",
    "ParityMismatch",
    "ParityResult",
    "PromptTokenizer",
    "UnsupportedTokenizerError",
    "build_hf_tokenizer",
    "build_pre_tokenizer",
    "check_parity",
    "gguf_cache_key",
    "load_tokenizer",
    "split_special",
    "supported_pre_types",
]

#: Body flags for ``POST /tokenize`` that reproduce the chat completion path.
CHAT_TOKENIZE_FLAGS: dict[str, bool] = {"add_special": True, "parse_special": True}

# Bump when the build logic changes: old cache entries then stop matching.
_BUILD_VERSION = 2


class UnsupportedTokenizerError(Exception):
    """The GGUF's tokenizer cannot be reproduced exactly here; use the server's tokenizer."""


# --------------------------------------------------------------------------------------------------
# llama.cpp's Unicode tables (src/unicode-data.cpp at commit 0c1e570, "generated with
# scripts/gen-unicode-data.py"): code point ranges flagged LETTER (\p{L}) and NUMBER (\p{N}).
# Encoding: comma separated "gap:span" in hex; a range starts `gap` after the end of the previous
# range + 1 (the first after 0) and covers start..start+span.
# --------------------------------------------------------------------------------------------------
_LLAMA_LETTER_RANGES = (
    "41:19,6:19,2f:0,a:0,4:0,5:16,1:1e,1:1c9,4:b,e:4,7:0,1:0,81:4,1:1,2:3,1:0,6:0,1:2,1:0,1:13,1:52,"
    "1:8a,8:a5,1:25,2:0,6:28,47:1a,4:3,2d:2a,23:1,1:62,1:0,f:1,7:1,a:2,2:0,10:0,1:1d,1d:58,b:0,18:20,"
    "9:1,4:0,5:15,4:0,9:0,3:0,17:18,7:a,5:17,1:5,11:29,3a:35,3:0,12:0,7:9,f:f,4:7,2:1,2:15,1:6,1:0,"
    "3:3,3:0,10:0,d:1,1:2,e:1,a:0,8:5,4:1,2:15,1:6,1:1,1:1,1:1,1f:3,1:0,13:2,10:8,1:2,1:15,1:6,1:1,"
    "1:4,3:0,12:0,f:1,17:0,b:7,2:1,2:15,1:6,1:1,1:4,3:0,1e:1,1:2,f:0,11:0,1:5,3:2,1:3,3:1,1:0,1:1,"
    "3:1,3:2,3:b,16:0,34:7,1:2,1:16,1:f,3:0,1a:2,2:0,2:1,1e:0,4:7,1:2,1:16,1:9,1:4,3:0,1f:1,1:1,f:1,"
    "11:8,1:2,1:28,2:0,10:0,5:2,8:2,18:5,5:11,3:17,1:8,1:0,2:6,3a:2f,1:1,c:6,3a:1,1:0,1:4,1:17,1:0,"
    "1:9,1:1,9:0,2:4,1:0,15:3,20:0,3f:7,1:23,1b:4,73:2a,14:0,10:5,4:3,3:0,3:1,7:2,4:c,c:0,11:25,1:0,"
    "5:0,2:2a,1:14c,1:3,2:6,1:0,1:3,2:28,1:3,2:20,1:3,2:6,1:0,1:3,2:e,1:38,1:3,2:42,25:f,10:55,2:5,"
    "3:26b,2:10,1:19,5:4a,6:7,7:11,d:12,e:11,e:c,1:2,f:33,23:0,4:0,43:58,7:4,2:21,1:0,5:45,a:1e,"
    "31:1d,2:4,b:2b,4:19,36:16,9:34,52:0,5d:2e,11:7,36:1d,d:1,a:2b,1a:23,29:2,a:23,2:8,7:2a,2:2,29:3,"
    "1:5,1:1,3:0,5:bf,40:115,2:5,2:25,2:5,2:7,1:0,1:0,1:0,1:1e,2:34,1:6,1:0,3:2,1:6,3:3,2:5,4:c,5:2,"
    "1:6,74:0,d:0,10:c,65:0,4:0,2:9,1:0,3:4,6:0,1:0,1:0,1:3,1:a,2:3,5:4,4:0,34:1,a7b:e4,6:3,3:1,c:25,"
    "1:0,5:0,2:37,7:0,10:16,9:6,1:6,1:6,1:6,1:6,1:6,1:6,1:6,50:0,1d5:1,2a:4,5:1,4:55,6:2,1:59,1:3,"
    "5:2a,1:5d,11:1f,30:f,200:19bf,40:568c,43:2d,2:10c,3:f,a:1,14:2e,10:1e,2:45,31:8,2:66,2:3f,5:1,"
    "1:0,1:4,18:f,1:2,1:3,1:16,1d:33,e:31,3e:5,3:0,1:1,b:1b,a:16,19:1c,7:2e,1c:0,10:4,1:9,a:4,1:28,"
    "17:2,1:7,14:16,3:0,3:31,1:0,3:1,2:4,2:0,1:0,18:2,2:a,7:2,c:5,2:5,2:5,9:6,1:6,1:2a,1:d,6:72,"
    "1d:2ba3,c:16,4:30,2104:16d,2:69,26:6,c:4,5:0,1:9,1:c,1:4,1:0,1:1,1:1,1:6b,21:16a,12:3f,2:35,"
    "28:b,74:4,1:86,24:19,6:19,b:58,3:5,2:5,2:5,2:2,23:b,1:19,1:12,1:1,1:e,2:d,22:7a,185:1c,3:30,"
    "2f:1f,d:13,1:7,6:25,a:1d,2:23,4:7,30:9d,12:23,4:23,4:27,8:33,c:a,1:e,1:6,1:1,1:a,1:e,1:6,1:1,"
    "43:136,9:15,a:7,18:5,1:29,1:8,45:5,2:0,1:2b,1:1,3:0,2:16,a:16,9:1e,41:12,1:1,a:15,a:19,46:37,"
    "6:1,40:0,f:3,1:2,1:1c,2a:1c,3:1c,23:7,1:1b,1b:35,a:15,a:12,d:11,6e:48,37:32,d:32,d:23,15c:29,"
    "6:1,4e:1c,a:0,8:15,2a:11,2e:14,1b:16,c:34,39:1,2:0,d:2c,20:18,1a:23,1d:0,2:0,8:22,3:0,c:2f,e:3,"
    "15:0,1:0,23:11,1:18,13:1,3f:6,1:0,1:3,1:e,1:9,7:2e,26:7,2:1,2:15,1:6,1:1,1:4,3:0,12:0,c:4,9e:34,"
    "12:3,14:2,1e:2f,14:1,1:0,b8:2e,29:3,24:2f,14:0,3b:2a,d:0,47:1a,25:6,b9:2b,74:3f,1f:7,2:0,2:7,"
    "1:1,1:17,f:0,1:0,5e:7,2:26,10:0,1:0,1c:0,a:27,7:0,15:0,b:2d,13:0,12:48,107:8,1:24,11:0,31:1d,"
    "70:6,1:1,1:25,15:0,19:5,1:1,1:1f,e:0,147:12,f:0,1:c,1:21,7c:0,4f:399,e6:c3,a4c:60,f:42f,11:5,"
    "fb9:246,21b9:238,7:1e,11:4e,11:1d,12:2f,10:3,1f:14,5:12,2b0:3f,80:4a,5:0,42:c,40:1,1:0,1c:17f7,"
    "8:4d5,2a:8,22e7:3,1:6,1:1,1:122,f:0,1d:2,2:0,e:3,8:18b,904:6a,5:c,3:8,7:9,1766:54,1:46,1:1,2:0,"
    "2:1,2:3,1:b,1:0,1:6,1:40,1:3,2:7,1:6,1:1b,1:3,1:4,1:0,3:6,1:153,2:18,1:18,1:1e,1:18,1:1e,1:18,"
    "1:1e,1:18,1:1e,1:18,1:7,734:1e,6:5,105:3d,92:2c,a:6,10:0,141:1d,12:2b,1e4:1b,2f4:6,1:3,1:1,1:e,"
    "1:c4,3b:43,7:0,4b4:3,1:1a,1:1,1:0,2:0,1:9,1:3,1:0,1:0,6:0,4:0,1:0,1:0,1:2,1:1,1:0,2:0,1:0,1:0,"
    "1:0,1:0,1:1,1:0,2:3,1:6,1:3,1:3,1:0,1:9,1:10,5:2,1:4,1:10,1144:a6df,20:1039,6:dd,2:1681,e:1d30,"
    "f:26d,9a2:21d,5e2:134a,5:105f"
)
_LLAMA_NUMBER_RANGES = (
    "30:9,78:1,5:0,2:2,5a1:9,86:9,c6:9,19c:9,76:9,4:5,6c:9,76:9,76:9,2:5,6e:c,73:9,8:6,67:9,68:6,"
    "7:12,6d:9,60:9,76:9,46:13,10c:9,46:9,2cf:13,371:2,ef:9,6:9,16:9,12c:9,80:a,a5:9,6:9,b6:9,56:9,"
    "86:9,6:9,416:0,3:5,6:9,c6:32,2:4,2d6:3b,4e:15,276:1d,569:0,309:0,19:8,e:2,157:3,8a:9,1e:7,1:e,"
    "20:9,27:e,7360:9,bc:9,140:5,9a:9,26:9,c6:9,16:9,56:9,196:9,5316:9,1ed:2c,c:38,11:1,155:1a,24:3,"
    "1d:0,8:0,86:4,ca:9,3ae:7,19:6,27:8,4b:4,16:5,a0:1,2:f,2:2d,40:8,34:1,1e:2,4b:4,68:7,18:7,29:6,"
    "14a:5,30:9,126:1e,9e:9,2a:3,70:6,86:1d,80:9,3c:9,90:9,7:13,fb:9,156:9,76:9,176:9,66:9,66:b,"
    "1a4:12,5d:9,2f6:1c,e3:9,46:9,1a6:9,66:14,42b:6e,45f1:9,56:9,86:9,1:6,31e:16,6429:13,c:13,6c:18,"
    "455:31,940:9,1a6:9,1f6:9,3cd:8,80:9,317:3a,1:2,1:3,4c:2c,1:e,3c2:c,ae3:9"
)

# unicode_set_whitespace in the same file (the Unicode White_Space property).
_LLAMA_WHITESPACE: tuple[int, ...] = (
    0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, 0x2000, 0x2001, 0x2002, 0x2003, 0x2004,
    0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000,
)


def _decode_ranges(encoded: str) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    prev = 0
    for part in encoded.split(","):
        gap, span = part.split(":")
        start = prev + int(gap, 16)
        end = start + int(span, 16)
        out.append((start, end))
        prev = end + 1
    return out


def _ranges_from_points(points: Iterable[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for cp in sorted(points):
        if out and out[-1][1] == cp - 1:
            out[-1] = (out[-1][0], cp)
        else:
            out.append((cp, cp))
    return out


LLAMA_LETTER_RANGES: tuple[tuple[int, int], ...] = tuple(_decode_ranges(_LLAMA_LETTER_RANGES))
LLAMA_NUMBER_RANGES: tuple[tuple[int, int], ...] = tuple(_decode_ranges(_LLAMA_NUMBER_RANGES))
LLAMA_WHITESPACE_RANGES: tuple[tuple[int, int], ...] = tuple(_ranges_from_points(_LLAMA_WHITESPACE))


def _class_body(ranges: Iterable[tuple[int, int]]) -> str:
    parts = []
    for a, b in ranges:
        parts.append(f"\\x{{{a:X}}}" if a == b else f"\\x{{{a:X}}}-\\x{{{b:X}}}")
    return "".join(parts)


_CLASS_BODIES: dict[str, str] = {
    r"\p{L}": _class_body(LLAMA_LETTER_RANGES),
    r"\p{N}": _class_body(LLAMA_NUMBER_RANGES),
    r"\s": _class_body(LLAMA_WHITESPACE_RANGES),
}


def translate_regex(expr: str) -> str:
    r"""Rewrite a llama.cpp pre-tokenizer regex for Oniguruma with llama.cpp's character classes.

    ``\p{L}``, ``\p{N}``, ``\s`` and ``\S`` become explicit code point classes; any other Unicode
    property raises :class:`UnsupportedTokenizerError`.
    """
    out: list[str] = []
    inside = False
    i = 0
    n = len(expr)
    while i < n:
        c = expr[i]
        if c == "\\" and i + 1 < n:
            nxt = expr[i + 1]
            if nxt == "p":
                close = expr.find("}", i)
                prop = expr[i : close + 1] if close > 0 else expr[i:]
                body = _CLASS_BODIES.get(prop)
                if body is None:
                    raise UnsupportedTokenizerError(f"regex property {prop!r} not supported")
                out.append(body if inside else f"[{body}]")
                i = close + 1
                continue
            if nxt == "s":
                body = _CLASS_BODIES[r"\s"]
                out.append(body if inside else f"[{body}]")
                i += 2
                continue
            if nxt == "S":
                if inside:
                    raise UnsupportedTokenizerError(r"\S inside a character class not supported")
                out.append(f"[^{_CLASS_BODIES[chr(92) + 's']}]")
                i += 2
                continue
            out.append(expr[i : i + 2])
            i += 2
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        out.append(c)
        i += 1
    return "".join(out)


# --------------------------------------------------------------------------------------------------
# Pre-tokenizer families (src/llama-vocab.cpp: llama_vocab::impl::load and llm_tokenizer_bpe).
# --------------------------------------------------------------------------------------------------
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreFamily:
    name: str
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    default_add_bos: bool = False


# The GPT-2 regex: llama.cpp uses its hand-written splitter, which also does the regex's missing
# trailing "|\s+" (a lone whitespace not followed by whitespace); adding it here changes nothing
# else because Split(..., "isolated") keeps unmatched text as its own piece anyway.
_FAM_GPT2 = _PreFamily("gpt2", (_RE_GPT2 + r"|\s+",))
_FAM_STARCODER = _PreFamily("starcoder", (r"\p{N}", _RE_GPT2 + r"|\s+"))
_FAM_LLAMA3 = _PreFamily("llama3", (_RE_LLAMA3,), ignore_merges=True, default_add_bos=True)
_FAM_DBRX = _PreFamily("dbrx", (_RE_LLAMA3,))
_FAM_QWEN2 = _PreFamily("qwen2", (_RE_QWEN2,))

_PRE_FAMILIES: dict[str, _PreFamily] = {}
for _names, _fam in (
    (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
      "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais",
      "trillion", "granite-docling", "exaone4"), _FAM_GPT2),
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
     _FAM_STARCODER),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano"), _FAM_LLAMA3),
    (("dbrx", "smaug-bpe"), _FAM_DBRX),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"),
     _FAM_QWEN2),
):
    for _n in _names:
        _PRE_FAMILIES[_n] = _fam


def supported_pre_types() -> list[str]:
    """``tokenizer.ggml.pre`` values :func:`build_hf_tokenizer` can reproduce exactly."""
    return sorted(_PRE_FAMILIES)


# --------------------------------------------------------------------------------------------------
# Token attributes as llama.cpp derives them (token_type + text-based overrides).
# --------------------------------------------------------------------------------------------------
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

# Texts llama.cpp marks CONTROL when found (EOT/EOM/FIM auto-detection and the EOG list).
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                  "<|code_prefix|>", "<|prefix|>")
_FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                  "<|code_suffix|>", "<|suffix|>")
_FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                  "<|code_middle|>", "<|middle|>")
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<｜end▁of▁sentence｜>", "[e~[")
_GPT_OSS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
# (GGUF key of the id, candidate texts): auto-detection only runs when the key is absent.
_AUTODETECT = (
    ("tokenizer.ggml.eot_token_id", _EOT_TEXTS),
    ("tokenizer.ggml.eom_token_id", _EOM_TEXTS),
    ("tokenizer.ggml.fim_pre_token_id", _FIM_PRE_TEXTS),
    ("tokenizer.ggml.fim_suf_token_id", _FIM_SUF_TEXTS),
    ("tokenizer.ggml.fim_mid_token_id", _FIM_MID_TEXTS),
    ("tokenizer.ggml.fim_pad_token_id", _FIM_PAD_TEXTS),
    ("tokenizer.ggml.fim_rep_token_id", _FIM_REP_TEXTS),
    ("tokenizer.ggml.fim_sep_token_id", _FIM_SEP_TEXTS),
)
_AUTODETECT_DEPRECATED = {
    "tokenizer.ggml.fim_pre_token_id": "tokenizer.ggml.prefix_token_id",
    "tokenizer.ggml.fim_suf_token_id": "tokenizer.ggml.suffix_token_id",
    "tokenizer.ggml.fim_mid_token_id": "tokenizer.ggml.middle_token_id",
}

#: Every text llama.cpp may promote to a special token by its text; probed by :func:`check_parity`.
SPECIAL_CANDIDATE_TEXTS: tuple[str, ...] = tuple(
    dict.fromkeys(
        _EOT_TEXTS + _EOM_TEXTS + _FIM_PRE_TEXTS + _FIM_SUF_TEXTS + _FIM_MID_TEXTS + _FIM_PAD_TEXTS
        + _FIM_REP_TEXTS + _FIM_SEP_TEXTS + _EOG_TEXTS + _GPT_OSS_USER_DEFINED
    )
)


@dataclass
class _Special:
    id: int
    text: str
    control: bool  # CONTROL / UNKNOWN (vs USER_DEFINED)
    lstrip: bool = False
    rstrip: bool = False


@dataclass
class GGUFVocab:
    """The tokenizer part of a GGUF, as llama.cpp interprets it."""

    model: str
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool
    general_name: str = ""
    specials: list[_Special] = field(default_factory=list)


def _field_value(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


def read_gguf_vocab(gguf_path: str | os.PathLike[str]) -> GGUFVocab:
    """Read the vocabulary of a GGUF with ``gguf.GGUFReader`` (no network)."""
    from gguf import GGUFReader  # imported lazily: it pulls in numpy and is slow to import

    try:
        return _read_gguf_vocab(GGUFReader(os.fspath(gguf_path), "r"))
    except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError) as e:
        raise UnsupportedTokenizerError(f"cannot read the GGUF vocabulary: {type(e).__name__}: {e}") from e


def _read_gguf_vocab(reader: Any) -> GGUFVocab:
    model = _field_value(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedTokenizerError(f"tokenizer.ggml.model={model!r}: only 'gpt2' (BPE) is supported")
    pre = _field_value(reader, "tokenizer.ggml.pre") or ""
    if pre not in _PRE_FAMILIES:
        raise UnsupportedTokenizerError(
            f"tokenizer.ggml.pre={pre!r} is not supported (supported: {', '.join(supported_pre_types())})"
        )
    fam = _PRE_FAMILIES[pre]
    tokens = _field_value(reader, "tokenizer.ggml.tokens")
    merges = _field_value(reader, "tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise UnsupportedTokenizerError("GGUF has no tokenizer.ggml.tokens / tokenizer.ggml.merges")
    types = _field_value(reader, "tokenizer.ggml.token_type")
    n = len(tokens)
    token_types = [int(t) for t in types] if types is not None else [_TT_NORMAL] * n
    if len(token_types) < n:
        raise UnsupportedTokenizerError("tokenizer.ggml.token_type shorter than the vocab")
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]

    def _id(key: str, default: int | None) -> int | None:
        v = _field_value(reader, key)
        if v is None:
            return default
        return int(v) if 0 <= int(v) < n else default

    bos_id = _id("tokenizer.ggml.bos_token_id", 11 if n > 11 else None)
    eos_id = _id("tokenizer.ggml.eos_token_id", 11 if n > 11 else None)
    add_bos = fam.default_add_bos
    add_eos = False
    v = _field_value(reader, "tokenizer.ggml.add_bos_token")
    if v is not None:
        add_bos = bool(v)
    v = _field_value(reader, "tokenizer.ggml.add_eos_token")
    if v is not None:
        add_eos = bool(v)
    if (add_bos and bos_id is None) or (add_eos and eos_id is None):
        raise UnsupportedTokenizerError("vocab adds BOS/EOS but has no such token")
    name = _field_value(reader, "general.name") or ""
    vocab = GGUFVocab(
        model=model, pre=pre, tokens=list(tokens), token_types=token_types[:n], merges=list(merges),
        bos_id=bos_id, eos_id=eos_id, add_bos=add_bos, add_eos=add_eos, general_name=str(name),
    )
    present_keys = {k for k in reader.fields if k.startswith("tokenizer.ggml.")}
    vocab.specials = _llama_specials(vocab, present_keys)
    return vocab


def _llama_specials(vocab: GGUFVocab, present_keys: set[str]) -> list[_Special]:
    """The tokens ``tokenizer_st_partition`` cuts out (parse_special=true), in llama.cpp's order."""
    text_to_id: dict[str, int] = {}
    for i, t in enumerate(vocab.tokens):
        text_to_id[t] = i  # later duplicates win, like llama.cpp's token_to_id[word] = i
    kind: dict[int, str] = {}  # "control" | "user" for special ids
    for i, tt in enumerate(vocab.token_types):
        if tt in (_TT_CONTROL, _TT_UNKNOWN):
            kind[i] = "control"
        elif tt == _TT_USER_DEFINED:
            kind[i] = "user"

    def _promote(text: str) -> None:
        tid = text_to_id.get(text)
        if tid is not None:
            kind[tid] = "control"  # attr |= CONTROL

    for key, texts in _AUTODETECT:
        dep = _AUTODETECT_DEPRECATED.get(key)
        if key in present_keys or (dep is not None and dep in present_keys):
            continue
        for text in texts:  # llama.cpp promotes only the first found (hash order): we take all
            _promote(text)
    eog_texts = [t for t in _EOG_TEXTS if t in text_to_id]
    for text in eog_texts:
        _promote(text)
    for text in _GPT_OSS_USER_DEFINED:
        tid = text_to_id.get(text)
        if tid is not None:
            kind[tid] = "user"
    if "</s>" in eog_texts and ("<|tool_response>" in eog_texts or "<|plamo:eos|>" in text_to_id):
        kind.pop(text_to_id["</s>"], None)  # "</s> is a normal token here"

    specials = [_Special(i, vocab.tokens[i], kind[i] == "control") for i in sorted(kind)]
    name = vocab.general_name.lower()
    if "phi-3" in name or "phi3" in name:
        for s in specials:
            s.rstrip = s.text not in ("<unk>", "<s>", "<|endoftext|>")
    if vocab.pre in ("jina-v2-de", "jina-v2-es", "jina-v2-code"):
        for s in specials:
            s.lstrip = s.text == "<mask>"
    if "modern-bert" in name:
        for s in specials:
            s.lstrip = s.text == "[MASK]"
    specials.sort(key=lambda s: (-len(s.text.encode("utf-8")), s.id))
    return specials


# --------------------------------------------------------------------------------------------------
# Building the tokenizers.Tokenizer
# --------------------------------------------------------------------------------------------------
def _hf_from_vocab(vocab: GGUFVocab) -> Tokenizer:
    fam = _PRE_FAMILIES[vocab.pre]
    token_to_id: dict[str, int] = {}
    for i, t in enumerate(vocab.tokens):
        token_to_id[t] = i
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for m in vocab.merges:
        pos = m.find(" ", 1)
        pair = (m[:pos], m[pos + 1 :]) if pos >= 0 else ("", "")
        if pair in seen or not pair[0] or not pair[1]:
            continue  # bpe_ranks.emplace keeps the first rank; malformed lines never match
        seen.add(pair)
        if pair[0] not in token_to_id or pair[1] not in token_to_id or pair[0] + pair[1] not in token_to_id:
            # llama.cpp would merge and then fall back to bytes; tokenizers cannot express that
            raise UnsupportedTokenizerError(f"merge {m!r} refers to tokens outside the vocab")
        merges.append(pair)
    # llama.cpp keeps a byte-level symbol that is not in the vocab (SmolLM2 lacks 21 of the 256, e.g.
    # the bytes 0x04, 0xF1) as a BPE symbol that nothing merges with, then drops it (its byte fallback
    # finds no token). tokenizers drops unknown symbols *before* merging, letting their neighbours
    # merge across the gap. So such symbols become an "unk" token here, a special token that is in no
    # merge (a barrier, like in llama.cpp); PromptTokenizer removes it from the output.
    unk: str | None = None
    missing = [c for c in pre_tokenizers.ByteLevel.alphabet() if c not in token_to_id]
    if missing:
        in_merges = {t for pair in merges for t in pair}
        unk = next(
            (s.text for s in sorted(vocab.specials, key=lambda s: s.id)
             if s.text not in in_merges and token_to_id.get(s.text) == s.id),
            None,
        )
        if unk is None:
            raise UnsupportedTokenizerError(
                f"vocab lacks {len(missing)} byte symbols and has no special token to stand in for them"
            )
    try:
        bpe = models.BPE(
            vocab=token_to_id, merges=merges, ignore_merges=fam.ignore_merges, fuse_unk=False,
            byte_fallback=False, unk_token=unk,
        )
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise UnsupportedTokenizerError(f"cannot build BPE model: {e}") from e
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = build_pre_tokenizer(vocab.pre)
    tok.decoder = decoders.ByteLevel()
    added = [
        AddedToken(s.text, single_word=False, lstrip=s.lstrip, rstrip=s.rstrip, normalized=False,
                   special=s.control)
        for s in sorted(vocab.specials, key=lambda s: s.id)
    ]
    if added:
        tok.add_tokens(added)
    single: list[str] = []
    special_tokens: list[tuple[str, int]] = []
    if vocab.add_bos and vocab.bos_id is not None:
        single.append(vocab.tokens[vocab.bos_id])
        special_tokens.append((vocab.tokens[vocab.bos_id], vocab.bos_id))
    single.append("$A")
    if vocab.add_eos and vocab.eos_id is not None:
        single.append(vocab.tokens[vocab.eos_id])
        special_tokens.append((vocab.tokens[vocab.eos_id], vocab.eos_id))
    if special_tokens:
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(single), special_tokens=list(dict.fromkeys(special_tokens))
        )
    # check every id round-trips (duplicated texts in the vocab would break id parity)
    if tok.get_vocab_size(with_added_tokens=True) != len(vocab.tokens):
        raise UnsupportedTokenizerError("vocab has duplicate token texts")
    return tok


def build_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's pre-tokenizer for ``tokenizer.ggml.pre`` = ``pre``: its regex list in order, each
    as an isolating split (like ``unicode_regex_split``), then GPT-2 byte-level encoding."""
    fam = _PRE_FAMILIES.get(pre)
    if fam is None:
        raise UnsupportedTokenizerError(f"tokenizer.ggml.pre={pre!r} is not supported")
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(translate_regex(r)), behavior="isolated") for r in fam.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    )


def build_hf_tokenizer(gguf_path: str | os.PathLike[str]) -> Tokenizer:
    """Build a ``tokenizers.Tokenizer`` equivalent to llama.cpp's for this GGUF.

    The pre-tokenizer is llama.cpp's regex list for ``tokenizer.ggml.pre`` (with llama.cpp's Unicode
    classes), the model is byte-level BPE from ``tokenizer.ggml.tokens`` / ``merges``, llama.cpp's
    special tokens (CONTROL / USER_DEFINED / UNKNOWN, plus text-detected EOG/FIM ones) are added
    tokens, and a post-processor adds BOS / EOS when the vocab does (``add_special_tokens=True``).
    Raises :class:`UnsupportedTokenizerError` for anything it cannot reproduce exactly.
    """
    return _hf_from_vocab(read_gguf_vocab(gguf_path))


# --------------------------------------------------------------------------------------------------
# Disk cache
# --------------------------------------------------------------------------------------------------
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_metadata_end(buf: mmap.mmap | bytes) -> int:
    """Byte offset where a (little-endian, v2+) GGUF's key/value section ends."""
    if buf[:4] != b"GGUF":
        raise ValueError("not a GGUF file")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version < 2 or version > 0xFFFF:
        raise ValueError(f"unsupported GGUF version {version}")
    (n_kv,) = struct.unpack_from("<Q", buf, 16)
    off = 24
    u64 = struct.Struct("<Q")
    u32 = struct.Struct("<I")

    def skip_value(off: int, vtype: int) -> int:
        if vtype == _GGUF_STRING:
            return off + 8 + u64.unpack_from(buf, off)[0]
        if vtype == _GGUF_ARRAY:
            (itype,) = u32.unpack_from(buf, off)
            (count,) = u64.unpack_from(buf, off + 4)
            off += 12
            if itype == _GGUF_STRING:
                for _ in range(count):
                    off += 8 + u64.unpack_from(buf, off)[0]
                return off
            if itype in _GGUF_SCALAR_SIZES:
                return off + count * _GGUF_SCALAR_SIZES[itype]
            for _ in range(count):
                off = skip_value(off, itype)
            return off
        return off + _GGUF_SCALAR_SIZES[vtype]

    for _ in range(n_kv):
        off += 8 + u64.unpack_from(buf, off)[0]  # key
        (vtype,) = u32.unpack_from(buf, off)
        off = skip_value(off + 4, vtype)
        if off > len(buf):
            raise ValueError("truncated GGUF metadata")
    return off


def gguf_cache_key(gguf_path: str | os.PathLike[str]) -> str:
    """Cheap identity of a GGUF's tokenizer: size, mtime and the sha256 of its metadata section.

    Also covers this module's build version and the ``tokenizers`` version, so a cache entry is
    rebuilt when either changes.
    """
    path = os.fspath(gguf_path)
    st = os.stat(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                try:
                    end = _gguf_metadata_end(mm)
                except (ValueError, struct.error, KeyError):
                    end = min(len(mm), 64 << 20)
                h.update(memoryview(mm)[:end])
        except ValueError:  # empty file: mmap refuses length 0
            pass
    ident = f"v{_BUILD_VERSION}|tokenizers {tokenizers.__version__}|{st.st_size}|{st.st_mtime_ns}|"
    return hashlib.sha256(ident.encode() + h.digest()).hexdigest()[:32]


def load_tokenizer(gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str]) -> Tokenizer:
    """:func:`build_hf_tokenizer`, cached as ``<cache_dir>/<key>.tokenizer.json`` (see
    :func:`gguf_cache_key`). A damaged cache file is rebuilt; writes are atomic."""
    cache = Path(cache_dir)
    path = cache / f"{gguf_cache_key(gguf_path)}.tokenizer.json"
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception:  # corrupt or foreign file: rebuild it
            pass
    tok = build_hf_tokenizer(gguf_path)
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tokenizer-", suffix=".tmp", dir=cache)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(tok.to_str())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tok


# --------------------------------------------------------------------------------------------------
# Special-token partition (port of llama_vocab::impl::tokenizer_st_partition)
# --------------------------------------------------------------------------------------------------
_C_ISSPACE = frozenset(" \t\n\v\f\r")


class SpecialToken(NamedTuple):
    id: int
    text: str
    lstrip: bool = False
    rstrip: bool = False


def split_special(text: str, specials: Sequence[SpecialToken]) -> list[str | int]:
    """Cut ``text`` at special tokens exactly like llama.cpp (``parse_special=true``).

    ``specials`` must be in llama.cpp's order (longest UTF-8 text first). Returns text pieces (never
    empty) and token ids, in order.
    """
    frags: list[tuple[int, int] | int] = [(0, len(text))] if text else []
    for sp in specials:
        tt = sp.text
        if not tt or tt not in text:
            continue
        out: list[tuple[int, int] | int] = []
        for fr in frags:
            if isinstance(fr, int):
                out.append(fr)
                continue
            pos, end = fr
            while True:
                m = text.find(tt, pos, end)
                if m < 0:
                    break
                left = m
                if sp.lstrip:
                    while left > pos and text[left - 1] in _C_ISSPACE:
                        left -= 1
                if left > pos:
                    out.append((pos, left))
                out.append(sp.id)
                pos = m + len(tt)
                if sp.rstrip:
                    while pos < end and text[pos] in _C_ISSPACE:
                        pos += 1
            if pos < end:
                out.append((pos, end))
        frags = out
    return [fr if isinstance(fr, int) else text[fr[0] : fr[1]] for fr in frags]


# --------------------------------------------------------------------------------------------------
# PromptTokenizer
# --------------------------------------------------------------------------------------------------
@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    entries: int = 0
    cached_tokens: int = 0


class _PieceCache:
    """Thread-safe LRU of text piece -> token ids, bounded by the total number of cached tokens."""

    def __init__(self, max_tokens: int, max_entries: int) -> None:
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self._d: OrderedDict[str, array.array[int]] = OrderedDict()
        self._lock = threading.Lock()
        self._tokens = 0
        self.stats = CacheStats()

    def get(self, key: str) -> array.array[int] | None:
        with self._lock:
            v = self._d.get(key)
            if v is not None:
                self._d.move_to_end(key)
                self.stats.hits += 1
                self.stats.hit_tokens += len(v)
            return v

    def put(self, key: str, ids: array.array[int]) -> None:
        if len(ids) > self.max_tokens // 4 or self.max_entries <= 0:
            return
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self._tokens -= len(old)
            self._d[key] = ids
            self._tokens += len(ids)
            while self._d and (self._tokens > self.max_tokens or len(self._d) > self.max_entries):
                _, ev = self._d.popitem(last=False)
                self._tokens -= len(ev)

    def count_miss(self, n_tokens: int) -> None:
        with self._lock:
            self.stats.misses += 1
            self.stats.miss_tokens += n_tokens

    def snapshot(self) -> CacheStats:
        with self._lock:
            s = CacheStats(**vars(self.stats))
            s.entries = len(self._d)
            s.cached_tokens = self._tokens
            return s

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self._tokens = 0


def _tokenizer_meta(tok: Tokenizer) -> tuple[int | None, int | None, int | None]:
    """(BOS id, EOS id) that the tokenizer's TemplateProcessing adds around ``$A``, and the id of
    the BPE model's unk token (a barrier for byte symbols missing from the vocab), if any."""
    spec = json.loads(tok.to_str())
    unk_text = (spec.get("model") or {}).get("unk_token")
    unk = tok.token_to_id(unk_text) if unk_text else None
    pp = spec.get("post_processor")
    if not pp or pp.get("type") != "TemplateProcessing":
        return None, None, unk
    single = pp.get("single") or []
    sp = pp.get("special_tokens") or {}

    def _id(piece: dict[str, Any]) -> int | None:
        st = piece.get("SpecialToken")
        if st is None:
            return None
        ids = (sp.get(st["id"]) or {}).get("ids") or []
        return int(ids[0]) if len(ids) == 1 else None

    bos = _id(single[0]) if single else None
    eos = _id(single[-1]) if len(single) > 1 else None
    return bos, eos, unk


class PromptTokenizer:
    """Tokenize a rendered chat prompt like llama-server's chat path (add_special, parse_special).

    The text is cut at special tokens (:func:`split_special`); each text piece is BPE-encoded through
    an LRU cache keyed by the piece's content (system prompts, tool schemas and past turns repeat
    between requests), and BOS / EOS are added when the vocab adds them. :meth:`encode` is
    synchronous and thread-safe; run it in an executor thread from asyncio code.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        specials: Sequence[SpecialToken] | None = None,
        bos_id: int | None | Literal["auto"] = "auto",
        eos_id: int | None | Literal["auto"] = "auto",
        cache_max_tokens: int = 4_000_000,
        cache_max_entries: int = 100_000,
    ) -> None:
        """``specials`` (in llama.cpp's order), ``bos_id`` and ``eos_id`` (None: not added) default
        to what :func:`build_hf_tokenizer` put in the tokenizer: its added tokens and its
        post-processor. The piece cache holds at most ``cache_max_tokens`` token ids in
        ``cache_max_entries`` pieces (0 entries disables it)."""
        self.tokenizer = tokenizer
        if specials is None:
            dec = tokenizer.get_added_tokens_decoder()
            specials = sorted(
                (SpecialToken(i, t.content, bool(t.lstrip), bool(t.rstrip)) for i, t in dec.items()),
                key=lambda s: (-len(s.text.encode("utf-8")), s.id),
            )
        self.specials: tuple[SpecialToken, ...] = tuple(specials)
        meta_bos, meta_eos, self.unk_id = _tokenizer_meta(tokenizer)
        self.bos_id: int | None = meta_bos if bos_id == "auto" else bos_id
        self.eos_id: int | None = meta_eos if eos_id == "auto" else eos_id
        self._cache = _PieceCache(cache_max_tokens, cache_max_entries)

    @classmethod
    def from_gguf(
        cls, gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None, **kw: Any
    ) -> PromptTokenizer:
        tok = load_tokenizer(gguf_path, cache_dir) if cache_dir is not None else build_hf_tokenizer(gguf_path)
        return cls(tok, **kw)

    # -- encoding ---------------------------------------------------------------------------------
    def split(self, text: str) -> list[str | int]:
        """Text pieces and special token ids of ``text`` (no BOS/EOS)."""
        return split_special(text, self.specials)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` exactly as the server's chat path produces them."""
        parts = self.split(text)
        cache = self._cache
        found: dict[str, array.array[int]] = {}
        todo: dict[str, None] = {}  # ordered set of cache misses
        for p in parts:
            if isinstance(p, str) and p not in found and p not in todo:
                ids = cache.get(p)
                if ids is None:
                    todo[p] = None
                else:
                    found[p] = ids
        if todo:
            missing = list(todo)
            # encode_batch_fast releases the GIL (Tokenizer.encode does not), so the event loop keeps
            # running while an executor thread tokenizes; it also spreads pieces over cores.
            encs = self.tokenizer.encode_batch_fast(missing, add_special_tokens=False)
            for p, enc in zip(missing, encs, strict=True):
                ids = self._piece_ids(enc.ids)
                found[p] = ids
                cache.count_miss(len(ids))
                cache.put(p, ids)
        out: list[int] = []
        if self.bos_id is not None:
            out.append(self.bos_id)
        for p in parts:
            if isinstance(p, int):
                out.append(p)
            else:
                out.extend(found[p])
        if self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def _piece_ids(self, ids: list[int]) -> array.array[int]:
        unk = self.unk_id
        if unk is not None and unk in ids:
            ids = [i for i in ids if i != unk]
        return array.array("i", ids)

    def encode_uncached(self, text: str) -> list[int]:
        """:meth:`encode` without the piece cache, one ``Tokenizer.encode`` per piece (a second code
        path for checks and benchmarks; it holds the GIL while tokenizing)."""
        out: list[int] = [self.bos_id] if self.bos_id is not None else []
        for p in self.split(text):
            if isinstance(p, int):
                out.append(p)
            else:
                out.extend(self._piece_ids(self.tokenizer.encode(p, add_special_tokens=False).ids))
        if self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    # -- cache --------------------------------------------------------------------------------------
    def cache_stats(self) -> CacheStats:
        return self._cache.snapshot()

    def clear_cache(self) -> None:
        self._cache.clear()

    def probe_texts(self) -> list[str]:
        """Texts that exercise every special token and every text llama.cpp may promote to one."""
        texts = [s.text for s in self.specials]
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        texts += [t for t in SPECIAL_CANDIDATE_TEXTS if t in vocab and t not in texts]
        out: list[str] = []
        chunk: list[str] = []
        for t in texts:
            chunk.append(f"a{t} {t}\n{t}{t}x")
            if len(chunk) == 32:
                out.append(" ".join(chunk))
                chunk = []
        if chunk:
            out.append(" ".join(chunk))
        return out


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
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
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
    remote_tokenize: Callable[[str], Awaitable[list[int]]],
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
