"""The tests' tiny random-weight projector and images (proxy/native/projectors.py's "tiny" shape).

The projector is a llava-style CLIP of projector type MLP over a 32x32 image cut into 8x8
patches (a ViT of 2 layers at width 32, one of which runs), then the two-layer MLP up to the text
model's width: each image is 16 tokens, encoded in a few milliseconds.

    mmproj = tiny_mmproj(576)                 # for SmolLM2-135M (n_embd 576)
    part = image_part(tiny_png(seed=1))       # an OpenAI image_url content part
"""

from __future__ import annotations

from pathlib import Path

from proxy.native.projectors import PROJECTORS, projector
from proxy.traffic.images import image_part, png

__all__ = ["IMAGE_SIZE", "N_IMAGE_TOKENS", "image_part", "tiny_mmproj", "tiny_png"]

IMAGE_SIZE = PROJECTORS["tiny"].image_size
N_IMAGE_TOKENS = PROJECTORS["tiny"].n_image_tokens


def tiny_mmproj(n_embd: int, seed: int = 0) -> Path:
    """The tiny projector for a text model of width ``n_embd``, written once into the cache."""
    return projector("tiny", n_embd, seed)


def tiny_png(seed: int, size: int = IMAGE_SIZE) -> bytes:
    """A ``size`` x ``size`` PNG of seeded random pixels."""
    return png(seed, size)
