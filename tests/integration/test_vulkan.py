"""KV in device memory (issue 26): the KV-move tests against llama-server built with ggml's
Vulkan backend, every layer and the KV cache offloaded (-ngl 99), patched and stock
(docs/devices.md). The tests and the on-device checks are tests/integration/device_kv.py's.

On a machine with no GPU the device is Mesa's lavapipe, a CPU Vulkan implementation: ggml
skips CPU-type Vulkan devices unless GGML_VK_VISIBLE_DEVICES names one, so these tests point
the Vulkan loader at lavapipe's ICD and make its device 0 visible, unless the caller set either
variable (a real GPU).

They run where the Vulkan builds are cached and a Vulkan device is found; ``make vulkan-test``
(RADIX_TEST_VULKAN=1) builds what is missing first. Elsewhere they skip and say why, so
``make test`` passes on machines without Vulkan.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.native.build import build_server, server_path, spec_for
from tests.integration import device_kv
from tests.integration.device_kv import Device


def _lavapipe_env() -> dict[str, str]:
    """The variables to set: lavapipe's ICD and its device visible, unless the caller chose."""
    if "VK_ICD_FILENAMES" in os.environ or "VK_DRIVER_FILES" in os.environ:
        return {}
    icds = sorted(glob.glob("/usr/share/vulkan/icd.d/lvp_icd.*.json"))
    if not icds:
        return {}
    env = {"VK_ICD_FILENAMES": icds[0], "VK_DRIVER_FILES": icds[0]}
    if "GGML_VK_VISIBLE_DEVICES" not in os.environ:
        env["GGML_VK_VISIBLE_DEVICES"] = "0"
    return env


def _binary(variant: str) -> Path:
    spec = spec_for(variant, "vulkan")
    path = server_path(spec)
    if path.exists():
        return path
    if os.environ.get("RADIX_TEST_VULKAN") != "1":
        pytest.skip(
            f"no {variant} Vulkan llama-server is cached ({path.parent.name}): "
            "`make vulkan-test` installs the packages, builds it and runs these tests"
        )
    return build_server(spec)  # a failed build fails the tests: RADIX_TEST_VULKAN asked for them


@pytest.fixture(scope="module")
def device() -> Iterator[Device]:
    with pytest.MonkeyPatch.context() as mp:
        env = _lavapipe_env()
        for name, value in env.items():
            mp.setenv(name, value)
        patched, stock = _binary("patched"), _binary("stock")
        name, description = device_kv.list_devices(patched, "Vulkan")[0]
        yield Device(patched, stock, name, description, "llvmpipe" if "VK_ICD_FILENAMES" in env else "")


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
