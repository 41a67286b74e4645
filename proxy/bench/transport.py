"""``radixctl bench kvctl --transport both``: the same moves through shared-memory files and
inline over HTTP (msgpack binary, as to a server on another host), side by side in MB/s."""

from __future__ import annotations

from typing import Any


def transport_table(shared: dict[str, Any], inline: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """A markdown table and its rows: per size and direction, MB/s of each transport and their ratio."""
    rows: list[dict[str, Any]] = []
    by_size = {r["tokens"]: r for r in inline["sizes"]}
    for row in shared["sizes"]:
        other = by_size.get(row["tokens"])
        if other is None:
            continue
        for op in ("export", "import"):
            files, http = row[op]["mb_s"], other[op]["mb_s"]
            rows.append(
                {
                    "tokens": row["tokens"],
                    "mib": row["bytes"] / 2**20,
                    "op": op,
                    "shared_mb_s": files,
                    "inline_mb_s": http,
                    "inline_over_shared": http / files if files else None,
                }
            )
    lines = [
        "| tokens | MiB | move | shared files MB/s | inline HTTP MB/s | inline / shared |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        ratio = f"{r['inline_over_shared']:.2f}" if r["inline_over_shared"] is not None else "-"
        lines.append(
            f"| {r['tokens']} | {r['mib']:.1f} | {r['op']} | {r['shared_mb_s']:.0f} | "
            f"{r['inline_mb_s']:.0f} | {ratio} |"
        )
    return "\n".join(lines) + "\n", rows


async def warm_slot0(server_url: str, n_tokens: int) -> None:
    """Prefill slot 0 with the tokens the kvctl bench will use, without its 10 s HTTP limit: on a
    loaded machine the prefill alone can take longer; the bench then finds them in the slot."""
    import aiohttp

    from proxy.bench.kvbench import _tokens
    from proxy.server.dataplane.backend import ServerClient

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        backend = ServerClient(server_url, session)
        async with session.get(f"{server_url}/props") as resp:
            resp.raise_for_status()
            n_ctx_slot = int((await resp.json())["default_generation_settings"]["n_ctx"])
        # The bench moves at most what one slot holds (clamp_sizes): warm no more than that.
        tokens = await _tokens(backend, min(n_tokens, n_ctx_slot - 1))
        body = {"prompt": tokens, "n_predict": 1, "id_slot": 0, "cache_prompt": True, "temperature": 0}
        async with session.post(f"{server_url}/completion", json=body) as resp:
            resp.raise_for_status()
            await resp.read()
