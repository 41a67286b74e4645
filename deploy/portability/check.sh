#!/usr/bin/env bash
# Portability check: install and build on the oldest and newest Python that distributions
# ship within requires-python, as those distributions ship them: Debian 12 bookworm
# (python3 3.11.2) and Debian 13 trixie (python3 3.13). In a fresh container per suite:
# `pip install '.[test]'`, `radixctl build`, `radixctl model path`, `pytest -m unit`.
#
# Base images are made here with debootstrap + `docker import` (no registry needed), once;
# later runs reuse them. Needs root, debootstrap and a Debian mirror (DEBIAN_MIRROR), PyPI.
#
#   deploy/portability/check.sh [suite ...]      default: bookworm trixie
#   QUICK=1 ...   skip the llama.cpp compile (about 8 min per suite on 2 cores): fetch and
#                 extract the pinned source only, the step that crashed on 3.11.2
#   ENGINE=podman ...   another docker-compatible engine
#   CA_BUNDLE=/path ... a CA bundle for pip in the containers (default: $PIP_CERT if set)
#
# Exits 0 with a "skip:" line where no container engine is reachable.
set -euo pipefail

ENGINE=${ENGINE:-docker}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
QUICK=${QUICK:-0}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE="$ROOT/deploy/portability"
SUITES=("$@")
[ ${#SUITES[@]} -gt 0 ] || SUITES=(bookworm trixie)

log() { echo "[portability] $*" >&2; }

if ! command -v "$ENGINE" >/dev/null 2>&1 || ! "$ENGINE" info >/dev/null 2>&1; then
    log "skip: no container engine ($ENGINE not installed or its daemon not reachable)."
    log "      To run it: apt-get install -y docker.io debootstrap, start dockerd, then make portability."
    exit 0
fi

. "$HERE/base-image.sh"   # base_image SUITE: debootstrap + docker import, once

# A CA bundle for pip behind a TLS-intercepting proxy: the host's, when pip on the host uses one.
ca=${CA_BUNDLE:-${PIP_CERT:-}}
ca_args=()
if [ -n "$ca" ] && [ -f "$ca" ]; then
    ca_args=(-v "$ca:/etc/ssl/host-ca.pem:ro" -e PIP_CERT=/etc/ssl/host-ca.pem -e SSL_CERT_FILE=/etc/ssl/host-ca.pem)
fi

status=0
summary=()
for suite in "${SUITES[@]}"; do
    base=$(base_image "$suite")
    image="radix-portability/$suite:tools"
    buildlog=/var/tmp/radix-portability-$suite-image.log
    log "$suite: image with the system packages deploy/Dockerfile installs (log: $buildlog) ..."
    DOCKER_BUILDKIT=0 "$ENGINE" build --network host --build-arg BASE="$base" \
        -t "$image" -f "$HERE/Dockerfile" "$HERE" >"$buildlog" 2>&1 \
        || { log "image build failed:"; tail -15 "$buildlog" >&2; exit 1; }
    log "$suite: run the check (QUICK=$QUICK) ..."
    started=$(date +%s)
    # The working tree as git sees it (tracked and untracked, ignored files left out),
    # streamed in: nothing of the host's .venv or cache leaks into the container.
    if (cd "$ROOT" && git ls-files -z -co --exclude-standard | xargs -0 tar -c --ignore-failed-read 2>/dev/null) \
        | "$ENGINE" run --rm -i --network host -e QUICK="$QUICK" "${ca_args[@]}" "$image" \
            bash -c 'mkdir -p /src && tar -x -C /src && cd /src && bash deploy/portability/in-container.sh'; then
        result=pass
    else
        result=FAIL
        status=1
    fi
    summary+=("$suite: $result in $(( $(date +%s) - started )) s")
done
for line in "${summary[@]}"; do log "$line"; done
exit $status
