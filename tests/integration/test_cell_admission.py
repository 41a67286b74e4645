"""KV-cell admission on a real patched server: a wave of requests sharing a prefix, sent at
once to a pool too small to hold them all, is served in full; none runs the pool out of
cells ("Context size has been exceeded"), with resident sharing or without."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest

from proxy.config import Config
from proxy.native.launch import free_port
from tests.helpers import ProxyThread, Reply, ServerFactory, chat_body, post
from tests.integration.test_proxy import document

POOL = 1024  # cells: two of the wave's requests at once, not four
ANSWER = 16


def wave(seed: int, n: int = 4) -> list[list[dict[str, str]]]:
    """``n`` conversations of about 420 tokens whose first half (the system prompt) is common."""
    common = document(seed, n_words=150)
    return [
        [
            {"role": "system", "content": f"You are a careful analyst. Reference document:\n{common}"},
            {"role": "user", "content": f"{document(seed * 100 + i, n_words=150)}\nName one word."},
        ]
        for i in range(n)
    ]


def send_together(proxy: ProxyThread, conversations: list[list[dict[str, str]]]) -> list[Reply]:
    body = lambda m: chat_body(m, ANSWER, ignore_eos=True)  # noqa: E731
    with concurrent.futures.ThreadPoolExecutor(len(conversations)) as pool:
        return list(pool.map(lambda m: post(f"{proxy.url}/v1/chat/completions", body(m)), conversations))


@pytest.mark.parametrize("kv_share", [False, True], ids=["proxy", "proxy-hs"])
def test_a_wave_larger_than_the_pool_is_served_without_running_out_of_cells(
    start_server: ServerFactory, patched_bin: Path, kv_share: bool
) -> None:
    backend = start_server(patched_bin, ctx_size=POOL, n_parallel=4)
    assert backend.spec.kvctl_dir is not None
    config = Config(
        backends=(backend.url,),
        port=free_port(),
        shm_dir=backend.spec.kvctl_dir,
        kvctl_key=backend.spec.kvctl_key,
        min_restore_tokens=32,
        cache_ram_mib=64,
        kv_share=kv_share,
        # Requests wait for room one after another: on a loaded test machine that takes longer
        # than the default deadline (a 503 past it is covered by the unit tests).
        queue_timeout_s=900,
        fanout_wait_s=900,
    )
    proxy = ProxyThread(config).start()
    try:
        n_cells = proxy.call(lambda rt: rt.coordinator.servers[0].n_cells)
        assert n_cells == POOL
        for round_ in range(2):  # the second wave finds the pool full of the first one's caches
            replies = send_together(proxy, wave(60 + 10 * round_ + int(kv_share)))
            for reply in replies:
                assert reply.status == 200, reply.body  # not "Context size has been exceeded"
                assert reply.body["usage"]["completion_tokens"] == ANSWER
            proxy.settle()
            prompts = [r.body["usage"]["prompt_tokens"] for r in replies]
            assert sum(prompts) + 4 * ANSWER > POOL  # the wave does not fit at once

        def books(rt: object) -> tuple[int, int, int]:
            from proxy.server.ops.runtime import Runtime

            assert isinstance(rt, Runtime)
            rt.coordinator.leases.check_invariants()
            server = rt.coordinator.servers[0]
            no_room = int(rt.metrics.rejected.labels("no_room")._value.get())
            return server.reserved_cells, server.admitted_cells, no_room

        assert proxy.call(books) == (0, 0, 0)
        # The server never found its pool full: admission let no more in than it holds (a
        # lucky retry of a request the server refused would not show in the replies).
        log = backend.log_path.read_text(errors="replace")
        assert "failed to find free space" not in log
        assert "context size has been exceeded" not in log.lower()
    finally:
        proxy.stop()
