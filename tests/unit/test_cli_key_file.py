"""`--kvctl-key-file` (serve, up): the key read from a file, as llama-server reads its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from proxy.cli.options import kvctl_key_file_option, kvctl_key_option, take_kvctl_key_file

pytestmark = pytest.mark.unit


@click.command()
@kvctl_key_option
@kvctl_key_file_option
def _show(**kw: Any) -> None:
    take_kvctl_key_file(kw)
    click.echo(f"key=[{kw['kvctl_key']}]")


def _run(args: list[str], env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(_show, args, env=env or {})


def test_first_line_trailing_whitespace_stripped(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("s3cret \r\nsecond line\n")
    result = _run(["--kvctl-key-file", str(key)])
    assert result.exit_code == 0, result.output
    assert result.output == "key=[s3cret]\n"


def test_from_the_environment(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("from-env")
    result = _run([], env={"RADIX_KVCTL_KEY_FILE": str(key)})
    assert result.output == "key=[from-env]\n"


def test_no_file_keeps_the_plain_option() -> None:
    assert _run(["--kvctl-key", "plain"]).output == "key=[plain]\n"
    assert _run([]).output == "key=[None]\n"


@pytest.mark.parametrize("content", ["", "\n", "   \nkey on line two\n"])
def test_empty_key_refused(tmp_path: Path, content: str) -> None:
    key = tmp_path / "key"
    key.write_text(content)
    result = _run(["--kvctl-key-file", str(key)])
    assert result.exit_code == 2
    assert "holds an empty key" in result.output


def test_missing_file_and_both_given_refused(tmp_path: Path) -> None:
    result = _run(["--kvctl-key-file", str(tmp_path / "absent")])
    assert result.exit_code == 2 and "cannot read" in result.output
    key = tmp_path / "key"
    key.write_text("k")
    result = _run(["--kvctl-key", "x", "--kvctl-key-file", str(key)])
    assert result.exit_code == 2 and "not both" in result.output


def test_doctor_reads_both_key_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # doctor talks to the server as the proxy will: the same keys, from the same files.
    from proxy.cli import doctor as cli_doctor
    from proxy.cli.main import main

    seen: list[tuple[str | None, str | None]] = []

    async def fake_check(
        url: str, kvctl_key: str | None, shm_dir: Any, cache: Any, api_key: str | None = None
    ) -> list[Any]:
        seen.append((kvctl_key, api_key))
        return [cli_doctor.Check("reachable", "ok", url)]

    monkeypatch.setattr(cli_doctor, "check_server", fake_check)
    kvctl, api = tmp_path / "kvctl", tmp_path / "api"
    kvctl.write_text("kv-secret\n")
    api.write_text("api-secret\n")
    args = ["doctor", "--backend-url", "http://127.0.0.1:1", "--kvctl-key-file", str(kvctl)]
    result = CliRunner().invoke(main, [*args, "--server-api-key-file", str(api)], env={})
    assert result.exit_code == 0, result.output
    assert seen == [("kv-secret", "api-secret")]
    result = CliRunner().invoke(main, [*args, "--kvctl-key", "x"], env={})
    assert result.exit_code == 2 and "not both" in result.output
