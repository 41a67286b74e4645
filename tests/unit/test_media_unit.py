"""Requests with media (patch 0026), the pure parts: the media keys of a chat body, the /kvctl
replies' media fields, and the slot tie-break that steers a request to the slot holding its
media after the same text."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

from proxy.core.planner import PlanInput, Route, SlotView, plan
from proxy.server.api.media import media_keys
from proxy.server.coordinator.leases import _media_match
from proxy.server.coordinator.state import SlotState
from proxy.server.dataplane.kvctl import Caps, KvctlReplyError, Slots
from tests.unit.test_kvctl_replies import GOOD

pytestmark = pytest.mark.unit

PNG_A = {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUFB"}}
PNG_B = {"type": "image_url", "image_url": {"url": "data:image/png;base64,QkJC"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}


def _chat(*contents: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": c} for c in contents]}


def test_media_keys_name_each_media_part_in_order() -> None:
    assert media_keys(_chat("just text")) == ()
    assert media_keys(_chat([{"type": "text", "text": "hi"}])) == ()
    a, b, audio = (media_keys(_chat([p]))[0] for p in (PNG_A, PNG_B, AUDIO))
    assert len({a, b, audio}) == 3
    assert media_keys(_chat([{"type": "text", "text": "x"}, PNG_A], "then", [PNG_B, AUDIO])) == (a, b, audio)
    # The key is the part as sent, whatever the message around it says.
    assert media_keys(_chat([{"type": "text", "text": "other"}, PNG_A])) == (a,)
    # Malformed shapes are the server's to refuse: no key, no crash.
    assert media_keys({"messages": "no"}) == () and media_keys({"messages": [1, {"content": 3}]}) == ()


def test_caps_say_whether_a_projector_is_loaded() -> None:
    caps = Caps.parse(GOOD["caps"])
    assert not caps.multimodal and caps.media_marker == ""  # a server before 0026, or none loaded
    on = Caps.parse({**GOOD["caps"], "multimodal": {"on": True, "media_marker": "<__media_x__>"}})
    assert on.multimodal and on.media_marker == "<__media_x__>"
    off = Caps.parse({**GOOD["caps"], "multimodal": {"on": False, "media_marker": ""}})
    assert not off.multimodal
    with pytest.raises(KvctlReplyError, match="multimodal"):
        Caps.parse({**GOOD["caps"], "multimodal": {"on": "yes"}})


def _slot_entry(tokens: list[int], media: list[dict[str, Any]] | None, **over: Any) -> Any:
    slots = copy.deepcopy(GOOD["slots"])
    entry = slots["slots"][0]
    entry.update({"tokens": tokens, "n_tokens": len(tokens), "n_cells": len(tokens), **over})
    if media is not None:
        entry["media"] = media
    return Slots.parse(slots).slots[0]


@pytest.mark.parametrize(
    ("tokens", "media", "text"),
    [
        ([5, 6, 7], None, [5, 6, 7]),  # no projector: every token is text
        ([5, 6, -1, -1, 8], [{"idx": 2, "n_tokens": 2, "n_pos": 2, "id": "h"}], [5, 6]),
        ([-1, -1, 8], [{"idx": 0, "n_tokens": 2, "n_pos": 1, "id": "h"}], []),  # an image first
        # Two images: the text stops at the first, wherever the list puts it.
        (
            [5, -1, 7, -1],
            [
                {"idx": 3, "n_tokens": 1, "n_pos": 1, "id": "b"},
                {"idx": 1, "n_tokens": 1, "n_pos": 1, "id": "a"},
            ],
            [5],
        ),
        ([5, -1, 7], None, [5]),  # a token below 0 not listed as media ends the text too
    ],
)
def test_a_slot_records_only_the_text_before_its_first_media(
    tokens: list[int], media: list[dict[str, Any]] | None, text: list[int]
) -> None:
    entry = _slot_entry(tokens, media)
    assert entry.text_before_media().tolist() == text
    assert (entry.media_at is None) == (media is None)


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
