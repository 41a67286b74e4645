#!/usr/bin/env bash
# Without Docker Hub (docs/deploy.md, "Without Docker Hub"): the images' Debian 12 base made
# locally with debootstrap and `docker import`, once (a few minutes; root, debootstrap), the
# same image `make deploy-test` and `make portability` use. Prints its name; with an env file
# (deploy/.env) also sets RADIX_BASE_IMAGE, RADIX_RUNTIME_BASE_IMAGE and RADIX_PROXY_BASE_IMAGE
# there, so `docker-compose build` / `docker compose build` pull nothing.
#
#   deploy/local-base.sh deploy/.env
#
#   ENGINE=docker             the container engine CLI
#   RADIX_BASE_ARCH=arm64     also an arm64 base (debootstrap under qemu-user), for the runtime
#                             and proxy images of compose.arm64.yml; RADIX_BASE_IMAGE (the
#                             server's build stage, which cross-compiles) stays this machine's
#   DEBIAN_MIRROR=URL         the Debian mirror (default: the one apt uses here, else deb.debian.org)
set -euo pipefail

ENGINE=${ENGINE:-docker}
HERE=$(cd "$(dirname "$0")" && pwd)
mirror=$(sed -n 's/^URIs: *\([^ ]*\/debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n 1 || true)
[ -n "$mirror" ] || mirror=$(sed -n 's/^deb \(\[[^]]*\] \)\{0,1\}\([^ ]*\/debian\) .*/\2/p' /etc/apt/sources.list 2>/dev/null | head -n 1 || true)
MIRROR=${DEBIAN_MIRROR:-${mirror:-http://deb.debian.org/debian}}
log() { echo "[local-base] $*" >&2; }
"$ENGINE" info >/dev/null 2>&1 || { log "the $ENGINE daemon is not reachable (start dockerd first: docs/deploy.md)"; exit 1; }
# shellcheck source=portability/base-image.sh
. "$HERE/portability/base-image.sh"
image=$(base_image bookworm)
runtime=$image
if [ -n "${RADIX_BASE_ARCH:-}" ]; then
    runtime=$(base_image bookworm "$RADIX_BASE_ARCH")
fi
if [ $# -ge 1 ]; then
    [ -f "$1" ] || { log "$1: no such file (cp deploy/.env.example deploy/.env first)"; exit 1; }
    for pair in RADIX_BASE_IMAGE="$image" RADIX_RUNTIME_BASE_IMAGE="$runtime" RADIX_PROXY_BASE_IMAGE="$runtime"; do
        key=${pair%%=*}
        if grep -q "^$key=" "$1"; then
            sed -i "s|^$key=.*|$pair|" "$1"
        else
            echo "$pair" >>"$1"
        fi
    done
    log "$1: RADIX_BASE_IMAGE set to $image, RADIX_RUNTIME_BASE_IMAGE and RADIX_PROXY_BASE_IMAGE to $runtime"
fi
echo "$runtime"
