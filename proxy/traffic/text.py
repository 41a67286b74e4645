"""Deterministic local text for the benchmark workloads (no network, no model, no downloads).

Token counts are approximate: prose is sized in words (``TOKENS_PER_WORD`` tokens each, as
measured with the default model's tokenizer on this prose), and ``approx_tokens`` estimates any
text (JSON, figures, logs) by counting letter runs, digits and punctuation runs, within about
10 % of the real count on the agents' documents. Every random
choice comes from a ``random.Random`` seeded with a string, which Python hashes with SHA-512,
so the same seed gives the same text on every machine and run (``PYTHONHASHSEED`` plays no part).
"""

from __future__ import annotations

import random
import re

TOKENS_PER_WORD = 1.1

_VOCAB_TEXT = """
the of and to in is that for it as with was on be by this are from at or an have not which one all
were they can more has been but their other new some these time would there when about many into
only any also first two may most over such then than them well system data value report result model
process level market change period group plan order service device signal sensor pressure flow cycle
rate share cost price unit volume demand supply region customer contract project review analysis team
network server request queue memory cache storage window margin asset revenue income expense balance
operating quarter annual growth decline stable increase decrease higher lower early late current prior
average total measured expected observed recorded reported estimated adjusted normal minor major high
low small large long short steady partial full final initial regular routine manual automatic remote
local central northern southern eastern western primary secondary backup main spare reserve field site
line stage step phase section part module component panel valve pump motor filter belt bearing seal
gauge meter switch relay cable circuit board housing frame bracket mount cover door gate tank pipe hose
check inspect replace adjust clean test verify record confirm monitor track compare review note report
after before during while since until within without across along around between under above below
engineer operator analyst manager technician auditor owner partner supplier vendor client user staff
weekly daily monthly hourly morning evening night shift schedule deadline window target limit threshold
warning alarm fault error failure issue incident event alert notice update patch release version build
"""
_VOCAB = _VOCAB_TEXT.split()


def seeded(*parts: object) -> random.Random:
    """A generator seeded by the given parts (deterministic across runs and machines)."""
    return random.Random(":".join(str(p) for p in parts))


def words_for(tokens: int) -> int:
    """Words of prose that make about ``tokens`` tokens."""
    return max(1, round(tokens / TOKENS_PER_WORD))


_LETTERS = re.compile(r"[A-Za-z]+")
_DIGITS = re.compile(r"\d")
_PUNCT = re.compile(r"[^\sA-Za-z\d]+")


def approx_tokens(text: str) -> int:
    """About how many tokens ``text`` makes (most digits and punctuation runs are a token each)."""
    return round(1.05 * len(_LETTERS.findall(text)) + len(_DIGITS.findall(text)) + len(_PUNCT.findall(text)))


def prose(rng: random.Random, n_words: int) -> str:
    """Exactly ``n_words`` words of sentence-like text."""
    out: list[str] = []
    while len(out) < n_words:
        length = min(rng.randint(8, 17), n_words - len(out))
        sentence = [rng.choice(_VOCAB) for _ in range(length)]
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        out.extend(sentence)
    return " ".join(out)


def fill_to(text: str, rng: random.Random, tokens: int) -> str:
    """``text`` followed by prose up to about ``tokens`` tokens in all (``text`` alone if it is longer)."""
    need = tokens - approx_tokens(text)
    return text if need <= 0 else f"{text}\n{prose(rng, words_for(need))}"


def word_prefix(a: str, b: str) -> int:
    """Number of leading whitespace-separated words two texts share."""
    n = 0
    for x, y in zip(a.split(), b.split(), strict=False):
        if x != y:
            break
        n += 1
    return n
