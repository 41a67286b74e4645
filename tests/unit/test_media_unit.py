"""Requests with media (patch 0026), the pure parts: the media keys of a chat body, the /kvctl
replies' media fields, and the slot tie-break that steers a request to the slot holding its
media after the same text."""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from proxy.cli.doctor import _media_checks
from proxy.core.planner import PlanInput, Route, SlotView, plan
from proxy.server.api.media import has_media
from proxy.server.coordinator.leases import _media_match
from proxy.server.coordinator.moves import import_range
from proxy.server.coordinator.saves import _text_end, share_lengths
from proxy.server.coordinator.state import ServerState, SlotState, prompt_cells
from proxy.server.dataplane.kvctl import Caps, KvctlReplyError, Slots, Tokenized
from proxy.server.ops.admin import detokenize
from tests.unit.test_kvctl_replies import GOOD

pytestmark = pytest.mark.unit

PNG_A = {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUFB"}}
PNG_B = {"type": "image_url", "image_url": {"url": "data:image/png;base64,QkJC"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}


def _chat(*contents: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": c} for c in contents]}


def test_has_media_finds_a_media_part_anywhere() -> None:
    assert not has_media(_chat("just text")) and not has_media(_chat([{"type": "text", "text": "hi"}]))
    assert has_media(_chat("text", [{"type": "text", "text": "x"}, PNG_A]))
    assert has_media(_chat([AUDIO]))
    assert has_media(_chat([{"type": "video_url", "video_url": {"url": "x"}}]))
    # Malformed shapes are the server's to refuse: no media found, no crash.
    assert not has_media({"messages": "no"}) and not has_media({"messages": [1, {"content": 3}]})


def test_caps_say_whether_a_projector_is_loaded() -> None:
    caps = Caps.parse(GOOD["caps"])
    assert not caps.multimodal and caps.media_marker == ""  # a server before 0026, or none loaded
    on = Caps.parse({**GOOD["caps"], "multimodal": {"on": True, "media_marker": "<__media_x__>"}})
    assert on.multimodal and on.media_marker == "<__media_x__>"
    off = Caps.parse({**GOOD["caps"], "multimodal": {"on": False, "media_marker": ""}})
    assert not off.multimodal
    with pytest.raises(KvctlReplyError, match="multimodal"):
        Caps.parse({**GOOD["caps"], "multimodal": {"on": "yes"}})
    # Patch 0027: whether media moves, and why not.
    assert not on.media_moves and on.media_fixed == ""  # before 0027: never
    moving = Caps.parse(
        {**GOOD["caps"], "multimodal": {"on": True, "media_marker": "m", "media_moves": True}}
    )
    assert moving.media_moves
    fixed = {"on": True, "media_marker": "m", "media_moves": False, "media_fixed": "M-RoPE: shared"}
    assert Caps.parse({**GOOD["caps"], "multimodal": fixed}).media_fixed == "M-RoPE: shared"
    assert not moving.media_shared  # before 0028: owners hold text only
    shared = {"on": True, "media_marker": "m", "media_moves": True, "media_shared": True}
    assert Caps.parse({**GOOD["caps"], "multimodal": shared}).media_shared


def test_a_server_state_follows_what_its_caps_say_of_media() -> None:
    state = ServerState("s0", SimpleNamespace(), SimpleNamespace(), [], 1024, None)
    mm = {"on": True, "media_marker": "m", "media_moves": True, "media_shared": True, "media_keys": "k1"}
    assert state.take_media_caps(Caps.parse({**GOOD["caps"], "multimodal": mm}))
    assert (state.media_marker, state.media_fixed, state.media_shared, state.media_keys) == (
        "m",
        "",
        True,
        "k1",
    )
    assert not state.take_media_caps(Caps.parse({**GOOD["caps"], "multimodal": mm}))  # unchanged
    fixed = {**mm, "media_moves": False, "media_fixed": "M-RoPE: x", "media_keys": "k2"}
    assert state.take_media_caps(Caps.parse({**GOOD["caps"], "multimodal": fixed}))
    assert (state.media_fixed, state.media_shared, state.media_keys) == ("M-RoPE: x", False, "k2")
    assert state.take_media_caps(Caps.parse(GOOD["caps"]))  # restarted without a projector
    assert (state.media_marker, state.media_keys) == ("", "")


def test_owners_and_checkpoints_stop_where_they_can_hold_no_more() -> None:
    tokens = np.array([5, 6, -7, -8, -9, -10, 11, -1, -1, 12], dtype=np.int32)
    assert _text_end(tokens) == 2  # whole-state checkpoints, owners before 0028: text only
    assert _text_end(tokens, movable_too=True) == 7  # owners of 0028: up to media no move names
    assert _text_end(tokens[:2]) == 2 and _text_end(tokens[:7], movable_too=True) == 7


@pytest.mark.parametrize(
    ("mm", "status", "says"),
    [
        ({}, None, ""),
        ({"on": True, "media_moves": True}, "ok", "moves with the text"),
        ({"on": True, "media_moves": False, "media_fixed": "M-RoPE: x"}, "warn", "M-RoPE: x"),
        ({"on": True}, "warn", "a patch before 0027"),
    ],
)
def test_doctor_says_whether_media_moves(mm: dict[str, Any], status: str | None, says: str) -> None:
    checks = _media_checks(mm)
    assert [c.status for c in checks] == ([status] if status else [])
    assert all(says in c.detail for c in checks)


def test_a_lease_with_media_reserves_its_whole_tokenization() -> None:
    # Under M-RoPE the keyed tokens end at the first image; the prompt fills every cell.
    tokens = np.array([5, 6, 7, -1, -1, -1, -1, 8], dtype=np.int32)
    media = Tokenized.parse({"tokens": tokens.tolist(), "media": [_mm(3, 4, movable=False)]})
    assert prompt_cells(3, media) == 8 and prompt_cells(3, None) == 3


def _mm(idx: int, n: int, movable: bool) -> dict[str, Any]:
    return {"idx": idx, "n_tokens": n, "n_pos": n, "id": "h", "movable": movable, "chunk": "AA=="}


def _slot_entry(tokens: list[int], media: list[dict[str, Any]] | None, **over: Any) -> Any:
    slots = copy.deepcopy(GOOD["slots"])
    entry = slots["slots"][0]
    entry.update({"tokens": tokens, "n_tokens": len(tokens), "n_cells": len(tokens), **over})
    if media is not None:
        entry["media"] = media
    return Slots.parse(slots).slots[0]


def _m(idx: int, n: int, movable: bool = False) -> dict[str, Any]:
    return {"idx": idx, "n_tokens": n, "n_pos": n if movable else 1, "id": "h", "movable": movable}


@pytest.mark.parametrize(
    ("tokens", "media", "keyed"),
    [
        ([5, 6, 7], None, [5, 6, 7]),  # no projector: every token is text
        ([5, 6, -1, -1, 8], [_m(2, 2)], [5, 6]),  # an image no move can name ends them
        ([-1, -1, 8], [_m(0, 2)], []),  # such an image first
        # A movable image is keyed by tokens below -1: it goes on through it, to the next one.
        ([5, -7, -9, 8, -1], [_m(1, 2, movable=True), _m(4, 1)], [5, -7, -9, 8]),
        ([5, -7, -9], [_m(1, 2, movable=True)], [5, -7, -9]),
        # Two unmovable ones: the text stops at the first, wherever the list puts it.
        ([5, -1, 7, -1], [_m(3, 1), _m(1, 1)], [5]),
        ([5, -1, 7], None, [5]),  # a -1 not listed as media ends them too
    ],
)
def test_a_slot_records_what_the_moves_can_name(
    tokens: list[int], media: list[dict[str, Any]] | None, keyed: list[int]
) -> None:
    entry = _slot_entry(tokens, media)
    assert entry.keyed_prefix().tolist() == keyed


def test_a_media_entry_must_start_inside_the_slot() -> None:
    with pytest.raises(KvctlReplyError, match="media"):
        _slot_entry([5, -1], [{"idx": -1, "n_tokens": 1, "n_pos": 1, "id": "h"}])
    with pytest.raises(KvctlReplyError, match=r"media\[0\]"):
        _slot_entry([5, -1], [{"n_tokens": 1}])


def _state(tokens: list[int], media: tuple[str, ...]) -> SlotState:
    return SlotState(0, tokens=np.asarray(tokens, dtype=np.int32), media=media)


@pytest.mark.parametrize(
    ("slot_tokens", "slot_media", "lcp", "n_text", "media", "expect"),
    [
        ([1, 2], ("a", "b"), 2, 2, ("a", "b", "c"), 2),
        ([1, 2], ("a", "x"), 2, 2, ("a", "b"), 1),
        ([1, 2], ("x",), 2, 2, ("a",), 0),
        ([1, 2], ("a",), 2, 2, (), 0),  # a text-only request: no media to reuse
        ([1, 2], (), 2, 2, ("a",), 0),  # the slot holds no media
        ([1, 2, 3], ("a",), 2, 2, ("a",), 0),  # the slot's text goes on past the request's
        ([1, 2], ("a",), 2, 3, ("a",), 0),  # the request's text goes on past the slot's
        ([1, 2], ("a",), 1, 2, ("a",), 0),  # the texts part before the media
    ],
)
def test_media_match(
    slot_tokens: list[int],
    slot_media: tuple[str, ...],
    lcp: int,
    n_text: int,
    media: tuple[str, ...],
    expect: int,
) -> None:
    assert _media_match(_state(slot_tokens, slot_media), lcp, n_text, media) == expect


def test_among_slots_holding_the_text_the_one_with_its_media_is_picked() -> None:
    slots = (
        SlotView(0, True, 40, 40, last_used=9.0, media_match=0),  # used last, another image
        SlotView(1, True, 40, 40, last_used=1.0, media_match=1),  # the request's image
        SlotView(2, True, 0, 0, last_used=0.0),
    )
    got = plan(PlanInput(n_prompt=41, slots=slots, host_len=40, min_restore_tokens=10))
    assert got is not None and (got.route, got.slot_id) == (Route.A, 1)
    # Without media the tie goes to the slot used last, as before.
    plain = tuple(SlotView(s.slot_id, s.idle, s.lcp, s.n_tokens, s.last_used) for s in slots)
    got = plan(PlanInput(n_prompt=41, slots=plain, host_len=40, min_restore_tokens=10))
    assert got is not None and got.slot_id == 0


def _tokenized(tokens: list[int], *media: dict[str, Any]) -> Tokenized:
    return Tokenized.parse({"tokens": tokens, "media": [{"chunk": "Q0g=", **m} for m in media]})


def test_a_tokenized_prompt_keys_movable_media_and_stops_at_the_rest() -> None:
    t = _tokenized([5, -7, -9, 8, -1, -1, 9], _m(1, 2, movable=True), _m(4, 2))
    assert t.keyed().tolist() == [5, -7, -9, 8]
    # An import names the movable chunks that start in its range; a move ends at a chunk's edge.
    assert t.chunks_in(0, 4) == [{"idx": 1, "chunk": "Q0g="}]
    assert t.chunks_in(2, 4) == []
    assert t.chunk_start(2) == 1 and t.chunk_start(3) == 3 and t.chunk_start(1) == 1
    assert _tokenized([1, 2]).keyed().tolist() == [1, 2]


@pytest.mark.parametrize(
    ("tokens", "media"),
    [
        ([5, -7, 8], [_m(1, 2, movable=True)]),  # its cells are not all media
        ([5, -1, -1], [_m(1, 2, movable=True)]),  # a movable chunk's cells are keyed, not -1
        ([5, -7, -8], [_m(1, 2)]),  # an unmovable chunk's cells are -1
        ([5, -7], []),  # a media cell in no chunk
        ([5, -1], [_m(1, 2)]),  # past the end
        ([5, -1], [_m(-1, 1)]),
    ],
)
def test_a_tokenize_reply_that_does_not_add_up_is_refused(
    tokens: list[int], media: list[dict[str, Any]]
) -> None:
    with pytest.raises(KvctlReplyError, match="tokenize"):
        _tokenized(tokens, *media)


def test_the_admin_views_show_media_cells_as_a_marker() -> None:
    class Decoder:
        def decode(self, ids: list[int]) -> str:
            assert all(t >= 0 for t in ids)
            return "".join(chr(ord("a") + t) for t in ids)

    runtime = SimpleNamespace(local_tokenizer=Decoder())
    got = asyncio.run(detokenize(runtime, [0, 1, -7, -9, 2, -1]))  # type: ignore[arg-type]
    assert got == "ab<media: 2 cells>c<media: 1 cells>"
    assert asyncio.run(detokenize(runtime, [])) == ""  # type: ignore[arg-type]


# A prompt of 3 text tokens, a movable image of 4 cells at 3, and 2 text tokens.
PROMPT = np.array([1, 2, 3, -5, -6, -7, -8, 9, 10], dtype=np.int32)
WITH_IMAGE = Tokenized.parse({"tokens": PROMPT.tolist(), "media": [_mm(3, 4, movable=True)]})


@pytest.mark.parametrize(
    ("planned", "cut"),
    [
        ((0, 9), (0, 9)),
        ((3, 9), (3, 9)),
        ((5, 9), (3, 9)),  # the slot kept part of the image: the import starts at the image
        ((0, 5), (0, 3)),  # the host holds part of it: the import stops before it
        ((7, 9), (7, 9)),
        ((4, 6), (3, 3)),  # nothing whole: nothing imported
    ],
)
def test_a_host_import_ends_at_media_edges(planned: tuple[int, int], cut: tuple[int, int]) -> None:
    assert import_range(*planned, WITH_IMAGE) == cut
    assert import_range(*planned, None) == planned  # text only: as planned


@pytest.mark.parametrize(
    ("held", "host_to", "shared", "want"),
    [
        (9, 0, True, [9]),
        (9, 5, True, [3, 9]),  # the host part ended inside the image: published before it
        (9, 7, True, [7, 9]),
        (9, 7, False, []),  # owners before 0028 hold text only, and the prompt holds an image
        (6, 9, True, []),  # the slot holds only part of the image: neither length
        (6, 5, True, [3]),
    ],
)
def test_a_slot_publishes_whole_media_chunks(held: int, host_to: int, shared: bool, want: list[int]) -> None:
    slot = PROMPT[:held]
    assert share_lengths(slot, PROMPT, host_to, WITH_IMAGE, shared) == want
