"""--server-cpus: the CPU lists `radixctl bench` reads (taskset -c's form)."""

from __future__ import annotations

import click
import pytest

from proxy.bench.cli_options import parse_cpus


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", (0,)), ("1,0", (0, 1)), ("0-3", (0, 1, 2, 3)), ("0-1,4", (0, 1, 4)), ("2,2", (2,))],
)
def test_a_cpu_list_reads_as_taskset_reads_it(
    text: str, cpus: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert parse_cpus(text) == cpus


@pytest.mark.parametrize(
    "text", ["", ",", "a", "1-", "-1", "0-x", "3-1", "1_0", "+1", "\u0663", "8", "0-1000000000000"]
)
def test_anything_else_is_a_usage_error(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python's int() reads 1_0, +1 and other scripts' digits, taskset does not; a CPU past the
    machine's is refused before any range is built."""
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    with pytest.raises(click.BadParameter):
        parse_cpus(text)
