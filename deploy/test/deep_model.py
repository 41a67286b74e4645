"""Writes a deeper copy of a GGUF model: its transformer blocks' quantized matrices widened to
F16, the blocks repeated until the file is at least --min-mb, the block count in the metadata
raised to match (deploy/test/run.sh's model-volume race check needs a model large enough that
copying it takes a while).

The values are the input's (dequantized), so llama-server loads the result as a valid (slower,
deeper) model with the same vocabulary. Widening keeps the block count under llama.cpp's
limit (LLAMA_MAX_LAYERS, 512: a deeper model crashes the loader). No weights are downloaded:
the input is the image's own default model.

    deep_model.py IN.gguf OUT.gguf --min-mb 1024
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import gguf
import numpy as np

BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
MAX_BLOCKS = 512  # llama.cpp's LLAMA_MAX_LAYERS
PLAIN = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)


def widened(tensor: gguf.ReaderTensor) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """A block tensor's data as written: quantized matrices as F16, the rest unchanged."""
    if tensor.tensor_type in PLAIN:
        return np.asarray(tensor.data), tensor.tensor_type
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float16)
    return values, gguf.GGMLQuantizationType.F16


def deepen(src: Path, dst: Path, min_bytes: int) -> tuple[int, int, int]:
    reader = gguf.GGUFReader(src)
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise SystemExit(f"{src}: no general.architecture")
    arch = str(arch_field.contents())
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    count_field = reader.get_field(count_key)
    if count_field is None:
        raise SystemExit(f"{src}: no {count_key}")
    n_blocks = int(count_field.contents())
    blocks = {t.name: widened(t) for t in reader.tensors if BLOCK.match(t.name)}
    block_bytes = sum(int(data.nbytes) for data, _ in blocks.values())
    other_bytes = sum(int(t.n_bytes) for t in reader.tensors if not BLOCK.match(t.name))
    if block_bytes <= 0:
        raise SystemExit(f"{src}: no blk.N tensors")
    repeat = max(1, math.ceil((min_bytes - other_bytes) / block_bytes))
    if n_blocks * repeat > MAX_BLOCKS:
        raise SystemExit(f"{src}: {n_blocks * repeat} blocks needed, more than llama.cpp's {MAX_BLOCKS}")

    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = n_blocks * repeat if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)

    # Tensors in the input's order, each block's tensors once per repeat (blk.(r*n+i)).
    plan: list[tuple[str, np.ndarray, gguf.GGMLQuantizationType]] = []
    for tensor in reader.tensors:
        if not BLOCK.match(tensor.name):
            plan.append((tensor.name, np.asarray(tensor.data), tensor.tensor_type))
    for r in range(repeat):
        for tensor in reader.tensors:
            m = BLOCK.match(tensor.name)
            if m:
                data, qtype = blocks[tensor.name]
                plan.append((f"blk.{r * n_blocks + int(m.group(1))}.{m.group(2)}", data, qtype))
    for name, data, qtype in plan:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in plan:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    return n_blocks, n_blocks * repeat, dst.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--min-mb", type=int, default=1024, help="smallest output size, MiB")
    args = parser.parse_args()
    before, after, size = deepen(args.src, args.dst, args.min_mb << 20)
    print(f"{args.dst}: {before} -> {after} blocks, {size / 2**20:.0f} MiB", file=sys.stderr)


if __name__ == "__main__":
    main()
