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

# seed_build_cache BASE BINARY: the cached build holding BINARY (radixctl's bin/<key>/ folder) into
# the BuildKit cache mount deploy/Dockerfile builds in for BASE, so the image's `radixctl build`
# finds it (same content key) instead of compiling. Needs BUILD_CLI (buildkit_cli), ENGINE, log().
seed_build_cache() {
    local base=$1 binary=$2 seed slug
    seed=$(mktemp -d /var/tmp/radix-seed.XXXXXX)
    mkdir -p "$seed/bin" && cp -a "$(dirname "$binary")" "$seed/bin/"
    slug=$(printf %s "$base" | tr -c 'A-Za-z0-9.-' _)   # as deploy/Dockerfile names the cache
    printf 'FROM %s\nRUN --mount=type=cache,target=/cache --mount=type=bind,source=.,target=/seed mkdir -p /cache/%s && cp -an /seed/bin /cache/%s/ && ls /cache/%s/bin\n' \
        "$base" "$slug" "$slug" "$slug" >"$seed/Dockerfile"
    DOCKER_BUILDKIT=1 "$BUILD_CLI" build --no-cache --progress plain -t radix-seed "$seed" >"$seed.log" 2>&1 \
        || { log "seeding failed:"; tail -10 "$seed.log" >&2; exit 1; }
    "$ENGINE" rmi radix-seed >/dev/null 2>&1 || true
    rm -rf "$seed" "$seed.log"
    log "seeded the image build's cache with the host's $(basename "$(dirname "$binary")")"
}
