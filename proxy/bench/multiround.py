"""The ``multi-round`` workload: many users of one chat service, questions at a fixed rate.

Every user's conversation starts with the same system prompt (the service's instructions and
reference notes, ``system_tokens``) and grows turn by turn: round ``r`` of a user carries its
``r - 1`` earlier questions and answers, then a new question (``question_tokens``). Answers are
``max_tokens`` long (a few dozen tokens). The assistant turns in the history are scripted, so
the request list never depends on what the model answers (as in ``agents``).

Arrivals are open loop: one question every ``interval_ms``, users in turn (user 0 round 1,
user 1 round 1, ..., user 0 round 2, ...), each sent at its arrival time whatever the answers
before it are doing, so a user asks again every ``users x interval_ms``. Nothing caps the
requests in flight: when the arm falls behind, requests queue in it, as they would in a
service. What a cache can reuse: the system prompt across users, and each user's own
history across its rounds, which other users' turns push out of the slots in between.
"""

from __future__ import annotations

from proxy.traffic.spec import BenchRequest, Workload
from proxy.traffic.text import prose, seeded, words_for


def multi_round(
    users: int = 8,
    rounds: int = 4,
    system_tokens: int = 800,
    question_tokens: int = 40,
    max_tokens: int = 32,
    interval_ms: int = 3000,
    seed: int = 0,
) -> Workload:
    """``users`` conversations of ``rounds`` questions each, one question every ``interval_ms``."""
    if users < 1 or rounds < 1:
        raise ValueError("users and rounds must be at least 1")
    if interval_ms < 0:
        raise ValueError("interval_ms must not be negative")
    system = (
        "You are the help desk of a regional service company. Answer in two or three sentences, "
        "from the reference notes below when they say something about the question.\n\n## Reference notes\n"
        + prose(seeded(seed, "multi-round", "system"), words_for(system_tokens))
    )
    histories: list[list[dict[str, str]]] = [[] for _ in range(users)]
    reqs: list[BenchRequest] = []
    for rnd in range(1, rounds + 1):
        for user in range(users):
            k = (rnd - 1) * users + user  # arrival index
            ask = f"[user {user}, question {rnd}] " + prose(
                seeded(seed, "multi-round", user, rnd, "q"), max(1, words_for(question_tokens) - 4)
            )
            messages = [
                {"role": "system", "content": system},
                *histories[user],
                {"role": "user", "content": ask},
            ]
            reqs.append(
                BenchRequest(
                    f"u{user}-r{rnd}",
                    f"u{user}",
                    f"round {rnd}",
                    {"messages": messages, "max_tokens": max_tokens, "temperature": 0},
                    delay_s=k * interval_ms / 1000,  # no dependencies: from the start of the run
                    meta={"user": user, "round": rnd, "arrival_s": k * interval_ms / 1000},
                )
            )
            answer = prose(seeded(seed, "multi-round", user, rnd, "a"), words_for(max_tokens))
            histories[user] += [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]
    return Workload(
        "multi-round",
        f"{users} users sharing a system prompt, each with a growing history, one question every "
        f"{interval_ms} ms (open loop)",
        tuple(reqs),
        len(reqs),  # open loop: nothing caps the requests in flight
        {
            "users": users,
            "rounds": rounds,
            "system_tokens": system_tokens,
            "question_tokens": question_tokens,
            "max_tokens": max_tokens,
            "interval_ms": interval_ms,
            "seed": seed,
        },
    )
