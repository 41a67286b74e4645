#!/bin/sh
# Compose v2 on Debian 12 (docs/deploy.md, "Compose v1 and v2"). Debian 12 packages only
# docker-compose 1.29 (v1); Debian 13 packages v2 (docker-compose 2.26.1, a Go binary that
# needs nothing but libc >= 2.34, which Debian 12 has). This downloads that one package with
# apt from the Debian mirror the system already uses (apt checks the archive's signature and
# the package's hash; a private source list and state, the system's apt setup and packages
# are left alone), keeps its binary under the radixctl cache and installs it as the docker CLI
# plugin of this user (${DOCKER_CONFIG:-~/.docker}/cli-plugins/docker-compose), so that
# `docker compose` is compose v2; the system's docker-compose (v1) stays as it is.
# Prints the plugin's path.
set -eu

VERSION=2.26.1-4
SUITE=trixie
CACHE=${RADIX_CACHE_DIR:-$HOME/.cache/llama-radix-proxy}
BIN=$CACHE/compose-v2/$VERSION/docker-compose
PLUGIN=${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins/docker-compose

if [ ! -x "$BIN" ]; then
    command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null \
        || { echo "compose v2: apt-get and dpkg-deb are needed (Debian)" >&2; exit 1; }
    MIRROR=$(sed -n 's/^URIs: *\([^ ]*\/debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n 1)
    [ -n "$MIRROR" ] || MIRROR=$(sed -n 's/^deb \(\[[^]]*\] \)\{0,1\}\([^ ]*\/debian\) .*/\2/p' /etc/apt/sources.list 2>/dev/null | head -n 1)
    [ -n "$MIRROR" ] || { echo "compose v2: no Debian mirror in the apt sources" >&2; exit 1; }
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/parts"
    printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: main\n' "$MIRROR" "$SUITE" >"$tmp/parts/radix.sources"
    set -- -o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts="$tmp/parts" \
        -o Dir::State::Lists="$tmp/lists" -o Dir::Cache="$tmp/cache" -o Debug::NoLocking=1 \
        -o APT::Sandbox::User=root
    echo "compose v2: docker-compose $VERSION from Debian $SUITE ($MIRROR) ..." >&2
    apt-get "$@" -q update >"$tmp/update.log" 2>&1 || { tail -n 5 "$tmp/update.log" >&2; exit 1; }
    (cd "$tmp" && apt-get "$@" -q download "docker-compose=$VERSION") >"$tmp/download.log" 2>&1 \
        || { tail -n 5 "$tmp/download.log" >&2; exit 1; }
    dpkg-deb -x "$tmp"/docker-compose_*.deb "$tmp/x"
    mkdir -p "$(dirname "$BIN")"
    install -m 0755 "$tmp/x/usr/libexec/docker/cli-plugins/docker-compose" "$BIN.tmp"
    mv "$BIN.tmp" "$BIN"
fi
mkdir -p "$(dirname "$PLUGIN")"
install -m 0755 "$BIN" "$PLUGIN"
"$PLUGIN" version >&2
echo "$PLUGIN"
