"""A request's LoRA scales as part of its cache key (proxy/core/adapters.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.adapters import NO_ADAPTERS, request_adapters, server_scales, with_adapters
from proxy.errors import BadRequest

COMPAT = {
    "adapters": [
        {"lora": "/m/a.gguf", "scale": 0.0},
        {"lora": "/m/b.gguf", "scale": 0.5},
        {"control_vector": "/m/cv.gguf", "strength": 1.0, "layer_start": -1, "layer_end": -1},
    ]
}
BASE = server_scales(COMPAT)


def test_server_scales_are_the_lora_entries_in_id_order() -> None:
    assert BASE == (0.0, 0.5)
    assert server_scales({}) == ()
    assert server_scales({"adapters": "nonsense"}) == ()


@pytest.mark.parametrize(
    ("lora", "ns", "kvctl"),
    [
        (None, "", None),  # no field: the server's own scales
        ([], "", None),  # an empty list: the same, as on the server
        ([{"id": 1, "scale": 0.5}], "", ((1, 0.5),)),  # the server's own scales, named
        ([{"id": 0, "scale": 1}], "lora=1.0,0.0", ((0, 1.0),)),  # b is not named: scale 0
        ([{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}], "lora=1.0,0.5", ((0, 1.0), (1, 0.5))),
        ([{"id": 1, "scale": 2.0}, {"id": 1, "scale": 0.25}], "lora=0.0,0.25", ((1, 0.25),)),  # last wins
        ([{"id": 0, "scale": -0.0}, {"id": 1, "scale": 0.5}], "", ((0, 0.0), (1, 0.5))),  # -0.0 is 0.0
    ],
)
def test_effective_scales(lora: Any, ns: str, kvctl: Any) -> None:
    body = {} if lora is None else {"lora": lora}
    got = request_adapters(body, BASE)
    assert (got.ns, got.kvctl) == (ns, kvctl)
    assert got.as_json() == (None if kvctl is None else [{"id": i, "scale": s} for i, s in kvctl])


@pytest.mark.parametrize(
    "lora",
    [
        "x",
        {"id": 0, "scale": 1.0},
        [1],
        [{"id": 2, "scale": 1.0}],
        [{"id": -1, "scale": 1.0}],
        [{"id": "0", "scale": 1.0}],
        [{"id": True, "scale": 1.0}],
        [{"id": 0}],
        [{"id": 0, "scale": float("nan")}],
        [{"id": 0, "scale": float("inf")}],
        [{"id": 0, "scale": False}],
    ],
)
def test_bad_fields_are_refused(lora: Any) -> None:
    with pytest.raises(BadRequest, match="lora"):
        request_adapters({"lora": lora}, BASE)


def test_a_server_without_adapters_refuses_any() -> None:
    assert request_adapters({}, ()) == NO_ADAPTERS
    with pytest.raises(BadRequest, match="--lora"):
        request_adapters({"lora": [{"id": 0, "scale": 1.0}]}, ())


def test_with_adapters_leaves_the_base_namespace_alone() -> None:
    assert with_adapters("m:abc", NO_ADAPTERS) == "m:abc"
    assert (
        with_adapters("m:abc", request_adapters({"lora": [{"id": 0, "scale": 1}]}, BASE))
        == "m:abc/lora=1.0,0.0"
    )


@given(st.lists(st.tuples(st.integers(0, 1), st.floats(-4, 4, allow_nan=False)), max_size=4), st.data())
def test_keys_equal_exactly_when_the_float32_scales_do(
    named: list[tuple[int, float]], data: st.DataObject
) -> None:
    """Two requests share a namespace if and only if the server would run them with the same
    float32 scales (so KV is never reused across adapter sets, and is across spellings)."""
    other = data.draw(st.lists(st.tuples(st.integers(0, 1), st.floats(-4, 4, allow_nan=False)), max_size=4))

    def effective(entries: list[tuple[int, float]]) -> tuple[float, ...]:
        if not entries:
            return BASE
        got = dict(entries)
        return tuple(float(np.float32(got.get(i, 0.0))) for i in range(len(BASE)))

    def key(entries: list[tuple[int, float]]) -> str:
        return request_adapters({"lora": [{"id": i, "scale": s} for i, s in entries]}, BASE).ns

    assert (key(named) == key(other)) == (effective(named) == effective(other))
