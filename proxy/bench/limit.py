"""Every benchmark read against its limit: the fewest tokens any cache must prefill, and the
time an oracle cache would need.

**Minimum prefill.** In arrival order, a request's prompt (as the server tokenizes it) can
reuse at most its longest common prefix with an earlier request's prompt: KV depends on every
token before it, so no cache can hold more of it. What is left, its *new tokens*, has to be
computed by any cache, and at least one token per request (every arm computes the last
prompt token again to get its logits; a fully cached prompt is still a one-token prefill).
The workload's minimum is the sum over its requests. The longest common prefix with any
earlier prompt is a walk down a token trie of the earlier prompts, so the whole computation
is linear in the workload's tokens. The arrival order is the workload's order (the order
requests become ready; those sent together in the order listed); without the one-token floor
the total would not depend on the order at all (it is the size of the trie of all prompts).
Only prompts count: tokens a request generated that happen to begin the scripted assistant
turn after it (an agent's tool call) are reused by real caches too, so an arm can come in a
few tokens under the minimum on workloads with such turns.

**Oracle time.** From an arm's own results (llama-server's ``timings``): a request was
prefilling from ``ttft - prompt_ms`` to its first token, and decoding from then to its last
byte. Prefill windows of concurrent requests overlap (the server batches them), so the time
the server spent prefilling is the length of their union, and the measured prefill rate is
the tokens prefilled over that time. Decode time is the time some request was decoding while
none was prefilling. The oracle bound is ``decode_s + min_prefill_tokens / prefill_rate``:
the same decode, and only the minimum prefill at the arm's own rate. ``busy_s``, the time at
least one request was outstanding (client view: queueing, restores and the proxy included),
splits into the oracle, the extra prefill ``(prefilled - min) / rate`` and the rest.

**Media.** A request with images (or audio) is tokenized by a patched server with its projector
(``/kvctl/tokenize``, the stock server has no such route): its text tokens as the completion
makes them, and each media chunk as cells keyed by the chunk's content hash (a movable chunk's
cells by their keys below -1, any other chunk's by ``(hash, cell)``), so the same image after the
same text is reused whole and a different one is new, as the server keys them.

Pure: no event loop or HTTP here except :func:`prompt_token_lists` and :func:`tokenized_limit`,
which ask a server.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from proxy.traffic.spec import Workload

Window = tuple[float, float]


class Timed(Protocol):
    """What the limit reads of a request's result (``proxy.traffic.runner.RequestResult``)."""

    id: str
    group: str
    sent_s: float
    ttft_s: float | None
    e2e_s: float | None
    prompt_n: int | None
    prompt_ms: float | None

    @property
    def ok(self) -> bool: ...


# ---- minimum prefill ------------------------------------------------------------------------


def new_tokens(prompts: Iterable[Sequence[Hashable]]) -> list[int]:
    """For each prompt in order: its tokens beyond the longest common prefix with any earlier one."""
    root: dict[Hashable, Any] = {}
    out = []
    for tokens in prompts:
        node, matched = root, 0
        for token in tokens:
            child = node.get(token)
            if child is None:
                break
            node, matched = child, matched + 1
        for token in tokens[matched:]:
            child = {}
            node[token] = child
            node = child
        out.append(len(tokens) - matched)
    return out


def min_prefill(prompts: Iterable[Sequence[Hashable]]) -> list[int]:
    """Per request, the tokens any cache must prefill: its new tokens, at least one."""
    return [max(1, n) for n in new_tokens(prompts)]


def workload_limit(
    ids: Sequence[str], groups: Sequence[str], prompts: Sequence[Sequence[Hashable]]
) -> dict[str, Any]:
    """The workload's side of the limit, from each request's prompt tokens in arrival order."""
    if not len(ids) == len(groups) == len(prompts):
        raise ValueError("one id, group and prompt per request")
    mins = min_prefill(prompts)
    by_group: dict[str, int] = {}
    for group, n in zip(groups, mins, strict=True):
        by_group[group] = by_group.get(group, 0) + n
    return {
        "requests": len(ids),
        "prompt_tokens": sum(len(p) for p in prompts),  # what an arm without a cache computes
        "min_prefill_tokens": sum(mins),
        "min_prefill_by_group": by_group,
        "min_prefill_by_request": dict(zip(ids, mins, strict=True)),
        "prompt_tokens_by_request": {i: len(p) for i, p in zip(ids, prompts, strict=True)},
    }


# ---- time ----------------------------------------------------------------------------------------


def union_s(windows: Iterable[Window]) -> float:
    """Total length of the union of ``(start, end)`` windows (empty or reversed ones count 0)."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(w for w in windows if w[1] > w[0]):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def windows(results: Iterable[Timed]) -> tuple[list[Window], list[Window], list[Window]]:
    """Prefill, decode and whole-request windows (seconds from the run's start) of the results
    that answered with the server's prefill time."""
    prefill, decode, whole = [], [], []
    for r in results:
        if not r.ok or r.ttft_s is None or r.e2e_s is None:
            continue
        first = r.sent_s + r.ttft_s
        whole.append((r.sent_s, r.sent_s + r.e2e_s))
        if r.prompt_ms is not None:
            prefill.append((max(r.sent_s, first - r.prompt_ms / 1000), first))
            decode.append((first, r.sent_s + r.e2e_s))
    return prefill, decode, whole


def oracle_s(min_tokens: int, prefilled: int, prefill_s: float, decode_s: float) -> float | None:
    """``decode_s`` plus ``min_tokens`` at the measured rate (``prefilled`` in ``prefill_s``)."""
    if prefilled <= 0 or prefill_s <= 0:
        return None
    return decode_s + min_tokens * prefill_s / prefilled


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def arm_limit(results: Sequence[Timed], min_by_request: Mapping[str, int]) -> dict[str, Any]:
    """An arm's prefilled tokens and times against the workload's minimum.

    ``complete`` says every request answered with ``prompt_n`` (and ``prompt_ms`` for the
    times); otherwise the sums miss requests and the ratios are left out.
    """
    min_tokens = sum(min_by_request.values())
    counted = [r for r in results if r.ok and r.prompt_n is not None]
    prefilled = sum(r.prompt_n or 0 for r in counted)
    complete = len(counted) == len(results) == len(min_by_request)
    prefill, decode, whole = windows(results)
    timed = complete and len(prefill) == len(results)
    prefill_s = union_s(prefill)
    decode_s = union_s(prefill + decode) - prefill_s
    busy_s = union_s(whole)
    oracle = oracle_s(min_tokens, prefilled, prefill_s, decode_s) if timed else None
    rate = prefilled / prefill_s if timed and prefill_s > 0 else None
    return {
        "min_prefill_tokens": min_tokens,
        "prefilled_tokens": prefilled if counted else None,
        "complete": complete,
        "prefilled_vs_min": _ratio(prefilled, min_tokens) if complete else None,
        "prefill_s": prefill_s if timed else None,
        "prefill_tokens_per_s": rate,
        "decode_s": decode_s if timed else None,
        "busy_s": busy_s,
        "oracle_s": oracle,
        "busy_vs_oracle": _ratio(busy_s, oracle),
        "extra_prefill_s": (prefilled - min_tokens) / rate if rate else None,
        "other_s": busy_s - prefill_s - decode_s if timed else None,
    }


# ---- the real tokenization --------------------------------------------------------------------------


def chat_body(path: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The OpenAI chat body the server computes for a request to ``path`` (``/v1/messages``
    bodies converted as llama-server converts them)."""
    if path.rstrip("/").endswith("/messages"):
        from proxy.server.api.anthropic import to_chat

        return to_chat(dict(body))
    return dict(body)


def media_cells(reply: Mapping[str, Any]) -> list[Hashable]:
    """The cells of a ``/kvctl/tokenize`` reply as the limit keys them: text tokens and movable
    media cells as they are (a media cell's key comes from its chunk's content hash), the cells
    of a chunk no move can name (-1 each) as ``(chunk id, cell)``. The reply is checked as the
    proxy checks it (``Tokenized.parse``: every negative cell in a chunk, a movable chunk's
    cells keyed below -1), and a chunk no move can name needs its id (else two images would
    compare equal); a reply that fails is a ValueError."""
    from proxy.server.dataplane.kvctl import KvctlReplyError, Tokenized

    try:
        tokenized = Tokenized.parse(reply)
    except KvctlReplyError as exc:
        raise ValueError(str(exc)) from exc
    cells: list[Hashable] = [int(t) for t in tokenized.tokens]
    for chunk in tokenized.media:
        if not chunk.movable:
            if not chunk.id:
                raise ValueError(f"the media chunk at {chunk.idx} has no id to key it by")
            cells[chunk.idx : chunk.idx + chunk.n_tokens] = [(chunk.id, j) for j in range(chunk.n_tokens)]
    return cells


async def prompt_token_lists(
    server_url: str, requests: Iterable[Any], kvctl_headers: Mapping[str, str] | None = None
) -> list[list[Hashable]]:
    """Each request's prompt as the server tokenizes it: its chat template (with the tools,
    when the body has them) through ``/apply-template``, then ``/tokenize``; a request with media
    through ``/kvctl/tokenize`` (``kvctl_headers``: a patched server's key). ``requests``:
    ``BenchRequest``-like objects (``body`` and ``path``)."""
    import aiohttp

    from proxy.server.api.media import has_media

    async def post(
        session: aiohttp.ClientSession,
        path: str,
        body: dict[str, Any],
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        async with session.post(f"{server_url}{path}", json=body, headers=headers) as resp:
            resp.raise_for_status()
            return await resp.json()

    out: list[list[Hashable]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for req in requests:
            chat = chat_body(getattr(req, "path", "/v1/chat/completions"), req.body)
            chat.pop("stream", None)
            if has_media(chat):
                if kvctl_headers is None:
                    raise ValueError("a request with media needs a patched server's /kvctl/tokenize")
                out.append(media_cells(await post(session, "/kvctl/tokenize", chat, kvctl_headers)))
                continue
            rendered = await post(session, "/apply-template", chat)
            tokens = await post(
                session,
                "/tokenize",
                {"content": rendered["prompt"], "add_special": True, "parse_special": True},
            )
            out.append([int(t["id"]) if isinstance(t, dict) else int(t) for t in tokens["tokens"]])
    return out


def workload_has_media(workload: Workload) -> bool:
    """Whether any request carries media (its limit needs a patched server: :func:`prompt_token_lists`)."""
    from proxy.server.api.media import has_media

    return any(has_media(chat_body(r.path, r.body)) for r in workload.requests)


def tokenized_limit(
    server_url: str,
    workload: Workload,
    say: Callable[[str], None],
    kvctl_headers: Mapping[str, str] | None = None,
) -> dict[str, Any] | None:
    """:func:`workload_limit` of a ``Workload`` on the server's own tokenization (None, said, if
    the server cannot tokenize it)."""
    import asyncio

    import aiohttp

    try:
        prompts = asyncio.run(prompt_token_lists(server_url, workload.requests, kvctl_headers))
    except (aiohttp.ClientError, OSError, TimeoutError, KeyError, ValueError) as exc:
        say(f"could not tokenize the workload ({type(exc).__name__}: {exc}): the report has no limit")
        return None
    reqs = workload.requests
    return workload_limit([r.id for r in reqs], [r.group for r in reqs], prompts)


# ---- the report's section -------------------------------------------------------------------------


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def render_limit(report: Mapping[str, Any]) -> list[str]:
    """The markdown lines of the limit: the workload's minimum, then per arm what it prefilled
    and its time against the oracle (nothing when the run was not tokenized)."""
    limit = report.get("limit")
    if not limit:
        return []
    lines = [
        "",
        f"Against the limit: the workload's prompts are {limit['prompt_tokens']:,} tokens (what an arm without "
        f"a cache computes); any cache must prefill at least {limit['min_prefill_tokens']:,} (each prompt's "
        "tokens beyond its longest common prefix with an earlier prompt, at least one; docs/bench.md, "
        "Limits). Oracle: the arm's decode time plus that minimum at the arm's measured prefill rate; busy: "
        "time with a request outstanding = oracle + extra prefill + other (queueing, restores, the proxy).",
        "",
        "| arm | prefilled | min | prefilled / min | prefill tok/s | decode s | busy s | oracle s "
        "| busy / oracle | extra prefill s | other s |",
        "|" + "---|" * 11,
    ]
    for name, arm in (report.get("arms") or {}).items():
        lim = arm.get("limit") or {}
        if not lim:
            continue
        cells = [
            name,
            _f(lim.get("prefilled_tokens"), "{:,}") + ("" if lim.get("complete") else " (incomplete)"),
            _f(lim.get("min_prefill_tokens"), "{:,}"),
            _f(lim.get("prefilled_vs_min"), "{:.2f}x"),
            _f(lim.get("prefill_tokens_per_s"), "{:.0f}"),
            _f(lim.get("decode_s"), "{:.1f}"),
            _f(lim.get("busy_s"), "{:.1f}"),
            _f(lim.get("oracle_s"), "{:.1f}"),
            _f(lim.get("busy_vs_oracle"), "{:.2f}x"),
            _f(lim.get("extra_prefill_s"), "{:.1f}"),
            _f(lim.get("other_s"), "{:.1f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
