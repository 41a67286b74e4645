#!/usr/bin/env bash
# Runs inside a check.sh container, in a copy of the working tree: the user's path on the
# distribution's python3 as deploy/Dockerfile does (a venv, `pip install .` from the
# checkout, `radixctl build` run in it, `radixctl model path`), then the unit tests. QUICK=1 replaces the compile with the source fetch and extraction.
set -euo pipefail
export RADIX_CACHE_DIR=/tmp/radix-cache   # fresh: every download and extraction really happens

t0=$(date +%s)
step() { echo "[in-container] $* ($(( $(date +%s) - t0 )) s)" >&2; }

step "$(. /etc/os-release && echo "$PRETTY_NAME"), $(python3 --version), $(gcc --version | head -1), $(cmake --version | head -1)"
python3 -m venv /opt/venv
/opt/venv/bin/pip --version >&2
step "pip install '.[test]'"
/opt/venv/bin/pip install -q --disable-pip-version-check '.[test]'
if [ "${QUICK:-0}" = 1 ]; then
    step "QUICK: fetch and extract the pinned llama.cpp source (no compile)"
    /opt/venv/bin/python -c 'from proxy.native.build import _pristine_source; print(_pristine_source())'
else
    step "radixctl build"
    server=$(/opt/venv/bin/radixctl build)
    step "radixctl build again (cached)"
    [ "$(/opt/venv/bin/radixctl build)" = "$server" ]
    "$server" --version 2>&1 | grep -i version >&2
    "$server" --help 2>&1 | grep -q -- --kvctl || { echo "$server lacks --kvctl: not patched" >&2; exit 1; }
fi
step "radixctl model path"
/opt/venv/bin/radixctl model path
step "pytest -m unit"
/opt/venv/bin/python -m pytest -m unit -q -p no:cacheprovider
step "done"
