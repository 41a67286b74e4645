"""What a benchmark workload is: requests with their dependencies, and how many run at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BenchRequest:
    id: str
    session: str
    group: str  # what the report breaks figures down by
    body: dict[str, Any]  # the body for ``path`` (the runner adds "stream")
    after: tuple[str, ...] = ()
    delay_s: float = 0.0
    via: str = "front"  # "front": the arm's OpenAI URL; "server": its llama-server directly
    meta: dict[str, Any] = field(default_factory=dict)
    path: str = "/v1/chat/completions"  # the API: /v1/messages takes an Anthropic body


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    requests: tuple[BenchRequest, ...]
    concurrency: int
    params: dict[str, Any]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for req in self.requests:
            if req.id in seen:
                raise ValueError(f"{self.name}: duplicate request id {req.id}")
            missing = [d for d in req.after if d not in seen]
            if missing:
                raise ValueError(f"{self.name}: {req.id} waits for {missing}, which do not come before it")
            if req.via not in ("front", "server"):
                raise ValueError(f"{self.name}: {req.id}: via must be 'front' or 'server'")
            seen.add(req.id)
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
