"""Tokenize OpenAI chat prompts exactly as llama-server's chat path does.

The proxy matches token prefixes against its KV caches, so its tokens must be the server's tokens,
id for id. This package builds a ``tokenizers.Tokenizer`` from the GGUF vocabulary and wraps it in
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
  tables (``src/unicode-data.cpp`` at the pinned commit, embedded in ``unicode_ranges.py``), not
  the regex engine's ``\\p{L}`` / ``\\p{N}``: Oniguruma in ``tokenizers`` 0.23 classifies ~4,300 more
  code points as letters and 80 more as digits (Unicode 16 additions such as U+1C89, U+A7CB, Garay
  digits U+10D40..) than llama.cpp's tables do; ``\\s`` is the same 25 code points in both.
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

# Names other modules and tests import: the ``X as X`` form marks a re-export outside ``__all__``.
from proxy.tokenizer.errors import UnsupportedTokenizerError
from proxy.tokenizer.parity import CORPUS, ParityMismatch, ParityResult, ProbeResult, check_parity, probe
from proxy.tokenizer.prompt import CHAT_TOKENIZE_FLAGS, PromptTokenizer, split_special
from proxy.tokenizer.prompt import CacheStats as CacheStats
from proxy.tokenizer.prompt import SpecialToken as SpecialToken
from proxy.tokenizer.unicode_ranges import LLAMA_LETTER_RANGES as LLAMA_LETTER_RANGES
from proxy.tokenizer.unicode_ranges import LLAMA_NUMBER_RANGES as LLAMA_NUMBER_RANGES
from proxy.tokenizer.unicode_ranges import LLAMA_WHITESPACE_RANGES as LLAMA_WHITESPACE_RANGES
from proxy.tokenizer.unicode_ranges import translate_regex as translate_regex
from proxy.tokenizer.vocab import SPECIAL_CANDIDATE_TEXTS as SPECIAL_CANDIDATE_TEXTS
from proxy.tokenizer.vocab import GGUFVocab as GGUFVocab
from proxy.tokenizer.vocab import _gguf_metadata_end as _gguf_metadata_end
from proxy.tokenizer.vocab import (
    build_hf_tokenizer,
    build_pre_tokenizer,
    gguf_cache_key,
    load_tokenizer,
    supported_pre_types,
)
from proxy.tokenizer.vocab import read_gguf_vocab as read_gguf_vocab

__all__ = [
    "CHAT_TOKENIZE_FLAGS",
    "CORPUS",
    "ParityMismatch",
    "ParityResult",
    "ProbeResult",
    "PromptTokenizer",
    "UnsupportedTokenizerError",
    "build_hf_tokenizer",
    "build_pre_tokenizer",
    "check_parity",
    "gguf_cache_key",
    "load_tokenizer",
    "probe",
    "split_special",
    "supported_pre_types",
]
