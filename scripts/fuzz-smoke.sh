#!/usr/bin/env bash
# Runs each cargo-fuzz target for a short while on stable (no sanitizer), from its committed
# seed corpus. Usage: scripts/fuzz-smoke.sh [SECONDS_PER_TARGET]
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-30}"
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
for target in $(cargo fuzz list); do
    echo "== fuzz $target for ${secs}s"
    cargo fuzz run "$target" -s none -- -max_total_time="$secs" -print_final_stats=1 2>&1 | tail -3
done
