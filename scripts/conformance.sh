#!/usr/bin/env bash
# Replays every log of the shared corpus (default ../shared/workloads) through each index
# backend and checks every answer. Usage: scripts/conformance.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-../shared/workloads}"
if [ ! -d "$dir" ]; then
    echo "no corpus at $dir: skipping (the bundled sample is checked by the test suite)"
    exit 0
fi
cargo build --release --locked -p kvrouter
for log in "$dir"/*.jsonl*; do
    for index in reference tree; do
        echo "== $log --index $index"
        ./target/release/kvrouter replay --check "$log" --index "$index"
    done
done
