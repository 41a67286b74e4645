#!/bin/bash
# Projections of the 1B, 8B and 32B shapes through the simulator (docs/scale.md).
# 1B on this CPU: `radixctl sim calibrate` on an idle stock server of the 1B shape
# (-np 4 -c 16384 -t 2, --words 300,1300) and the 1B kvctl bench's move rates.
# Everything else is scaled or assumed: see ../README.md, Projections.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
R=".venv/bin/radixctl sim run --servers 8,16 --policies cache-aware,least-loaded,round-robin"
OUT=docs/results/2026-12-05-shapes-1b/projections
# name            prefill  ctx    decode  move MB/s call s  bytes/token  host MiB  load
while read -r name pf ctx dec mbs call bpt ram load; do
  $R --prefill-tok-s "$pf" --prefill-ctx-tokens "$ctx" --decode-tok-s "$dec" --move-mb-s "$mbs" \
     --move-call-s "$call" --bytes-per-token "$bpt" --cache-ram-mib "$ram" --load "$load" --out "$OUT/$name.md"
done <<'TABLE'
1b-cpu            114.7    4664   7.1     3000      0.04    32768        8192      0.5
8b-cpu            15.9     4664   1.0     3000      0.04    131072       16384     0.067
32b-cpu           3.57     4664   0.24    3000      0.04    262144       32768     0.015
8b-gpu-today      10000    16000  60      2000      0.06    131072       16384     6
8b-gpu-pinned     10000    16000  60      20000     0.01    131072       16384     6
32b-gpu-today     2200     16000  25      2000      0.06    262144       32768     2
32b-gpu-pinned    2200     16000  25      20000     0.01    262144       32768     2
TABLE
