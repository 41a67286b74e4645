"""The /kvctl reply parsers: each reply as docs/kvctl.md shows it parses; a missing field or a
field of another type is one KvctlReplyError naming the route and the field."""

from __future__ import annotations

import base64
import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from proxy.errors import FallbackCause, KvMoveError
from proxy.server.dataplane.kvctl import Caps, Cells, KvctlReplyError, KvRoute, SeqInfo, Slots, Tokenized
from proxy.server.dataplane.kvctl_moves import (
    CheckpointReply,
    EraseReply,
    ExportReply,
    ImportReply,
    ReleaseReply,
    RestoreReply,
)

pytestmark = pytest.mark.unit

INSTANCE = "5f0c3a9e1d7b42c88e6a0f3b9d2c4e71"
COMPAT = {"format_version": 1, "fingerprint": "cd2d", "n_layer": 2, "k_types": [1, 1], "v_types": [1, 1]}
SEQ = {"id": 0, "n_tokens": 3, "tokens_hash": "d9d5", "pos_min": 0, "pos_max": 2, "n_cells": 3}

CPU_BUFFER = {
    "name": "CPU",
    "device": "CPU",
    "description": "AMD EPYC 7B13",
    "type": "cpu",
    "backend": "CPU",
    "host": True,
    "bytes": 47185920,
}

# The replies as the patched server sends them (docs/kvctl.md), "instance" included.
GOOD: dict[str, dict[str, Any]] = {
    "caps": {
        "format_version": 1,
        "instance": INSTANCE,
        "fingerprint": "cd2d",
        "compat": COMPAT,
        "compat_id": "749b",
        "payload": {"header_bytes": 744, "cell_bytes": 23052},
        "n_ctx": 8192,
        "n_ctx_slot": 8192,
        "n_cells": 8192,
        "n_parallel": 4,
        "n_seq_max": 13,
        "owner_ids": [4, 12],
        "scratch_id": 12,
        "dir": "/dev/shm/kvctl-test",
        "dir_id": "26:3107",
        "inline_max_bytes": 67108864,
        "max_depth": 8,
        "sharing": True,
        "reasons": [],
        "moves": True,
        "moves_off": [],
        "memory": {
            "kind": "kv",
            "n_swa": 0,
            "swa_full": False,
            "n_layer": 2,
            "n_pos_per_embd": 1,
            "buffers": [CPU_BUFFER],
        },
        "infill": {"n_batch": 2048},
        "embedding": {"on": False, "pooling": 0},
        "checkpoints": {"on": False, "off": ["not needed"], "per_slot": 32},
        "fault_injection": False,
    },
    "slots": {
        "instance": INSTANCE,
        "slots": [{**SEQ, "busy": False, "tokens": [1, 2, 3]}],
        "owners": [{**SEQ, "id": 4}],
    },
    "cells": {
        "instance": INSTANCE,
        "n_cells": 8192,
        "used": 60,
        "free": 8132,
        "slot": 60,
        "owner": 40,
        "owner_only": 0,
        "seq": {"0": 40, "4": 40},
        "logical": 80,
    },
    "export": {
        "instance": INSTANCE,
        "size": 100,
        "in_place": True,
        "n_cells": 3,
        "p0": 0,
        "p1": 3,
        "compat_id": "749b",
        "compat": COMPAT,
        "t_ms": 1.5,
        "file": "x.kv",
    },
    "import": {"instance": INSTANCE, "slot": 0, "n_tokens": 3, "n_cells": 3, "bytes": 100, "t_ms": 2.0},
    "publish": {"instance": INSTANCE, **SEQ, "id": 4},
    "attach": {"instance": INSTANCE, **SEQ, "owner": 4},
    "release": {"instance": INSTANCE, "owner": 4, "n_released": 3},
    "erase": {"instance": INSTANCE, "slot": 0, "n_erased": 3},
    "checkpoint": {
        "instance": INSTANCE,
        "size": 2,
        "n_tokens": 3,
        "compat_id": "749b",
        "t_ms": 0.5,
        "data": b"CK",
    },
    "restore": {"instance": INSTANCE, "slot": 1, "n_tokens": 3, "bytes": 2, "t_ms": 0.4},
    "tokenize": {
        "tokens": [1, -7, -9, 2],
        "media": [{"idx": 1, "n_tokens": 2, "n_pos": 2, "id": "12ab", "movable": True, "chunk": "Q0g="}],
    },
}

PARSERS: dict[str, Callable[[object], object]] = {
    "caps": Caps.parse,
    "slots": Slots.parse,
    "cells": Cells.parse,
    "export": ExportReply.parse,
    "import": ImportReply.parse,
    "publish": lambda obj: SeqInfo.parse(obj, KvRoute.PUBLISH, FallbackCause.PUBLISH),
    "attach": lambda obj: SeqInfo.parse(obj, KvRoute.ATTACH, FallbackCause.ATTACH),
    "release": ReleaseReply.parse,
    "erase": EraseReply.parse,
    "checkpoint": CheckpointReply.parse,
    "restore": RestoreReply.parse,
    "tokenize": Tokenized.parse,
}

# One field each parser needs, and a value of the wrong type for it.
NEEDED = {
    "caps": ("n_parallel", "4"),
    "slots": ("slots", {}),
    "cells": ("free", 8132.5),
    "export": ("p1", "3"),
    "import": ("n_tokens", None),
    "publish": ("pos_max", True),
    "attach": ("n_cells", [3]),
    "release": ("n_released", "3"),
    "erase": ("slot", False),
    "checkpoint": ("n_tokens", "3"),
    "restore": ("slot", None),
    "tokenize": ("tokens", "1 2"),
}


def test_every_route_has_a_parser() -> None:
    assert set(PARSERS) == set(GOOD) == set(NEEDED) == {r.value for r in KvRoute}


@pytest.mark.parametrize("route", sorted(GOOD))
def test_a_good_reply_parses(route: str) -> None:
    assert PARSERS[route](copy.deepcopy(GOOD[route])) is not None


def test_the_parsed_fields() -> None:
    caps = Caps.parse(GOOD["caps"])
    assert caps.owner_ids == (4, 12) and caps.n_parallel == 4 and caps.memory_kind == "kv"
    assert caps.instance == INSTANCE and caps.embedding is not None and not caps.embedding.on
    slots = Slots.parse(GOOD["slots"])
    assert slots.slot(0).held_tokens().tolist() == [1, 2, 3] and slots.owners[0].tokens is None
    assert not slots.owners[0].busy  # owners have no busy flag
    cells = Cells.parse(GOOD["cells"])
    assert cells.free == 8132 and cells.as_json()["seq"] == {"0": 40, "4": 40}
    export = ExportReply.parse(GOOD["export"])
    assert export.in_place and export.file == "x.kv" and export.data is None and export.t_ms == 1.5


def test_optional_fields_of_older_patches() -> None:
    caps = dict(GOOD["caps"])
    for key in ("infill", "embedding", "dir", "dir_id", "fault_injection"):
        del caps[key]
    parsed = Caps.parse(caps)
    assert parsed.infill is None and parsed.embedding is None and parsed.dir is None
    assert not parsed.fault_injection
    export = {k: v for k, v in GOOD["export"].items() if k not in ("in_place", "file", "t_ms")}
    inline = ExportReply.parse({**export, "data": base64.b64encode(b"KV").decode()})
    assert inline.data == b"KV" and not inline.in_place
    assert ExportReply.parse({**export, "data": b"KV"}).data == b"KV"  # msgpack bin
    # Before patch 0017: no checkpoints; slots list none.
    assert Caps.parse({k: v for k, v in GOOD["caps"].items() if k != "checkpoints"}).checkpoints is False
    assert Slots.parse(GOOD["slots"]).slots[0].checkpoints == ()


def test_caps_say_where_the_kv_lives() -> None:
    caps = Caps.parse(GOOD["caps"])
    assert caps.kv_buffers is not None and caps.kv_buffers[0].host
    assert caps.kv_devices == ("CPU",) and caps.kv_backends == ("CPU",) and caps.kv_where_unknown() is None
    # Layers split over a GPU and the CPU: both named, each once, in the server's order.
    gpu = {**CPU_BUFFER, "name": "CUDA0", "device": "CUDA0", "type": "gpu", "backend": "CUDA", "host": False}
    split = copy.deepcopy(GOOD["caps"])
    split["memory"]["buffers"] = [gpu, CPU_BUFFER, {**gpu, "name": "CUDA0_split"}]
    parsed = Caps.parse(split)
    assert parsed.kv_devices == ("CUDA0", "CPU") and parsed.kv_backends == ("CUDA", "CPU")
    assert parsed.kv_where_unknown() is None


def test_caps_that_cannot_say_where_the_kv_lives() -> None:
    older = copy.deepcopy(GOOD["caps"])
    del older["memory"]["buffers"]  # a patch before 0019
    parsed = Caps.parse(older)
    assert parsed.kv_buffers is None and parsed.kv_devices == ()
    assert "no memory.buffers" in (parsed.kv_where_unknown() or "")
    empty = copy.deepcopy(GOOD["caps"])
    empty["memory"]["buffers"] = []
    assert "empty" in (Caps.parse(empty).kv_where_unknown() or "")
    unknown = copy.deepcopy(GOOD["caps"])
    unknown["memory"]["buffers"] = [{**CPU_BUFFER, "name": "X_Host", "device": "", "type": "unknown"}]
    assert "X_Host" in (Caps.parse(unknown).kv_where_unknown() or "")


@pytest.mark.parametrize("field", sorted(CPU_BUFFER))
def test_a_renamed_buffer_field_fails_in_the_caps_parser(field: str) -> None:
    caps = copy.deepcopy(GOOD["caps"])
    buffer = caps["memory"]["buffers"][0]
    buffer[field + "_renamed"] = buffer.pop(field)
    with pytest.raises(KvctlReplyError, match=rf"field memory\.buffers\[0\]\.'{field}' is missing"):
        Caps.parse(caps)
    caps["memory"]["buffers"] = [{**CPU_BUFFER, field: None}]
    with pytest.raises(KvctlReplyError, match=rf"'{field}' is NoneType, expected"):
        Caps.parse(caps)
    caps["memory"]["buffers"] = {"CPU": CPU_BUFFER}
    with pytest.raises(KvctlReplyError, match=r"field memory\.'buffers' is dict, expected a list"):
        Caps.parse(caps)


def test_checkpoints_in_caps_slots_and_the_checkpoint_reply() -> None:
    caps = Caps.parse({**GOOD["caps"], "checkpoints": {"on": True, "off": [], "per_slot": 32}})
    assert caps.checkpoints and caps.checkpoints_off == () and caps.compat_id == "749b"
    slots = copy.deepcopy(GOOD["slots"])
    slots["slots"][0]["checkpoints"] = [1, 2]
    assert Slots.parse(slots).slots[0].checkpoints == (1, 2)
    slots["slots"][0]["checkpoints"] = ["1"]
    with pytest.raises(KvctlReplyError, match="checkpoints"):
        Slots.parse(slots)
    # The payload must be as long as the reply says: a short one is refused, not kept.
    with pytest.raises(KvctlReplyError, match="no payload of the 3 bytes"):
        CheckpointReply.parse({**GOOD["checkpoint"], "size": 3})
    b64 = base64.b64encode(b"CK").decode()
    assert CheckpointReply.parse({**GOOD["checkpoint"], "data": b64}).data == b"CK"  # JSON reply


@pytest.mark.parametrize("route", sorted(GOOD))
def test_a_missing_field_is_one_clear_error(route: str) -> None:
    field, _ = NEEDED[route]
    reply = copy.deepcopy(GOOD[route])
    del reply[field]
    with pytest.raises(KvctlReplyError) as info:
        PARSERS[route](reply)
    assert info.value.message.endswith(f"/kvctl/{route} reply: field {field!r} is missing")
    assert isinstance(info.value, KvMoveError)  # a move that failed: the request falls back


@pytest.mark.parametrize("route", sorted(GOOD))
def test_a_field_of_another_type_is_one_clear_error(route: str) -> None:
    field, wrong = NEEDED[route]
    reply = {**copy.deepcopy(GOOD[route]), field: wrong}
    with pytest.raises(KvctlReplyError) as info:
        PARSERS[route](reply)
    message = info.value.message
    assert f"/kvctl/{route} reply: field {field!r} is " in message, message
    assert "expected" in message


def test_nested_fields_are_named_with_their_path() -> None:
    slots = copy.deepcopy(GOOD["slots"])
    del slots["slots"][0]["pos_min"]
    with pytest.raises(KvctlReplyError, match=r"field slots\[0\]\.'pos_min' is missing"):
        Slots.parse(slots)
    caps = copy.deepcopy(GOOD["caps"])
    caps["memory"] = {"n_swa": 0}
    with pytest.raises(KvctlReplyError, match=r"field memory\.'kind' is missing"):
        Caps.parse(caps)
    with pytest.raises(KvctlReplyError, match="owner_ids"):
        Caps.parse({**GOOD["caps"], "owner_ids": [4]})
    with pytest.raises(KvctlReplyError, match="is list, not an object"):
        Cells.parse([1, 2])


def test_the_error_carries_the_operations_cause() -> None:
    with pytest.raises(KvctlReplyError) as info:
        ExportReply.parse({**GOOD["export"], "size": "x"})
    assert info.value.cause is FallbackCause.EXPORT and info.value.route is KvRoute.EXPORT
    export = {k: v for k, v in GOOD["export"].items() if k != "file"}
    with pytest.raises(KvctlReplyError, match="neither 'file' nor 'data'"):
        ExportReply.parse(export)


def test_a_slot_missing_from_the_slots_reply() -> None:
    with pytest.raises(KvctlReplyError, match="no entry for slot 7"):
        Slots.parse(GOOD["slots"]).slot(7)
    assert Slots.parse({"slots": []}).owners == ()  # owners: only non-empty ones, may be absent
    assert isinstance(Slots.parse(GOOD["slots"]).slots[0].tokens, np.ndarray)
