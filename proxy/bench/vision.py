"""The ``vision`` workload: inspection sessions that send the same photos on every turn.

Every session starts with the service's instructions (``system_tokens``), then a first question
with ``shared_images`` reference photos every session sends (the same bytes) and ``own_images``
photos of its own; each later round carries the whole conversation again, photos included, as chat
clients do, and asks one more question (``question_tokens``). Answers are ``max_tokens`` long; the
assistant turns in the history are scripted, so the request list never depends on the answers.

Sessions start ``stagger_ms`` apart and each asks its next question ``think_ms`` after its last
answer (closed loop): with more sessions than slots, the other sessions' turns push a session's
photos out of its slot between its rounds. What a cache can reuse: the instructions and the
shared photos across sessions, and each session's own photos and history across its rounds. An
image costs its encoding (the projector's tower) and its tokens' prefill; the server keys each
image by its content hash, so any cache that can hold image KV reuses it whole or not at all.

Needs a server with a projector: ``radixctl bench vision`` starts every arm's servers with
``--mmproj`` (``--mmproj SHAPE|FILE``: a random-weight tower of a real shape by default).
"""

from __future__ import annotations

from typing import Any

from proxy.traffic.images import image_part, png
from proxy.traffic.spec import BenchRequest, Workload
from proxy.traffic.text import prose, seeded, words_for


def _photo(seed: int, image_px: int, *parts: object) -> dict[str, Any]:
    return image_part(png(seeded(seed, "vision", *parts).getrandbits(32), image_px))


def vision(
    users: int = 6,
    rounds: int = 3,
    system_tokens: int = 400,
    question_tokens: int = 30,
    max_tokens: int = 24,
    image_px: int = 224,
    shared_images: int = 1,
    own_images: int = 1,
    stagger_ms: int = 500,
    think_ms: int = 1000,
    seed: int = 0,
) -> Workload:
    """``users`` sessions of ``rounds`` questions each about the same photos."""
    if users < 1 or rounds < 1:
        raise ValueError("users and rounds must be at least 1")
    if shared_images < 0 or own_images < 0 or shared_images + own_images < 1:
        raise ValueError("a vision workload needs at least one image (shared_images + own_images)")
    if image_px < 8 or stagger_ms < 0 or think_ms < 0:
        raise ValueError("image_px must be at least 8, stagger_ms and think_ms not negative")
    system = (
        "You are the inspection assistant of a parts warehouse. Compare the customer's photos with "
        "the reference photos and answer in two sentences.\n\n## Inspection notes\n"
        + prose(seeded(seed, "vision", "system"), words_for(system_tokens))
    )
    shared = [_photo(seed, image_px, "shared", k) for k in range(shared_images)]
    reqs: list[BenchRequest] = []
    for user in range(users):
        own = [_photo(seed, image_px, "own", user, k) for k in range(own_images)]
        history: list[dict[str, Any]] = []
        previous: tuple[str, ...] = ()
        for rnd in range(1, rounds + 1):
            ask = f"[session {user}, question {rnd}] " + prose(
                seeded(seed, "vision", user, rnd, "q"), max(1, words_for(question_tokens) - 4)
            )
            if rnd == 1:
                content: Any = [
                    {"type": "text", "text": "Reference photos:"},
                    *shared,
                    {"type": "text", "text": "My photos:"},
                    *own,
                    {"type": "text", "text": ask},
                ]
            else:
                content = ask
            messages = [{"role": "system", "content": system}, *history, {"role": "user", "content": content}]
            rid = f"s{user}-r{rnd}"
            reqs.append(
                BenchRequest(
                    rid,
                    f"s{user}",
                    f"round {rnd}",
                    {"messages": messages, "max_tokens": max_tokens, "temperature": 0},
                    previous,
                    delay_s=(user * stagger_ms if rnd == 1 else think_ms) / 1000,
                    meta={"user": user, "round": rnd, "images": shared_images + own_images},
                )
            )
            answer = prose(seeded(seed, "vision", user, rnd, "a"), words_for(max_tokens))
            history += [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
            previous = (rid,)
    # The limit's order: every first round, then the second rounds, ... Real arrivals interleave
    # (a session's second round can come before a later session's first), but a round shares
    # more than the instructions and the shared photos only with its own session's earlier
    # rounds, which come before it in either order, so the minimum is the same.
    ordered = sorted(reqs, key=lambda r: (r.meta["round"], r.meta["user"]))
    return Workload(
        "vision",
        f"{users} sessions sending {shared_images} shared and {own_images} own photo(s) of {image_px} px on "
        f"each of {rounds} turns",
        tuple(ordered),
        users,
        {
            "users": users,
            "rounds": rounds,
            "system_tokens": system_tokens,
            "question_tokens": question_tokens,
            "max_tokens": max_tokens,
            "image_px": image_px,
            "shared_images": shared_images,
            "own_images": own_images,
            "stagger_ms": stagger_ms,
            "think_ms": think_ms,
            "seed": seed,
        },
    )
