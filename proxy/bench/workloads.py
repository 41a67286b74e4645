"""Benchmark workloads: pure, seeded generators of request lists.

A workload is a tuple of ``BenchRequest`` plus how many may be in flight at once. Order and
timing are expressed as dependencies: a request is sent once every request named in its
``after`` has finished, ``delay_s`` later (closed loop: what the answers cost decides the
pace). The runner records the real send times in a manifest so a run can be replayed open
loop against any OpenAI URL. Generators never touch the network or the clock; the same
arguments give the same list.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from proxy.bench.agents import agents
from proxy.bench.coding import coding_agent
from proxy.bench.fleetload import cluster
from proxy.bench.multiround import multi_round
from proxy.bench.vision import vision
from proxy.traffic.spec import BenchRequest, Workload
from proxy.traffic.text import prose, seeded, words_for

QUESTION_WORDS = 12


def chat(
    system: str, user: str, max_tokens: int, history: list[dict[str, str]] | None = None
) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, *(history or []), {"role": "user", "content": user}]
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0}


def question(seed: object, *label: object) -> str:
    return f"Question {'-'.join(map(str, label))}: {prose(seeded(seed, 'q', *label), QUESTION_WORDS)}"


def prompt_words(body: dict[str, Any]) -> list[str]:
    """The words of all message contents, in order (what the shared-prefix fractions count)."""
    return [w for m in body["messages"] for w in str(m.get("content", "")).split()]


# ---- prefix tiers -------------------------------------------------------------------------


def prefix_tiers(
    prompt_tokens: int = 1000,
    rounds: int = 3,
    prompts: int = 4,
    tiers: tuple[int, ...] = (0, 25, 50, 75, 90),
    max_tokens: int = 16,
    seed: int = 0,
) -> Workload:
    """Per tier, ``prompts`` concurrent requests whose first ``tier`` % is common.

    Waves go tier by tier, round by round; each wave starts when the previous one finished,
    so by the next round the other tiers have overwritten every slot and only host caches
    can still hold a tier's prefix. The rest of each prompt is new in every round.
    """
    total = words_for(prompt_tokens)
    reqs: list[BenchRequest] = []
    previous: tuple[str, ...] = ()
    for rnd in range(1, rounds + 1):
        for tier in tiers:
            shared_n = round(tier / 100 * total)
            shared = prose(seeded(seed, "tier", tier), shared_n) if shared_n else ""
            wave = []
            for i in range(prompts):
                unique_n = max(1, total - shared_n - QUESTION_WORDS - 2)
                unique = f"[doc-{rnd}-{tier}-{i}] " + prose(seeded(seed, "tier", tier, rnd, i), unique_n - 1)
                system = f"{shared} {unique}" if shared else unique
                rid = f"r{rnd}-t{tier}-p{i}"
                reqs.append(
                    BenchRequest(
                        rid,
                        f"t{tier}-p{i}",
                        f"tier {tier}%",
                        chat(system, question(seed, rnd, tier, i), max_tokens),
                        previous,
                        meta={"tier": tier, "round": rnd, "prompt": i, "shared_words": shared_n},
                    )
                )
                wave.append(rid)
            previous = tuple(wave)
    return Workload(
        "prefix-tiers",
        "common prefixes of several sizes, concurrent waves, several rounds",
        tuple(reqs),
        prompts,
        {
            "prompt_tokens": prompt_tokens,
            "rounds": rounds,
            "prompts": prompts,
            "tiers": list(tiers),
            "max_tokens": max_tokens,
            "seed": seed,
        },
    )


# ---- host dedup ---------------------------------------------------------------------------


def host_dedup(
    prompt_tokens: int = 2000, prompts: int = 8, rounds: int = 2, max_tokens: int = 16, seed: int = 0
) -> Workload:
    """``prompts`` prompts sharing their first half, one at a time; later rounds ask again.

    What it shows is the host cache size: a full copy per prompt (Legacy) against each shared
    prefix stored once (the radix tree). More prompts than slots, so later rounds need a
    host cache to reuse anything beyond the shared half.
    """
    total = words_for(prompt_tokens)
    half = total // 2
    shared = prose(seeded(seed, "dedup", "shared"), half)
    reqs: list[BenchRequest] = []
    previous: tuple[str, ...] = ()
    for rnd in range(1, rounds + 1):
        for i in range(prompts):
            unique = f"[doc-{i}] " + prose(
                seeded(seed, "dedup", i), max(1, total - half - QUESTION_WORDS - 3)
            )
            rid = f"r{rnd}-p{i}"
            reqs.append(
                BenchRequest(
                    rid,
                    f"p{i}",
                    f"round {rnd}",
                    chat(f"{shared} {unique}", question(seed, "dedup", rnd, i), max_tokens),
                    previous,
                    meta={"round": rnd, "prompt": i, "shared_words": half},
                )
            )
            previous = (rid,)
    return Workload(
        "host-dedup",
        "prompts sharing their first half, sent one at a time",
        tuple(reqs),
        1,
        {
            "prompt_tokens": prompt_tokens,
            "prompts": prompts,
            "rounds": rounds,
            "max_tokens": max_tokens,
            "seed": seed,
        },
    )


# ---- restore ------------------------------------------------------------------------------


def restore(
    prompt_tokens: int = 1500, rounds: int = 3, fillers: int = 4, max_tokens: int = 16, seed: int = 0
) -> Workload:
    """A prompt, then ``fillers`` other prompts at once (one per slot: the prompt is in no slot
    any more), then the prompt again with a new question. Compare the TTFT of ``again`` (a
    host restore, if the arm has a host cache) with ``first`` (a full prefill)."""
    total = words_for(prompt_tokens)
    reqs: list[BenchRequest] = []
    previous: tuple[str, ...] = ()
    for rnd in range(1, rounds + 1):
        doc = f"[doc-{rnd}] " + prose(seeded(seed, "restore", rnd), max(1, total - QUESTION_WORDS - 3))
        first = f"r{rnd}-first"
        reqs.append(
            BenchRequest(
                first,
                f"s{rnd}",
                "first",
                chat(doc, question(seed, "restore", rnd, 1), max_tokens),
                previous,
                meta={"round": rnd},
            )
        )
        fill_ids = []
        for j in range(fillers):
            text = f"[filler-{rnd}-{j}] " + prose(seeded(seed, "filler", rnd, j), max(1, total // 2))
            fid = f"r{rnd}-fill{j}"
            reqs.append(
                BenchRequest(
                    fid,
                    f"f{rnd}-{j}",
                    "fill",
                    chat(text, question(seed, "fill", rnd, j), max_tokens),
                    (first,),
                    meta={"round": rnd},
                )
            )
            fill_ids.append(fid)
        again = f"r{rnd}-again"
        reqs.append(
            BenchRequest(
                again,
                f"s{rnd}",
                "again",
                chat(doc, question(seed, "restore", rnd, 2), max_tokens),
                tuple(fill_ids),
                meta={"round": rnd},
            )
        )
        previous = (again,)
    return Workload(
        "restore",
        "a prompt evicted from every slot, then asked again",
        tuple(reqs),
        max(1, fillers),
        {
            "prompt_tokens": prompt_tokens,
            "rounds": rounds,
            "fillers": fillers,
            "max_tokens": max_tokens,
            "seed": seed,
        },
    )


# ---- overhead -----------------------------------------------------------------------------


def overhead(
    pairs: int = 100, prompt_tokens: int = 32, max_tokens: int = 1, delay_s: float = 0.2, seed: int = 0
) -> Workload:
    """Short distinct prompts, alternately through the arm's front and to its server directly.

    On the proxy arm the paired TTFT difference is what the proxy adds on a miss. On arms
    without a proxy both sides hit the same server, so their difference is the noise floor.
    ``delay_s`` between requests lets the proxy's background save finish, so the direct
    request never races it.
    """
    n = words_for(prompt_tokens)
    reqs: list[BenchRequest] = []
    previous: tuple[str, ...] = ()
    for k in range(pairs):
        order = ("front", "server") if k % 2 == 0 else ("server", "front")
        for via in order:
            text = f"[note-{k}-{via}] " + prose(seeded(seed, "overhead", k, via), max(1, n - 1))
            rid = f"pair{k}-{via}"
            body = {
                "messages": [
                    {"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": text},
                ],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            reqs.append(BenchRequest(rid, f"pair{k}", via, body, previous, delay_s, via, meta={"pair": k}))
            previous = (rid,)
    return Workload(
        "overhead",
        "proxy latency on a miss against the server direct (paired)",
        tuple(reqs),
        1,
        {
            "pairs": pairs,
            "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens,
            "delay_s": delay_s,
            "seed": seed,
        },
    )


# ---- capacity -----------------------------------------------------------------------------


def capacity(
    prompt_tokens: int = 400, prompts: int = 4, shared_pct: int = 50, max_tokens: int = 16, seed: int = 0
) -> Workload:
    """``prompts`` concurrent requests whose first ``shared_pct`` % is common (one wave).

    The capacity search (``proxy.bench.capacity``) sends this wave to a fresh arm for every KV
    pool size it tries. Requests carry ``ignore_eos`` so a complete answer is exactly
    ``max_tokens`` tokens: fewer means the server cut it short.
    """
    if not 0 <= shared_pct <= 100:
        raise ValueError("shared_pct must be between 0 and 100")
    total = words_for(prompt_tokens)
    shared_n = round(shared_pct / 100 * total)
    shared = prose(seeded(seed, "capacity", "shared"), shared_n) if shared_n else ""
    reqs: list[BenchRequest] = []
    for i in range(prompts):
        unique_n = max(1, total - shared_n - QUESTION_WORDS - 2)
        unique = f"[doc-{i}] " + prose(seeded(seed, "capacity", i), unique_n - 1)
        system = f"{shared} {unique}" if shared else unique
        body = {**chat(system, question(seed, "capacity", i), max_tokens), "ignore_eos": True}
        reqs.append(
            BenchRequest(f"p{i}", f"p{i}", "wave", body, meta={"prompt": i, "shared_words": shared_n})
        )
    return Workload(
        "capacity",
        f"{prompts} concurrent requests with a {shared_pct}% common prefix: the smallest "
        "KV pool that serves them",
        tuple(reqs),
        max(1, prompts),
        {
            "prompt_tokens": prompt_tokens,
            "prompts": prompts,
            "shared_pct": shared_pct,
            "max_tokens": max_tokens,
            "seed": seed,
        },
    )


# ---- fan-out ------------------------------------------------------------------------------


def fanout(
    trunk_tokens: int = 1000,
    branches: int = 4,
    rounds: int = 1,
    in_flight: int = 0,
    max_tokens: int = 16,
    seed: int = 0,
) -> Workload:
    """``branches`` concurrent requests off one long trunk (a document), each with its own question.

    Every round has a new trunk nothing has seen, so each round starts cold for its prefix.
    With ``in_flight`` 0 a round starts when the previous one finished; otherwise every round
    is queued at once and the client keeps ``in_flight`` requests outstanding, so a round's
    branches start as the previous round's answers end, one by one (groups sharing a system
    prompt, sent together). What it shows: whether the trunk is computed once (fan-out) or
    once per branch, in the TTFT of every branch and the total.
    """
    if in_flight < 0:
        raise ValueError("in_flight must be 0 (round after round) or more")
    n = words_for(trunk_tokens)
    reqs: list[BenchRequest] = []
    previous: tuple[str, ...] = ()
    for rnd in range(1, rounds + 1):
        trunk = f"[trunk-{rnd}] " + prose(seeded(seed, "fanout", rnd), max(1, n - QUESTION_WORDS - 3))
        wave = []
        for b in range(branches):
            rid = f"r{rnd}-b{b}"
            reqs.append(
                BenchRequest(
                    rid,
                    f"b{b}",
                    f"branch {b}",
                    chat(trunk, question(seed, "fanout", rnd, b), max_tokens),
                    previous,
                    meta={"round": rnd, "branch": b},
                )
            )
            wave.append(rid)
        previous = () if in_flight else tuple(wave)
    return Workload(
        "fanout",
        f"{branches} concurrent branches off one long trunk on a cold server",
        tuple(reqs),
        in_flight or max(1, branches),
        {
            "trunk_tokens": trunk_tokens,
            "branches": branches,
            "rounds": rounds,
            "in_flight": in_flight,
            "max_tokens": max_tokens,
            "seed": seed,
        },
    )


# ---- registry (BenchRequest and Workload live in spec.py; imported here for callers) -----------------------------------------------------------------------------


# Arms run when --arms is not given (nocache, legacy, proxy otherwise). Overhead compares the proxy
# with its own server; Legacy runs it too, where front and server are the same (the noise floor).
# Capacity compares sharing with the baseline; fan-out the proxy with and without sharing.
DEFAULT_ARMS: dict[str, tuple[str, ...]] = {
    "overhead": ("legacy", "proxy"),
    "capacity": ("legacy", "proxy-hs"),
    "fanout": ("legacy", "proxy", "proxy-hs"),
    "coding-agent": ("legacy", "proxy"),
    "multi-round": ("legacy", "proxy"),
    "vision": ("legacy", "proxy"),
    "cluster": ("legacy", "fleet", "fleet-shared"),
}

GENERATORS: dict[str, Callable[..., Workload]] = {
    "prefix-tiers": prefix_tiers,
    "host-dedup": host_dedup,
    "restore": restore,
    "overhead": overhead,
    "agents": agents,
    "capacity": capacity,
    "fanout": fanout,
    "coding-agent": coding_agent,
    "multi-round": multi_round,
    "vision": vision,
    "cluster": cluster,
}


def generator_params(name: str) -> dict[str, Any]:
    """The size options a workload takes, with their defaults."""
    fn: Callable[..., Workload] = GENERATORS[name]
    return {k: p.default for k, p in inspect.signature(fn).parameters.items()}


def make_workload(name: str, **options: Any) -> Workload:
    """The workload ``name`` with the given sizes; options it does not take (or None) are ignored."""
    if name not in GENERATORS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(GENERATORS)}")
    accepted = generator_params(name)
    return GENERATORS[name](**{k: v for k, v in options.items() if v is not None and k in accepted})
