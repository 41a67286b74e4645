"""Synthetic multi-turn agent traffic, token level, seeded (the shape of ``bench agents``).

A few long system prompts (role, tool schemas, documents) with Zipf popularity are shared by
many sessions. A session is a tool loop: the user's task, then for each step the assistant's
answer (a tool call) and the tool's result appended to the prompt, then the final answer and
0-2 follow-ups branching from it, sent together. Every prompt extends the previous one by
exactly the tokens of the previous answer plus new text, as a chat template renders it.
Token ids are random, so two sessions share exactly their system prompt and nothing more.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

VOCAB = (1_000, 49_000)


@dataclass(frozen=True)
class Turn:
    tokens: np.ndarray  # the prompt (int32)
    answer: np.ndarray  # what the server generates (its length is max_tokens)


@dataclass(frozen=True)
class Session:
    session_id: int
    system_id: int
    start_s: float
    steps: tuple[tuple[Turn, ...], ...]  # each step's requests are sent together
    think_s: tuple[float, ...]  # pause before each step after the first (tool time, user)


@dataclass(frozen=True)
class WorkloadSpec:
    sessions: int = 400
    rate_per_s: float = 0.5  # new sessions per second (Poisson)
    systems: int = 8  # distinct system prompts
    system_tokens: tuple[int, int] = (1_000, 3_000)
    zipf_s: float = 1.1  # popularity of the system prompts
    task_tokens: tuple[int, int] = (40, 200)
    tool_steps: tuple[int, int] = (1, 4)
    tool_result_tokens: tuple[int, int] = (100, 600)
    answer_tokens: tuple[int, int] = (16, 96)
    followups: tuple[int, int] = (0, 2)
    followup_tokens: tuple[int, int] = (20, 80)
    tool_think_s: float = 1.0  # mean, exponential
    user_think_s: float = 8.0  # mean, exponential
    seed: int = 0


def _rand_tokens(rng: np.random.Generator, span: tuple[int, int]) -> np.ndarray:
    n = int(rng.integers(span[0], span[1] + 1))
    return rng.integers(VOCAB[0], VOCAB[1], size=n, dtype=np.int32)


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


def generate(spec: WorkloadSpec) -> list[Session]:
    """The sessions, in start order. Same spec, same sessions (bit for bit)."""
    rng = np.random.default_rng(spec.seed)
    pick = random.Random(spec.seed)
    systems = [_rand_tokens(rng, spec.system_tokens) for _ in range(spec.systems)]
    weights = _zipf_weights(spec.systems, spec.zipf_s)
    out, t = [], 0.0
    for sid in range(spec.sessions):
        t += pick.expovariate(spec.rate_per_s)
        system_id = pick.choices(range(spec.systems), weights)[0]
        out.append(_session(sid, system_id, t, systems[system_id], spec, rng, pick))
    return out


def _session(
    sid: int,
    system_id: int,
    start: float,
    system: np.ndarray,
    spec: WorkloadSpec,
    rng: np.random.Generator,
    pick: random.Random,
) -> Session:
    prompt = np.concatenate([system, _rand_tokens(rng, spec.task_tokens)])
    steps: list[tuple[Turn, ...]] = []
    think: list[float] = []
    for _ in range(pick.randint(*spec.tool_steps)):
        turn = Turn(prompt, _rand_tokens(rng, spec.answer_tokens))
        steps.append((turn,))
        think.append(pick.expovariate(1 / spec.tool_think_s))
        prompt = np.concatenate([prompt, turn.answer, _rand_tokens(rng, spec.tool_result_tokens)])
    final = Turn(prompt, _rand_tokens(rng, spec.answer_tokens))
    steps.append((final,))
    branches = pick.randint(*spec.followups)
    if branches:
        think.append(pick.expovariate(1 / spec.user_think_s))
        base = np.concatenate([prompt, final.answer])
        steps.append(
            tuple(
                Turn(
                    np.concatenate([base, _rand_tokens(rng, spec.followup_tokens)]),
                    _rand_tokens(rng, spec.answer_tokens),
                )
                for _ in range(branches)
            )
        )
    return Session(sid, system_id, start, tuple(steps), tuple(think))
