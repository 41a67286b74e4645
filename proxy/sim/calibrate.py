"""Measure a running llama-server's prefill and decode rates for the simulator's model.

Sends prompts of a few sizes with ``cache_prompt: false`` (one at a time) and reads the
server's own ``timings``; fits the prefill model of ``Calibration.prefill_s`` to them.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from dataclasses import dataclass

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "river",
    "stone",
    "cloud",
    "market",
    "engine",
    "signal",
    "harbor",
    "valley",
]


class CalibrationError(Exception):
    """The server refused or did not answer a calibration prompt."""


@dataclass(frozen=True)
class Sample:
    prompt_n: int
    prompt_s: float
    predicted_n: int
    predicted_s: float


def measure(url: str, words: int, n_predict: int, seed: int = 0, timeout_s: float = 600.0) -> Sample:
    rng = random.Random(f"{seed}-{words}")
    text = " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 99)}" for _ in range(words))
    body = {
        "prompt": text,
        "n_predict": n_predict,
        "cache_prompt": False,
        "temperature": 0,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        url.rstrip("/") + "/completion",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            t = json.load(resp)["timings"]
    except urllib.error.HTTPError as e:
        # The server says why (a prompt over the slot's context, most often): show that.
        raise CalibrationError(
            f"{url} answered {e.code} to a {words}-word prompt: {e.read(300)!r}"
            " (a slot holds ctx-size / parallel tokens: smaller --words fit)"
        ) from None
    except OSError as e:
        raise CalibrationError(f"{url} did not answer: {e}") from None
    return Sample(int(t["prompt_n"]), t["prompt_ms"] / 1e3, int(t["predicted_n"]), t["predicted_ms"] / 1e3)


def fit_prefill(a: Sample, b: Sample) -> tuple[float, float]:
    """(prefill_tok_s, prefill_ctx_tokens) through two cold prefills: per-token time grows
    linearly with the mean context n/2. Falls back to a flat rate when it does not grow."""
    ta, tb = a.prompt_s / a.prompt_n, b.prompt_s / b.prompt_n
    slope = (tb - ta) / ((b.prompt_n - a.prompt_n) / 2) if b.prompt_n != a.prompt_n else 0.0
    base = ta - slope * a.prompt_n / 2
    if slope <= 0 or base <= 0:
        rate = (a.prompt_n + b.prompt_n) / (a.prompt_s + b.prompt_s)
        return rate, 1e18
    return 1 / base, base / slope
