"""The routing cost model on tables, the backend spec syntax, and the model naming rule."""

from __future__ import annotations

import pytest

from proxy.config import BackendSpec, parse_backend
from proxy.core.routing import (
    CostModel,
    MeasuredRates,
    ServerLoad,
    choose_server,
    cost_s,
    slowdown,
    time_to_answer_s,
    worth_waiting,
)
from proxy.errors import BadRequest, NotFound
from proxy.server.ops.models import ModelEntry, compat_ns, models_listing, pick_model, with_model

pytestmark = pytest.mark.unit

M = CostModel(prefill_s_per_token=0.005, move_bytes_per_s=400e6, inline_bytes_per_s=100e6, busy_weight=0.5)
TOK = 23_040  # bytes per token of the default model's f16 KV


def load(index: int, **kw: object) -> ServerLoad:
    base: dict[str, object] = {"index": index, "n_prompt": 1000, "cached": 0}
    return ServerLoad(**{**base, **kw})  # type: ignore[arg-type]


# (loads, expected index, why)
CHOICES = [
    ([load(0), load(1)], 0, "equal: lower index"),
    ([load(0, cached=0), load(1, cached=800)], 1, "the longer prefix wins"),
    ([load(0, busy_slots=1), load(1)], 1, "equal prefixes: the idler server"),
    (
        [load(0, cached=900, busy_slots=1), load(1, cached=0)],
        0,
        "a long prefix on a busy server beats an idle server that must compute it all",
    ),
    (
        [load(0, cached=200, busy_slots=3), load(1, cached=0)],
        1,
        "a short prefix does not make up for three running requests",
    ),
    ([load(0, affinity=True), load(1)], 0, "a tie: the session's server"),
    ([load(0), load(1, affinity=True)], 1, "a tie: the session's server even with a higher index"),
    (
        [load(0, cached=500, affinity=True), load(1, cached=900)],
        1,
        "affinity never beats a longer prefix elsewhere",
    ),
    ([load(0, cached=900, healthy=False), load(1)], 1, "a down server is no candidate"),
    (
        [load(0, cached=900, moved_bytes=900 * TOK), load(1, cached=900)],
        1,
        "the same prefix: the server that holds it beats importing it",
    ),
    (
        [load(0, cached=900, moved_bytes=900 * TOK), load(1, cached=0)],
        0,
        "importing 900 tokens is far cheaper than computing them",
    ),
    (
        [load(0, cached=900, moved_bytes=900 * TOK, inline=True), load(1, cached=900, moved_bytes=900 * TOK)],
        1,
        "the same import: over shared memory before over HTTP",
    ),
    (
        [load(0, free_cells=100, n_predict=200), load(1, free_cells=5000, n_predict=200)],
        1,
        "room for the request without evicting anything",
    ),
]


@pytest.mark.parametrize(("loads", "expected", "why"), CHOICES, ids=[c[2] for c in CHOICES])
def test_choose_server(loads: list[ServerLoad], expected: int, why: str) -> None:
    chosen = choose_server(loads, M)
    assert chosen is not None and chosen.index == expected, why


def test_no_candidate() -> None:
    assert choose_server([], M) is None
    assert choose_server([load(0, healthy=False)], M) is None


COSTS = [
    (load(0), 1000 * 0.005),
    (load(0, cached=999), 0.005),
    (load(0, busy_slots=2), 1000 * 0.005 * 2.0),
    (load(0, cached=1000, moved_bytes=400_000_000), 1.0),
    (load(0, cached=1000, moved_bytes=100_000_000, inline=True), 1.0),
    (load(0, free_cells=500, n_predict=100), (1000 + 600) * 0.005),
    (load(0, cached=1200), 0.0),  # cached past the prompt (never planned) costs nothing, not less
    (load(0, healthy=False), float("inf")),
]


@pytest.mark.parametrize(("x", "seconds"), COSTS)
def test_cost_table(x: ServerLoad, seconds: float) -> None:
    assert cost_s(x, M) == pytest.approx(seconds)


def test_tie_window() -> None:
    # 1 token apart (5 ms) is within a 10 ms tie: the session's server; outside a 1 ms tie: the cheaper.
    loads = [load(0, cached=500, affinity=True), load(1, cached=501)]
    wide, narrow = (
        CostModel(prefill_s_per_token=0.005, tie_s=0.010),
        CostModel(prefill_s_per_token=0.005, tie_s=0.001),
    )
    assert choose_server(loads, wide).index == 0  # type: ignore[union-attr]
    assert choose_server(loads, narrow).index == 1  # type: ignore[union-attr]


def test_cost_model_checks() -> None:
    with pytest.raises(ValueError):
        CostModel(prefill_s_per_token=0)
    with pytest.raises(ValueError):
        CostModel(busy_weight=-1)


SPECS = [
    ("http://127.0.0.1:8081", BackendSpec("http://127.0.0.1:8081")),
    ("http://127.0.0.1:8081/", BackendSpec("http://127.0.0.1:8081")),
    ("smol=http://h:1", BackendSpec("http://h:1", "smol")),
    ("smol=http://h:1#inline", BackendSpec("http://h:1", "smol", "inline")),
    ("http://h:1#shared", BackendSpec("http://h:1", "", "shared")),
    ("a.b-c_d=https://h:1#auto", BackendSpec("https://h:1", "a.b-c_d", "auto")),
    ("http://h:1/?x=1", BackendSpec("http://h:1/?x=1")),
]


@pytest.mark.parametrize(("text", "spec"), SPECS)
def test_parse_backend(text: str, spec: BackendSpec) -> None:
    assert parse_backend(text) == spec


@pytest.mark.parametrize("text", ["=http://h:1", "h:1", "smol=h:1", "http://h:1#files", "smol=http://h:1#"])
def test_parse_backend_refuses(text: str) -> None:
    if text.endswith("#"):  # an empty mode is the default
        assert parse_backend(text).payloads == "auto"
        return
    with pytest.raises(ValueError):
        parse_backend(text)


def _entry(name: str, named: bool = True, compat: dict[str, object] | None = None) -> ModelEntry:
    c = compat or {"fingerprint": name}
    return ModelEntry(name, compat_ns(c), dict(c), named, {"id": "file.gguf", "meta": {"n_vocab": 5}})


def test_pick_model() -> None:
    one_unnamed = {"file.gguf": _entry("file.gguf", named=False)}
    assert pick_model(one_unnamed, {"model": "gpt-4"}).name == "file.gguf"  # ignored, as llama-server does
    assert pick_model(one_unnamed, {}).name == "file.gguf"
    one_named = {"smol": _entry("smol")}
    assert pick_model(one_named, {"model": "smol"}).name == "smol"
    with pytest.raises(NotFound) as nf:
        pick_model(one_named, {"model": "gpt-4"})
    assert nf.value.to_body()["error"] == {
        "code": 404,
        "message": "The model `gpt-4` does not exist. Available: smol",
        "type": "not_found_error",
    }
    two = {"a": _entry("a"), "b": _entry("b")}
    assert pick_model(two, {"model": "b"}).name == "b"
    with pytest.raises(BadRequest):
        pick_model(two, {})
    with pytest.raises(BadRequest):
        pick_model(two, {"model": 3})


def test_model_namespaces() -> None:
    a, b = compat_ns({"fingerprint": "x", "k_type": 1}), compat_ns({"k_type": 1, "fingerprint": "x"})
    assert a == b and a != compat_ns({"fingerprint": "x", "k_type": 8})
    assert with_model(a, "") == a and with_model(a, "t") == f"{a}/t"


def test_models_listing() -> None:
    listing = models_listing({"a": _entry("a"), "b": _entry("b")})
    assert [m["id"] for m in listing["data"]] == ["a", "b"]
    assert listing["data"][0]["meta"] == {"n_vocab": 5} and listing["object"] == "list"


# ---- waiting for a request in flight that computes this one's prefix

CPU = MeasuredRates(prefill_s_per_token=1 / 200, decode_s_per_token=1 / 30)  # this machine
GPU = MeasuredRates(prefill_s_per_token=1 / 20_000, decode_s_per_token=1 / 80)

# (rates, prefill of the blocker, its answer, elapsed, gain tokens, running, wait?, why)
WAITS = [
    (CPU, 2000, 16, 0.0, 2000, 1, True, "CPU: a 2k prefix costs 10 s, its answer 0.5 s more"),
    (CPU, 2000, 16, 9.0, 2000, 1, True, "nearly done: even more worth it"),
    (CPU, 2000, 1024, 0.0, 2000, 1, False, "a long answer (34 s) is not waited for"),
    (CPU, 2000, 16, 0.0, 100, 1, False, "a short gain is not worth the blocker's whole prefill"),
    (GPU, 2000, 64, 0.0, 2000, 1, False, "GPU: prefill 0.1 s, the answer 0.8 s: compute it"),
    (GPU, 2000, 4, 0.0, 2000, 5, True, "GPU: a 4-token answer while five run: wait"),
]


@pytest.mark.parametrize(
    ("rates", "prefill", "n_predict", "elapsed", "gain", "running", "wait", "why"),
    WAITS,
    ids=[w[-1] for w in WAITS],
)
def test_worth_waiting(
    rates: MeasuredRates,
    prefill: int,
    n_predict: int,
    elapsed: float,
    gain: int,
    running: int,
    wait: bool,
    why: str,
) -> None:
    left = time_to_answer_s(prefill, n_predict, elapsed, rates)
    assert worth_waiting(gain, left, gain * TOK, running, rates, M) is wait, why


def test_time_to_answer_never_negative() -> None:
    assert time_to_answer_s(100, 10, 1e6, CPU) == 0.0
    assert time_to_answer_s(200, 30, 0.0, CPU) == pytest.approx(1 + 1)


def test_measured_rates_follow_the_server_and_skip_small_samples() -> None:
    rates = MeasuredRates()
    for _ in range(40):
        rates.observe(prompt_n=1000, prompt_ms=50.0, predicted_n=100, predicted_ms=1000.0)
    assert rates.prefill_s_per_token == pytest.approx(5e-5, rel=1e-3)
    assert rates.decode_s_per_token == pytest.approx(1e-2, rel=1e-3)
    rates.observe(prompt_n=3, prompt_ms=900.0, predicted_n=1, predicted_ms=900.0)  # too small to say
    rates.observe(prompt_n=1000, prompt_ms=0.0, predicted_n=100, predicted_ms=-1.0)  # no timings
    assert rates.prefill_s_per_token == pytest.approx(5e-5, rel=1e-3)
    assert rates.decode_s_per_token == pytest.approx(1e-2, rel=1e-3)


def test_slowdown_is_the_blockers_overrun() -> None:
    assert slowdown(200, 30, 0.5, CPU) == 1.0  # within its estimate (2 s)
    assert slowdown(200, 30, 8.0, CPU) == pytest.approx(4.0)
    assert slowdown(0, 0, 8.0, CPU) == 1.0


# ---- measured move rates -------------------------------------------------------------------------


def test_a_move_teaches_the_servers_rate_from_its_work() -> None:
    rates = MeasuredRates()
    assert rates.import_bytes_per_s == rates.export_bytes_per_s == CostModel.move_bytes_per_s  # the prior
    nbytes = 100 << 20
    rates.observe_move("import", nbytes, server_s=0.5, proxy_s=0.5)  # 100 MiB in 1 s of work
    assert rates.import_bytes_per_s == pytest.approx(400e6 + 0.25 * (nbytes - 400e6))
    assert rates.export_bytes_per_s == 400e6 and rates.moves_seen == 1
    for _ in range(60):
        rates.observe_move("export", nbytes, server_s=2.0, proxy_s=0.0)  # a slow device-to-host copy
    assert rates.export_bytes_per_s == pytest.approx(nbytes / 2.0, rel=1e-6)
    # A small move (fixed costs), a server that reports no t_ms, a nonsense time: nothing learned.
    before = (rates.export_bytes_per_s, rates.import_bytes_per_s, rates.moves_seen)
    rates.observe_move("import", 4096, server_s=0.001, proxy_s=0.0)
    rates.observe_move("import", nbytes, server_s=None, proxy_s=0.2)
    rates.observe_move("import", nbytes, server_s=0.0, proxy_s=0.0)
    rates.observe_move("export", nbytes, server_s=-1.0, proxy_s=0.5)
    assert (rates.export_bytes_per_s, rates.import_bytes_per_s, rates.moves_seen) == before
    with pytest.raises(ValueError, match="direction"):
        rates.observe_move("sideways", nbytes, 1.0, 0.0)  # type: ignore[arg-type]


def test_the_cost_model_prices_a_host_restore_at_the_servers_import_rate() -> None:
    moved = 1000 * TOK  # 23 MB
    prior = cost_s(load(0, cached=1000, n_prompt=1001, moved_bytes=moved), M)
    assert prior == pytest.approx(0.005 + moved / 400e6)
    fast = cost_s(load(0, cached=1000, n_prompt=1001, moved_bytes=moved, import_bytes_per_s=4e9), M)
    slow = cost_s(load(0, cached=1000, n_prompt=1001, moved_bytes=moved, import_bytes_per_s=2e6), M)
    assert fast == pytest.approx(0.005 + moved / 4e9) and slow == pytest.approx(0.005 + moved / 2e6)
    # Inline payloads are no faster than HTTP bodies, however fast the server copies.
    inline = cost_s(
        load(0, cached=1000, n_prompt=1001, moved_bytes=moved, inline=True, import_bytes_per_s=4e9), M
    )
    assert inline == pytest.approx(0.005 + moved / 100e6)
    # Two servers holding the same prefix: the one whose device imports faster takes it; a
    # server that imports slower than it computes loses to one that computes it all.
    a = load(0, cached=1000, n_prompt=1001, moved_bytes=moved, import_bytes_per_s=2e6)
    b = load(1, cached=1000, n_prompt=1001, moved_bytes=moved, import_bytes_per_s=2e9)
    assert choose_server([a, b], M) is b
    computes = load(2, cached=0, n_prompt=1001)  # 5 s of prefill against 11.5 s of import
    assert choose_server([a, computes], M) is computes


def test_waiting_for_a_prefix_prices_its_restore_at_the_servers_rate() -> None:
    gain, restore = 400, 400 * TOK  # 2 s to compute, 9.2 MB to restore
    fast = MeasuredRates(import_bytes_per_s=4e9)
    slow = MeasuredRates(import_bytes_per_s=5e6)  # 1.8 s to restore
    assert worth_waiting(gain, 1.0, restore, 0, fast, M)
    assert not worth_waiting(gain, 1.0, restore, 0, slow, M)
