#!/bin/sh
# Newer Vulkan headers for the Vulkan build (docs/devices.md), where the system's are too old.
#
# The pinned llama.cpp's ggml-vulkan uses VK_EXT_layer_settings (vk::LayerSettingEXT, in the
# headers since 1.3.261); Debian 12's libvulkan-dev ships 1.3.239, and the compile fails with
# "error: 'LayerSettingEXT' is not a member of 'vk'". Debian 13's libvulkan-dev (1.4.309) has
# them: this downloads that one package with apt from the machine's own Debian mirror, with a
# private source list and state (the system's apt sources and packages are left alone), and
# unpacks only its include/ under the radixctl cache. The loader, lavapipe and the compilers
# stay Debian 12's; radixctl build --backend vulkan finds these headers there by itself.
# Prints where the headers are, or why none were needed or fetched; exits 0 either way.
set -eu

VERSION=1.4.309.0-1
SUITE=trixie
CACHE=${RADIX_CACHE_DIR:-$HOME/.cache/llama-radix-proxy}
DEST=$CACHE/vulkan-headers/$VERSION

if grep -q VK_EXT_layer_settings /usr/include/vulkan/vulkan_core.h 2>/dev/null; then
    echo "vulkan headers: the system's are new enough (/usr/include/vulkan)"
    exit 0
fi
if [ -f "$DEST/include/vulkan/vulkan.hpp" ]; then
    echo "vulkan headers: $DEST/include"
    exit 0
fi
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
    echo "skip: no apt-get/dpkg-deb to fetch Vulkan headers $VERSION (install headers with VK_EXT_layer_settings, or set VULKAN_SDK)"
    exit 0
fi
# The mirror the system already uses for Debian (deb822 or one-line sources).
MIRROR=$(sed -n 's/^URIs: *\([^ ]*\/debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n 1)
[ -n "$MIRROR" ] || MIRROR=$(sed -n 's/^deb \(\[[^]]*\] \)\{0,1\}\([^ ]*\/debian\) .*/\2/p' /etc/apt/sources.list 2>/dev/null | head -n 1)
if [ -z "$MIRROR" ]; then
    echo "skip: no Debian mirror in the apt sources to fetch Vulkan headers $VERSION from"
    exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/parts"
printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: main\n' "$MIRROR" "$SUITE" > "$tmp/parts/radix.sources"
set -- -o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts="$tmp/parts" \
    -o Dir::State::Lists="$tmp/lists" -o Dir::Cache="$tmp/cache" -o Debug::NoLocking=1 \
    -o APT::Sandbox::User=root
apt-get "$@" -q update >"$tmp/update.log" 2>&1 || { tail -n 5 "$tmp/update.log"; echo "skip: apt-get update of $SUITE failed"; exit 0; }
(cd "$tmp" && apt-get "$@" -q download "libvulkan-dev=$VERSION") >"$tmp/download.log" 2>&1 ||
    { tail -n 5 "$tmp/download.log"; echo "skip: downloading libvulkan-dev $VERSION failed"; exit 0; }
dpkg-deb -x "$tmp"/libvulkan-dev_*.deb "$tmp/x"
mkdir -p "$DEST.tmp"
cp -r "$tmp/x/usr/include" "$DEST.tmp/"
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
echo "vulkan headers: $DEST/include"
