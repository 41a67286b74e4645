# Sourced by deploy/portability/check.sh and deploy/test/run.sh. Needs ENGINE, MIRROR and log().
# base_image SUITE [ARCH] prints the name of a minimal Debian SUITE image, made once with
# debootstrap and `docker import` (no registry needed) and reused afterwards. ARCH (a Debian
# architecture, e.g. arm64) other than this machine's makes an image of that platform: its
# second stage runs under qemu-user (qemu-user-static, registered with binfmt_misc).
base_image() {  # debootstrap a minimal Debian and import it as an image, once
    local suite=$1 arch=${2:-} image="radix-portability/debian:$1" platform=()
    if [ -n "$arch" ] && [ "$arch" != "$(dpkg --print-architecture)" ]; then
        image="$image-$arch"
        platform=(--platform "linux/$arch")
    else
        arch=""
    fi
    if "$ENGINE" image inspect "$image" >/dev/null 2>&1; then
        echo "$image"
        return
    fi
    command -v debootstrap >/dev/null || { log "debootstrap missing: apt-get install -y debootstrap"; exit 1; }
    [ "$(id -u)" = 0 ] || { log "debootstrap needs root"; exit 1; }
    local rootfs
    rootfs=$(mktemp -d /var/tmp/radix-rootfs-"$suite".XXXXXX)
    log "$suite${arch:+ ($arch)}: debootstrap --variant=minbase from $MIRROR (once; a few minutes) ..."
    debootstrap ${arch:+--arch="$arch"} --variant=minbase "$suite" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 \
        || { log "debootstrap failed, see $rootfs.log"; tail -5 "$rootfs.log" >&2; exit 1; }
    if [ -z "$arch" ]; then
        tar -C "$rootfs" -c . | "$ENGINE" import - "$image" >/dev/null
    else
        # `docker import --platform` labels the image with the daemon's own architecture
        # (docker 20.10): an image FROM scratch built for the platform carries the right one.
        local ctx cli
        ctx=$(mktemp -d /var/tmp/radix-base-"$suite-$arch".XXXXXX)
        tar -C "$rootfs" -cf "$ctx/rootfs.tar" .
        printf 'FROM scratch\nADD rootfs.tar /\nCMD ["bash"]\n' >"$ctx/Dockerfile"
        cli=$(buildkit_cli)
        [ -n "$cli" ] || { log "no BuildKit-capable $ENGINE client (install docker-buildx)"; exit 1; }
        DOCKER_BUILDKIT=1 "$cli" build -q "${platform[@]}" -t "$image" "$ctx" >/dev/null
        rm -rf "$ctx"
    fi
    rm -rf "$rootfs" "$rootfs.log"
    echo "$image"
}

# BuildKit (secret and cache mounts, --platform): a client with buildx, or one older than 23
# (built in). Prints its path, or nothing.
buildkit_cli() {
    local cli major
    for cli in $(which -a "$ENGINE" | awk '!seen[$0]++'); do
        if "$cli" buildx version >/dev/null 2>&1; then echo "$cli"; return; fi
        major=$("$cli" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)
        if [ -n "$major" ] && [ "$major" -lt 23 ] 2>/dev/null; then echo "$cli"; return; fi
    done
}
