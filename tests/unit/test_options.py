"""The CLI's options against the one Config: every proxy option lands on its Config field with
that field's default, the Config fields no option sets are named here, and an option spelled
the same in two commands reads the same RADIX_* variable. The README's options table is
checked against the same options in tests/unit/test_docs_drift.py."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import click
import pytest

from proxy.cli.main import main
from proxy.cli.options import PROXY_OPTIONS, take_kvctl_key_file
from proxy.cli.serve import serve, up
from proxy.config import Config

pytestmark = pytest.mark.unit

# Config fields that no option sets: fixed settings (tests and the bench replace them), or set
# by the command itself (backends: serve's --backend-url; tokenizer_cache: under the cache root).
NOT_OPTIONS = {
    "backends",
    "tokenizer_cache",
    "cache_disk_queue_mib",
    "cache_disk_timeout_s",
    "cache_remote_queue_mib",
    "cache_remote_backoff_s",
    "cache_remote_ttl_s",
    "cache_remote_prefix",
    "summary_interval_s",
    "fanout_wait_s",
    "finish_timeout_s",
    "startup_timeout_s",
    "health_interval_s",
    "health_timeout_s",
    "stream_buffer_bytes",
}
# Options of `up` that start its llama-server rather than configure the proxy.
UP_SERVER_OPTIONS = {
    "model_arg",
    "server_port",
    "n_parallel",
    "ctx_size",
    "threads",
    "build_backend",
    "server_args",
}


@pytest.fixture(autouse=True)
def _no_radix_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("RADIX_")]:
        monkeypatch.delenv(name)


def parsed(command: click.Command, args: list[str]) -> dict[str, Any]:
    """The command's keyword arguments for ``args``, callbacks applied, the key files read."""
    params = dict(command.make_context(command.name, args).params)
    take_kvctl_key_file(params)
    return params


def test_serve_with_no_options_is_the_default_config() -> None:
    params = parsed(serve, ["--backend-url", "http://127.0.0.1:1"])
    backends = params.pop("backends")
    unknown = sorted(set(params) - {f.name for f in dataclasses.fields(Config)})
    assert not unknown, f"options that are not Config fields: {unknown}"
    differ = {k: (v, getattr(Config, k)) for k, v in params.items() if v != getattr(Config, k)}
    assert not differ, f"option default != Config default (option, Config): {differ}"
    assert Config(backends=backends, **params) == Config(backends=backends)


def test_up_takes_the_same_proxy_options() -> None:
    params = parsed(up, [])
    proxy = {k: v for k, v in params.items() if k not in UP_SERVER_OPTIONS}
    serve_params = parsed(serve, ["--backend-url", "http://127.0.0.1:1"])
    serve_params.pop("backends")
    assert proxy == serve_params


def test_every_config_field_is_an_option_or_named_as_not_one() -> None:
    dests = set(parsed(serve, ["--backend-url", "http://127.0.0.1:1"])) - {"backends"}
    fields = {f.name for f in dataclasses.fields(Config)}
    assert fields - dests == NOT_OPTIONS, (
        "a Config field is neither an option nor in NOT_OPTIONS (or is both): "
        f"{sorted((fields - dests) ^ NOT_OPTIONS)}"
    )


def test_a_sized_option_converts_to_the_field_unit() -> None:
    params = parsed(serve, ["--backend-url", "http://x:1", "--max-answer", "2", "--max-grammar", "3"])
    assert params["max_answer_bytes"] == 2 << 20 and params["max_grammar_bytes"] == 3 << 10


def test_proxy_options_read_radix_and_their_flag() -> None:
    @click.command()
    def probe() -> None: ...

    for option in PROXY_OPTIONS:
        option(probe)
    for param in probe.params:
        assert isinstance(param, click.Option)
        flag = param.opts[0]
        assert param.envvar == "RADIX_" + flag[2:].upper().replace("-", "_"), flag


def _options(command: click.Command, path: str) -> list[tuple[str, str, click.Option]]:
    out = []
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            out += _options(sub, f"{path} {name}")
    for param in command.params:
        if isinstance(param, click.Option):
            out += [(opt, path, param) for opt in param.opts if opt.startswith("--")]
    return out


def test_an_option_spelled_alike_reads_one_variable() -> None:
    # The workbench is an app of its own over the proxy's HTTP API, with WORKBENCH_* variables.
    seen: dict[str, set[str]] = {}
    for flag, path, option in _options(main, "radixctl"):
        if isinstance(option.envvar, str) and not path.startswith("radixctl workbench"):
            seen.setdefault(flag, set()).add(option.envvar)
    several = {flag: names for flag, names in seen.items() if len(names) > 1}
    assert not several, several


def test_doctor_has_every_key_option_of_serve() -> None:
    from proxy.cli.doctor import doctor

    keys = {"--kvctl-key", "--kvctl-key-file", "--server-api-key", "--server-api-key-file"}
    serve_keys = {
        p.opts[0]: p.envvar for p in serve.params if isinstance(p, click.Option) and p.opts[0] in keys
    }
    doctor_keys = {
        p.opts[0]: p.envvar for p in doctor.params if isinstance(p, click.Option) and p.opts[0] in keys
    }
    assert doctor_keys == serve_keys and len(serve_keys) == 4


def test_compose_reads_the_build_backend_under_radixctl_s_variable() -> None:
    # compose's build backend was RADIX_BACKEND, one letter from the proxy's RADIX_BACKENDS.
    from pathlib import Path

    from proxy.cli.build import build

    (envvar,) = {p.envvar for p in [*build.params, *up.params] if p.name in ("backend", "build_backend")}
    deploy = Path(__file__).resolve().parents[2] / "deploy"
    compose = (deploy / "docker-compose.yml").read_text()
    assert f"BACKEND: ${{{envvar}:-cpu}}" in compose and f"llama-server:${{{envvar}:-cpu}}" in compose
    assert f"\n{envvar}=cpu\n" in (deploy / ".env.example").read_text()
    for path in [*deploy.rglob("*.yml"), deploy / ".env.example", deploy / "Dockerfile"]:
        assert "RADIX_BACKEND}" not in path.read_text() and "RADIX_BACKEND=" not in path.read_text(), path


@pytest.mark.parametrize("flag", ["--parallel", "--ctx-size", "--build-backend", "--threads"])
def test_a_llama_server_option_is_one_definition(flag: str) -> None:
    # up, the bench arms and bench soak start llama-server with the same options; --threads
    # alone has a default (and so a help text) per command.
    uses = [(path, o) for f, path, o in _options(main, "radixctl") if f == flag]
    assert len(uses) >= 3 and any(path == "radixctl up" for path, _ in uses)
    shapes = {(o.opts[-1], o.name, str(o.type)) for _, o in uses}
    assert len(shapes) == 1, shapes
    if flag != "--threads":
        assert len({(o.help, o.default) for _, o in uses}) == 1, uses
