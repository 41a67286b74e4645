"""radixctl doctor's checks against a fake llama-server, without a server."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import doctor as cli_doctor
from proxy.cli.doctor import Check, format_doctor
from proxy.core.payload import KvLayout
from proxy.errors import BackendError

COMPAT = {
    "n_layer": 2,
    "v_trans": False,
    "k_types": [1, 1],
    "v_types": [1, 1],
    "k_row_bytes": [8, 8],
    "v_row_bytes": [8, 8],
}


def caps(**over: Any) -> dict[str, Any]:
    base = {
        "format_version": 1,
        "compat": COMPAT,
        "compat_id": "749b",
        "sharing": True,
        "reasons": [],
        "owner_ids": [4, 12],
        "n_ctx_slot": 8192,
        "n_cells": 8192,
        "n_parallel": 4,
        "moves": True,
        "moves_off": [],
        "memory": {"kind": "kv"},
        "dir": None,
        "fault_injection": False,
    }
    return {**base, **over}


# ---- doctor --------------------------------------------------------------------------------------


def test_caps_checks_say_what_to_change(tmp_path: Path) -> None:
    def by_name(checks: list[Check]) -> dict[str, Check]:
        return {c.name: c for c in checks}

    good = by_name(cli_doctor._caps_checks(caps(dir=str(tmp_path)), tmp_path, KvLayout))
    assert all(c.status == "ok" for c in good.values()), good
    inline = by_name(cli_doctor._caps_checks(caps(), None, KvLayout))["payload dir"]
    assert inline.status == "warn" and "--kvctl-dir" in inline.fix and "--shm-dir" in inline.fix
    other = by_name(cli_doctor._caps_checks(caps(dir=str(tmp_path)), tmp_path / "x", KvLayout))["payload dir"]
    assert other.status == "warn" and f"--shm-dir {tmp_path}" in other.fix
    bad = by_name(
        cli_doctor._caps_checks(
            caps(
                format_version=2,
                compat={"n_layer": 1},
                sharing=False,
                reasons=["--kvctl-owners 0"],
                fault_injection=True,
                n_ctx_slot=512,
            ),
            None,
            KvLayout,
        )
    )
    assert bad["payload format"].status == "fail" and bad["KV layout"].status == "fail"
    assert bad["sharing"].status == "warn" and "--kvctl-owners 0" in bad["sharing"].detail
    assert bad["fault injection"].status == "warn" and bad["context"].status == "warn"


TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class FakeBackend:
    url = "http://fake"

    def __init__(self, caps_error: int | None = None, model: str = "/nonexistent.gguf") -> None:
        self.caps_error = caps_error
        self.model = model

    async def get_json(self, path: str) -> Any:
        assert path in ("/health", "/props")
        return (
            {"status": "ok"}
            if path == "/health"
            else {
                "build_info": "b0-0c1e570",
                "total_slots": 4,
                "model_path": self.model,
                "modalities": {"vision": False},
                "chat_template": TEMPLATE,
                "bos_token": "",
                "eos_token": "",
            }
        )

    async def kv_get(self, route: str, adopt: bool = False) -> Any:
        if route == "caps":
            if self.caps_error:
                raise BackendError("nope", backend_status=self.caps_error)
            return caps()
        return {"slots": [{}] * 4, "owners": []} if route == "slots" else {"used": 0, "n_cells": 8192}

    async def apply_template(self, body: Any, headers: Any) -> str:
        return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in body["messages"]) + (
            "<|im_start|>assistant\n"
        )

    async def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        return [ord(c) for c in text]


@pytest.mark.parametrize(("status", "fix"), [(404, "--kvctl"), (401, "--kvctl-key")])
def test_doctor_names_the_fix_for_a_server_without_kvctl(status: int, fix: str, tmp_path: Path) -> None:
    checks = asyncio.run(cli_doctor._doctor(FakeBackend(status), None, None, tmp_path))
    (kvctl,) = [c for c in checks if c.name == "kvctl"]
    assert kvctl.status == "fail" and fix in kvctl.fix and str(status) in kvctl.detail
    tokenizer = checks[-1]
    assert (
        tokenizer.name == "tokenizer"
        and tokenizer.status == "warn"
        and "not readable here" in tokenizer.detail
    )
    out = format_doctor("http://fake", checks)
    assert "FAIL  kvctl" in out and "result: 1 problem(s), 1 warning(s)" in out


def test_doctor_on_a_patched_server(tmp_path: Path) -> None:
    checks = asyncio.run(cli_doctor._doctor(FakeBackend(), None, None, tmp_path))
    assert [c.name for c in checks if c.status == "fail"] == []
    assert {"kvctl", "KV layout", "sharing", "/kvctl/slots", "/kvctl/cells", "chat template"} <= {
        c.name for c in checks
    }
    (parity,) = [c for c in checks if c.name == "chat template parity"]
    assert parity.status == "ok" and "rendered in the proxy" in parity.detail


def test_doctor_tokenizer_check_uses_the_startup_probe(tmp_path: Path) -> None:
    """A readable file that is no GGUF: the same probe as at startup, told as a warning with the cause."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"not a gguf")
    checks = asyncio.run(cli_doctor._doctor(FakeBackend(model=str(model)), None, None, tmp_path / "cache"))
    tokenizer = checks[-1]
    assert tokenizer.name == "tokenizer" and tokenizer.status == "warn"
    assert (
        tokenizer.detail.startswith("no local tokenizer for this model (") and "/tokenize" in tokenizer.detail
    )


def test_doctor_fails_a_caps_reply_the_proxy_cannot_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = caps()
    del broken["n_parallel"]

    async def kv_get(self: FakeBackend, route: str, adopt: bool = False) -> Any:
        return broken if route == "caps" else {"slots": [], "owners": []}

    monkeypatch.setattr(FakeBackend, "kv_get", kv_get)
    checks = asyncio.run(cli_doctor._doctor(FakeBackend(), None, None, tmp_path))
    (reply,) = [c for c in checks if c.name == "kvctl reply"]
    assert reply.status == "fail" and "'n_parallel' is missing" in reply.detail
