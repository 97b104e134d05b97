#!/bin/sh
# Idle resident memory of a behest binary (issue 27 item 9): starts `BINARY serve` with the
# default configuration (no --config: the demo model) on a fresh SQLite file in a temporary
# directory, waits IDLE seconds (default 5), prints VmRSS, RssAnon and RssFile from
# /proc/<pid>/status (KiB), then stops it. Linux only.
#
#   cargo build --release --bin behest
#   scripts/idle-rss.sh target/release/behest [IDLE] [STARTS]
#
# With STARTS > 1 it starts the binary that many times, one line each.
set -eu
binary=$(realpath "${1:?usage: idle-rss.sh BINARY [IDLE_SECONDS] [STARTS]}")
idle=${2:-5}
starts=${3:-1}
i=0
while [ "$i" -lt "$starts" ]; do
    i=$((i + 1))
    dir=$(mktemp -d)
    (cd "$dir" && env -u BEHEST_CONFIG -u BEHEST_DATABASE_URL -u BEHEST_BIND \
        "$binary" serve --bind 127.0.0.1:0 >"$dir/log" 2>&1) &
    sleep "$idle"
    pid=$(pgrep -n -f "^$binary serve --bind 127.0.0.1:0" || true)
    if [ -z "$pid" ]; then
        echo "the server did not start:" >&2
        cat "$dir/log" >&2
        exit 1
    fi
    printf 'start %s: ' "$i"
    grep -E '^(VmRSS|RssAnon|RssFile)' "/proc/$pid/status" | tr -s ' \t' ' ' | tr '\n' ' '
    echo
    if [ -n "${IDLE_RSS_SMAPS:-}" ]; then
        cp "/proc/$pid/smaps" "$IDLE_RSS_SMAPS"
    fi
    kill -TERM "$pid"
    wait 2>/dev/null || true
    rm -rf "$dir"
done
