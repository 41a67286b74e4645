#!/usr/bin/env bash
# make deploy-test: the compose stack built and run for real (docs/deploy.md).
#
# Builds the CPU images (llama-server, proxy, Prometheus) from a local Debian 12 base made
# with debootstrap (deploy/portability/base-image.sh), starts deploy/docker-compose.yml with
# host networking (compose.hostnet.yml: all traffic on loopback, free ports) and the `multi`
# profile (two llama-servers behind one proxy) and the `workbench` profile, waits for every
# health check, then deploy/test/check_stack.py: chat through the proxy with cache reuse
# (X-Radix-Route), a host restore through the shared payload volume, Prometheus scraping the
# proxy and every query of the Grafana dashboard returning series; then `radixctl workbench
# verify` against the workbench container (every scenario run once through its HTTP API, with
# a tool call and a follow-up that reuses cached tokens). Then stops the stack and checks every
# container exited cleanly, nothing is left (containers, volumes) and no payload file stayed
# behind.
# Grafana itself is not started: its image comes from Docker Hub only.
#
#   ENGINE=docker            the container engine CLI (a BuildKit-capable one is picked)
#   COMPOSE="docker-compose" the compose command (default: `docker compose`, else docker-compose)
#   CA_BUNDLE=/path          an extra CA bundle for the build (default: $PIP_CERT if set)
#   KEEP=1                   leave the stack running on failure, for a look
#   SKIP_BUILD=1             use the images an earlier run built
#   SEED_FROM_HOST=1         before the build, copy the host's own patched CPU build
#                            (`radixctl build`, the same content key: pinned source, patch
#                            series, flags) into the image build's cache, so the image's
#                            `radixctl build` finds it instead of compiling (about 10 min on
#                            2 cores). Only where the host runs the base's Debian release.
#
# Exits 0 with a "skip:" line where no container engine or compose is reachable.
set -euo pipefail

ENGINE=${ENGINE:-docker}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DEPLOY="$ROOT/deploy"
SUITE=bookworm
PYTHON=${PYTHON:-$(command -v "$ROOT/.venv/bin/python" || command -v python3)}
t0=$(date +%s)

log() { echo "[deploy-test] $* ($(( $(date +%s) - t0 )) s)" >&2; }
skip() { log "skip: $*"; exit 0; }

# ---- tools ---------------------------------------------------------------------------------------
command -v "$ENGINE" >/dev/null 2>&1 && "$ENGINE" info >/dev/null 2>&1 \
    || skip "no container engine ($ENGINE not installed or its daemon not reachable). To run it: apt-get install -y docker.io docker-compose debootstrap, start dockerd, then make deploy-test."

# BuildKit (secret and cache mounts): a client with buildx, or one older than 23 (built in).
buildkit_cli() {
    local cli major
    for cli in $(which -a "$ENGINE" | awk '!seen[$0]++'); do
        if "$cli" buildx version >/dev/null 2>&1; then echo "$cli"; return; fi
        major=$("$cli" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)
        if [ -n "$major" ] && [ "$major" -lt 23 ] 2>/dev/null; then echo "$cli"; return; fi
    done
}
BUILD_CLI=$(buildkit_cli)
[ -n "$BUILD_CLI" ] || skip "no BuildKit-capable $ENGINE client (install docker-buildx)."

if [ -z "${COMPOSE:-}" ]; then
    if "$ENGINE" compose version >/dev/null 2>&1; then COMPOSE="$ENGINE compose"
    elif command -v docker-compose >/dev/null 2>&1; then COMPOSE=docker-compose
    else skip "no docker compose (plugin) and no docker-compose: apt-get install -y docker-compose."
    fi
fi
log "engine $ENGINE, builds with $BUILD_CLI (BuildKit), compose: $COMPOSE ($($COMPOSE version --short 2>/dev/null || true))"

# ---- images ----------------------------------------------------------------------------------------
. "$DEPLOY/portability/base-image.sh"
BASE=$(base_image "$SUITE")
ca=${CA_BUNDLE:-${PIP_CERT:-}}
secret_args=()
[ -n "$ca" ] && [ -f "$ca" ] && secret_args=(--secret "id=ca_bundle,src=$ca")
build() {  # build TAG DOCKERFILE [ARGS...]
    local tag=$1 file=$2 logfile="/var/tmp/radix-deploy-test-build-${1//[^A-Za-z0-9]/_}.log"
    shift 2
    log "build $tag (log: $logfile) ..."
    DOCKER_BUILDKIT=1 "$BUILD_CLI" build --progress plain --network host "${secret_args[@]}" \
        -t "$tag" -f "$file" "$@" "$ROOT" >"$logfile" 2>&1 \
        || { log "build of $tag failed:"; tail -25 "$logfile" >&2; exit 1; }
}
seed_from_host() {  # the host's patched CPU build into the BuildKit cache mount the Dockerfile uses
    local host_suite binary seed slug
    host_suite=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
    [ "$host_suite" = "$SUITE" ] || { log "SEED_FROM_HOST: host is $host_suite, not $SUITE: not seeding"; return; }
    binary=$("$ROOT/.venv/bin/radixctl" build)
    seed=$(mktemp -d /var/tmp/radix-deploy-seed.XXXXXX)
    mkdir -p "$seed/bin"
    cp -a "$(dirname "$binary")" "$seed/bin/"
    slug=$(printf %s "$BASE" | tr -c 'A-Za-z0-9.-' _)   # as deploy/Dockerfile names the cache
    printf 'FROM %s\nRUN --mount=type=cache,target=/cache --mount=type=bind,source=.,target=/seed mkdir -p /cache/%s && cp -an /seed/bin /cache/%s/ && ls /cache/%s/bin\n' \
        "$BASE" "$slug" "$slug" "$slug" >"$seed/Dockerfile"
    DOCKER_BUILDKIT=1 "$BUILD_CLI" build --no-cache --progress plain -t radix-deploy-seed "$seed" >"$seed.log" 2>&1 \
        || { log "seeding failed:"; tail -10 "$seed.log" >&2; exit 1; }
    "$ENGINE" rmi radix-deploy-seed >/dev/null 2>&1 || true
    rm -rf "$seed" "$seed.log"
    log "seeded the image build's cache with the host's $(basename "$(dirname "$binary")")"
}
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    [ "${SEED_FROM_HOST:-0}" = 1 ] && seed_from_host
    build llama-radix-proxy/llama-server:cpu "$DEPLOY/Dockerfile" --target server \
        --build-arg BASE="$BASE" --build-arg RUNTIME_BASE="$BASE" --build-arg BACKEND=cpu
    build llama-radix-proxy/proxy:latest "$DEPLOY/Dockerfile" --target proxy --build-arg PROXY_BASE="$BASE"
    build llama-radix-proxy/workbench:latest "$DEPLOY/Dockerfile" --target proxy --build-arg PROXY_BASE="$BASE" \
        --build-arg PIP_EXTRAS=workbench
    build llama-radix-proxy/prometheus:latest "$DEPLOY/docker/prometheus.Dockerfile" --build-arg BASE="$BASE"
fi
for image in llama-radix-proxy/llama-server:cpu llama-radix-proxy/proxy:latest llama-radix-proxy/workbench:latest; do
    user=$("$ENGINE" image inspect -f '{{.Config.User}}' "$image")
    [ -n "$user" ] && [ "${user%%:*}" != 0 ] && [ "${user%%:*}" != root ] \
        || { log "FAIL: $image runs as root"; exit 1; }
done
for image in llama-radix-proxy/llama-server:cpu llama-radix-proxy/proxy:latest llama-radix-proxy/workbench:latest \
        llama-radix-proxy/prometheus:latest; do
    if "$ENGINE" history --no-trunc "$image" | grep -qi -- 'BEGIN CERTIFICATE\|ca_bundle,src'; then
        log "FAIL: the CA bundle shows in $image's history"
        exit 1
    fi
    "$ENGINE" run --rm --network none --entrypoint /bin/sh "$image" -c \
        'test ! -e /etc/apt/apt.conf.d/99radix-build-ca && test ! -e /run/secrets/ca_bundle && ! ls /tmp/radix-ca.* 2>/dev/null' \
        || { log "FAIL: build-time CA material left in $image"; exit 1; }
done
log "images run as non-root; no build-time CA material in them"

# ---- the stack's settings: .env.example with free loopback ports ----------------------------------
work=$(mktemp -d /var/tmp/radix-deploy-test.XXXXXX)
payloads=$(mktemp -d /dev/shm/radix-deploy-test-kv.XXXXXX)
project="radixdeploytest$$"
read -r P_PROXY P_LLAMA P_LLAMA2 P_PROM P_WB P_METRICS < <("$PYTHON" - <<'EOF'
import socket
socks = [socket.socket() for _ in range(6)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
)
mkdir -p "$work/secrets"
head -c 32 /dev/urandom | base64 >"$work/secrets/kvctl_key"
head -c 32 /dev/urandom | base64 >"$work/secrets/server_api_key"
chown 10001:10001 "$work/secrets/kvctl_key" "$work/secrets/server_api_key" "$payloads" \
    && chmod 0400 "$work/secrets/kvctl_key" "$work/secrets/server_api_key" && chmod 0700 "$payloads"
sed "s/proxy:9464/127.0.0.1:$P_METRICS/" "$DEPLOY/prometheus.yml" >"$work/prometheus.yml"
grep -q "127.0.0.1:$P_METRICS" "$work/prometheus.yml" || { log "FAIL: deploy/prometheus.yml does not name proxy:9464"; exit 1; }
chmod 0644 "$work/prometheus.yml"
# The payload volume as a bind of a host tmpfs directory, so what is left in it can be seen
# after the stack is down (the stack's own volume is tmpfs as well).
cat >"$work/payload-bind.yml" <<EOF
volumes:
  kv-payloads:
    driver: local
    driver_opts: {type: none, o: bind, device: $payloads}
EOF
declare -A settings=(
    [COMPOSE_FILE]=docker-compose.yml:compose.hostnet.yml
    [RADIX_BASE_IMAGE]=$BASE [RADIX_RUNTIME_BASE_IMAGE]=$BASE [RADIX_PROXY_BASE_IMAGE]=$BASE
    [RADIX_LISTEN_ADDR]=127.0.0.1 [RADIX_BIND_ADDR]=127.0.0.1
    [PROXY_PORT]=$P_PROXY [PROXY_METRICS_PORT]=$P_METRICS [LLAMA_PORT]=$P_LLAMA [LLAMA_PORT_2]=$P_LLAMA2 [PROMETHEUS_PORT]=$P_PROM [WORKBENCH_PORT]=$P_WB
    [RADIX_BACKENDS]="http://127.0.0.1:$P_LLAMA http://127.0.0.1:$P_LLAMA2"
    [RADIX_PROXY_HOST]=127.0.0.1 [RADIX_PROMETHEUS_URL]=http://127.0.0.1:$P_PROM
    [RADIX_PARALLEL]=2 [RADIX_CTX_SIZE]=4096 [RADIX_THREADS]=1 [RADIX_CACHE_RAM]=512
    [RADIX_PAYLOAD_TMPFS_SIZE]=256m [RADIX_RESTART]=no
    [RADIX_KVCTL_KEY_FILE]=$work/secrets/kvctl_key
    [RADIX_SERVER_API_KEY_FILE]=$work/secrets/server_api_key
    [GRAFANA_ADMIN_PASSWORD_FILE]=$work/secrets/kvctl_key
    [RADIX_PROMETHEUS_CONFIG]=$work/prometheus.yml
)
# Every setting the test changes must be one .env.example documents, and vice versa every
# variable the compose files read must be documented there.
"$PYTHON" - "$DEPLOY" "${!settings[@]}" <<'EOF'
import re, sys
from pathlib import Path
deploy = Path(sys.argv[1])
documented = set(re.findall(r"^#?([A-Z][A-Z0-9_]*)=", (deploy / ".env.example").read_text(), re.M))
used = set()
for name in ("docker-compose.yml", "compose.ports.yml", "compose.cuda.yml", "compose.cann.yml", "compose.hostnet.yml"):
    used |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)(?::?-[^}]*)?\}", (deploy / name).read_text()))
missing = sorted((used | set(sys.argv[2:])) - documented)
if missing:
    sys.exit(f"[deploy-test] FAIL: not documented in deploy/.env.example: {missing}")
EOF
grace=$(sed -n 's/^RADIX_SHUTDOWN_GRACE=//p' "$DEPLOY/.env.example")
stop=$(sed -n 's/^RADIX_STOP_GRACE_PERIOD=//p' "$DEPLOY/.env.example")
[ "${stop%s}" = $(( grace + 10 )) ] || { log "FAIL: RADIX_STOP_GRACE_PERIOD ($stop) is not RADIX_SHUTDOWN_GRACE ($grace) + 10 s"; exit 1; }
{
    grep -v -E "^($(IFS='|'; echo "${!settings[*]}"))=" "$DEPLOY/.env.example"
    for key in "${!settings[@]}"; do printf '%s=%s\n' "$key" "${settings[$key]}"; done
} >"$work/.env"

compose() {
    $COMPOSE -p "$project" --env-file "$work/.env" --profile multi --profile workbench \
        -f "$DEPLOY/docker-compose.yml" -f "$DEPLOY/compose.hostnet.yml" -f "$work/payload-bind.yml" "$@"
}
SERVICES=(llama-server llama-server-2 proxy prometheus workbench)
cleanup() {
    local rc=$?
    if [ $rc -ne 0 ] && [ "${KEEP:-0}" = 1 ]; then
        log "KEEP=1: stack $project left running; settings in $work"
        return
    fi
    if [ $rc -ne 0 ]; then
        for service in "${SERVICES[@]}"; do
            log "--- $service log (tail) ---"
            compose logs --no-color --tail 25 "$service" 2>&1 | sed 's/^/    /' >&2 || true
        done
    fi
    compose down -v --remove-orphans >/dev/null 2>&1 || true
    rm -rf "$work" "$payloads"
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

compose config -q
log "compose config valid (CPU, CUDA and CANN files too)"
for variant in compose.cuda.yml compose.cann.yml; do
    $COMPOSE -p "$project" --env-file "$work/.env" --profile multi --profile workbench \
        -f "$DEPLOY/docker-compose.yml" -f "$DEPLOY/compose.ports.yml" -f "$DEPLOY/$variant" config -q
done

# ---- up, health ------------------------------------------------------------------------------------
log "up: ${SERVICES[*]} (host network; proxy :$P_PROXY, servers :$P_LLAMA :$P_LLAMA2, Prometheus :$P_PROM, workbench :$P_WB)"
compose up -d --no-build "${SERVICES[@]}" >"$work/up.log" 2>&1 || { cat "$work/up.log" >&2; exit 1; }
deadline=$(( $(date +%s) + 300 ))
for service in "${SERVICES[@]}"; do
    id=$(compose ps -q "$service")
    while :; do
        health=$("$ENGINE" inspect -f '{{.State.Health.Status}} {{.State.Status}}' "$id")
        [ "${health%% *}" = healthy ] && break
        [ "${health#* }" = running ] || { log "FAIL: $service is ${health#* }"; exit 1; }
        [ "$(date +%s)" -lt "$deadline" ] || { log "FAIL: $service not healthy in 300 s ($health)"; exit 1; }
        sleep 2
    done
    log "$service healthy (user $("$ENGINE" inspect -f '{{.Config.User}}' "$id"))"
done
# The key is in no process's argv and in no container's environment.
key=$(cat "$work/secrets/kvctl_key")
for service in "${SERVICES[@]}"; do
    id=$(compose ps -q "$service")
    if "$ENGINE" inspect "$id" | grep -qF -- "$key"; then log "FAIL: the kvctl key shows in $service's config"; exit 1; fi
done
if grep -qsF -- "$key" /proc/[0-9]*/cmdline 2>/dev/null; then log "FAIL: the kvctl key is in a command line"; exit 1; fi
log "the kvctl key is in no argv and no container config"

# ---- traffic and Prometheus --------------------------------------------------------------------------
"$PYTHON" "$ROOT/deploy/test/check_stack.py" --proxy "http://127.0.0.1:$P_PROXY" \
    --prometheus "http://127.0.0.1:$P_PROM" --dashboard "$DEPLOY/grafana/llama-radix-proxy.json" \
    --servers 2 --slots 2
compose logs --no-color proxy 2>&1 | grep -E 'payloads via /run/radix-kv' >&2 \
    || { log "FAIL: the proxy does not use the shared payload directory"; exit 1; }
# The workbench container, driven through its HTTP API as its page does, against the proxy.
"$ROOT/.venv/bin/radixctl" workbench verify --base-url "http://127.0.0.1:$P_PROXY/v1" \
    --workbench-url "http://127.0.0.1:$P_WB" >&2 \
    || { log "FAIL: radixctl workbench verify against the workbench container"; exit 1; }
log "the workbench container ran every scenario through the proxy"

# ---- stop: graceful, nothing left ---------------------------------------------------------------------
ids=$(compose ps -q)
compose stop >/dev/null 2>&1
for id in $ids; do
    read -r name status code oom < <("$ENGINE" inspect -f '{{.Name}} {{.State.Status}} {{.State.ExitCode}} {{.State.OOMKilled}}' "$id")
    [ "$status" = exited ] && [ "$code" = 0 ] && [ "$oom" = false ] \
        || { log "FAIL: $name after stop: $status, exit code $code, OOM-killed $oom"; exit 1; }
done
log "every container stopped on SIGTERM with exit code 0"
left=$(find "$payloads" -mindepth 1 | head -5)
[ -z "$left" ] || { log "FAIL: payload files left behind: $left"; exit 1; }
compose down -v --remove-orphans >/dev/null 2>&1
running=$("$ENGINE" ps -aq --filter "label=com.docker.compose.project=$project")
volumes=$("$ENGINE" volume ls -q --filter "label=com.docker.compose.project=$project")
networks=$("$ENGINE" network ls -q --filter "label=com.docker.compose.project=$project")
[ -z "$running$volumes$networks" ] \
    || { log "FAIL: left after down: containers [$running] volumes [$volumes] networks [$networks]"; exit 1; }
log "down: no container, volume, network or payload file left"
log "deploy test passed"
