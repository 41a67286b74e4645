#!/usr/bin/env bash
# make deploy-fleet-test: the compose stack's `fleet` profile built and run for real
# (docs/scale-out.md, "Deploy"): two proxies, each in front of a server of its own on a payload
# volume of its own, sharing the `valkey` service as their remote KV tier.
#
# Builds the server, proxy and store images with compose from the local Debian 12 base
# (deploy/local-base.sh, as `make deploy-test` does), starts llama-server, proxy, llama-server-3,
# proxy-2 and valkey with host networking on free loopback ports, waits for every health check,
# then: a long prompt through proxy 1 (prefilled, its KV written to the store), the same prompt
# through proxy 2, which never saw it (route H: restored from the store; its server computes only
# the prompt's last partial block), both proxies' remote-tier figures, the store's password in
# no argv and no container config, a clean stop (every container exits 0) and nothing left.
#
#   ENGINE=docker  COMPOSE=...  KEEP=1  SKIP_BUILD=1  SEED_FROM_HOST=1   as in deploy/test/run.sh
#   RESULTS=docs/results/deploy-test   where a pass writes last-pass-fleet.json (empty: nowhere)
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

log() { echo "[deploy-fleet-test] $* ($(( $(date +%s) - t0 )) s)" >&2; }
skip() { log "skip: $*"; exit 0; }

command -v "$ENGINE" >/dev/null 2>&1 && "$ENGINE" info >/dev/null 2>&1 \
    || skip "no container engine ($ENGINE not installed or its daemon not reachable): apt-get install -y docker.io docker-compose debootstrap, start dockerd."
. "$DEPLOY/portability/base-image.sh"
BUILD_CLI=$(buildkit_cli)
[ -n "$BUILD_CLI" ] || skip "no BuildKit-capable $ENGINE client (install docker-buildx)."
if [ -z "${COMPOSE:-}" ]; then
    if "$ENGINE" compose version >/dev/null 2>&1; then COMPOSE="$ENGINE compose"
    elif command -v docker-compose >/dev/null 2>&1; then COMPOSE=docker-compose
    else skip "no docker compose (plugin) and no docker-compose: apt-get install -y docker-compose."
    fi
fi
PATH="$(dirname "$BUILD_CLI"):$PATH"
export PATH
BASE=$(base_image "$SUITE")
log "engine $ENGINE, compose: $COMPOSE, base $BASE"

# ---- settings: .env.example with free loopback ports and the fleet's secrets ---------------------------
work=$(mktemp -d /var/tmp/radix-fleet-test.XXXXXX)
project="radixfleettest$$"
compose() {
    $COMPOSE -p "$project" --env-file "$work/.env" --profile fleet \
        -f "$DEPLOY/docker-compose.yml" -f "$DEPLOY/compose.hostnet.yml" "$@"
}
SERVICES=(valkey llama-server proxy llama-server-3 proxy-2)
cleanup() {
    local rc=$?
    [ -z "$ca_test" ] || rm -f "$ca_test"
    if [ $rc -ne 0 ] && [ "${KEEP:-0}" = 1 ]; then
        log "KEEP=1: stack $project left running; settings in $work"
        return
    fi
    if [ $rc -ne 0 ]; then
        for service in models-init "${SERVICES[@]}"; do
            log "--- $service log (tail) ---"
            compose logs --no-color --tail 25 "$service" 2>&1 | sed 's/^/    /' >&2 || true
        done
    fi
    compose down -v --remove-orphans >/dev/null 2>&1 || true
    rm -rf "$work"
}
ca_test=""
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
read -r P_PROXY P_METRICS P_PROXY2 P_METRICS2 P_LLAMA P_LLAMA3 P_VALKEY < <("$PYTHON" - <<'EOF'
import socket
socks = [socket.socket() for _ in range(7)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
)
mkdir -p "$work/secrets"
for k in kvctl_key server_api_key remote_key valkey_password; do
    head -c 32 /dev/urandom | base64 >"$work/secrets/$k"
    chown 10001:10001 "$work/secrets/$k" || { log "FAIL: giving the secrets to uid 10001 needs root"; exit 1; }
    chmod 0400 "$work/secrets/$k"
done
declare -A settings=(
    [COMPOSE_FILE]=docker-compose.yml:compose.hostnet.yml
    [RADIX_BASE_IMAGE]=$BASE [RADIX_RUNTIME_BASE_IMAGE]=$BASE [RADIX_PROXY_BASE_IMAGE]=$BASE
    [RADIX_VALKEY_BASE_IMAGE]=$BASE
    [RADIX_LISTEN_ADDR]=127.0.0.1 [RADIX_BIND_ADDR]=127.0.0.1
    [PROXY_PORT]=$P_PROXY [PROXY_METRICS_PORT]=$P_METRICS [PROXY_PORT_2]=$P_PROXY2 [PROXY_METRICS_PORT_2]=$P_METRICS2
    [LLAMA_PORT]=$P_LLAMA [LLAMA_PORT_3]=$P_LLAMA3 [VALKEY_PORT]=$P_VALKEY
    [RADIX_BACKENDS]="http://127.0.0.1:$P_LLAMA#shared" [RADIX_BACKENDS_2]="http://127.0.0.1:$P_LLAMA3#shared"
    [RADIX_CACHE_REMOTE]="valkey://127.0.0.1:$P_VALKEY/0"
    [RADIX_CACHE_REMOTE_KEY_FILE]=$work/secrets/remote_key
    [RADIX_CACHE_REMOTE_PASSWORD_FILE]=$work/secrets/valkey_password
    [RADIX_PARALLEL]=1 [RADIX_CTX_SIZE]=4096 [RADIX_THREADS]=1 [RADIX_CACHE_RAM]=512
    [RADIX_PAYLOAD_TMPFS_SIZE]=768m [RADIX_RESTART]=no [RADIX_VALKEY_MAXMEMORY]=256mb
    [RADIX_KVCTL_KEY_FILE]=$work/secrets/kvctl_key
    [RADIX_SERVER_API_KEY_FILE]=$work/secrets/server_api_key
    [GRAFANA_ADMIN_PASSWORD_FILE]=$work/secrets/kvctl_key
)
{
    grep -v -E "^($(IFS='|'; echo "${!settings[*]}"))=" "$DEPLOY/.env.example"
    for key in "${!settings[@]}"; do printf '%s=%s\n' "$key" "${settings[$key]}"; done
} >"$work/.env"

# ---- images -----------------------------------------------------------------------------------------
# Behind a TLS-inspecting proxy the build gets the CA bundle's non-public certificates through
# deploy/ca/, as in deploy/test/run.sh (which also searches the images for them).
t_build=$(date +%s)
ca=${CA_BUNDLE:-${PIP_CERT:-}}
if [ "${SKIP_BUILD:-0}" != 1 ] && [ -n "$ca" ] && [ -f "$ca" ]; then
    ca_test="$DEPLOY/ca/deploy-test-ca.pem"
    rc=0
    "$PYTHON" "$ROOT/deploy/test/no_ca_in_images.py" --ca "$ca" --extract "$ca_test" || rc=$?
    case $rc in
        0) log "CA bundle $ca: its non-public certificates in deploy/ca/ for the build" ;;
        2) ca_test=""; log "CA bundle $ca: public CAs only, nothing to give the build" ;;
        *) log "FAIL: reading the CA bundle $ca"; exit 1 ;;
    esac
fi
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    if [ "${SEED_FROM_HOST:-0}" = 1 ] && [ "$(. /etc/os-release && echo "${VERSION_CODENAME:-}")" = "$SUITE" ]; then
        seed_build_cache "$BASE" "$("$ROOT/.venv/bin/radixctl" build)"
    fi
    buildlog=/var/tmp/radix-fleet-test-build.log
    log "build: DOCKER_BUILDKIT=1 $COMPOSE build ${SERVICES[*]} (log: $buildlog) ..."
    DOCKER_BUILDKIT=1 compose build "${SERVICES[@]}" >"$buildlog" 2>&1 \
        || { log "FAIL: compose build:"; tail -30 "$buildlog" >&2; exit 1; }
fi
build_s=$(( $(date +%s) - t_build ))
compose config -q

# ---- up, health -------------------------------------------------------------------------------------
log "up: ${SERVICES[*]} (host network; proxies :$P_PROXY :$P_PROXY2, servers :$P_LLAMA :$P_LLAMA3, store :$P_VALKEY)"
t_up=$(date +%s)
compose up -d --no-build "${SERVICES[@]}" >"$work/up.log" 2>&1 || { cat "$work/up.log" >&2; exit 1; }
deadline=$(( $(date +%s) + 300 ))
for service in "${SERVICES[@]}"; do
    id=$(compose ps -q "$service")
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
healthy_s=$(( $(date +%s) - t_up ))
password=$(cat "$work/secrets/valkey_password")
for service in "${SERVICES[@]}"; do
    config=$("$ENGINE" inspect "$(compose ps -q "$service")")  # not piped: grep -q must not cut it short
    if grep -qF -- "$password" <<<"$config"; then
        log "FAIL: the store's password shows in $service's config"; exit 1
    fi
done
if grep -qsF -- "$password" /proc/[0-9]*/cmdline 2>/dev/null; then log "FAIL: the store's password is in a command line"; exit 1; fi
for service in proxy proxy-2; do
    compose logs --no-color "$service" 2>&1 | grep -E "remote tier|cache-remote|valkey://127.0.0.1:$P_VALKEY" >&2 \
        || { log "FAIL: $service does not name the remote tier at startup"; exit 1; }
done

# ---- one prompt behind proxy 1, then behind proxy 2 ----------------------------------------------------
"$PYTHON" - "http://127.0.0.1:$P_PROXY" "http://127.0.0.1:$P_PROXY2" "$work/summary.json" <<'EOF'
import json, random, sys, time, urllib.request

one, two, out = sys.argv[1:4]
rnd = random.Random(7)
words = "river stone lantern copper meadow signal harbor violet engine orchard cable summit".split()
doc = " ".join(rnd.choice(words) for _ in range(1400))
body = {"messages": [{"role": "system", "content": "You answer in one word."},
                     {"role": "user", "content": doc + "\n\nWhat is the first word?"}],
        "max_tokens": 8, "temperature": 0}

def chat(base):
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:
        reply = json.load(r)
        return dict(r.headers), reply, time.monotonic() - t

def remote(base):
    with urllib.request.urlopen(base + "/radix/stats", timeout=10) as r:
        return json.load(r)["tiers"]["remote"]

h1, r1, s1 = chat(one)
route1 = h1.get("X-Radix-Route")
assert route1 == "prefill", h1
deadline = time.monotonic() + 60
while remote(one)["writes"] == 0 and time.monotonic() < deadline:
    time.sleep(0.5)  # the write is asynchronous
w1 = remote(one)
assert w1["writes"] > 0, w1
h2, r2, s2 = chat(two)
route2 = h2.get("X-Radix-Route")
w2 = remote(two)
assert route2 == "H", (h2, w2)
assert w2["promotions"] >= 1 and w2["promoted_tokens"] >= 512, w2
cached = r2.get("timings", {}).get("cache_n")
prompt = r2["usage"]["prompt_tokens"]
same = r1["choices"][0]["message"]["content"] == r2["choices"][0]["message"]["content"]
summary = {"prompt_tokens": prompt, "proxy1": {"route": route1, "seconds": round(s1, 2), "remote": w1},
           "proxy2": {"route": route2, "seconds": round(s2, 2), "cache_n": cached, "remote": w2},
           "same_answer": same}
json.dump(summary, open(out, "w"), indent=1)
print(f"[deploy-fleet-test] {prompt} prompt tokens: proxy 1 {route1} in {s1:.2f} s ({w1['writes']} chunks "
      f"written), proxy 2 {route2} in {s2:.2f} s ({w2['promoted_tokens']} tokens from the store); "
      f"same answer: {same}", file=sys.stderr)
assert same, (r1, r2)
EOF

# ---- stop: graceful, nothing left ------------------------------------------------------------------------
ids=$(compose ps -a -q)
compose stop >/dev/null 2>&1
for id in $ids; do
    read -r name status code oom < <("$ENGINE" inspect -f '{{.Name}} {{.State.Status}} {{.State.ExitCode}} {{.State.OOMKilled}}' "$id")
    [ "$status" = exited ] && [ "$code" = 0 ] && [ "$oom" = false ] \
        || { log "FAIL: $name after stop: $status, exit code $code, OOM-killed $oom"; exit 1; }
done
log "every container stopped on SIGTERM with exit code 0"
compose down -v --remove-orphans >/dev/null 2>&1
left=$("$ENGINE" ps -aq --filter "label=com.docker.compose.project=$project")$("$ENGINE" volume ls -q --filter "label=com.docker.compose.project=$project")
[ -z "$left" ] || { log "FAIL: left after down: $left"; exit 1; }
log "down: no container or volume left"

results=${RESULTS-$ROOT/docs/results/deploy-test}
if [ -n "$results" ]; then
    mkdir -p "$results"
    "$PYTHON" - "$work/summary.json" "$results/last-pass-fleet.json" <<EOF
import json, sys
s = json.load(open(sys.argv[1]))
s.update(total_s=$(( $(date +%s) - t0 )), build_s=$build_s, healthy_s=$healthy_s, compose="$COMPOSE",
         engine="$("$ENGINE" version --format '{{.Server.Version}}' 2>/dev/null || true)", base="$BASE",
         seed_from_host="${SEED_FROM_HOST:-0}", skip_build="${SKIP_BUILD:-0}", cores=$(nproc))
json.dump(s, open(sys.argv[2], "w"), indent=1)
EOF
    log "summary: $results/last-pass-fleet.json"
fi
log "deploy fleet test passed in $(( $(date +%s) - t0 )) s"
