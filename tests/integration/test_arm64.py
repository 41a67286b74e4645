"""ARM64 (issue 26, docs/devices.md): llama-server cross-built for aarch64 with Debian's cross
toolchain (``radixctl build --cross aarch64``), patched and stock, run here under
``qemu-aarch64-static`` (user-mode emulation with the cross sysroot; no binfmt_misc needed),
and the /kvctl round trips of tests/integration/test_kvctl.py against it: export, erase and
import with a byte-identical re-export and a bitwise-identical continuation, stock aarch64
from scratch under the near-tie rule, two segments, publish/attach, both payload encodings and
moves bound to tokens.

They run only when asked (RADIX_TEST_ARM64=1), with qemu-aarch64-static installed:
``make arm64-check`` installs the packages, builds what is missing and runs them. Elsewhere they
skip and say why, so ``make test`` neither builds for aarch64 nor spends the minutes emulation
takes, even where the aarch64 builds are cached.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.native.build import BuildSpec, build_server, server_path
from proxy.native.launch import ServerProcess
from proxy.native.toolchain import CROSS, write_emulated_wrapper
from tests.helpers import ServerFactory
from tests.integration import test_kvctl as kvctl_tests

TARGET = "aarch64"
EM_AARCH64 = 183  # ELF e_machine
EMULATED_TIMEOUT = 900.0  # seconds per request: emulation is some 10 to 50 times slower


def _cross_binary(variant: str) -> Path:
    spec = BuildSpec(variant=variant, cross=TARGET)
    path = server_path(spec)
    return path if path.exists() else build_server(spec)  # a failed build fails the tests


def elf_machine(binary: Path) -> int:
    with open(binary, "rb") as f:
        head = f.read(20)
    assert head[:4] == b"\x7fELF", binary
    return int.from_bytes(head[18:20], "little")


@pytest.fixture(scope="module")
def emulated_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.environ.get("RADIX_TEST_ARM64") != "1":
        pytest.skip("the aarch64 tests run under emulation only when asked: `make arm64-check`")
    if shutil.which(CROSS[TARGET].qemu) is None:
        pytest.skip(f"{CROSS[TARGET].qemu} is not installed (`make arm64-deps`)")
    return tmp_path_factory.mktemp("arm64")


def _emulated(variant: str, out: Path) -> Path:
    """A ``llama-server`` script that runs the aarch64 build of ``variant`` under qemu."""
    return write_emulated_wrapper(TARGET, _cross_binary(variant), out / variant / "llama-server")


@pytest.fixture(scope="module")
def patched_bin(emulated_dir: Path) -> Path:
    return _emulated("patched", emulated_dir)


@pytest.fixture(scope="module")
def stock_bin(emulated_dir: Path) -> Path:
    """Built (or found) only for the tests that compare with stock."""
    return _emulated("stock", emulated_dir)


@pytest.fixture(scope="module")
def stock_server(start_server: ServerFactory, stock_bin: Path) -> ServerProcess:
    return start_server(stock_bin, kvctl=False, threads=kvctl_tests.ONE)


@pytest.fixture(scope="module", autouse=True)
def slow_emulated_timeouts() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvctl_tests, "CALL_TIMEOUT", EMULATED_TIMEOUT)
        yield


def test_the_server_is_aarch64_under_emulation(patched_bin: Path, kv_server: ServerProcess) -> None:
    """The patched build is an aarch64 ELF file (it cannot run here natively), run through
    qemu, and the server these tests move KV on answers /kvctl/caps with moves on."""
    assert elf_machine(_cross_binary("patched")) == EM_AARCH64
    assert CROSS[TARGET].qemu in patched_bin.read_text()
    caps = kvctl_tests.caps(kv_server.url)
    assert caps["moves"] is True, caps


# The /kvctl tests of tests/integration/test_kvctl.py, collected here: their fixtures
# (kv_server, stock_server, the binaries) resolve to this module's, i.e. the emulated builds.
kv_server = kvctl_tests.kv_server
moved = kvctl_tests.moved
test_export_erase_import_is_lossless = kvctl_tests.test_export_erase_import_is_lossless
test_two_segments_and_import_on_top = kvctl_tests.test_two_segments_and_import_on_top
test_publish_attach_share_cells = kvctl_tests.test_publish_attach_share_cells
test_msgpack_and_octet_stream = kvctl_tests.test_msgpack_and_octet_stream
test_attach_part_then_import_on_top = kvctl_tests.test_attach_part_then_import_on_top
test_moves_are_bound_to_tokens = kvctl_tests.test_moves_are_bound_to_tokens
