"""``radixctl workbench serve | verify | incident``.

LangGraph is imported only inside the commands, so ``radixctl`` works without the
``workbench`` extra and says which extra to install when a command needs it.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from proxy.workbench.launch import IncidentProcess, free_port, missing_extra

PROTOCOLS = click.Choice(["auto", "openai", "text"])


def _need_extra() -> None:
    why = missing_extra()
    if why is not None:
        click.echo(f"radixctl workbench: error: {why}", err=True)
        sys.exit(2)


@click.group()
def workbench() -> None:
    """The agent workbench: three local assistants (LangGraph) that use the proxy like any app."""


def _settings(model: str, max_steps: int, max_tokens: int, protocol: str) -> Any:
    from proxy.workbench.protocol import AgentSettings

    return AgentSettings(model=model, max_steps=max_steps, max_tokens=max_tokens, protocol=protocol)  # type: ignore[arg-type]


@workbench.command()
@click.option(
    "--llm-base-url",
    envvar="LLM_BASE_URL",
    default="http://127.0.0.1:8080/v1",
    show_default=True,
    help="The proxy's OpenAI base URL.",
)
@click.option(
    "--llm-model", envvar="LLM_MODEL", default="", help="Model name sent in requests (default: the server's)."
)
@click.option(
    "--llm-api-key", envvar="LLM_API_KEY", default="", help="Bearer key for the OpenAI URL, if it needs one."
)
@click.option("--host", envvar="WORKBENCH_HOST", default="127.0.0.1", show_default=True)
@click.option("--port", envvar="WORKBENCH_PORT", default=8090, show_default=True)
@click.option(
    "--db",
    "db_path",
    envvar="WORKBENCH_DB",
    default="workbench.sqlite3",
    show_default=True,
    help="SQLite file of the sessions.",
)
@click.option(
    "--incident-url",
    envvar="WORKBENCH_INCIDENT_URL",
    default="",
    help="A running incident service (default: start one).",
)
@click.option(
    "--incident-port",
    envvar="WORKBENCH_INCIDENT_PORT",
    default=0,
    help="Port of the started incident service (0: free).",
)
@click.option(
    "--max-steps",
    default=4,
    show_default=True,
    help="Model calls per turn (the last one answers without tools).",
)
@click.option("--max-tokens", default=256, show_default=True)
@click.option("--tool-protocol", type=PROTOCOLS, default="auto", show_default=True)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    envvar="WORKBENCH_ALLOWED_HOSTS",
    help="A Host name the page is served for besides loopback names (repeatable; env: space-separated).",
)
def serve(
    llm_base_url: str,
    llm_model: str,
    llm_api_key: str,
    host: str,
    port: int,
    db_path: str,
    incident_url: str,
    incident_port: int,
    max_steps: int,
    max_tokens: int,
    tool_protocol: str,
    allowed_hosts: tuple[str, ...],
) -> None:
    """Serve the workbench page against a running proxy."""
    _need_extra()
    from aiohttp import web

    from proxy.workbench.app import WorkbenchConfig, build_workbench_app

    incident = None if incident_url else IncidentProcess(host="127.0.0.1", port=incident_port).start()
    try:
        config = WorkbenchConfig(
            llm_base_url,
            incident_url or (incident.url if incident else ""),
            db_path,
            llm_api_key,
            _settings(llm_model, max_steps, max_tokens, tool_protocol),
            allowed_hosts=allowed_hosts,
        )
        click.echo(
            f"[workbench] http://{host}:{port}/ against {llm_base_url}; incident service {config.incident_url}"
        )
        web.run_app(build_workbench_app(config), host=host, port=port, print=None)
    finally:
        if incident is not None:
            incident.stop()


async def _verify(base_url: str, workbench_url: str, settings: Any) -> bool:
    from aiohttp import web

    from proxy.workbench.app import WorkbenchConfig, build_workbench_app
    from proxy.workbench.verify import VerifyError, verify_scenarios

    runner = None
    with tempfile.TemporaryDirectory(prefix="workbench-verify-") as tmp, IncidentProcess() as incident:
        if not workbench_url:
            config = WorkbenchConfig(
                base_url, incident.url, str(Path(tmp) / "sessions.sqlite3"), settings=settings
            )
            runner = web.AppRunner(build_workbench_app(config))
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            workbench_url = f"http://127.0.0.1:{port}"
        try:
            outcomes = await verify_scenarios(base_url, workbench_url.rstrip("/"), click.echo)
        except VerifyError as exc:
            click.echo(f"verify: FAILED: {exc}")
            return False
        finally:
            if runner is not None:
                await runner.cleanup()
    failed = [o.scenario for o in outcomes if not o.ok]
    if failed:
        click.echo(f"verify: FAILED: {len(failed)} of {len(outcomes)} scenarios ({', '.join(failed)})")
        return False
    click.echo(f"verify: ok: all {len(outcomes)} scenarios passed")
    return True


@workbench.command()
@click.option(
    "--base-url", required=True, envvar="LLM_BASE_URL", help="The proxy's OpenAI base URL, ending in /v1."
)
@click.option(
    "--workbench-url", default="", help="A running workbench (default: start one here for the check)."
)
@click.option("--llm-model", envvar="LLM_MODEL", default="")
@click.option("--max-steps", default=3, show_default=True)
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--tool-protocol", type=PROTOCOLS, default="auto", show_default=True)
def verify(
    base_url: str, workbench_url: str, llm_model: str, max_steps: int, max_tokens: int, tool_protocol: str
) -> None:
    """Check the proxy and the workbench, and run each assistant once with the real model."""
    _need_extra()
    if not base_url.rstrip("/").endswith("/v1"):
        click.echo(
            f"verify: FAILED: --base-url must be the proxy's OpenAI base ending in /v1 (got {base_url})"
        )
        sys.exit(2)
    settings = _settings(llm_model, max_steps, max_tokens, tool_protocol)
    if not asyncio.run(_verify(base_url, workbench_url, settings)):
        sys.exit(1)


@workbench.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8091, show_default=True)
def incident(host: str, port: int) -> None:
    """Run the simulated incident service alone (the workbench starts one by itself)."""
    from proxy.workbench.incident import main

    main(["--host", host, "--port", str(port)])
