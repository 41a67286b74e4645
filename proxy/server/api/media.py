"""Chat requests with media (images, audio, video) for a server with a projector (``--mmproj``).

The proxy never guesses the tokens of media: a server renders the prompt (its
``/apply-template`` marks each media part with its own marker) and the proxy keys the text
before the first part, which libmtmd tokenizes alone, exactly as the proxy does. That text is
routed, restored and shared like any prompt; the server computes the media and what follows,
and reuses what its slot holds of them itself (it matches media chunks by content hash). Each
media part's key steers the request to a slot that served the same media after the same text.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import orjson

from proxy.server.ops.models import ModelEntry
from proxy.server.ops.runtime import Runtime

__all__ = ["MEDIA_PART_TYPES", "chat_tokens", "media_keys"]

#: Content part types llama-server loads as media (server-common.cpp, oaicompat_content_load_media).
MEDIA_PART_TYPES = frozenset({"image_url", "input_audio", "input_video", "video_url"})


def media_keys(body: dict[str, Any]) -> tuple[str, ...]:
    """A key per media part of the request's messages, in order (``()``: text only). The key is a
    hash of the part as sent (a data URL, a URL): a tie-break between slots, never a cache key
    (the server checks the media it holds by the decoded content's hash)."""
    keys: list[str] = []
    messages = body.get("messages")
    for msg in messages if isinstance(messages, list) else ():
        content = msg.get("content") if isinstance(msg, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") in MEDIA_PART_TYPES:
                kind = str(part["type"])
                raw = orjson.dumps([kind, part.get(kind)], option=orjson.OPT_SORT_KEYS)
                keys.append(hashlib.blake2b(raw, digest_size=16).hexdigest())
    return tuple(keys)


async def chat_tokens(
    runtime: Runtime, body: dict[str, Any], headers: dict[str, str], model: ModelEntry
) -> tuple[np.ndarray, tuple[str, ...]]:
    """A chat request's tokens exactly as the server makes them, and its media keys; with media,
    the tokens of the text before the first media part."""
    media = media_keys(body)
    if media:
        text = await runtime.text_before_media(body, headers, model)
    else:
        text = await runtime.render(body, headers, model)
    return await runtime.tokenize(text, model), media
