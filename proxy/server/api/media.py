"""Chat requests with media (images, audio, video) for a server with a projector (``--mmproj``).

The proxy never guesses the tokens of media: a server with a projector tokenizes the request
exactly as its completion will (``/kvctl/tokenize``, patch 0027), each cell of a media chunk that
sits at a position per cell keyed by a token below -1 made from the chunk's content hash, so the
tree, the slots and every move key media like text (a restore names the chunks, and the slot
takes them, so the server's next request reuses them by hash). A chunk no move can name (M-RoPE's
image cells share their first position) ends what the proxy keys: the server computes it and what
follows, and reuses them itself on the slot that holds them (route A); the chunks' content hashes
steer such a request to a slot that served the same media after the same text.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from proxy.server.dataplane.kvctl import Tokenized
from proxy.server.ops.models import ModelEntry
from proxy.server.ops.runtime import Runtime

__all__ = ["MEDIA_PART_TYPES", "chat_tokens", "has_media"]

#: Content part types llama-server loads as media (server-common.cpp, oaicompat_content_load_media).
MEDIA_PART_TYPES = frozenset({"image_url", "input_audio", "input_video", "video_url"})


def has_media(body: dict[str, Any]) -> bool:
    """Whether a chat request's messages hold a media part (malformed shapes are the server's
    to refuse)."""
    messages = body.get("messages")
    for msg in messages if isinstance(messages, list) else ():
        content = msg.get("content") if isinstance(msg, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") in MEDIA_PART_TYPES:
                return True
    return False


async def chat_tokens(
    runtime: Runtime, body: dict[str, Any], headers: dict[str, str], model: ModelEntry
) -> tuple[np.ndarray, Tokenized | None]:
    """A chat request's tokens exactly as the server makes them; with media, as a server with a
    projector keys them (up to a chunk no move can name), and the tokenization (its chunks)."""
    if has_media(body):
        tokenized = await runtime.media_tokens(body, model)
        return tokenized.keyed(), tokenized
    text = await runtime.render(body, headers, model)
    return await runtime.tokenize(text, model), None
