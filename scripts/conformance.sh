#!/usr/bin/env bash
# Replays every log of the shared corpus (default ../shared/workloads) through each index
# backend and checks every answer. Usage: scripts/conformance.sh [DIR]
#
# It checks with the dev build (debug assertions and overflow checks on) of `kvrouter` as
# the test suite builds it (the whole workspace with its test features, so that after
# scripts/test.sh nothing is rebuilt): a conformance run wants the assertions, not the
# speed (both logs and both indexes take about a minute on 2 cores). For timed replays use
# the release build (`kvrouter replay --perf`, docs/BENCHMARKS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-../shared/workloads}"
if [ ! -d "$dir" ]; then
    echo "no corpus at $dir: skipping (the bundled sample is checked by the test suite)"
    exit 0
fi
cargo test --workspace --locked --no-run
for log in "$dir"/*.jsonl*; do
    for index in reference tree; do
        echo "== $log --index $index"
        ./target/debug/kvrouter replay --check "$log" --index "$index"
    done
done
