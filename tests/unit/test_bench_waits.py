"""Queue and lock waits per route: the proxy's ``X-Radix-Waits-Ms`` header, the runner's reading
of it, and the ``waits`` field of the bench report (report.json and report.md), next to the
fields it had."""

from __future__ import annotations

import pytest

from proxy.bench.report import build_report, render_markdown
from proxy.bench.waits import route_waits
from proxy.server.http.forward import radix_headers, wait_header
from proxy.traffic.runner import RequestResult, add_prefix_step, parse_waits
from tests.unit.test_coordinator import coordinator, server, toks

pytestmark = pytest.mark.unit


def _result(rid: str, route: str | None, waits: str | None) -> RequestResult:
    r = RequestResult(rid, "s", "g", "front", 0.0, 200, 1.0, 2.0, None, 0, 100, 16, 500.0, route)
    r.waits_ms = parse_waits(waits)
    return r


async def test_the_answer_header_says_where_the_time_before_the_forward_went() -> None:
    coord = coordinator(server("s0", n_slots=1))
    lease = await coord.acquire("r", toks(0, 40))
    lease.queued_s, lease.prefix_wait_s, lease.lock_wait_s, lease.restore_s = 1.2344, 0.0, 0.0406, 0.0504
    assert wait_header(lease) == "queued=1234,prefix=0,lock=41,restore=50"
    assert radix_headers(lease, True)["X-Radix-Waits-Ms"] == wait_header(lease)
    assert "X-Radix-Waits-Ms" not in radix_headers(lease, False)  # --cache-info off: nothing
    coord.release(lease)


def test_the_runner_reads_the_header() -> None:
    assert parse_waits("queued=12,prefix=0,lock=3,restore=40") == {
        "queued": 12.0,
        "prefix": 0.0,
        "lock": 3.0,
        "restore": 40.0,
    }
    assert parse_waits(None) is None and parse_waits("") is None and parse_waits("queued=x") is None
    r = _result("a", "H", "queued=1,prefix=2,lock=3,restore=4")
    assert RequestResult.from_json(r.to_json()) == r
    old = r.to_json()
    del old["waits_ms"]  # results written before the field existed still load
    assert RequestResult.from_json(old).waits_ms is None


def test_the_report_gives_waits_per_route_and_keeps_its_fields() -> None:
    proxy = [
        _result("a", "H", "queued=0,prefix=100,lock=10,restore=50"),
        _result("b", "H", "queued=0,prefix=300,lock=30,restore=70"),
        _result("c", "prefill", "queued=4000,prefix=0,lock=0,restore=1"),
    ]
    legacy = [_result(x, None, None) for x in "abc"]
    waits = route_waits(proxy)
    assert set(waits) == {"H", "prefill"} and waits["H"]["n"] == 2
    assert waits["H"]["lock_ms"] == {"mean": 20.0, "p50": 20.0, "p90": 28.0, "max": 30.0}
    assert waits["prefill"]["queued_ms"]["max"] == 4000.0
    report = build_report({"name": "fanout"}, {"legacy": {"results": legacy}, "proxy": {"results": proxy}})
    assert report["arms"]["proxy"]["waits"] == waits and "waits" not in report["arms"]["legacy"]
    for key in ("ttft_p50_s", "routes", "groups", "ttft_p50_vs_legacy"):
        assert key in report["arms"]["proxy"]
    md = render_markdown(report)
    assert "| proxy | H | 2 | 0 / 0 / 0 | 200 / 280 / 300 | 20 / 28 / 30 | 60 / 68 / 70 |" in md
    assert "| proxy | prefill | 1 | 4000 / 4000 / 4000 |" in md


async def test_a_prefix_step_is_counted_in_the_heads_prompt_tokens() -> None:
    """What the server computed for a wave's head before its answer (X-Radix-Prefix-Step) is
    part of its prefill: the runner adds it to prompt_n and prompt_ms, so the limit's
    prefilled count cannot flatter the proxy."""
    coord = coordinator(server("s0", n_slots=1))
    lease = await coord.acquire("h", toks(0, 700), n_predict=8)
    assert "X-Radix-Prefix-Step" not in radix_headers(lease, show=True)
    lease.split_to, lease.prefix_step_tokens, lease.prefix_step_ms = 600, 600, 2000.4
    header = radix_headers(lease, show=True)["X-Radix-Prefix-Step"]
    assert header == "tokens=600,ms=2000"
    r = _result("h", "A", None)
    r.cache_n = 650  # the server counts the step's 600 tokens as reused by the answer
    add_prefix_step(r, parse_waits(header))
    assert (r.prompt_n, r.prompt_ms, r.prefix_step_n, r.cache_n) == (700, 2500.0, 600, 50)
    plain = _result("p", "H", None)
    add_prefix_step(plain, None)
    assert (plain.prompt_n, plain.prefix_step_n) == (100, None)
    coord.release(lease)
