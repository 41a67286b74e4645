#!/bin/sh
# Installs what deploy/grafana/check_dashboard.py checks the dashboard with: the dashboard schema
# of the Grafana version deploy/docker-compose.yml pins (npm's @grafana/schema: the dashboard
# kind and every core panel's options and field config, as TypeScript types generated from
# Grafana's CUE schema), the Prometheus query kind of the same version (the types of
# @grafana/prometheus only: its index.d.ts, not the package's UI dependencies) and the
# TypeScript compiler (the version that @grafana/schema itself was built with).
#
# Versions and hashes are pinned: package.json / package-lock.json (npm ci), and
# PROMETHEUS_INTEGRITY below for the tarball of @grafana/prometheus. Installed once under the
# radixctl cache, keyed by the content of this directory, behind a lock (make grafana-schema,
# and the test calls it too). Prints the install directory (it has node_modules/) on stdout.
# Exits 3 with a "skip:" line where node or npm is missing.
set -eu

HERE=$(cd "$(dirname "$0")" && pwd)
PROMETHEUS_INTEGRITY=sha512-WHYvo2qszBgMnJtZuXmsowkQeLL1nyaE63Xsog0ftan8xea8gkOXgtrqqYgIqbGQuBk/yOs5s+Bgb2tLz51gAQ==
CACHE=${RADIX_CACHE_DIR:-$HOME/.cache/llama-radix-proxy}

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "skip: node and npm are needed for the Grafana dashboard schema check (apt-get install -y nodejs npm)" >&2
    exit 3
fi
# The Grafana version: @grafana/schema's, which tests/unit/test_grafana_dashboard.py holds
# equal to the image tag in deploy/docker-compose.yml.
VERSION=$(node -e 'process.stdout.write(require(process.argv[1]).devDependencies["@grafana/schema"])' "$HERE/package.json")
key=$(cat "$HERE/package.json" "$HERE/package-lock.json" "$HERE/install.sh" | sha256sum | cut -c1-16)
DEST=$CACHE/grafana-schema/$VERSION-$key
mkdir -p "$CACHE/grafana-schema"
exec 9>"$DEST.lock"
flock 9
if [ -f "$DEST/.complete" ]; then
    echo "$DEST"
    exit 0
fi
tmp=$(mktemp -d "$DEST.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
cp "$HERE/package.json" "$HERE/package-lock.json" "$tmp/"
echo "grafana schema $VERSION: npm ci (@grafana/schema, typescript) ..." >&2
(cd "$tmp" && npm ci --ignore-scripts --no-audit --no-fund >&2)
echo "grafana schema $VERSION: @grafana/prometheus $VERSION (types only) ..." >&2
tarball=$(cd "$tmp" && npm pack --silent "@grafana/prometheus@$VERSION" | tail -n 1)
got=$(node -e '
const data = require("fs").readFileSync(process.argv[1]);
process.stdout.write("sha512-" + require("crypto").createHash("sha512").update(data).digest("base64"));
' "$tmp/$tarball")
if [ "$got" != "$PROMETHEUS_INTEGRITY" ]; then
    echo "@grafana/prometheus@$VERSION: integrity $got, expected $PROMETHEUS_INTEGRITY" >&2
    exit 1
fi
mkdir -p "$tmp/node_modules/@grafana/prometheus"
tar -xzf "$tmp/$tarball" -C "$tmp/node_modules/@grafana/prometheus" --strip-components=1 \
    package/package.json package/dist/index.d.ts
rm -f "$tmp/$tarball"
touch "$tmp/.complete"
rm -rf "$DEST"
mv "$tmp" "$DEST"
trap - EXIT
echo "$DEST"
