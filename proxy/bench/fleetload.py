"""The ``cluster`` workload: sessions that move between the proxies of a fleet.

Each session is one user working on a document of its own (``prompt_tokens``) under the
service's system prompt (``system_tokens``, the same for everyone), asking ``rounds``
questions in turn; round ``r`` carries the document, the ``r - 1`` earlier questions and
their scripted answers, and a new question. A session's rounds run one after the other
(closed loop: each is sent ``think_ms`` after the answer before it), all sessions at once.

Behind a round-robin balancer (``radixctl bench cluster``: N proxies, one server each) a
session's next round lands on whichever proxy is next in turn, so most rounds reach a proxy
that did not compute the round before. Without a shared tier that proxy knows the system
prompt at best and prefills the session's document again; with ``--cache-remote`` it restores
the document and the history the other proxy saved. What the whole fleet could reuse (the
workload's limit) is every earlier round of the session, wherever it ran.
"""

from __future__ import annotations

from proxy.traffic.spec import BenchRequest, Workload
from proxy.traffic.text import prose, seeded, words_for


def cluster(
    sessions: int = 3,
    rounds: int = 4,
    system_tokens: int = 400,
    prompt_tokens: int = 1600,
    question_tokens: int = 30,
    max_tokens: int = 16,
    think_ms: int = 1000,
    seed: int = 0,
) -> Workload:
    """``sessions`` concurrent sessions of ``rounds`` questions on a document each."""
    if sessions < 1 or rounds < 1:
        raise ValueError("sessions and rounds must be at least 1")
    if think_ms < 0:
        raise ValueError("think_ms must not be negative")
    system = "You are a careful analyst. Answer from the document in two sentences.\n\n" + prose(
        seeded(seed, "cluster", "system"), words_for(system_tokens)
    )
    reqs: list[BenchRequest] = []
    for s in range(sessions):
        document = f"[document {s}] " + prose(seeded(seed, "cluster", s, "doc"), words_for(prompt_tokens))
        history: list[dict[str, str]] = []
        previous: tuple[str, ...] = ()
        for rnd in range(1, rounds + 1):
            ask = f"[session {s}, question {rnd}] " + prose(
                seeded(seed, "cluster", s, rnd, "q"), max(1, words_for(question_tokens) - 4)
            )
            first = f"{document}\n\n{ask}" if rnd == 1 else ask
            messages = [{"role": "system", "content": system}, *history, {"role": "user", "content": first}]
            rid = f"s{s}-r{rnd}"
            reqs.append(
                BenchRequest(
                    rid,
                    f"s{s}",
                    "first round" if rnd == 1 else "later rounds",
                    {"messages": messages, "max_tokens": max_tokens, "temperature": 0},
                    previous,
                    delay_s=think_ms / 1000 if previous else 0.0,
                    meta={"session": s, "round": rnd},
                )
            )
            answer = prose(seeded(seed, "cluster", s, rnd, "a"), words_for(max_tokens))
            history += [{"role": "user", "content": first}, {"role": "assistant", "content": answer}]
            previous = (rid,)
    return Workload(
        "cluster",
        f"{sessions} sessions of {rounds} rounds on a private document each, under one system prompt; "
        "behind a round-robin balancer a session's rounds move between the proxies",
        tuple(reqs),
        sessions,
        {
            "sessions": sessions,
            "rounds": rounds,
            "system_tokens": system_tokens,
            "prompt_tokens": prompt_tokens,
            "question_tokens": question_tokens,
            "max_tokens": max_tokens,
            "think_ms": think_ms,
            "seed": seed,
        },
    )
