"""The server model: how long prefill, decode and KV moves take (calibrated, docs/scale.md).

Every figure is a default measured on this project's CPU machine with the default model
(SmolLM2-135M-Instruct Q4_1, 2 threads); `radixctl sim run` can override each one.
"""

from __future__ import annotations

from dataclasses import dataclass

# f16 KV of the default model: 30 layers x 2 (K, V) x 3 heads x 64 x 2 bytes.
REAL_BYTES_PER_TOKEN = 23_040


@dataclass(frozen=True)
class Calibration:
    """Seconds for each thing a server does. Prefill of tokens [c, n) costs
    ``(n - c) / prefill_tok_s * (1 + (n + c) / 2 / prefill_ctx_tokens)``: a rate that falls
    as the context grows (attention reads the whole context)."""

    # Two cold prefills measured on a quiet machine (docs/scale.md, Calibration): 1,533
    # tokens in 7.1 s and 2,000 in 9.5 s; the per-token time grows with the mean context.
    prefill_tok_s: float = 236.0
    prefill_ctx_tokens: float = 8_260.0
    # Not in the measured reports: an assumption (decode occupies a slot, not the engine, in
    # this model; docs/scale.md shows the figures with half and double this rate).
    decode_tok_s: float = 30.0  # per slot, slots decoding together (batched)
    # docs/design.md: the payload path runs at ~400 MB/s and a host restore of 2,400 tokens
    # (55 MB) costs ~0.2 s: 0.14 s of bytes plus ~0.06 s per move.
    move_mb_s: float = 400.0
    move_call_s: float = 0.060
    attach_s: float = 0.005  # route S: one /kvctl call, cell ownership only, no copy (assumed)
    request_overhead_s: float = 0.0033  # proxy on a miss (docs/results/overhead: 3.3 ms)
    bytes_per_token: int = REAL_BYTES_PER_TOKEN

    def __post_init__(self) -> None:
        for name in ("prefill_tok_s", "prefill_ctx_tokens", "decode_tok_s", "move_mb_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")

    def prefill_s(self, cached: int, n: int) -> float:
        """Compute tokens [cached, n) on top of a cached prefix."""
        if n <= cached:
            return 0.0
        mean_ctx = (n + cached) / 2
        return (n - cached) / self.prefill_tok_s * (1 + mean_ctx / self.prefill_ctx_tokens)

    def decode_s(self, n_tokens: int) -> float:
        return n_tokens / self.decode_tok_s

    def move_s(self, n_tokens: int) -> float:
        """One export or import of ``n_tokens`` of KV."""
        if n_tokens <= 0:
            return 0.0
        return self.move_call_s + n_tokens * self.bytes_per_token / (self.move_mb_s * 1e6)
