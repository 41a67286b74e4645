"""Writes a deeper copy of a GGUF model: its transformer blocks repeated until the file is at
least --min-mb, the block count in the metadata raised to match (deploy/test/run.sh's
model-volume race check needs a model large enough that copying it takes a while).

Every tensor keeps its type and bytes, so llama-server loads the result as a valid (slower,
deeper) model with the same vocabulary. No weights are downloaded: the input is the image's
own default model.

    deep_model.py IN.gguf OUT.gguf --min-mb 1024
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import gguf

BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


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
    block_bytes = sum(int(t.n_bytes) for t in reader.tensors if BLOCK.match(t.name))
    other_bytes = sum(int(t.n_bytes) for t in reader.tensors if not BLOCK.match(t.name))
    if block_bytes <= 0:
        raise SystemExit(f"{src}: no blk.N tensors")
    repeat = max(1, math.ceil((min_bytes - other_bytes) / block_bytes))

    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = n_blocks * repeat if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)

    # Tensors in the input's order, each block's tensors once per repeat (blk.(r*n+i)).
    plan: list[tuple[str, gguf.ReaderTensor]] = []
    for tensor in reader.tensors:
        m = BLOCK.match(tensor.name)
        if not m:
            plan.append((tensor.name, tensor))
    for r in range(repeat):
        for tensor in reader.tensors:
            m = BLOCK.match(tensor.name)
            if m:
                plan.append((f"blk.{r * n_blocks + int(m.group(1))}.{m.group(2)}", tensor))
    for name, tensor in plan:
        writer.add_tensor_info(
            name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, tensor in plan:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
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
