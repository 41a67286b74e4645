# Sourced by deploy/portability/check.sh and deploy/test/run.sh. Needs ENGINE, MIRROR and log().
# base_image SUITE prints the name of a minimal Debian SUITE image, made once with debootstrap
# and `docker import` (no registry needed) and reused afterwards.
base_image() {  # debootstrap a minimal Debian and import it as an image, once
    local suite=$1 image="radix-portability/debian:$1"
    if "$ENGINE" image inspect "$image" >/dev/null 2>&1; then
        echo "$image"
        return
    fi
    command -v debootstrap >/dev/null || { log "debootstrap missing: apt-get install -y debootstrap"; exit 1; }
    [ "$(id -u)" = 0 ] || { log "debootstrap needs root"; exit 1; }
    local rootfs
    rootfs=$(mktemp -d /var/tmp/radix-rootfs-"$suite".XXXXXX)
    log "$suite: debootstrap --variant=minbase from $MIRROR (once; a few minutes) ..."
    debootstrap --variant=minbase "$suite" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 \
        || { log "debootstrap failed, see $rootfs.log"; tail -5 "$rootfs.log" >&2; exit 1; }
    tar -C "$rootfs" -c . | "$ENGINE" import - "$image" >/dev/null
    rm -rf "$rootfs" "$rootfs.log"
    echo "$image"
}
