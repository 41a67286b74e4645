"""The markdown pieces every bench report is written with: numbers as text, and tables."""

from __future__ import annotations


def fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def fmt_x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def fmt_n(v: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def fmt_mib(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**20:.1f} MiB"


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *["| " + " | ".join(row) + " |" for row in rows],
    ]
