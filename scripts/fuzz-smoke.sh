#!/usr/bin/env bash
# Runs each cargo-fuzz target for a short while on stable (no sanitizer), from its committed
# seed corpus. Usage: scripts/fuzz-smoke.sh [SECONDS_PER_TARGET] [TARGET=SECONDS ...]
# (for example `scripts/fuzz-smoke.sh 20 index_diff=60`: the index's differential target
# for a minute, the decoders for 20 s each).
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-30}"
shift || true
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
for target in $(cargo fuzz list); do
    t="$secs"
    for o in "$@"; do
        [ "${o%%=*}" = "$target" ] && t="${o#*=}"
    done
    echo "== fuzz $target for ${t}s"
    cargo fuzz run "$target" -s none -- -max_total_time="$t" -print_final_stats=1 2>&1 | tail -3
done
