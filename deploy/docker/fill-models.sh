#!/bin/sh
# radix-fill-models: the compose stack's `models-init` service (deploy/docker-compose.yml).
# Puts the model the servers will open into the model volume, whole, before any of them
# starts: the servers depend on this service completing successfully.
#
#   radix-fill-models SOURCE TARGET     (RADIX_MODEL_FILE: the file the servers open)
#
# SOURCE is the image's /models, TARGET the volume (or host directory) the servers mount at
# /models. When RADIX_MODEL_FILE is one of the image's files, it is copied to a temporary name
# in TARGET, fsynced, renamed over the final name (so a reader sees the whole file or none),
# and listed, with its size and mtime, in TARGET/.radix-models-complete (written the same way). A copy
# already there that is identical to the image's is kept. When RADIX_MODEL_FILE is not in the
# image (the operator's own model in a host directory), nothing is written: the file must be
# there and non-empty. Exits non-zero with the reason otherwise.
#
# Replaces docker's copy of the image's /models into an empty named volume, which happens while
# the first container using the volume is created: a second server created at the same moment
# saw a non-empty volume, skipped the copy and could open the model before it was complete.
set -eu

src=${1:-/models}
dst=${2:-/target}
file=${RADIX_MODEL_FILE:?RADIX_MODEL_FILE is not set}
marker="$dst/.radix-models-complete"

say() { echo "radix-fill-models: $*" >&2; }

case "$file" in
    */* | .* | "") say "RADIX_MODEL_FILE must be a plain file name in the model directory, not '$file'"; exit 2 ;;
esac
[ -d "$dst" ] || { say "$dst is not a directory (the model volume is not mounted)"; exit 2; }

if [ ! -f "$src/$file" ]; then
    # Not the image's model: the operator's, in RADIX_MODEL_DIR. Only check it is there.
    if [ -f "$dst/$file" ] && [ -s "$dst/$file" ]; then
        say "$file is not one of the image's models; using the one in the model directory ($(stat -c %s "$dst/$file") bytes)"
        exit 0
    fi
    say "$file is neither in the image ($src) nor in the model directory: put it in RADIX_MODEL_DIR or fix RADIX_MODEL_FILE"
    exit 1
fi

size=$(stat -c %s "$src/$file")
entry="$file $size $(stat -c %Y "$src/$file")"   # a rebuilt image's file is compared again
if [ -f "$marker" ] && grep -qxF -- "$entry" "$marker" \
        && [ "$(stat -c %s "$dst/$file" 2>/dev/null || echo none)" = "$size" ]; then
    say "$file ($size bytes) already complete in the model volume"
    exit 0
fi

# Leftovers of an interrupted earlier run.
rm -f "$dst/.$file.partial."* "$marker.partial."*

if [ -f "$dst/$file" ] && cmp -s "$src/$file" "$dst/$file"; then
    say "$file in the model volume is identical to the image's: kept"
else
    tmp="$dst/.$file.partial.$$"
    say "copying $file ($size bytes) into the model volume ..."
    cp "$src/$file" "$tmp"
    chmod 0644 "$tmp"
    sync "$tmp"                       # fsync the data before the name points at it
    [ "$(stat -c %s "$tmp")" = "$size" ] || { say "short copy of $file"; rm -f "$tmp"; exit 1; }
    mv -f "$tmp" "$dst/$file"
fi
sync "$dst/$file"

# The completion marker: every entry but this file's, then this one; fsynced, renamed.
tmp="$marker.partial.$$"
{
    if [ -f "$marker" ]; then awk -v f="$file" '$1 != f' "$marker"; fi
    echo "$entry"
} >"$tmp"
chmod 0644 "$tmp"
sync "$tmp"
mv -f "$tmp" "$marker"
sync "$dst"                           # the directory: both renames are durable
say "$file ($size bytes) complete in the model volume"
