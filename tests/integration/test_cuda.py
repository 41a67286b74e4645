"""KV in device memory on an NVIDIA GPU (issue 26): the KV-move tests of
tests/integration/device_kv.py against llama-server built with ggml's CUDA backend, patched and
stock, every layer and the KV cache offloaded (-ngl 99), each server's log checked to say that
every KV buffer is on ``CUDA0`` (docs/devices.md).

They run where the CUDA builds (``radixctl build --backend cuda``, the spec the benches use) are
cached and ``llama-server --list-devices`` lists a CUDA device; ``deploy/gpu/check.sh``
(RADIX_TEST_CUDA=1) builds what is missing first. Elsewhere, this project's machines included
(no GPU), they skip and say why. ``make cuda-check`` only compiles.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from proxy.native.build import build_server, server_path, spec_for
from tests.integration import device_kv
from tests.integration.device_kv import Device


def _binary(variant: str) -> Path:
    spec = spec_for(variant, "cuda")
    path = server_path(spec)
    if path.exists():
        return path
    if os.environ.get("RADIX_TEST_CUDA") != "1":
        pytest.skip(
            f"no {variant} CUDA llama-server is cached ({path.parent.name}): "
            "deploy/gpu/check.sh builds it and runs these tests on a machine with an NVIDIA GPU"
        )
    return build_server(spec)  # a failed build fails the tests: RADIX_TEST_CUDA asked for them


@pytest.fixture(scope="module")
def device() -> Device:
    patched, stock = _binary("patched"), _binary("stock")
    name, description = device_kv.list_devices(patched, "CUDA")[0]
    return Device(patched, stock, name, description)


# The shared fixtures and tests (tests/integration/device_kv.py), collected here with ``device``.
start_server = device_kv.start_server
slow_device_timeouts = device_kv.slow_device_timeouts
patched_bin = device_kv.patched_bin
stock_bin = device_kv.stock_bin
kv_server = device_kv.kv_server
stock_server = device_kv.stock_server
moved = device_kv.moved
test_export_erase_import_is_lossless = device_kv.test_export_erase_import_is_lossless
test_two_segments_and_import_on_top = device_kv.test_two_segments_and_import_on_top
test_publish_attach_share_cells = device_kv.test_publish_attach_share_cells
test_msgpack_and_octet_stream = device_kv.test_msgpack_and_octet_stream
test_attach_part_then_import_on_top = device_kv.test_attach_part_then_import_on_top
test_moves_are_bound_to_tokens = device_kv.test_moves_are_bound_to_tokens
test_kv_lives_on_the_device = device_kv.test_kv_lives_on_the_device
test_kv_is_reused_exactly_on_every_route = device_kv.test_kv_is_reused_exactly_on_every_route
