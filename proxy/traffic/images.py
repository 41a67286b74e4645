"""Seeded images for workloads with vision: PNGs of random pixels and the chat parts that carry them.

A projector's cost does not depend on what an image shows, only on its size (the server resizes
it to the tower's square), so random pixels are as good as photos; distinct seeds give distinct
images (distinct content hashes, as the server keys them), one seed the same bytes every time.
"""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

import numpy as np


def png(seed: int, size: int) -> bytes:
    """A ``size`` x ``size`` RGB PNG of seeded random pixels (8-bit, unfiltered rows)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    raw = b"".join(b"\x00" + row.tobytes() for row in pixels)  # filter type 0 per row
    ihdr = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)  # 8-bit truecolour
    chunks = _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw)) + _chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + chunks


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def image_part(image: bytes) -> dict[str, Any]:
    """The OpenAI chat content part carrying a PNG as a base64 data URL."""
    url = "data:image/png;base64," + base64.b64encode(image).decode("ascii")
    return {"type": "image_url", "image_url": {"url": url}}
