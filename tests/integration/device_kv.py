"""The device KV-move tests, shared by the backends' modules (issue 26, docs/devices.md).

Each backend's module (test_vulkan.py, test_cuda.py) defines the fixture ``device`` (its
patched and stock builds and the device its servers must use) and takes the fixtures and tests
below into its own namespace, where pytest collects them. Every server started through this
module's ``start_server`` runs with every layer and the KV cache offloaded (-ngl 99) and must
say in its log that all layers were offloaded and that every KV buffer is on ``device.name``,
so no test can pass on host memory by accident; ``test_kv_lives_on_the_device`` also shows that
the check catches host KV (``--no-kv-offload``).

The tests are those of the CPU build: the /kvctl round trips of tests/integration/test_kvctl.py
(byte identity of the re-export, continuation bitwise identical to the KV left in place, stock
from scratch under the near-tie rule), and the routes A, A+H, H (disk tier after a restart), S
and S+H through the proxy from tests/integration/test_architectures.py, against the stock build
of the same backend computing from scratch.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proxy.native.launch import ServerProcess, ServerSpec, free_port
from tests.helpers import ServerFactory, request
from tests.integration import test_architectures as arch
from tests.integration import test_kvctl as kvctl_tests

# Every layer and the KV on the device; -lv 4: at the server's default verbosity (3) the
# library's info lines below (model load, KV cache) are not logged.
OFFLOAD = ("-ngl", "99", "-lv", "4")
WARM_UP = kvctl_tests.PROMPT
WARM_UP_TIMEOUT = 900
# "0.01.407.437 I llama_kv_cache:    Vulkan0 KV buffer size =     2.00 MiB" (one per buffer;
# CUDA0, CPU, ...).
KV_BUFFER = re.compile(r"^.*?llama_kv_cache:\s+(\S+) KV buffer size =\s*([\d.]+) MiB", re.M)
OFFLOADED = re.compile(r"load_tensors: offloaded (\d+)/(\d+) layers to GPU")
# "llama_prepare_model_devices: using device Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits)) (unknown id) - 2048 MiB free"
# "... using device CUDA0 (NVIDIA H200) (0000:00:05.0) - 142000 MiB free"
USING_DEVICE = re.compile(r"using device ([A-Za-z]+\d+) \((.*?)\) \(")
# `llama-server --list-devices`: "  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)"
LISTED = re.compile(r"^\s*([A-Za-z]+\d+): (.+?) \(\d+ MiB, \d+ MiB free\)", re.M)
# Families for the routes test (tiny models, tests/tinymodels.py): standard attention at head
# dim 128 and MLA's K-only cache. Not the default model: on lavapipe it decodes at about 4 s a
# token on 2 busy cores, and the test asks about 20 questions (docs/devices.md).
ROUTE_FAMILIES = ["llama-h128", "deepseek2"]


@dataclass(frozen=True)
class Device:
    patched: Path
    stock: Path
    name: str  # "Vulkan0", "CUDA0"
    description: str  # "llvmpipe (LLVM 15.0.6, 256 bits)", "NVIDIA H200"
    expect_in_description: str = ""  # e.g. "llvmpipe" where the tests chose lavapipe


def list_devices(binary: Path, prefix: str) -> list[tuple[str, str]]:
    """``llama-server --list-devices``: (name, description) of each device whose name starts
    with ``prefix``; skips the tests, saying why, when there is none."""
    listing = subprocess.run([str(binary), "--list-devices"], capture_output=True, text=True, timeout=120)
    text = listing.stdout + listing.stderr
    found = [(name, desc) for name, desc in LISTED.findall(text) if name.startswith(prefix)]
    if not found:
        pytest.skip(f"no {prefix} device: `llama-server --list-devices` lists none: {text.strip()[-300:]}")
    return found


def kv_buffers(server: ServerProcess) -> list[tuple[str, float]]:
    return [(name, float(mib)) for name, mib in KV_BUFFER.findall(server.run_log())]


def kv_on_device_problems(server: ServerProcess, device: str) -> list[str]:
    """What in the server's startup log says its KV or layers are not (all) on ``device``."""
    log = server.run_log()
    problems = []
    buffers = kv_buffers(server)
    if not buffers:
        problems.append("no 'KV buffer size' line in the log")
    problems += [f"a KV buffer of {mib} MiB on {name}" for name, mib in buffers if name != device]
    offloaded = OFFLOADED.findall(log)
    if not offloaded or offloaded[-1][0] != offloaded[-1][1]:
        problems.append(f"not every layer offloaded: {offloaded}")
    if device not in [d for d, _ in USING_DEVICE.findall(log)]:
        problems.append(f"the log does not say it uses {device}")
    return problems


def assert_kv_on_device(server: ServerProcess, device: str) -> None:
    problems = kv_on_device_problems(server, device)
    assert not problems, f"{server.url}: {'; '.join(problems)} (log {server.log_path})"


# --- the module's servers: the device builds, everything offloaded -----------------------------


@pytest.fixture(scope="module")
def start_server(start_server: ServerFactory, device: Device) -> ServerFactory:
    """The session factory with -ngl 99, each server checked to hold its KV on the device."""

    def start(binary: Path, **kw: Any) -> ServerProcess:
        kw["extra_args"] = (*OFFLOAD, *kw.get("extra_args", ()))
        server = start_server(binary, **kw)
        assert_kv_on_device(server, device.name)
        warm_up(server)
        return server

    return start


def warm_up(server: ServerProcess) -> None:
    """One prompt's prefill and a few decodes, the slot erased after. ggml-vulkan makes its
    pipelines on first use and lavapipe compiles each with LLVM then: the first long prompt
    on a fresh server took 2 to 4 minutes here (later ones seconds), past the tests' timeouts.
    (CUDA loads its kernels at first use too, in well under a second.)"""
    body = {"prompt": WARM_UP, "n_predict": 4, "temperature": 0, "cache_prompt": False, "id_slot": 0}
    reply = request(f"{server.url}/completion", "POST", body, timeout=WARM_UP_TIMEOUT)
    assert reply.status == 200, reply.body
    if server.spec.kvctl:
        key = {"Authorization": f"Bearer {server.spec.kvctl_key}"} if server.spec.kvctl_key else {}
        erased = request(f"{server.url}/kvctl/erase", "POST", {"slot": 0}, headers=key)
        assert erased.status == 200, erased.body


@pytest.fixture(scope="module", autouse=True)
def slow_device_timeouts() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvctl_tests, "CALL_TIMEOUT", 900.0)
        yield


@pytest.fixture(scope="module")
def patched_bin(device: Device) -> Path:
    return device.patched


@pytest.fixture(scope="module")
def stock_bin(device: Device) -> Path:
    return device.stock


@pytest.fixture(scope="module")
def kv_server(start_server: ServerFactory, patched_bin: Path) -> ServerProcess:
    """As in test_kvctl.py: patched, --kvctl, with a --kvctl-dir; these tests own its slots."""
    return kvctl_tests.keyed(start_server(patched_bin, threads=kvctl_tests.ONE))


@pytest.fixture(scope="module")
def stock_server(start_server: ServerFactory, stock_bin: Path) -> ServerProcess:
    return start_server(stock_bin, kvctl=False)


# --- the /kvctl tests of the cpu suite, on the device -------------------------------------------

# Tests (and the fixture ``moved``) of tests/integration/test_kvctl.py, taken into each
# backend's module: pytest resolves their fixtures (kv_server, stock_server, start_server, the
# binaries) from that module, i.e. on the device. In that module's order: the first one counts on the slot as
# ``moved`` left it.
moved = kvctl_tests.moved
test_export_erase_import_is_lossless = kvctl_tests.test_export_erase_import_is_lossless
test_two_segments_and_import_on_top = kvctl_tests.test_two_segments_and_import_on_top
test_publish_attach_share_cells = kvctl_tests.test_publish_attach_share_cells
test_msgpack_and_octet_stream = kvctl_tests.test_msgpack_and_octet_stream
test_attach_part_then_import_on_top = kvctl_tests.test_attach_part_then_import_on_top
test_moves_are_bound_to_tokens = kvctl_tests.test_moves_are_bound_to_tokens


# --- the proof --------------------------------------------------------------------------------


def test_kv_lives_on_the_device(
    device: Device, kv_server: ServerProcess, stock_server: ServerProcess
) -> None:
    """The servers these tests move KV on hold it in the device's buffers, every layer
    offloaded; the same check finds host KV when the KV is kept off the device
    (--no-kv-offload)."""
    print(f"device {device.name}: {device.description}")
    for server in (kv_server, stock_server):
        assert_kv_on_device(server, device.name)
        assert sum(mib for _, mib in kv_buffers(server)) > 0
    assert device.expect_in_description in device.description, device
    caps = arch._kvctl(kv_server, "caps").body
    assert caps["moves"] is True, caps
    # Its caps say so too (patch 0019), from the buffers themselves: every one on the device,
    # under the device's backend (CUDA0: CUDA, Vulkan0: Vulkan), none in host memory.
    buffers = caps["memory"]["buffers"]
    assert buffers and all(b["device"] == device.name for b in buffers), buffers
    assert all(device.name.startswith(b["backend"]) and b["backend"] for b in buffers), buffers
    assert not any(b["host"] for b in buffers), buffers
    # Patch 0024: CUDA pins the payload files the server keeps mapped (the arena); Vulkan's
    # backend has no registration of host memory.
    assert caps["memory"]["pinned_payloads"] is device.name.startswith("CUDA"), caps["memory"]

    # Not through start_server, which would refuse it.
    control = _start_unchecked(kv_server, device, ("--no-kv-offload",))
    try:
        problems = kv_on_device_problems(control, device.name)
        assert any("on CPU" in p for p in problems), problems
    finally:
        control.stop()


def _start_unchecked(like: ServerProcess, device: Device, extra: tuple[str, ...]) -> ServerProcess:
    port = free_port()
    spec = ServerSpec(
        binary=device.patched,
        model=like.spec.model,
        port=port,
        n_parallel=2,
        ctx_size=2048,
        threads=1,
        kvctl=False,
        extra_args=(*OFFLOAD, *extra),
    )
    return ServerProcess(spec, like.log_path.with_name(f"server-{port}.log")).start(timeout=180)


# --- routes through the proxy, against stock from scratch ------------------------------------


@pytest.mark.parametrize("family", ROUTE_FAMILIES)
def test_kv_is_reused_exactly_on_every_route(
    family: str,
    start_server: ServerFactory,
    patched_bin: Path,
    stock_bin: Path,
    tmp_path: Path,
) -> None:
    """tests/integration/test_architectures.py's routes test (A, A+H, H from the disk tier, S
    and S+H, each equal to stock from scratch, no fallback) with the KV on the device."""
    arch.test_kv_is_reused_exactly_on_every_route(family, start_server, patched_bin, stock_bin, tmp_path)
