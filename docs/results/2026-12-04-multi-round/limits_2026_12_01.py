"""The minimum prefill of the 2026-12-01 default-size runs (docs/results/2026-12-01-defaults/),
which predate the limit in the reports, against what each arm prefilled there.

Each workload is generated again from its report's parameters and tokenized by a stock
llama-server (the same commit and model), the same way `radixctl bench` does now
(proxy/bench/limit.py). That the generators still make the same requests is checked: the
prompt tokens must equal Legacy's cache_n + prompt_n of the old run. The old runs kept no
per-request results, so there is no oracle time for them.

    .venv/bin/python docs/results/2026-12-04-multi-round/limits_2026_12_01.py > limits_2026_12_01.txt
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

from proxy.bench.arms import ArmSettings, start_arm
from proxy.bench.limit import prompt_token_lists, workload_limit
from proxy.bench.workloads import make_workload
from proxy.native.modelref import resolve_model

ROOT = Path(__file__).resolve().parents[1] / "2026-12-01-defaults"
WORKLOADS = ("agents", "prefix-tiers", "restore", "fanout", "host-dedup", "overhead")


def main() -> int:
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        settings = ArmSettings(model=resolve_model(None), log_dir=Path(tmp), n_parallel=1, ctx_size=4096, threads=1)
        with start_arm("legacy", settings) as arm:
            for name in WORKLOADS:
                report = json.loads((ROOT / name / "report.json").read_text())
                wl = make_workload(name, **report["workload"]["params"])
                prompts = asyncio.run(prompt_token_lists(arm.server_url, wl.requests))
                limit = workload_limit([r.id for r in wl.requests], [r.group for r in wl.requests], prompts)
                legacy = report["arms"]["legacy"]
                same = limit["prompt_tokens"] == legacy["cache_n"] + legacy["prompt_n"]
                arms = {a: v["prompt_n"] for a, v in report["arms"].items()}
                mins = limit["min_prefill_tokens"]
                print(
                    f"{name}: {len(wl.requests)} requests, prompts {limit['prompt_tokens']} tokens "
                    f"({'same as' if same else 'NOT the same as'} the old run's), min prefill {mins}; prefilled "
                    + ", ".join(f"{a} {n} ({n / mins:.2f}x)" for a, n in arms.items())
                )
                out[name] = {
                    "prompt_tokens": limit["prompt_tokens"],
                    "same_requests": same,
                    "min_prefill_tokens": mins,
                    "prefilled": arms,
                    "min_prefill_by_group": limit["min_prefill_by_group"],
                }
    (Path(__file__).parent / "limits_2026_12_01.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
