"""Unit tests of proxy.tokenizer (no server).

A tiny byte-level BPE GGUF is written with ``gguf.GGUFWriter`` for the build / cache / BOS tests; the
pre-tokenizer regexes are checked against a Python port of llama.cpp's hand-written splitters
(``unicode_regex_split_custom_gpt2`` / ``_llama3`` / ``_qwen2`` in src/unicode.cpp). Tests marked
with the real SmolLM2 model skip when it is absent.
"""

from __future__ import annotations

import asyncio
import random
import threading
from bisect import bisect_right
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers

from proxy import tokenizer as T
from proxy.tokenizer import (
    CORPUS,
    PromptTokenizer,
    SpecialToken,
    UnsupportedTokenizerError,
    build_hf_tokenizer,
    build_pre_tokenizer,
    check_parity,
    gguf_cache_key,
    load_tokenizer,
    split_special,
    translate_regex,
)

pytestmark = pytest.mark.unit


# --------------------------------------------------------------------------------------------------
# A synthetic GGUF
# --------------------------------------------------------------------------------------------------
def _byte_alphabet() -> list[str]:
    """GPT-2 bytes_to_unicode, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>", "<|im_start|>x"]


def write_gguf(
    path: Path,
    *,
    pre: str = "smollm",
    add_bos: bool | None = None,
    add_eos: bool | None = None,
    drop_bytes: tuple[int, ...] = (),
    user_defined: tuple[str, ...] = ("<tool>",),
) -> Path:
    import gguf

    alphabet = _byte_alphabet()
    tokens = list(SPECIALS)
    types = [gguf.TokenType.USER_DEFINED if t in user_defined else gguf.TokenType.CONTROL for t in SPECIALS]
    for b, ch in enumerate(alphabet):
        if b not in drop_bytes:
            tokens.append(ch)
            types.append(gguf.TokenType.NORMAL)
    merges = ["Ġ t", "h e", "Ġt he", "i n", "in g", "Ġ a", "1 2", "a b", "b a", "Ġ Ġ", "ĠĠ ĠĠ", "Ċ Ċ"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
        types.append(gguf.TokenType.NORMAL)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("synthetic test vocab")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "synth.gguf")


@pytest.fixture(scope="module")
def synth_pt(synth: Path) -> PromptTokenizer:
    return PromptTokenizer(build_hf_tokenizer(synth))


# --------------------------------------------------------------------------------------------------
# Special-token partition
# --------------------------------------------------------------------------------------------------
SP = [SpecialToken(10, "<|im_start|>"), SpecialToken(11, "<|im_end|>"), SpecialToken(12, "<s>")]


def test_split_basic() -> None:
    assert split_special("", SP) == []
    assert split_special("plain text", SP) == ["plain text"]
    assert split_special("<|im_start|>user\nhi<|im_end|>\n", SP) == [10, "user\nhi", 11, "\n"]
    assert split_special("<|im_end|><|im_end|>", SP) == [11, 11]
    assert split_special("a<s>b<s>", SP) == ["a", 12, "b", 12]
    assert split_special("<|im_start <|im_end| <s", SP) == ["<|im_start <|im_end| <s"]


def test_split_longest_first_like_llama() -> None:
    # llama.cpp handles the longest token first, over the whole text: "<|im_start|>x" wins even
    # where a leftmost-longest scan would see "<|im_start|>" first in an overlap.
    sp = [
        SpecialToken(20, "<|im_start|>x"),
        SpecialToken(21, "x<|im_start|>"),
        SpecialToken(10, "<|im_start|>"),
    ]
    sp.sort(key=lambda s: (-len(s.text.encode()), s.id))
    assert split_special("<|im_start|>xyz", sp) == [20, "yz"]
    # both 13 bytes, the lower id goes first: a leftmost-longest matcher would give [21, "x"]
    assert split_special("x<|im_start|>x", sp) == ["x", 20]
    assert split_special("ab<|im_start|>", sp) == ["ab", 10]


def test_split_lstrip_rstrip() -> None:
    sp = [SpecialToken(5, "<mask>", lstrip=True), SpecialToken(6, "<r>", rstrip=True)]
    assert split_special("a \t<mask> b", sp) == ["a", 5, " b"]
    assert split_special("  <mask>", sp) == [5]
    assert split_special("x<r> \n y<r>  ", sp) == ["x", 6, "y", 6]
    # only ASCII (C isspace) whitespace is stripped
    assert split_special("a\u00a0<mask>", sp) == ["a\u00a0", 5]


def test_split_never_leaves_special_text(synth_pt: PromptTokenizer) -> None:
    rnd = random.Random(7)
    alphabet = ["<|im_start|>", "<|im_end|>", "<tool>", "<|im_start|>x", "<|", "|>", "x", " ", "\n", "é"]
    for _ in range(500):
        text = "".join(rnd.choice(alphabet) for _ in range(rnd.randrange(1, 12)))
        for part in synth_pt.split(text):
            if isinstance(part, str):
                assert part
                assert not any(s.text in part for s in synth_pt.specials)


# --------------------------------------------------------------------------------------------------
# Pre-tokenizer regexes vs a port of llama.cpp's splitters
# --------------------------------------------------------------------------------------------------
_L_STARTS = [a for a, _ in T.LLAMA_LETTER_RANGES]
_N_STARTS = [a for a, _ in T.LLAMA_NUMBER_RANGES]
_WS = {a for a, b in T.LLAMA_WHITESPACE_RANGES for a in range(a, b + 1)}


def _in(ranges: tuple[tuple[int, int], ...], starts: list[int], cp: int) -> bool:
    i = bisect_right(starts, cp) - 1
    return i >= 0 and cp <= ranges[i][1]


def is_l(c: str) -> bool:
    return _in(T.LLAMA_LETTER_RANGES, _L_STARTS, ord(c))


def is_n(c: str) -> bool:
    return _in(T.LLAMA_NUMBER_RANGES, _N_STARTS, ord(c))


def is_ws(c: str) -> bool:
    return ord(c) in _WS


def llama_split_gpt2(s: str) -> list[str]:
    """unicode_regex_split_custom_gpt2 on one fragment."""
    out: list[str] = []
    n = len(s)
    pos = 0
    prev = 0

    def cat(p: int) -> str:  # "" = out of range
        if p >= n:
            return ""
        c = s[p]
        return "w" if is_ws(c) else "l" if is_l(c) else "n" if is_n(c) else "o"

    def add(end: int) -> None:
        nonlocal prev
        if end > prev:
            out.append(s[prev:end])
        prev = end

    while pos < n:
        c = s[pos]
        if c == "'" and pos + 1 < n:
            if s[pos + 1] in "stmd":
                add(pos + 2)
                pos += 2
                continue
            if pos + 2 < n and s[pos + 1 : pos + 3] in ("re", "ve", "ll"):
                add(pos + 3)
                pos += 3
                continue
        f2 = cat(pos + 1) if c == " " else cat(pos)
        if f2 in ("l", "n", "o"):
            pos += c == " "
            while cat(pos) == f2:
                pos += 1
            add(pos)
            continue
        k = 0
        while cat(pos + k) == "w":
            k += 1
        if k > 1 and pos + k < n:
            pos += k - 1
            add(pos)
            continue
        if k > 0:
            pos += k
            add(pos)
            continue
        pos += 1
        add(pos)
    return out


def llama_split_llama3(s: str, max_digits: int) -> list[str]:
    """unicode_regex_split_custom_llama3 (max_digits=3) / _qwen2 (max_digits=1) on one fragment."""
    out: list[str] = []
    n = len(s)
    pos = 0
    prev = 0

    def cat(p: int) -> str:
        if p >= n:
            return ""
        c = s[p]
        return "w" if is_ws(c) else "l" if is_l(c) else "n" if is_n(c) else "o"

    def add(end: int) -> None:
        nonlocal prev
        if end > prev:
            out.append(s[prev:end])
        prev = end

    while pos < n:
        c = s[pos]
        if c == "'" and pos + 1 < n:
            if s[pos + 1].lower() in "stmd" and s[pos + 1] in "stmdSTMD":
                add(pos + 2)
                pos += 2
                continue
            if (
                pos + 2 < n
                and s[pos + 1 : pos + 3].lower() in ("re", "ve", "ll")
                and s[pos + 1 : pos + 3].isascii()
            ):
                add(pos + 3)
                pos += 3
                continue
        if not (c in "\r\n" or cat(pos) == "n") and (cat(pos) == "l" or cat(pos + 1) == "l"):
            pos += 1
            while cat(pos) == "l":
                pos += 1
            add(pos)
            continue
        if cat(pos) == "n":
            ini = pos
            while cat(pos) == "n":
                pos += 1
                if pos - ini >= max_digits:
                    add(pos)
                    ini = pos
            add(pos)
            continue
        f2 = cat(pos + 1) if c == " " else cat(pos)
        if f2 not in ("w", "l", "n") and cat(pos) != "":
            pos += c == " "
            while cat(pos) == "o":
                pos += 1
            while pos < n and s[pos] in "\r\n":
                pos += 1
            add(pos)
            continue
        k = 0
        last_rn = 0
        while cat(pos + k) == "w":
            if s[pos + k] in "\r\n":
                last_rn = pos + k + 1
            k += 1
        if last_rn > 0:
            pos = last_rn
            add(pos)
            continue
        if k > 1 and pos + k < n:
            pos += k - 1
            add(pos)
            continue
        if k > 0:
            pos += k
            add(pos)
            continue
        pos += 1
        add(pos)
    return out


def llama_words(pre: str, text: str) -> list[str]:
    if pre == "gpt-2":
        return llama_split_gpt2(text)
    if pre == "smollm":  # "\p{N}" (isolated), then GPT-2 on every piece
        pieces: list[str] = []
        cur = ""
        for ch in text:
            if is_n(ch):
                if cur:
                    pieces.append(cur)
                pieces.append(ch)
                cur = ""
            else:
                cur += ch
        if cur:
            pieces.append(cur)
        return [w for p in pieces for w in llama_split_gpt2(p)]
    if pre == "llama-bpe":
        return llama_split_llama3(text, 3)
    if pre == "qwen2":
        return llama_split_llama3(text, 1)
    raise AssertionError(pre)


_UNBYTE = {ch: b for b, ch in enumerate(_byte_alphabet())}


def hf_words(pt: pre_tokenizers.PreTokenizer, text: str) -> list[str]:
    return [bytes(_UNBYTE[c] for c in w).decode("utf-8") for w, _ in pt.pre_tokenize_str(text)]


def _random_text(rnd: random.Random) -> str:
    pool = [
        " ",
        "  ",
        "   ",
        "\n",
        "\n\n",
        "\r\n",
        "\t",
        " \t",
        "\u00a0",
        "\u3000",
        "\u2009",
        "\x0b",
        "\x85",
        "'",
        "'s",
        "'S",
        "'re",
        "'RE",
        "'ll",
        "'Ve",
        "'d",
        "a",
        "B",
        "é",
        "ß",
        "ǅ",
        "中",
        "の",
        "한",
        "й",
        "ع",
        "1",
        "23",
        "4567",
        "٣",
        "²",
        "Ⅻ",
        "½",
        "．",
        "!",
        "...",
        "-",
        "_",
        "{",
        "}",
        '"',
        "😀",
        "👍🏽",
        "\u200d",
        "\u0301",
        "$",
        "€",
        "word",
        " the",
        "ing",
        "\u1c89",
        "\ua7cb",
        "\U00010d40",
        "\U000105c0",
        "\U00016d40",
        "\x00",
        "\x7f",
        "\ue000",
        "\U000e0041",
    ]
    parts = []
    for _ in range(rnd.randrange(1, 25)):
        if rnd.random() < 0.85:
            parts.append(rnd.choice(pool))
        else:
            cp = rnd.randrange(0, 0x110000)
            parts.append(chr(cp) if not 0xD800 <= cp <= 0xDFFF else "x")
    return "".join(parts)


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2"])
def test_pretokenizer_matches_llama_splitter(pre: str) -> None:
    ptk = build_pre_tokenizer(pre)
    rnd = random.Random(hash(pre) & 0xFFFF)
    fixed = [
        "Hello  world\n\n\n  x",
        "a\t\tb",
        "   ",
        " ",
        "x ",
        "12345 67",
        "I'm you're 'LL 'S",
        "\r\n\r\n  \nx",
        "a\u1c89b 1\U00010d40 2",
        "?? !!\n\n",
        "  ...\n",
        "\u00a0\u00a0a",
        "😀😀 😀",
        "Ⅻ½²",
        "'",
    ]
    texts = fixed + [_random_text(rnd) for _ in range(1500)]
    for text in texts:
        assert hf_words(ptk, text) == llama_words(pre, text), repr(text)


def test_translate_regex() -> None:
    r = translate_regex(r" ?\p{L}+|[^\s\p{N}]|\s+(?!\S)")
    assert r"\p{" not in r and r"\s" not in r and r"\S" not in r
    assert r.startswith(" ?[\\x{41}-\\x{5A}")
    with pytest.raises(UnsupportedTokenizerError):
        translate_regex(r"\p{P}+")
    with pytest.raises(UnsupportedTokenizerError):
        build_pre_tokenizer("deepseek-coder")


def test_unicode_tables_are_llamas() -> None:
    # spot checks of llama.cpp's (pre Unicode 16) tables, where Oniguruma's differ
    assert is_l("a") and is_l("中") and is_l("ǅ") and not is_l("1") and not is_l("\u0301")
    assert is_n("7") and is_n("²") and is_n("Ⅻ") and is_n("٣") and not is_n("a")
    assert not is_l("\u1c89") and not is_l("\ua7cb") and not is_n("\U00010d40")
    assert is_ws("\u00a0") and is_ws("\x85") and is_ws("\u3000") and not is_ws("\u200b")


# --------------------------------------------------------------------------------------------------
# Building from a GGUF, the disk cache, BOS / EOS
# --------------------------------------------------------------------------------------------------
def test_build_synthetic(synth: Path, synth_pt: PromptTokenizer) -> None:
    tok = build_hf_tokenizer(synth)
    assert tok.get_vocab_size() == len(SPECIALS) + 256 + 12
    assert synth_pt.bos_id is None and synth_pt.eos_id is None  # gpt2 default: no BOS
    # longest first, ties by id
    assert [s.text for s in synth_pt.specials] == [
        "<|endoftext|>",
        "<|im_start|>x",
        "<|im_start|>",
        "<|im_end|>",
        "<tool>",
    ]
    ids = synth_pt.encode("<|im_start|>user\nthe theing<|im_end|>\n<tool>")
    assert ids[0] == 1 and ids[-1] == 3 and 2 in ids
    assert synth_pt.decode(ids) == "<|im_start|>user\nthe theing<|im_end|>\n<tool>"
    # digits are isolated (smollm), so "12" never merges despite the merge "1 2"
    twelve = tok.token_to_id("12")
    assert twelve is not None and twelve not in synth_pt.encode("x 12 y")
    assert twelve in PromptTokenizer(
        build_hf_tokenizer(write_gguf(synth.with_name("g.gguf"), pre="gpt-2"))
    ).encode("x 12 y")


def test_bos_eos_flags(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "bos.gguf", add_bos=True, add_eos=True)
    pt = PromptTokenizer(build_hf_tokenizer(p))
    assert pt.bos_id == 1 and pt.eos_id == 2
    assert pt.encode("") == [1, 2]
    ids = pt.encode("hi")
    assert ids[0] == 1 and ids[-1] == 2
    # llama3 family adds BOS by default, the GGUF key overrides it
    assert PromptTokenizer(build_hf_tokenizer(write_gguf(tmp_path / "l3.gguf", pre="llama-bpe"))).bos_id == 1
    p2 = write_gguf(tmp_path / "l3n.gguf", pre="llama-bpe", add_bos=False)
    assert PromptTokenizer(build_hf_tokenizer(p2)).bos_id is None
    # explicit override
    assert PromptTokenizer(build_hf_tokenizer(p), bos_id=None, eos_id=None).encode("") == []


def test_unsupported(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedTokenizerError, match="deepseek-coder"):
        build_hf_tokenizer(write_gguf(tmp_path / "ds.gguf", pre="deepseek-coder"))
    with pytest.raises(UnsupportedTokenizerError):
        build_hf_tokenizer(write_gguf(tmp_path / "none.gguf", pre=""))


def test_missing_byte_symbols_are_barriers(tmp_path: Path) -> None:
    # Drop the byte 0xC3 ('Ã'): "é" (C3 A9) -> 'Ã' '©'. llama.cpp keeps 'Ã' as an unmergeable symbol
    # and then drops it; neighbours must not merge across it ("a" + "b" stays two tokens).
    p = write_gguf(tmp_path / "drop.gguf", pre="gpt-2", drop_bytes=(0xC3,))
    pt = PromptTokenizer(build_hf_tokenizer(p))
    assert pt.unk_id is not None
    tok = pt.tokenizer
    a, b, ab = tok.token_to_id("a"), tok.token_to_id("b"), tok.token_to_id("ab")
    assert pt.encode("ab") == [ab]
    # "aéb" is one word; its bytes are a C3 A9 b: 'Ã' is missing, '©' (A9) exists
    assert pt.encode("a\u00e9b") == [a, tok.token_to_id("©"), b]
    assert pt.unk_id not in pt.encode("a\u00e9b \u00e9\u00e9")


def test_disk_cache(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "c.gguf")
    cache = tmp_path / "cache"
    key = gguf_cache_key(p)
    assert key == gguf_cache_key(p)
    t1 = load_tokenizer(p, cache)
    files = list(cache.glob("*.tokenizer.json"))
    assert [f.name for f in files] == [f"{key}.tokenizer.json"]
    t2 = load_tokenizer(p, cache)  # from the cache
    text = "<|im_start|>user\nthe 123 ab<|im_end|>"
    assert PromptTokenizer(t1).encode(text) == PromptTokenizer(t2).encode(text)
    # a damaged cache file is rebuilt
    files[0].write_text("{not json")
    t3 = load_tokenizer(p, cache)
    assert PromptTokenizer(t3).encode(text) == PromptTokenizer(t1).encode(text)
    # a different file (other metadata) gets another key
    p2 = write_gguf(tmp_path / "c2.gguf", add_bos=True)
    assert gguf_cache_key(p2) != key
    load_tokenizer(p2, cache)
    assert len(list(cache.glob("*.tokenizer.json"))) == 2
    # the metadata walk ends where the tensor infos start
    with open(p, "rb") as f:
        data = f.read()
    assert 24 < T._gguf_metadata_end(data) <= len(data)


# --------------------------------------------------------------------------------------------------
# The piece cache and threads
# --------------------------------------------------------------------------------------------------
def _conversation(n_turns: int, seed: int = 0) -> str:
    rnd = random.Random(seed)
    words = ["the", "ab", "ing", "ba", "12", "théâtre", "中文", "😀", "tool", "json", '{"a":', "1}"]
    out = '<|im_start|>system\nYou are helpful. Tools: <tool>{"name": "f"}<|im_end|>\n'
    for i in range(n_turns):
        role = "user" if i % 2 == 0 else "assistant"
        out += f"<|im_start|>{role}\n" + " ".join(rnd.choice(words) for _ in range(40)) + "<|im_end|>\n"
    return out + "<|im_start|>assistant\n"


def test_piece_cache_hits(synth: Path) -> None:
    pt = PromptTokenizer(build_hf_tokenizer(synth))
    conv = _conversation(6)
    first = pt.encode(conv)
    assert first == pt.encode_uncached(conv)
    s1 = pt.cache_stats()
    assert s1.hits == 0 and s1.misses > 0
    assert pt.encode(conv) == first
    s2 = pt.cache_stats()
    assert s2.misses == s1.misses and s2.hits > s1.hits
    # the same conversation plus one turn: everything but the new turn is a hit
    longer = _conversation(7)
    assert longer.startswith(conv[: -len("<|im_start|>assistant\n")])
    ids = pt.encode(longer)
    assert ids == pt.encode_uncached(longer)
    s3 = pt.cache_stats()
    assert s3.misses - s2.misses <= 2
    assert s3.hit_tokens - s2.hit_tokens > 0.8 * len(ids)


def test_piece_cache_bounds(synth: Path) -> None:
    pt = PromptTokenizer(build_hf_tokenizer(synth), cache_max_tokens=400, cache_max_entries=5)
    for i in range(50):
        text = _conversation(4, seed=i)
        assert pt.encode(text) == pt.encode_uncached(text)
        st = pt.cache_stats()
        assert st.entries <= 5 and st.cached_tokens <= 400
    off = PromptTokenizer(build_hf_tokenizer(synth), cache_max_entries=0)
    conv = _conversation(3)
    assert off.encode(conv) == off.encode(conv) == pt.encode_uncached(conv)
    assert off.cache_stats().entries == 0


def test_thread_safety_smoke(synth: Path) -> None:
    pt = PromptTokenizer(build_hf_tokenizer(synth), cache_max_tokens=3000, cache_max_entries=40)
    texts = [_conversation(3 + i % 5, seed=i % 12) for i in range(48)]
    expected = [pt.encode_uncached(t) for t in texts]
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def work(k: int) -> None:
        try:
            barrier.wait()
            for j in range(200):
                i = (k * 31 + j * 7) % len(texts)
                assert pt.encode(texts[i]) == expected[i]
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:1]
    st = pt.cache_stats()
    assert st.hits > 0 and st.entries <= 40 and st.cached_tokens <= 3000


# --------------------------------------------------------------------------------------------------
# check_parity with fake remotes
# --------------------------------------------------------------------------------------------------
def test_check_parity_fake_remote(synth_pt: PromptTokenizer) -> None:
    async def exact(text: str) -> list[int]:
        return synth_pt.encode_uncached(text)

    async def off_by_one(text: str) -> list[int]:
        ids = synth_pt.encode_uncached(text)
        return ids[:-1] + [ids[-1] + 1] if "world" in text and ids else ids

    async def broken(text: str) -> list[int]:
        raise ConnectionError("server gone")

    res = asyncio.run(check_parity(synth_pt, exact))
    assert res.ok and res.checked >= len(CORPUS) + 1 and not res.mismatches
    res = asyncio.run(check_parity(synth_pt, off_by_one))
    assert not res.ok and res.mismatches and "world" in res.mismatches[0].text
    text, local, remote = res.mismatches[0]
    assert local != remote
    assert "FAILED" in res.summary()
    res = asyncio.run(check_parity(synth_pt, broken, ["a", "b"], include_probes=False))
    assert not res.ok and res.checked == 2 and len(res.errors) == 2


def test_probe_texts_cover_specials(synth_pt: PromptTokenizer) -> None:
    joined = " ".join(synth_pt.probe_texts())
    for s in synth_pt.specials:
        assert s.text in joined
