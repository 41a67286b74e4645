"""Which server takes a request: the routing cost model, on pure data.

The planner (``proxy.core.planner``) picks, on each server, the slot and the route that
reuse the most. Routing compares those per-server plans and picks the server where the
request should get its first token soonest. It is a pure function of a few numbers per
server, so the coordinator and the cluster simulator drive the same code.

Estimated seconds to the first token on a server (``cost_s``)::

    work   = prefill_tokens * prefill_s_per_token       # what the server must compute
           + moved_bytes / import_bytes_per_s            # host-tree KV imported (H, A+H, S+H)
    cost_s = work * (1 + busy_weight * busy_slots)       # decodes in flight share its compute
           + short_cells * prefill_s_per_token           # KV that must be evicted to make room

- ``prefill_tokens`` = prompt tokens the plan does not reuse (``n_prompt - cached``);
- ``moved_bytes`` is priced at the server's own import rate (``MeasuredRates``: learned
  from its moves, host-to-device where its KV is on a device), at most the inline HTTP rate
  when the server does not share the proxy's payload directory;
- ``busy_slots``: requests running on that server now (its queue depth: the planner only
  leases idle slots, so the proxy's own queue is the same for every server);
- ``short_cells`` = cells the request needs (prefill + answer) beyond the server's free
  cells: someone's cached KV there is evicted, and the work it saved is lost;
- a server that is down (health monitor) is no candidate at all.

Candidates whose costs are within ``tie_s`` of the cheapest are ties, broken in order by:
session affinity (the server the session used last), fewer busy slots, lower index. So
affinity never beats a longer prefix elsewhere unless the two are worth the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

MoveDirection = Literal["export", "import"]


@dataclass(frozen=True)
class CostModel:
    """Rates calibrated on this project's CPU machine (docs/routing.md)."""

    prefill_s_per_token: float = 1 / 200  # SmolLM2-135M on 2 cores: 150-250 tokens/s
    # A KV move through shared-memory files, KV in host memory: each server's rates start here
    # and follow its measured moves (MeasuredRates.observe_move).
    move_bytes_per_s: float = 400e6
    inline_bytes_per_s: float = 100e6  # the same over HTTP (msgpack bin), measured lower
    busy_weight: float = 0.5  # each running request slows the server's prefill by half
    tie_s: float = 0.005  # costs closer than this are equal

    def __post_init__(self) -> None:
        if min(self.prefill_s_per_token, self.move_bytes_per_s, self.inline_bytes_per_s) <= 0:
            raise ValueError("rates must be positive")
        if self.busy_weight < 0 or self.tie_s < 0:
            raise ValueError("busy_weight and tie_s must be >= 0")


MIN_MOVE_SAMPLE_BYTES = 1 << 20  # smaller moves are mostly fixed costs: they say little about a rate


@dataclass
class MeasuredRates:
    """One server's prefill and decode speed, learned from its answers' timings, and its KV
    move rates, learned from its moves (each an exponentially weighted mean), starting from
    the calibration above. Decode starts slow on purpose: it only decides whether to wait for
    another request's answer (``worth_waiting``).

    A move's rate is its bytes over its work: the server's copy between its KV buffers and the
    payload (``t_ms`` in its reply: device-to-host for an export, host-to-device for an
    import, where the KV is on a device) plus the proxy's copy between the payload and the
    tree. Waits (the move lock, the server's main loop finishing a decode) are not work."""

    prefill_s_per_token: float = CostModel.prefill_s_per_token
    decode_s_per_token: float = 1 / 30
    export_bytes_per_s: float = CostModel.move_bytes_per_s
    import_bytes_per_s: float = CostModel.move_bytes_per_s
    weight: float = 0.25  # of each new observation
    moves_seen: int = 0  # moves that taught a rate (0: the rates are still the prior)

    def observe(self, prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float) -> None:
        """The server's timings of one answer; small or missing counts say little and are skipped."""
        if prompt_n >= 32 and prompt_ms > 0:
            self.prefill_s_per_token += self.weight * (prompt_ms / 1000 / prompt_n - self.prefill_s_per_token)
        if predicted_n >= 4 and predicted_ms > 0:
            self.decode_s_per_token += self.weight * (
                predicted_ms / 1000 / predicted_n - self.decode_s_per_token
            )

    def observe_move(
        self, direction: MoveDirection, nbytes: int, server_s: float | None, proxy_s: float
    ) -> None:
        """One move (``direction`` "export" or "import") of ``nbytes``: the server's part
        (its reply's ``t_ms``, in seconds; None: a server that does not report it teaches
        nothing) and the proxy's part."""
        if direction not in ("export", "import"):
            raise ValueError(f"direction must be 'export' or 'import', not {direction!r}")
        if server_s is None or nbytes < MIN_MOVE_SAMPLE_BYTES or server_s < 0 or proxy_s < 0:
            return
        seconds = server_s + proxy_s
        if seconds <= 0:
            return
        rate = nbytes / seconds
        if direction == "export":
            self.export_bytes_per_s += self.weight * (rate - self.export_bytes_per_s)
        else:
            self.import_bytes_per_s += self.weight * (rate - self.import_bytes_per_s)
        self.moves_seen += 1


def move_s(nbytes: int, rates: MeasuredRates, model: CostModel, inline: bool = False) -> float:
    """Seconds to import ``nbytes`` of host-tree KV into the server: at its measured import
    rate, and no faster than HTTP bodies when the payload goes inline."""
    rate = min(rates.import_bytes_per_s, model.inline_bytes_per_s) if inline else rates.import_bytes_per_s
    return nbytes / rate


def time_to_answer_s(prefill_tokens: int, n_predict: int, elapsed_s: float, rates: MeasuredRates) -> float:
    """Seconds until a request in flight has its whole answer (its prompt's KV saved right
    after): its prefill and answer at the server's rates, less the time it has run."""
    work = prefill_tokens * rates.prefill_s_per_token + n_predict * rates.decode_s_per_token
    return max(0.0, work - elapsed_s)


def slowdown(prefill_tokens: int, n_predict: int, elapsed_s: float, rates: MeasuredRates) -> float:
    """How much slower than its estimate a request in flight has run (at least 1): the
    server's real speed under its present load, which a prefix computed now would run at too."""
    expected = prefill_tokens * rates.prefill_s_per_token + n_predict * rates.decode_s_per_token
    return max(1.0, elapsed_s / expected) if expected > 0 else 1.0


def compute_s(gain_tokens: int, running: int, rates: MeasuredRates, model: CostModel) -> float:
    """Seconds to compute ``gain_tokens`` of prefill at the server's rate, slowed by the
    ``running`` requests it computes meanwhile."""
    return gain_tokens * rates.prefill_s_per_token * (1 + model.busy_weight * running)


def worth_waiting(
    gain_tokens: int, wait_s: float, restore_bytes: int, running: int, rates: MeasuredRates, model: CostModel
) -> bool:
    """Wait ``wait_s`` for a request computing this one's prefix, then restore its KV
    (``restore_bytes``), rather than compute those ``gain_tokens`` side by side with it, at the
    server's prefill rate slowed by the ``running`` requests (issue 28: compute each prefix
    once)."""
    return wait_s + move_s(restore_bytes, rates, model) < compute_s(gain_tokens, running, rates, model)


@dataclass(frozen=True)
class ServerLoad:
    """One server's best plan for the request, and its load. ``index``: the caller's id."""

    index: int
    n_prompt: int
    cached: int  # prompt tokens the plan does not compute (A, S and H together)
    moved_bytes: int = 0  # KV bytes the plan imports from the host tree
    inline: bool = False  # those bytes go over HTTP (the server does not share the payload dir)
    busy_slots: int = 0
    free_cells: int = 1 << 30
    n_predict: int = 0  # answer tokens the request may add (cells it will fill)
    healthy: bool = True
    affinity: bool = False  # the request's session was last served here
    import_bytes_per_s: float | None = None  # the server's measured import rate (None: the prior)


def cost_s(load: ServerLoad, model: CostModel) -> float:
    """Estimated seconds until the first token of the request on this server (inf: never)."""
    if not load.healthy:
        return float("inf")
    prefill = max(0, load.n_prompt - load.cached)
    rate = load.import_bytes_per_s or model.move_bytes_per_s
    if load.inline:
        rate = min(rate, model.inline_bytes_per_s)
    work = prefill * model.prefill_s_per_token + load.moved_bytes / rate
    short = max(0, prefill + load.n_predict - load.free_cells)
    return work * (1 + model.busy_weight * load.busy_slots) + short * model.prefill_s_per_token


def choose_server(loads: Sequence[ServerLoad], model: CostModel) -> ServerLoad | None:
    """The server to take the request (None when no healthy candidate)."""
    costs = [(cost_s(x, model), x) for x in loads if x.healthy]
    if not costs:
        return None
    cheapest = min(c for c, _ in costs)
    ties = [x for c, x in costs if c <= cheapest + model.tie_s]
    return min(ties, key=lambda x: (not x.affinity, x.busy_slots, x.index))
