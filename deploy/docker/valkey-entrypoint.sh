#!/bin/sh
# radix-valkey: the entrypoint of the Valkey (or Redis) image of the proxies' shared remote KV
# tier (deploy/docker/valkey.Dockerfile; docs/scale-out.md, "Deploy").
#
#   radix-valkey [SERVER OPTION]...      (extra options go to the server after the config file)
#
# Settings (environment):
#   RADIX_VALKEY_PASSWORD_FILE  the AUTH password, one line (default /run/secrets/valkey_password);
#                               required: the store holds whole KV, so it never runs open
#   RADIX_VALKEY_MAXMEMORY      the store's memory for entries (default 4gb), evicted LRU
#   RADIX_VALKEY_PORT           (default 6379)
#   RADIX_VALKEY_BIND           the addresses listened on (default "* -::*": every IPv4 and,
#                               where there is one, IPv6 address)
#   RADIX_VALKEY_RUN_DIR        where the config file is written and the server's working
#                               directory (default /run/valkey: a tmpfs, mode 0700)
#
# The password reaches the server in a config file (mode 0600, in the run directory), never
# on a command line: the server's argv shows in every process list of the host, a file of
# its own user does not. The server reads the file named as its first argument.
# A cache, not a database: no RDB snapshots, no AOF; a restart starts empty and the proxies
# fill it again with their next saves. Full, it evicts the least recently used entries
# (allkeys-lru), the policy the remote tier expects (docs/scale-out.md): with `noeviction`
# every write would fail with OOM instead.
set -eu

say() { echo "radix-valkey: $*" >&2; }

password_file=${RADIX_VALKEY_PASSWORD_FILE:-/run/secrets/valkey_password}
maxmemory=${RADIX_VALKEY_MAXMEMORY:-4gb}
port=${RADIX_VALKEY_PORT:-6379}
bind=${RADIX_VALKEY_BIND:-* -::*}
run_dir=${RADIX_VALKEY_RUN_DIR:-/run/valkey}

server=$(command -v valkey-server || command -v redis-server) \
    || { say "neither valkey-server nor redis-server is installed"; exit 1; }

# Each value goes on one line of the config file: nothing that could start another directive.
case "$maxmemory" in "" | *[!0-9kKmMgGbB]*) say "RADIX_VALKEY_MAXMEMORY must be like 4gb or 512mb, not '$maxmemory'"; exit 2 ;; esac
case "$port" in "" | *[!0-9]*) say "RADIX_VALKEY_PORT must be a number, not '$port'"; exit 2 ;; esac
case "$bind" in "" | *[!0-9A-Za-z.:%*\ -]*) say "RADIX_VALKEY_BIND must be addresses separated by spaces, not '$bind'"; exit 2 ;; esac

# A regular file: the compose file's default for an unset secret is /dev/null, refused here
# (as the proxy refuses it), so a store started without a password says so and stops.
[ -f "$password_file" ] || { say "$password_file is not a file: the store's password is required (RADIX_CACHE_REMOTE_PASSWORD_FILE in deploy/.env)"; exit 1; }
[ -r "$password_file" ] || { say "$password_file is not readable by uid $(id -u): chown it (docs/scale-out.md, \"Deploy\")"; exit 1; }
password=$(cat "$password_file")
[ -n "$password" ] || { say "$password_file is empty: the store's password is required"; exit 1; }
nl='
'
tab=$(printf '\t')
case "$password" in
    *" "* | *"$tab"* | *"$nl"* | *'"'* | *"'"* | *\\*)
        say "the password in $password_file must be one word without quotes or backslashes (head -c 32 /dev/urandom | base64)"
        exit 2
        ;;
esac

[ -d "$run_dir" ] && [ -w "$run_dir" ] || { say "$run_dir is not a writable directory (a tmpfs of uid $(id -u))"; exit 1; }
umask 077
conf="$run_dir/valkey.conf"
tmp="$conf.tmp.$$"
# printf is the shell's builtin: the password is in no process's argv, this one's included.
{
    printf 'bind %s\n' "$bind"
    printf 'port %s\n' "$port"
    printf 'requirepass %s\n' "$password"
    printf 'save ""\n'
    printf 'appendonly no\n'
    printf 'maxmemory %s\n' "$maxmemory"
    printf 'maxmemory-policy allkeys-lru\n'
    printf 'dir %s\n' "$run_dir"
    printf 'daemonize no\n'
    printf 'logfile ""\n'
} >"$tmp"
chmod 0600 "$tmp"
mv -f "$tmp" "$conf"
unset password
say "$(basename "$server") on port $port, maxmemory $maxmemory (allkeys-lru), no persistence"
exec "$server" "$conf" "$@"
