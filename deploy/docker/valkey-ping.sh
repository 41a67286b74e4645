#!/bin/sh
# radix-valkey-ping: the health check of the Valkey (or Redis) image (the compose stack's
# healthcheck, the Kubernetes probes): PING with the password, healthy on PONG only.
#
# The password goes to the cli in its environment (VALKEYCLI_AUTH for valkey-cli,
# REDISCLI_AUTH for redis-cli), never in its argv (`-a` would show it in every process list).
# The cli exits 0 on an error reply too (NOAUTH, a wrong password): the answer is checked.
# Same settings as radix-valkey: RADIX_VALKEY_PASSWORD_FILE, RADIX_VALKEY_PORT,
# RADIX_VALKEY_BIND (its first address is asked, loopback for a wildcard).
set -eu

password_file=${RADIX_VALKEY_PASSWORD_FILE:-/run/secrets/valkey_password}
port=${RADIX_VALKEY_PORT:-6379}
host=${RADIX_VALKEY_BIND:-*}
host=${host%% *}
case "$host" in "*" | 0.0.0.0 | "::" | "-"*) host=127.0.0.1 ;; esac

cli=$(command -v valkey-cli || command -v redis-cli) \
    || { echo "radix-valkey-ping: neither valkey-cli nor redis-cli is installed" >&2; exit 1; }
password=$(cat "$password_file")
export VALKEYCLI_AUTH="$password" REDISCLI_AUTH="$password"
answer=$("$cli" -h "$host" -p "$port" ping 2>&1) || true
[ "$answer" = PONG ] || { echo "radix-valkey-ping: $answer" >&2; exit 1; }
