#!/usr/bin/env bash
# What a GPU machine without network needs to run deploy/gpu/check.sh, packed small enough to
# travel with the checkout (at most 64 MiB in all on this workplace's device tool):
#
#   src.tar.xz     the pinned llama.cpp source as `radixctl build` extracts it, without docs,
#                  models, media, benches, tests, examples, .github and the web UI's sources
#                  (none of them is compiled: LLAMA_BUILD_TESTS/EXAMPLES/UI are off); about 8 MB
#   vocab.gguf     the default model's tokenizer keys alone (about 2 MB): what
#                  `radixctl model make SHAPE` copies into the random-weight models of real
#                  shapes, so the 98 MB default model need not travel
#   wheels/        the project's dependencies that the GPU machine's Python may lack (orjson),
#                  for CPython $PY_VERSION on x86-64 manylinux
#   manifest.env   where each goes under the radixctl cache (read by check.sh's `carry` step)
#
#   deploy/gpu/carry.sh [DIR]        default DIR: gpu-carry (ignored by git)
#   PY_VERSION=3.12 WHEELS="orjson"  the target's Python and the wheels to fetch
#
# On the GPU machine: CARRY=gpu-carry VENV=0 PYTHON=python3 deploy/gpu/check.sh (the carry step
# unpacks it first).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
DIR=${1:-$ROOT/gpu-carry}
PY_VERSION=${PY_VERSION:-3.12}
WHEELS=${WHEELS:-orjson}
if [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi

rm -rf "$DIR"
mkdir -p "$DIR/wheels"
# The source and the vocabulary as this machine's cache has them (made here if missing).
read -r SRC VOCAB < <("$PY" - <<'EOF'
from proxy.native.build import pristine_source
from proxy.native.shapes import vocab_path
print(pristine_source(), vocab_path())
EOF
)
CACHE=$(dirname "$(dirname "$SRC")")
TOP=src/$(basename "$SRC")
# Anchored at the source's top: tools/mtmd/models/ is compiled, the top-level models/ is not.
tar -C "$CACHE" -cJf "$DIR/src.tar.xz" \
    --exclude="$TOP/docs" --exclude="$TOP/models" --exclude="$TOP/media" --exclude="$TOP/benches" \
    --exclude="$TOP/tests" --exclude="$TOP/examples" --exclude="$TOP/.github" \
    --exclude="$TOP/tools/server/webui" "$TOP"
cp "$VOCAB" "$DIR/vocab.gguf"
# shellcheck disable=SC2086  # WHEELS is a list of names
"$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: --no-deps \
    --python-version "$PY_VERSION" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$DIR/wheels" $WHEELS
cat >"$DIR/manifest.env" <<EOF
CARRY_SRC=src/$(basename "$SRC")
CARRY_VOCAB=models/$(basename "$VOCAB")
EOF
du -sh "$DIR"/* >&2
total=$(du -sm "$DIR" | cut -f1)
echo "carry: $DIR (${total} MiB); on the GPU machine: CARRY=$(basename "$DIR") VENV=0 deploy/gpu/check.sh" >&2
