#!/bin/sh
# Make a Python >= 3.11 (the project's requires-python) with venv available as
# /usr/local/bin/radix-python, on any base image the Dockerfile accepts:
#   - Debian 12+/Ubuntu 24.04+ (python3 is 3.11+): the distribution's python3 and python3-venv;
#   - Ubuntu 22.04 (the CUDA 12.4 devel and CANN 8.0 bases ship 3.10): python3.11 from
#     Ubuntu's own archive (universe), else from the deadsnakes PPA; at image build time only;
#   - anything else with a python3.11+ on PATH already: that one.
# Usage: ensure-python.sh [build|runtime]   (build also installs the -dev headers)
set -eu
mode=${1:-build}
# The build needs venv with ensurepip (Debian splits it into python3-venv); the runtime only the interpreter.
modules=sys; [ "$mode" = build ] && modules="sys, venv, ensurepip"
ok() { "$1" -c "import $modules; sys.exit(sys.version_info < (3, 11))" 2>/dev/null; }
link() { ln -sf "$(command -v "$1")" /usr/local/bin/radix-python; "$1" --version; }
for candidate in python3 python3.13 python3.12 python3.11; do
    if command -v "$candidate" >/dev/null && ok "$candidate"; then link "$candidate"; exit 0; fi
done
export DEBIAN_FRONTEND=noninteractive
. /etc/os-release
apt-get update
if [ "${ID:-}" = debian ] || { [ "${ID:-}" = ubuntu ] && [ "${VERSION_ID%%.*}" -ge 24 ]; }; then
    pkgs=python3
    [ "$mode" = build ] && pkgs="$pkgs python3-venv"
    apt-get install -y --no-install-recommends $pkgs
    link python3
elif [ "${ID:-}" = ubuntu ]; then
    pkgs="python3.11 python3.11-venv"
    [ "$mode" = build ] && pkgs="$pkgs python3.11-dev"
    # Ubuntu 22.04's own archive (universe) has python3.11; the deadsnakes PPA only if it does not.
    if ! apt-get install -y --no-install-recommends $pkgs; then
        apt-get install -y --no-install-recommends software-properties-common gpg-agent
        add-apt-repository -y ppa:deadsnakes/ppa
        apt-get install -y --no-install-recommends $pkgs
        apt-get purge -y --auto-remove software-properties-common gpg-agent
    fi
    link python3.11
else
    echo "ensure-python: no Python >= 3.11 on this base ($PRETTY_NAME) and no known way to add one;" >&2
    echo "ensure-python: use a base that has one, or a Debian/Ubuntu base" >&2
    exit 1
fi
rm -rf /var/lib/apt/lists/*
