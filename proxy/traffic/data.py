"""Deterministic fictional data shared by the workbench's scenarios and ``radixctl bench agents``.

No network, no real company or hardware: every figure comes from ``seeded`` generators
(SHA-512 of a string, so the same seed gives the same data on every machine and run). The
functions keep the order of their random draws, so the benchmark's requests do not change
when the workbench asks for more periods or devices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from proxy.traffic.text import prose, seeded

# ---- financial research -------------------------------------------------------------------

COMPANIES = ("Altamira Foods", "Borealis Grid", "Cobalt Harbor Logistics", "Dunmore Textiles")
Financials = dict[str, dict[int, dict[str, float]]]


def financials(seed: object, years: tuple[int, ...]) -> Financials:
    """Reported figures (millions) of each fictional company for each fiscal year."""
    out: Financials = {}
    for name in COMPANIES:
        rng = seeded(seed, "fin", name)
        revenue = rng.uniform(200, 2000)
        by_year = {}
        for year in years:
            revenue *= rng.uniform(0.92, 1.15)
            cogs = revenue * rng.uniform(0.45, 0.7)
            opex = revenue * rng.uniform(0.12, 0.24)
            equity = revenue * rng.uniform(0.3, 0.8)
            by_year[year] = {
                k: round(v, 1)
                for k, v in {
                    "revenue": revenue,
                    "cost_of_goods_sold": cogs,
                    "operating_expenses": opex,
                    "net_income": (revenue - cogs - opex) * 0.75,
                    "current_assets": revenue * rng.uniform(0.2, 0.5),
                    "current_liabilities": revenue * rng.uniform(0.15, 0.4),
                    "total_liabilities": equity * rng.uniform(0.4, 2.2),
                    "equity": equity,
                }.items()
            }
        out[name] = by_year
    return out


RATIOS: dict[str, tuple[str, Callable[[dict[str, float]], float]]] = {
    "current_ratio": (
        "current assets / current liabilities",
        lambda f: f["current_assets"] / f["current_liabilities"],
    ),
    "debt_to_equity": ("total liabilities / equity", lambda f: f["total_liabilities"] / f["equity"]),
    "gross_margin": (
        "(revenue - cost of goods sold) / revenue",
        lambda f: (f["revenue"] - f["cost_of_goods_sold"]) / f["revenue"],
    ),
    "return_on_equity": ("net income / equity", lambda f: f["net_income"] / f["equity"]),
}


def ratio(data: Financials, company: str, name: str, year: int) -> dict[str, Any]:
    formula, fn = RATIOS[name]
    return {
        "company": company,
        "ratio": name,
        "year": year,
        "formula": formula,
        "value": round(fn(data[company][year]), 3),
    }


# ---- field maintenance --------------------------------------------------------------------

DEVICE_MODELS = {"Hydra-300 pump": "PMP", "Vortex-22 compressor": "CMP", "Kestrel-9 fan": "FAN"}
ERROR_CODES = {
    "E101": "bearing temperature high",
    "E214": "vibration above limit",
    "E330": "outlet pressure low",
    "E417": "motor current imbalance",
    "E502": "seal leak detected",
}


def device_id(model: str, i: int) -> str:
    return f"{DEVICE_MODELS[model]}-{400 + 7 * i:04d}"


def readings(device: str, code: str, n: int, seed: object, drift: bool = True) -> list[dict[str, Any]]:
    """``n`` sensor readings of a device, drifting (unless ``drift`` is off) towards ``code``,
    which the last three report."""
    rng = seeded(seed, "log", device)
    rows, d = [], 1 if drift else 0
    for k in range(n):
        temp, vib, bar = (
            rng.uniform(55, 70) + 2 * k * d,
            rng.uniform(1.5, 3.0) + 0.3 * k * d,
            rng.uniform(3.5, 4.2) - 0.05 * k * d,
        )
        rows.append(
            {
                "time": f"2024-03-0{1 + k // 6} {k % 24:02d}:15",
                "temp_c": round(temp, 1),
                "vibration_mm_s": round(vib, 2),
                "pressure_bar": round(bar, 2),
                "status": code if k >= n - 3 else "OK",
            }
        )
    return rows


def device_log(device: str, code: str, n: int, seed: object, drift: bool = True) -> list[str]:
    return [
        f"{r['time']} {device} temp={r['temp_c']:.1f}C vib={r['vibration_mm_s']:.2f}mm/s "
        f"p={r['pressure_bar']:.2f}bar status={r['status']}"
        for r in readings(device, code, n, seed, drift)
    ]


def manual_section(model: str, code: str, seed: object) -> str:
    return f"{code} ({ERROR_CODES[code]}): {prose(seeded(seed, 'manual', model, code), 20)}"


# ---- edge incident ------------------------------------------------------------------------

SERVICES = ("checkout-api", "inventory-db", "edge-cache", "auth-gateway", "payments-worker")


def service_status(service: str, seed: object) -> dict[str, Any]:
    """A degraded service's figures (the incident service scales them by its current state)."""
    rng = seeded(seed, "svc", service)
    minor = rng.randint(2, 9)
    return {
        "service": service,
        "health": "degraded",
        "version": f"1.{minor}.0",
        "previous_version": f"1.{minor - 1}.3",
        "replicas": rng.randint(2, 6),
        "p99_ms": round(rng.uniform(400, 2500)),
        "error_rate_pct": round(rng.uniform(2, 15), 1),
        "slo_error_rate_pct": 1.0,
    }


def error_logs(service: str, upstream: str, version: str, n: int, seed: object) -> list[str]:
    rng = seeded(seed, "errors", service)
    return [
        f"2024-05-1{k % 10}T10:{k:02d}:0{k % 10}Z ERROR {service} {rng.choice(['timeout', 'conn reset', '503'])} "
        f"upstream={upstream} v{version}"
        for k in range(n)
    ]
