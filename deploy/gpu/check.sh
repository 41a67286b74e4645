#!/usr/bin/env bash
# KV in device memory on an NVIDIA GPU (issue 26, docs/devices.md): run on a machine with an
# NVIDIA GPU, its driver and a CUDA toolkit (nvcc, CMake), from the project's checkout.
#
#   1. builds llama-server with ggml's CUDA backend, stock then patched
#      (`radixctl build --backend cuda`: the default spec, which the tests and the benches use;
#      GGML_NATIVE, so CMake compiles for the GPU it finds; flash attention kernels in);
#   2. RADIX_TEST_CUDA=1 pytest tests/integration/test_cuda.py: the device KV-move tests
#      (tests/integration/device_kv.py: /kvctl round trips, routes A/A+H/H/S/S+H against stock
#      CUDA from scratch) with -ngl 99, each server's log checked to put every KV buffer on CUDA0;
#   3. radixctl bench kvctl, restore and agents with --build-backend cuda --gpu-layers 99.
#
# PLAN=shapes runs the realistic shapes instead (issue 45 item 5; about 8 minutes with the
# bounded build): carry preflight build models shape-kvctl shape-restore shape-multiround
# shape-fanout, that is random-weight models shaped like Llama-3.2-1B and Llama-3.1-8B
# (`radixctl model make`), the PCIe copy rate of pinned memory (pcie_probe.py), `bench kvctl` at
# 4k/16k tokens on the 8B shape, `bench restore` and `multi-round` on both shapes and `fanout`
# on the 1B, each against stock CUDA in the same run.
#
# Writes under $OUT (default gpu-check-out/<UTC time>): summary.txt (machine, versions, each
# step's status and seconds; machine.txt alone), <step>.log for every step, tests.xml (JUnit), kvctl/, restore/,
# agents/ (the benches' report.md and report.json, logs), builds.json (the two build.json).
#
#   OUT=DIR          where the reports go
#   PLAN=suite|shapes  the default steps: the suite above, or the realistic shapes
#   STEPS="..."      which steps, in order (default: the plan's)
#   CARRY=DIR        what deploy/gpu/carry.sh packed (source, vocabulary, wheels): the `carry`
#                    step unpacks it into the radixctl cache and puts the wheels on PYTHONPATH
#   DRY_RUN=1        print what would run, after the checks that need no GPU; build nothing
#   PYTHON=python3   the interpreter for the project's virtual environment (3.11 or newer)
#   VENV=0           no virtual environment: $PYTHON already has the project's packages (e.g.
#                    from carried wheels) and runs this checkout from PYTHONPATH
#   RADIX_BUILD_CMAKE_ARGS   extra CMake arguments of every build (shell words), e.g.
#                    "-DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_CUDA_FA=OFF" for a bounded build
#                    (one architecture, no flash-attention kernels; the tests and the benches
#                    then use that build: its own cache key)
#   KVCTL_ARGS, RESTORE_ARGS, AGENTS_ARGS   extra arguments of each bench (e.g. --sizes 512,2048)
#   PYTEST_ARGS      extra pytest arguments (e.g. -k "lossless or routes")
#   SHAPE_SMALL, SHAPE_LARGE  the shapes of PLAN=shapes (default llama-3.2-1b, llama-3.1-8b)
#   MULTIROUND_ARGS, FANOUT_ARGS  extra arguments of those benches
#   BACKEND=cpu NGL=0  the benches' build backend and offloaded layers (default cuda, 99): a
#                    rehearsal of the bench steps on a machine without a GPU
#
# Without network: create .venv beforehand (or set PIP_NO_INDEX=1 PIP_FIND_LINKS=<wheels>), and
# carry the radixctl cache (RADIX_CACHE_DIR: downloads/ holds the llama.cpp sdist and the model
# wheel). cuBLAS: the toolkit's, else a Python environment's nvidia/cu13 (PyPI's nvidia-cublas,
# found on sys.path), else `radixctl build` fetches the pinned wheel; RADIX_CUBLAS_DIR overrides.
# Every step runs even after one failed; the exit status is 1 if any failed.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT" || exit 2
OUT=${OUT:-$ROOT/gpu-check-out/$(date -u +%Y%m%dT%H%M%SZ)}
PLAN=${PLAN:-suite}
case "$PLAN" in
    suite) DEFAULT_STEPS="preflight build tests kvctl restore agents" ;;
    shapes) DEFAULT_STEPS="carry preflight build models shape-kvctl shape-restore shape-multiround shape-fanout" ;;
    *) echo "unknown PLAN $PLAN (suite, shapes)" >&2 && exit 2 ;;
esac
STEPS=${STEPS:-$DEFAULT_STEPS}
CARRY=${CARRY:-}
DRY_RUN=${DRY_RUN:-0}
PYTHON=${PYTHON:-python3}
VENV=${VENV:-1}
if [ "$VENV" = 1 ]; then
    PY=$ROOT/.venv/bin/python
    RADIXCTL=("$ROOT/.venv/bin/radixctl")
else
    PY=$PYTHON
    RADIXCTL=("$PYTHON" -m proxy.cli)
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
# BACKEND=cpu NGL=0 rehearses the bench steps on a machine without a GPU (docs/devices.md).
GPU=(--build-backend "${BACKEND:-cuda}" --gpu-layers "${NGL:-99}")
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
failed=0
t0=$(date +%s)

log() { echo "[gpu-check] $* ($(($(date +%s) - t0)) s)" | tee -a "$SUMMARY" >&2; }

# run NAME CMD...: CMD's output to $OUT/NAME.log (and the terminal), its status and time to the summary.
run() {
    local name=$1
    shift
    if [ "$DRY_RUN" = 1 ]; then
        log "dry run: $name: $*"
        return 0
    fi
    local start=$SECONDS status
    log "$name: $*"
    "$@" 2>&1 | tee "$OUT/$name.log"
    status=${PIPESTATUS[0]}
    if [ "$status" = 0 ]; then
        log "$name: passed in $((SECONDS - start)) s"
    else
        log "$name: FAILED (exit $status) in $((SECONDS - start)) s, see $OUT/$name.log"
        failed=1
    fi
    return "$status"
}

# The toolkit's cuBLAS, else the first nvidia/cu13 (or cu12's nvidia/cublas) on a Python's path.
find_cublas() {
    local nvcc root py dir header cand
    nvcc=$(command -v nvcc) || return 0
    root=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
    for header in "$root"/include/cublas_v2.h "$root"/targets/*/include/cublas_v2.h; do
        if [ -f "$header" ]; then
            echo "toolkit"
            return 0
        fi
    done
    for py in "$PYTHON" python3 /opt/torch/.venv/bin/python3; do
        command -v "$py" >/dev/null || continue
        for dir in $("$py" -c 'import sys; print(" ".join(p for p in sys.path if p))' 2>/dev/null); do
            for cand in "$dir"/nvidia/cu13 "$dir"/nvidia/cublas; do
                if [ -f "$cand/include/cublas_v2.h" ] && ls "$cand"/lib/libcublas.so* >/dev/null 2>&1; then
                    echo "$cand"
                    return 0
                fi
            done
        done
    done
}

preflight() {
    local ok=1
    {
        echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
        echo "host: $(uname -srm), $(nproc) CPUs"
        if command -v nvidia-smi >/dev/null; then
            nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader || ok=0
        else
            echo "nvidia-smi: not found"
            ok=0
        fi
        if command -v nvcc >/dev/null; then nvcc --version | tail -n 2; else echo "nvcc: not found" && ok=0; fi
        if command -v cmake >/dev/null; then cmake --version | head -n 1; else echo "cmake: not found" && ok=0; fi
        "$PYTHON" --version || ok=0
    } >"$OUT/machine.txt" 2>&1
    tee -a "$SUMMARY" <"$OUT/machine.txt" >&2
    if [ -z "${RADIX_CUBLAS_DIR:-}" ]; then
        local cub
        cub=$(find_cublas)
        case "$cub" in
            toolkit) log "cuBLAS: the toolkit's" ;;
            "") log "cuBLAS: none found; radixctl build fetches PyPI's nvidia-cublas (needs the network)" ;;
            *)
                export RADIX_CUBLAS_DIR=$cub
                log "cuBLAS: RADIX_CUBLAS_DIR=$cub"
                ;;
        esac
    fi
    if [ -n "${RADIX_CUBLAS_DIR:-}" ]; then
        export LD_LIBRARY_PATH=$RADIX_CUBLAS_DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    fi
    log "build CMake arguments: ${RADIX_BUILD_CMAKE_ARGS:-none}"
    if [ "$VENV" = 1 ] && [ ! -x "${RADIXCTL[0]}" ]; then
        if [ "$DRY_RUN" = 1 ]; then
            log "dry run: make venv PYTHON=$PYTHON"
        else
            make venv PYTHON="$PYTHON" 2>&1 | tee "$OUT/venv.log" || ok=0
        fi
    fi
    [ "$ok" = 1 ] || { [ "$DRY_RUN" = 1 ] && log "dry run: preflight found no GPU toolchain (expected without a GPU)"; }
    [ "$ok" = 1 ] || [ "$DRY_RUN" = 1 ]
}

build() {
    run build-stock "${RADIXCTL[@]}" build --backend cuda --variant stock || return 1
    run build-patched "${RADIXCTL[@]}" build --backend cuda || return 1
    [ "$DRY_RUN" = 1 ] && return 0
    local bin
    {
        echo "["
        for variant in stock patched; do
            bin=$("${RADIXCTL[@]}" build --backend cuda --variant "$variant")
            cat "$(dirname "$bin")/build.json"
            [ "$variant" = stock ] && echo ","
        done
        echo "]"
    } >"$OUT/builds.json"
    bin=$("${RADIXCTL[@]}" build --backend cuda)
    ldd "$bin" | tee -a "$SUMMARY" | grep -q "not found" && log "build: libraries not found (above)"
    "$bin" --list-devices 2>&1 | tee -a "$SUMMARY"
}

tests() {
    # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
    run tests env RADIX_TEST_CUDA=1 PYTHONUNBUFFERED=1 "$PY" -m pytest tests/integration/test_cuda.py \
        -v -rs --durations=0 --junitxml="$OUT/tests.xml" ${PYTEST_ARGS:-}
    [ "$DRY_RUN" = 1 ] || log "tests: $(tail -n 1 "$OUT/tests.log")"
}

# shellcheck disable=SC2086  # *_ARGS are lists of words
bench_kvctl() { run kvctl "${RADIXCTL[@]}" bench kvctl "${GPU[@]}" --out "$OUT/kvctl" ${KVCTL_ARGS:-}; }
# shellcheck disable=SC2086
bench_restore() { run restore "${RADIXCTL[@]}" bench restore "${GPU[@]}" --out "$OUT/restore" ${RESTORE_ARGS:-}; }
# shellcheck disable=SC2086
bench_agents() { run agents "${RADIXCTL[@]}" bench agents "${GPU[@]}" --out "$OUT/agents" ${AGENTS_ARGS:-}; }

# Unpack what carry.sh packed: the source where `radixctl build` extracts it, the vocabulary
# where `radixctl model make` looks for it, the wheels into a directory on PYTHONPATH.
carry() {
    [ -n "$CARRY" ] || { log "carry: no CARRY directory given; nothing to unpack"; return 0; }
    [ -f "$CARRY/manifest.env" ] || { log "carry: $CARRY/manifest.env missing (run deploy/gpu/carry.sh)"; return 1; }
    # shellcheck disable=SC1091
    . "$CARRY/manifest.env"
    local cache=${RADIX_CACHE_DIR:-$HOME/.cache/llama-radix-proxy}
    if [ "$DRY_RUN" = 1 ]; then
        log "dry run: unpack $CARRY into $cache ($CARRY_SRC, $CARRY_VOCAB) and its wheels"
        return 0
    fi
    mkdir -p "$cache/models" "$OUT/site"
    [ -d "$cache/$CARRY_SRC" ] || tar -C "$cache" -xJf "$CARRY/src.tar.xz" || return 1
    cp "$CARRY/vocab.gguf" "$cache/$CARRY_VOCAB" || return 1
    # A wheel whose module the interpreter already imports is skipped (it may be built for
    # another Python: carry.sh packs for the GPU image's); the others must install.
    local whl mod need=()
    for whl in "$CARRY"/wheels/*.whl; do
        [ -f "$whl" ] || continue
        mod=$(basename "$whl"); mod=${mod%%-*}
        "$PYTHON" -c "import $mod" 2>/dev/null || need+=("$whl")
    done
    if [ ${#need[@]} -gt 0 ]; then
        "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps \
            --target "$OUT/site" "${need[@]}" || return 1
        export PYTHONPATH=$OUT/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    log "carry: unpacked into $cache"
}

# The random-weight models of real shapes the shape steps use (written once each).
SHAPE_SMALL=${SHAPE_SMALL:-llama-3.2-1b}
SHAPE_LARGE=${SHAPE_LARGE:-llama-3.1-8b}
models() {
    run model-small "${RADIXCTL[@]}" model make "$SHAPE_SMALL" || return 1
    run model-large "${RADIXCTL[@]}" model make "$SHAPE_LARGE" || return 1
    # The limit a host restore is read against: pinned host <-> device copies of 512 MiB.
    # (CUDA only: a BACKEND=cpu rehearsal has no device to copy to.)
    if [ "${BACKEND:-cuda}" != cuda ]; then
        log "pcie: skipped (BACKEND=${BACKEND})"
        return 0
    fi
    run pcie "$PY" "$ROOT/deploy/gpu/pcie_probe.py" --mib 512 --out "$OUT/pcie.json"
}

# shape_bench NAME WORKLOAD SHAPE ARGS...: one bench of one shape against stock CUDA.
shape_bench() {
    local name=$1 workload=$2 shape=$3
    shift 3
    run "$name" "${RADIXCTL[@]}" bench "$workload" "${GPU[@]}" --model "shape:$shape" --out "$OUT/$name" "$@"
}
# shellcheck disable=SC2086  # *_ARGS are lists of words
shape_kvctl() {
    # 16k tokens in one slot of the 8B shape: 2 GiB of f16 KV, one slot of a 32k pool.
    shape_bench kvctl-8b kvctl "$SHAPE_LARGE" --sizes 4096,16384 --reps 3 -np 2 -c 40960 ${KVCTL_ARGS:-}
}
# shellcheck disable=SC2086
shape_restore() {
    shape_bench restore-1b restore "$SHAPE_SMALL" --arms legacy,proxy --prompt-tokens 4000 --rounds 2 ${RESTORE_ARGS:-}
    shape_bench restore-8b restore "$SHAPE_LARGE" --arms legacy,proxy --prompt-tokens 4000 --rounds 2 ${RESTORE_ARGS:-}
}
# shellcheck disable=SC2086
shape_multiround() {
    shape_bench multiround-1b multi-round "$SHAPE_SMALL" --interval-ms 400 ${MULTIROUND_ARGS:-}
    shape_bench multiround-8b multi-round "$SHAPE_LARGE" --interval-ms 400 ${MULTIROUND_ARGS:-}
}
# shellcheck disable=SC2086
shape_fanout() { shape_bench fanout-1b fanout "$SHAPE_SMALL" --arms legacy,proxy ${FANOUT_ARGS:-}; }

log "output: $OUT"
for step in $STEPS; do
    case "$step" in
        carry) carry || { log "carry failed"; exit 1; } ;;
        preflight) preflight || { log "preflight failed: no GPU toolchain here"; exit 1; } ;;
        build) build || log "build failed: the later steps would build again; stopping" ;;
        tests) tests ;;
        kvctl) bench_kvctl ;;
        restore) bench_restore ;;
        agents) bench_agents ;;
        models) models || log "models failed: the shape steps would make them again" ;;
        shape-kvctl) shape_kvctl ;;
        shape-restore) shape_restore ;;
        shape-multiround) shape_multiround ;;
        shape-fanout) shape_fanout ;;
        *)
            log "unknown step $step (carry preflight build tests kvctl restore agents models shape-kvctl shape-restore shape-multiround shape-fanout)"
            exit 2
            ;;
    esac
    if [ "$step" = build ] && [ "$failed" = 1 ]; then break; fi
done
log "done: $([ "$failed" = 0 ] && echo "every step passed" || echo "some step FAILED") (summary $SUMMARY)"
exit "$failed"
