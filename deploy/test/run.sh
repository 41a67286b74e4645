#!/usr/bin/env bash
# make deploy-test: the compose stack built and run for real (docs/deploy.md).
#
# Builds the CPU images (llama-server, proxy, workbench, Prometheus) as docs/deploy.md says:
# `compose build` (v1 or v2, whichever COMPOSE is) from a local Debian 12 base made with
# debootstrap (deploy/local-base.sh, deploy/portability/base-image.sh), the CA bundle's
# non-public certificates given through deploy/ca/; then searches every layer, config and
# history of the images for them (after two control images that hold them). Starts deploy/docker-compose.yml with
# host networking (compose.hostnet.yml: all traffic on loopback, free ports) and the `multi`
# profile (two llama-servers behind one proxy) and the `workbench` profile, waits for every
# health check, then deploy/test/check_stack.py: chat through the proxy with cache reuse
# (X-Radix-Route), a restore on the second server of KV the first exported, through the
# shared payload volume (X-Radix-Server), Prometheus scraping the proxy and every query of the
# Grafana dashboard returning series; then `radixctl workbench verify` against the workbench
# container (every scenario run once through its HTTP API, with a tool call and a follow-up
# that reuses cached tokens). Then stops the stack and checks every container exited cleanly,
# nothing is left (containers, volumes) and no payload file stayed behind.
# Before the stack, the model-volume race: models-init and both servers started at once on a
# fresh, empty `models` volume with a model of RACE_MODEL_MB (a deeper copy of the default
# model, deploy/test/deep_model.py): both must come up healthy.
# On a pass it writes docs/results/deploy-test/last-pass-compose-vN.{json,md} (routes, servers,
# token and query counts, timings, the CA search), which docs/deploy.md quotes, and panels/:
# a picture of every dashboard panel drawn from the stack's Prometheus.
# Grafana itself is not started: its image comes from Docker Hub only. The dashboard is
# checked against the pinned Grafana's schema (deploy/grafana/check_dashboard.py) instead.
#
#   ENGINE=docker            the container engine CLI (a BuildKit-capable one is picked)
#   COMPOSE="docker-compose" the compose command (default: `docker compose`, else docker-compose)
#   CA_BUNDLE=/path          the CA bundle the host trusts (default: $PIP_CERT if set): its
#                            certificates that are not Debian's public CAs go to the build
#                            as deploy/ca/deploy-test-ca.pem (removed afterwards)
#   KEEP=1                   leave the stack running on failure, for a look
#   SKIP_BUILD=1             use the images an earlier run built
#   SEED_FROM_HOST=1         before the build, copy the host's own patched CPU build
#                            (`radixctl build`, the same content key: pinned source, patch
#                            series, flags) into the image build's cache, so the image's
#                            `radixctl build` finds it instead of compiling (about 10 min on
#                            2 cores). Only where the host runs the base's Debian release.
#                            Where the host has no such build yet, `radixctl build` compiles
#                            it on the host first (as long, once; cached for both).
#   RACE_MODEL_MB=2048       the size of the race check's model (0: skip that check); with
#                            2 GiB the race was lost on every try before models-init
#   RESULTS=docs/results/deploy-test   where a pass writes its summary (empty: nowhere)
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

# base_image and buildkit_cli (BuildKit: secret and cache mounts).
. "$DEPLOY/portability/base-image.sh"
BUILD_CLI=$(buildkit_cli)
[ -n "$BUILD_CLI" ] || skip "no BuildKit-capable $ENGINE client (install docker-buildx)."

if [ -z "${COMPOSE:-}" ]; then
    if "$ENGINE" compose version >/dev/null 2>&1; then COMPOSE="$ENGINE compose"
    elif command -v docker-compose >/dev/null 2>&1; then COMPOSE=docker-compose
    else skip "no docker compose (plugin) and no docker-compose: apt-get install -y docker-compose."
    fi
fi
log "engine $ENGINE, builds with $BUILD_CLI (BuildKit), compose: $COMPOSE ($($COMPOSE version --short 2>/dev/null || true))"

# ---- the base image and the seed ---------------------------------------------------------------------
# compose v1 runs `docker build` from PATH: the BuildKit-capable client first.
PATH="$(dirname "$BUILD_CLI"):$PATH"
export PATH
BASE=$(base_image "$SUITE")
seed_from_host() {  # the host's patched CPU build into the BuildKit cache mount the Dockerfile uses
    local host_suite
    host_suite=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
    [ "$host_suite" = "$SUITE" ] || { log "SEED_FROM_HOST: host is $host_suite, not $SUITE: not seeding"; return; }
    seed_build_cache "$BASE" "$("$ROOT/.venv/bin/radixctl" build)"
}
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
    [RADIX_PAYLOAD_TMPFS_SIZE]=768m [RADIX_RESTART]=no
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
race_project="${project}race"
race_compose() {  # the race check's stack: its own project (fresh volumes), the deep model's image
    $COMPOSE -p "$race_project" --env-file "$work/race.env" --profile multi \
        -f "$DEPLOY/docker-compose.yml" -f "$DEPLOY/compose.hostnet.yml" -f "$work/race.yml" "$@"
}
RACE_SERVICES=(models-init llama-server llama-server-2)
cleanup() {
    local rc=$?
    [ -z "$ca_test" ] || rm -f "$ca_test"
    if [ $rc -ne 0 ] && [ "${KEEP:-0}" = 1 ]; then
        log "KEEP=1: stack $project (race check: $race_project) left running; settings in $work"
        return
    fi
    if [ $rc -ne 0 ]; then
        if [ -f "$work/race.yml" ] && [ -n "$(race_compose ps -a -q 2>/dev/null)" ]; then
            for service in "${RACE_SERVICES[@]}"; do
                log "--- race check: $service log (tail) ---"
                race_compose logs --no-color --tail 25 "$service" 2>&1 | sed 's/^/    /' >&2 || true
            done
        fi
        for service in models-init "${SERVICES[@]}"; do
            log "--- $service log (tail) ---"
            compose logs --no-color --tail 25 "$service" 2>&1 | sed 's/^/    /' >&2 || true
        done
    fi
    if [ -f "$work/race.yml" ]; then race_compose down -v --remove-orphans >/dev/null 2>&1 || true; fi
    compose down -v --remove-orphans >/dev/null 2>&1 || true
    "$ENGINE" rmi "$RACE_IMAGE" >/dev/null 2>&1 || true
    rm -rf "$work" "$payloads"
}
RACE_IMAGE=radix-deploy-test/llama-server-deep:$project
ca_test=""
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

# ---- images: built as docs/deploy.md says, with compose, from the local base -----------------------
# Behind a TLS-inspecting proxy the build gets the CA bundle's non-public certificates through
# deploy/ca/ (bind-mounted into the download steps only), as a user of either compose version
# does; no BuildKit secret.
t_build=$(date +%s)
ca=${CA_BUNDLE:-${PIP_CERT:-}}
if [ -n "$ca" ] && [ -f "$ca" ]; then
    ca_test="$DEPLOY/ca/deploy-test-ca.pem"
    rc=0
    "$PYTHON" "$ROOT/deploy/test/no_ca_in_images.py" --ca "$ca" --extract "$ca_test" || rc=$?
    case $rc in
        0) log "CA bundle $ca: its $(grep -c 'BEGIN CERTIFICATE' "$ca_test") non-public certificates in deploy/ca/ for the build" ;;
        2) ca_test=""; log "CA bundle $ca: public CAs only, nothing to give the build" ;;
        *) log "FAIL: reading the CA bundle $ca"; exit 1 ;;
    esac
fi
IMAGES=(llama-radix-proxy/llama-server:cpu llama-radix-proxy/proxy:latest llama-radix-proxy/workbench:latest
    llama-radix-proxy/prometheus:latest)
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    [ "${SEED_FROM_HOST:-0}" = 1 ] && seed_from_host
    buildlog=/var/tmp/radix-deploy-test-build.log
    log "build: DOCKER_BUILDKIT=1 $COMPOSE build (base $BASE; log: $buildlog) ..."
    DOCKER_BUILDKIT=1 compose build >"$buildlog" 2>&1 || { log "FAIL: compose build:"; tail -30 "$buildlog" >&2; exit 1; }
fi
for image in "${IMAGES[@]:0:3}"; do
    user=$("$ENGINE" image inspect -f '{{.Config.User}}' "$image")
    [ -n "$user" ] && [ "${user%%:*}" != 0 ] && [ "${user%%:*}" != root ] \
        || { log "FAIL: $image runs as root"; exit 1; }
done
for image in "${IMAGES[@]}"; do
    if "$ENGINE" history --no-trunc "$image" | grep -qi -- 'BEGIN CERTIFICATE\|ca_bundle,src'; then
        log "FAIL: the CA bundle shows in $image's history"
        exit 1
    fi
    "$ENGINE" run --rm --network none --entrypoint /bin/sh "$image" -c \
        'test ! -e /etc/apt/apt.conf.d/99radix-build-ca && test ! -e /run/secrets/ca_bundle && ! ls /tmp/radix-ca.* /run/radix-ca/*.pem 2>/dev/null' \
        || { log "FAIL: build-time CA material left in $image"; exit 1; }
done
log "images run as non-root; no build-time CA file left in them"
# Every file of every layer, the config and the history of each image, searched for the
# certificates (deploy/test/no_ca_in_images.py). First two control images that do hold them,
# which the search must catch: the CA copied into a layer and removed in the next one
# (`docker history` shows nothing), and the CA as a build argument (kept in the history).
ca_scan=skipped
if [ -n "$ca_test" ]; then
    ctl=$(mktemp -d /var/tmp/radix-ca-control.XXXXXX)
    cp "$ca_test" "$ctl/ca.pem"
    printf 'FROM %s\nCOPY ca.pem /tmp/ca.pem\nRUN rm /tmp/ca.pem\n' "$BASE" >"$ctl/Dockerfile.layer"
    printf 'FROM %s\nARG CA_PEM\nRUN test -n "$CA_PEM"\n' "$BASE" >"$ctl/Dockerfile.arg"
    DOCKER_BUILDKIT=1 "$BUILD_CLI" build -q -f "$ctl/Dockerfile.layer" -t radix-deploy-test/ca-control:layer "$ctl" >/dev/null
    DOCKER_BUILDKIT=1 "$BUILD_CLI" build -q -f "$ctl/Dockerfile.arg" --build-arg CA_PEM="$(cat "$ctl/ca.pem")" \
        -t radix-deploy-test/ca-control:arg "$ctl" >/dev/null
    for control in layer arg; do
        if "$PYTHON" "$ROOT/deploy/test/no_ca_in_images.py" --engine "$ENGINE" --ca "$ca_test" \
                "radix-deploy-test/ca-control:$control" 2>"$ctl/$control.log"; then
            log "FAIL: the layer search missed the CA in the control image ($control)"
            exit 1
        fi
        log "control image ($control): the search finds the CA: $(grep -m1 FOUND "$ctl/$control.log" | cut -c1-160)"
    done
    "$ENGINE" rmi radix-deploy-test/ca-control:layer radix-deploy-test/ca-control:arg >/dev/null
    rm -rf "$ctl"
    "$PYTHON" "$ROOT/deploy/test/no_ca_in_images.py" --engine "$ENGINE" --ca "$ca_test" "${IMAGES[@]}" \
        || { log "FAIL: a build-time CA certificate is in an image"; exit 1; }
    ca_scan="$(grep -c 'BEGIN CERTIFICATE' "$ca_test") certificates in none of ${#IMAGES[@]} images (every layer, config, history); both control images caught"
fi
build_s=$(( $(date +%s) - t_build ))

compose config -q
log "compose config valid (CPU, CUDA and CANN files too)"
for variant in compose.cuda.yml compose.cann.yml; do
    $COMPOSE -p "$project" --env-file "$work/.env" --profile multi --profile workbench \
        -f "$DEPLOY/docker-compose.yml" -f "$DEPLOY/compose.ports.yml" -f "$DEPLOY/$variant" config -q
done

wait_healthy() {  # wait_healthy COMPOSE-FUNCTION SERVICE...: each healthy within 300 s
    local run=$1 service id health deadline=$(( $(date +%s) + 300 ))
    shift
    for service in "$@"; do
        id=$("$run" ps -q "$service")
        [ -n "$id" ] || { log "FAIL: $service has no container"; exit 1; }
        while :; do
            health=$("$ENGINE" inspect -f '{{.State.Health.Status}} {{.State.Status}}' "$id")
            [ "${health%% *}" = healthy ] && break
            [ "${health#* }" = running ] || { log "FAIL: $service is ${health#* }"; exit 1; }
            [ "$(date +%s)" -lt "$deadline" ] || { log "FAIL: $service not healthy in 300 s ($health)"; exit 1; }
            sleep 2
        done
        log "$service healthy (user $("$ENGINE" inspect -f '{{.Config.User}}' "$id"))"
    done
}
init_done() {  # init_done COMPOSE-FUNCTION: models-init ran, exited 0, and filled the volume
    local run=$1 id state
    id=$("$run" ps -a -q models-init)  # -a: compose v2 lists only running containers without it
    [ -n "$id" ] || { log "FAIL: models-init did not run"; exit 1; }
    state=$("$ENGINE" inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$id")
    [ "$state" = "exited 0" ] || { log "FAIL: models-init is $state"; exit 1; }
    "$run" logs --no-color models-init 2>&1 | grep -q 'complete in the model volume' \
        || { log "FAIL: models-init did not report the model complete"; exit 1; }
}

# ---- the model volume: no start-up race ------------------------------------------------------------
# Docker copies an image's files into an empty named volume while it creates the first
# container that mounts it; a second server created at the same moment saw a non-empty volume
# and could open a model still being copied ("tensor ... data is not within the file bounds").
# models-init fills the volume (temporary name, fsync, rename, marker) and the servers wait
# for it to complete. Both servers on a fresh volume, with a model large enough that copying
# it takes a while, must come up healthy.
race_s=0
race_mb=${RACE_MODEL_MB:-2048}
if [ "$race_mb" != 0 ]; then
    t_race=$(date +%s)
    mkdir -p "$work/deep"
    "$ENGINE" run --rm --network none --entrypoint /bin/cat llama-radix-proxy/llama-server:cpu \
        /models/SmolLM2-135M-Instruct.Q4_1.gguf >"$work/deep/default.gguf"
    "$PYTHON" "$ROOT/deploy/test/deep_model.py" "$work/deep/default.gguf" "$work/deep/deep.gguf" --min-mb "$race_mb"
    rm -f "$work/deep/default.gguf"
    race_bytes=$(stat -c %s "$work/deep/deep.gguf")
    printf 'FROM llama-radix-proxy/llama-server:cpu\nCOPY --chown=0:0 deep.gguf /models/deep.gguf\n' >"$work/deep/Dockerfile"
    DOCKER_BUILDKIT=1 "$BUILD_CLI" build --progress plain -t "$RACE_IMAGE" "$work/deep" >"$work/deep.log" 2>&1 \
        || { log "FAIL: building the race check's image:"; tail -10 "$work/deep.log" >&2; exit 1; }
    rm -rf "$work/deep"
    {
        grep -v -E '^(RADIX_MODEL_FILE|RADIX_CTX_SIZE)=' "$work/.env"
        echo RADIX_MODEL_FILE=deep.gguf
        echo RADIX_CTX_SIZE=512
    } >"$work/race.env"
    printf 'services:\n' >"$work/race.yml"
    for service in "${RACE_SERVICES[@]}"; do printf '  %s: {image: "%s"}\n' "$service" "$RACE_IMAGE" >>"$work/race.yml"; done
    race_compose config -q
    log "race check: models-init, llama-server, llama-server-2 at once on a fresh models volume, model $(( race_bytes >> 20 )) MiB"
    race_compose up -d --no-build llama-server llama-server-2 >"$work/race-up.log" 2>&1 \
        || { cat "$work/race-up.log" >&2; exit 1; }
    init_done race_compose
    wait_healthy race_compose llama-server llama-server-2
    if race_compose logs --no-color llama-server llama-server-2 2>&1 | grep -E 'not within the file bounds|failed to load model'; then
        log "FAIL: a server opened an incomplete model"
        exit 1
    fi
    race_compose down -v --remove-orphans >/dev/null 2>&1
    "$ENGINE" rmi "$RACE_IMAGE" >/dev/null 2>&1 || true
    race_s=$(( $(date +%s) - t_race ))
    log "race check passed: both servers loaded the whole $(( race_bytes >> 20 )) MiB model from a fresh volume"
else
    race_bytes=0
    log "race check skipped (RACE_MODEL_MB=0)"
fi

# ---- up, health ------------------------------------------------------------------------------------
log "up: ${SERVICES[*]} (host network; proxy :$P_PROXY, servers :$P_LLAMA :$P_LLAMA2, Prometheus :$P_PROM, workbench :$P_WB)"
t_up=$(date +%s)
compose up -d --no-build "${SERVICES[@]}" >"$work/up.log" 2>&1 || { cat "$work/up.log" >&2; exit 1; }
init_done compose
wait_healthy compose "${SERVICES[@]}"
healthy_s=$(( $(date +%s) - t_up ))
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
    --servers 2 --slots 2 --summary "$work/summary.json"
# Both servers move KV through the KV arena in the shared payload directory, the restoring one
# included (the startup line says "payloads through the arena in DIR").
restorer=$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["cross_server"]["restorer"])' "$work/summary.json")
for name in s0 s1; do
    compose logs --no-color proxy 2>&1 | grep -E "$name: http://[^ ]+, .*payloads through the arena in /run/radix-kv" >&2 \
        || { log "FAIL: the proxy does not move KV for $name through the arena in the shared payload directory"; exit 1; }
done
log "the restore on $restorer came through the shared payload volume"
# The workbench container, driven through its HTTP API as its page does, against the proxy.
if ! "$ROOT/.venv/bin/radixctl" workbench verify --base-url "http://127.0.0.1:$P_PROXY/v1" \
        --workbench-url "http://127.0.0.1:$P_WB" 2>&1 | tee "$work/workbench.log" >&2; then
    log "FAIL: radixctl workbench verify against the workbench container"
    exit 1
fi
log "the workbench container ran every scenario through the proxy"
# The dashboard: Grafana's schema for the version compose pins (deploy/grafana/check_dashboard.py),
# and a picture of every panel drawn from this Prometheus (deploy/grafana/render_panels.py),
# after all the traffic (the chats, then the workbench's scenarios).
rc=0
schema_out=$("$PYTHON" "$ROOT/deploy/grafana/check_dashboard.py" 2>&1) || rc=$?
echo "$schema_out" | sed 's/^/[deploy-test]   /' >&2
case $rc in
    0) dashboard_schema=$(echo "$schema_out" | sed -n 's/.*: \(fits the Grafana .* schema\)$/\1/p' | head -n 1) ;;
    3) dashboard_schema="not checked (no node/npm)" ;;
    *) log "FAIL: the dashboard does not fit the pinned Grafana's schema"; exit 1 ;;
esac
sleep 10  # a scrape (every 5 s) after the last request
rc=0
"$PYTHON" "$ROOT/deploy/grafana/render_panels.py" --prometheus "http://127.0.0.1:$P_PROM" --out "$work/panels" \
    --since "$(( t_up - 10 ))" || rc=$?
case $rc in
    0) panels=$(ls "$work/panels"/panel-*.png | wc -l); log "drew the dashboard's $panels panels from Prometheus" ;;
    3) panels=0 ;;
    *) log "FAIL: drawing the dashboard's panels"; exit 1 ;;
esac

# ---- stop: graceful, nothing left ---------------------------------------------------------------------
ids=$(compose ps -a -q)
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

# ---- the summary docs/deploy.md quotes ---------------------------------------------------------------
results=${RESULTS-$ROOT/docs/results/deploy-test}
if [ -n "$results" ]; then
    mkdir -p "$results"
    compose_version=$($COMPOSE version --short 2>/dev/null || true)
    name="last-pass-compose-v${compose_version%%.*}"
    "$PYTHON" "$ROOT/deploy/test/summary.py" "$work/summary.json" "$results" --name "$name" \
        --workbench "$work/workbench.log" \
        --set total_s=$(( $(date +%s) - t0 )) build_s="$build_s" healthy_s="$healthy_s" \
        race_s="$race_s" race_model_bytes="$race_bytes" \
        compose="$COMPOSE $compose_version" \
        engine="$("$ENGINE" version --format '{{.Server.Version}}' 2>/dev/null || true)" \
        seed_from_host="${SEED_FROM_HOST:-0}" skip_build="${SKIP_BUILD:-0}" \
        cores="$(nproc)" load="$(cut -d' ' -f1-3 /proc/loadavg)" base="$BASE" ca_scan="$ca_scan" \
        dashboard_schema="$dashboard_schema" panels="$panels"
    if [ "$panels" != 0 ]; then
        rm -rf "$results/panels"
        cp -r "$work/panels" "$results/panels"
    fi
    log "summary: $results/$name.md"
fi
log "deploy test passed in $(( $(date +%s) - t0 )) s"
