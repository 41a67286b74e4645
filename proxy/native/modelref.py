"""What ``--model`` names: the default model, a random-weight model of a real shape
(``shape:NAME[:QUANT]``, proxy/native/shapes.py) or a GGUF file."""

from __future__ import annotations

from pathlib import Path

from proxy.errors import ConfigError
from proxy.native.model import default_model_path
from proxy.native.shapes import parse_shape_ref, shape_model


def resolve_model(model: str | None) -> Path:
    """``None`` or ``"default"`` gives the default model, ``shape:NAME[:QUANT]`` a random-weight
    model of that shape (written once, proxy/native/shapes.py); anything else must be a GGUF file."""
    if not model or model == "default":
        return default_model_path()
    if model.startswith("shape:"):
        return shape_model(*parse_shape_ref(model))
    path = Path(model).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"model file {path} does not exist",
            fix="pass the path of a .gguf file, shape:NAME for a random-weight model of a real "
            "shape (radixctl model shapes), or omit --model for the default model",
        )
    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ConfigError(f"{path} is not a GGUF file", fix="pass a .gguf model file")
    return path
