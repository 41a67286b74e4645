#!/usr/bin/env bash
# make arm64-images: the compose stack's llama-server and proxy built for linux/arm64 and run
# (docs/deploy.md, "ARM64"; issue 26). On an x86-64 host:
#   1. the bases: this machine's Debian 12 (the server's build stage) and an arm64 Debian 12
#      (the runtime and proxy stages), both made locally with debootstrap (deploy/local-base.sh);
#   2. `compose build models-init llama-server proxy` with compose.arm64.yml: the server
#      cross-compiled in its build stage (radixctl build --cross aarch64), the arm64 stages
#      (apt, the proxy's pip install of aarch64 wheels) under qemu-user through binfmt_misc;
#   3. the images say arm64 and their programs are aarch64 ELF files;
#   4. the stack up on the host's network (models-init, llama-server, proxy; every container
#      emulated): health checks pass, `uname -m` in the containers says aarch64, and two chat
#      requests sharing a prefix go through the proxy, the second reusing the first's KV
#      (X-Radix-Route A or H, cached tokens);
#   5. down -v; times into docs/results/arm64-images/last-pass.md.
#
#   SEED_FROM_HOST=1   put the host's own cross build (`radixctl build --cross aarch64`, the
#                      same content key) into the image build's cache first, so the build stage
#                      finds it instead of cross-compiling (10-15 min on 2 cores)
#   KEEP=1             leave the stack running on failure
# Prints a "skip:" line and exits 0 where docker, docker-compose, debootstrap or an aarch64
# binfmt handler is missing.
set -euo pipefail

ENGINE=${ENGINE:-docker}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DEPLOY="$ROOT/deploy"
RADIXCTL="$ROOT/.venv/bin/radixctl"
t0=$(date +%s)
log() { echo "[arm64-images] $* ($(($(date +%s) - t0)) s)" >&2; }
skip() { log "skip: $*"; exit 0; }

if ! command -v "$ENGINE" >/dev/null || ! "$ENGINE" info >/dev/null 2>&1; then
    skip "no $ENGINE daemon (start dockerd: docs/deploy.md)"
fi
COMPOSE=${COMPOSE:-$(command -v docker-compose || true)}
[ -n "$COMPOSE" ] || skip "no docker-compose (apt-get install -y docker-compose)"
command -v debootstrap >/dev/null || skip "no debootstrap (apt-get install -y debootstrap)"
if [ "$(uname -m)" != aarch64 ]; then
    [ -d /proc/sys/fs/binfmt_misc ] && [ -e /proc/sys/fs/binfmt_misc/register ] \
        || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null || true
    if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] && [ -f /usr/lib/binfmt.d/qemu-aarch64.conf ]; then
        cat /usr/lib/binfmt.d/qemu-aarch64.conf >/proc/sys/fs/binfmt_misc/register 2>/dev/null || true
    fi
    grep -q enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 2>/dev/null \
        || skip "no aarch64 binfmt handler (apt-get install -y qemu-user-static; as root)"
fi

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# shellcheck source=deploy/portability/base-image.sh
. "$DEPLOY/portability/base-image.sh"
BUILD_CLI=$(buildkit_cli)
[ -n "$BUILD_CLI" ] || skip "no BuildKit-capable $ENGINE client (install docker-buildx)"
# compose v1 runs `docker build` from PATH: the BuildKit-capable client first.
PATH="$(dirname "$BUILD_CLI"):$PATH"
export PATH
BASE=$(base_image bookworm)
ARM_BASE=$(base_image bookworm arm64)
log "bases: $BASE (build stage), $ARM_BASE (runtime and proxy)"

work=$(mktemp -d /var/tmp/radix-arm64.XXXXXX)
project="radixarm64$$"
read -r P_PROXY P_LLAMA P_METRICS < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
mkdir -p "$work/secrets"
for k in kvctl_key server_api_key; do head -c 32 /dev/urandom | base64 >"$work/secrets/$k"; done
chown 10001:10001 "$work"/secrets/* && chmod 0400 "$work"/secrets/*
cat >"$work/.env" <<EOF
RADIX_BASE_IMAGE=$BASE
RADIX_RUNTIME_BASE_IMAGE=$ARM_BASE
RADIX_PROXY_BASE_IMAGE=$ARM_BASE
RADIX_LISTEN_ADDR=127.0.0.1
PROXY_PORT=$P_PROXY
PROXY_METRICS_PORT=$P_METRICS
LLAMA_PORT=$P_LLAMA
RADIX_BACKENDS=http://127.0.0.1:$P_LLAMA
RADIX_PARALLEL=2
RADIX_CTX_SIZE=4096
RADIX_THREADS=2
RADIX_CACHE_RAM=512
RADIX_RESTART=no
RADIX_KVCTL_KEY_FILE=$work/secrets/kvctl_key
RADIX_SERVER_API_KEY_FILE=$work/secrets/server_api_key
GRAFANA_ADMIN_PASSWORD_FILE=$work/secrets/kvctl_key
EOF
compose() {
    "$COMPOSE" -p "$project" --env-file "$work/.env" \
        -f "$DEPLOY/docker-compose.yml" -f "$DEPLOY/compose.hostnet.yml" -f "$DEPLOY/compose.arm64.yml" "$@"
}
SERVICES=(models-init llama-server proxy)
cleanup() {
    local rc=$?
    if [ $rc -ne 0 ] && [ "${KEEP:-0}" = 1 ]; then log "KEEP=1: stack $project left running; settings in $work"; return; fi
    if [ $rc -ne 0 ]; then
        for s in "${SERVICES[@]}"; do
            log "--- $s log (tail) ---"
            compose logs --no-color --tail 25 "$s" 2>&1 | sed 's/^/    /' >&2 || true
        done
    fi
    compose down -v --remove-orphans >/dev/null 2>&1 || true
    [ -z "$ca_test" ] || rm -f "$ca_test"
    rm -rf "$work"
}
ca_test=""
trap cleanup EXIT

seed_from_host() {  # the host's cross build into the BuildKit cache mount the Dockerfile uses
    seed_build_cache "$BASE" "$("$RADIXCTL" build --cross aarch64)"
}

# Behind a TLS-inspecting proxy: the CA bundle's non-public certificates to the build through
# deploy/ca/ (bind-mounted into the download steps only), as `make deploy-test` does.
ca=${CA_BUNDLE:-${PIP_CERT:-}}
if [ -n "$ca" ] && [ -f "$ca" ]; then
    ca_test="$DEPLOY/ca/arm64-test-ca.pem"
    rc=0
    python3 "$ROOT/deploy/test/no_ca_in_images.py" --ca "$ca" --extract "$ca_test" || rc=$?
    case $rc in
        0) log "CA bundle $ca: its non-public certificates in deploy/ca/ for the build" ;;
        2) ca_test="" ;;
        *) log "FAIL: reading the CA bundle $ca"; exit 1 ;;
    esac
fi

t_build=$(date +%s)
[ "${SEED_FROM_HOST:-0}" = 1 ] && seed_from_host
buildlog=/var/tmp/radix-arm64-build.log
log "build: DOCKER_BUILDKIT=1 COMPOSE_DOCKER_CLI_BUILD=1 compose build ${SERVICES[*]} (log: $buildlog) ..."
DOCKER_BUILDKIT=1 COMPOSE_DOCKER_CLI_BUILD=1 compose build "${SERVICES[@]}" >"$buildlog" 2>&1 \
    || { log "FAIL: compose build:"; tail -30 "$buildlog" >&2; exit 1; }
build_s=$(($(date +%s) - t_build))
log "built in $build_s s"

server_image=$(compose config | python3 -c 'import sys, yaml; print(yaml.safe_load(sys.stdin)["services"]["llama-server"]["image"])')
proxy_image=llama-radix-proxy/proxy:arm64
for image in "$server_image" "$proxy_image"; do
    arch=$("$ENGINE" image inspect -f '{{.Architecture}}' "$image")
    [ "$arch" = arm64 ] || { log "FAIL: $image is $arch, not arm64"; exit 1; }
done
elf=$("$ENGINE" run --rm --platform linux/arm64 --network none --entrypoint /bin/sh "$server_image" -c \
    'od -An -tx1 -j18 -N2 /opt/llama-server/bin/llama-server' | tr -d ' \n')
[ "$elf" = b700 ] || { log "FAIL: llama-server's ELF machine is $elf, not aarch64 (b7 00)"; exit 1; }
log "images are arm64; llama-server is an aarch64 ELF file"

t_up=$(date +%s)
compose up -d "${SERVICES[@]}" >"$work/up.log" 2>&1 || { log "FAIL: compose up:"; tail -20 "$work/up.log" >&2; exit 1; }
for service in llama-server proxy; do
    for _ in $(seq 1 180); do
        status=$("$ENGINE" inspect -f '{{.State.Health.Status}}' "$(compose ps -q "$service")" 2>/dev/null || echo none)
        [ "$status" = healthy ] && break
        sleep 5
    done
    [ "$status" = healthy ] || { log "FAIL: $service is $status after 15 minutes"; exit 1; }
done
up_s=$(($(date +%s) - t_up))
machines=$(for s in llama-server proxy; do compose exec -T "$s" uname -m; done | tr -d '\r' | sort -u | tr '\n' ' ')
[ "$machines" = "aarch64 " ] || { log "FAIL: the containers run on '$machines', not aarch64"; exit 1; }
log "llama-server and proxy healthy in $up_s s, both aarch64"

t_chat=$(date +%s)
python3 - "http://127.0.0.1:$P_PROXY" "$work/chat.json" <<'EOF'
import json, sys, urllib.request
url, out = sys.argv[1], sys.argv[2]
system = "You are a careful assistant for a hardware shop. " * 24
rows = []
for question in ("Which drill should I buy?", "How do I store the batteries?"):
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as reply:
        data = json.load(reply)
        rows.append({"route": reply.headers.get("X-Radix-Route"), "usage": data["usage"],
                     "text": data["choices"][0]["message"]["content"]})
json.dump(rows, open(out, "w"), indent=2)
cached = (rows[1]["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
print(json.dumps(rows, indent=2))
if rows[1]["route"] not in ("A", "H", "A+H") or cached < 200:
    sys.exit(f"FAIL: the second request did not reuse the first's KV: route {rows[1]['route']}, cached {cached}")
EOF
chat_s=$(($(date +%s) - t_chat))
log "two chat requests through the proxy in $chat_s s; the second reused the first's KV"

compose down -v --remove-orphans >/dev/null 2>&1
RESULTS=${RESULTS-$ROOT/docs/results/arm64-images}
if [ -n "$RESULTS" ]; then
    mkdir -p "$RESULTS"
    {
        echo "# make arm64-images: last pass ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null))"
        echo
        echo "Host: $(uname -m), $(nproc) cores; $("$ENGINE" version --format '{{.Server.Version}}' 2>/dev/null | sed 's/^/docker /'); $("$COMPOSE" version --short 2>/dev/null | sed 's/^/docker-compose /')."
        echo "Images: $server_image and $proxy_image (linux/arm64), bases $BASE (build stage) and $ARM_BASE."
        echo
        echo "- build (compose build, SEED_FROM_HOST=${SEED_FROM_HOST:-0}): $build_s s"
        echo "- up until llama-server and proxy were healthy, emulated: $up_s s"
        echo "- two chat requests through the proxy, emulated: $chat_s s"
        echo
        echo '```json'
        cat "$work/chat.json"
        echo
        echo '```'
    } >"$RESULTS/last-pass.md"
    log "wrote $RESULTS/last-pass.md"
fi
log "pass"
