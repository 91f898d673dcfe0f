#!/usr/bin/env bash
# The eleven routing cells of docs/HARNESS.md ("The routing goals"), every policy, in
# virtual time: the agentic dev trace (first 6,000 requests at speeds 0.3 and 1, and the
# whole trace; 16 workers), the Mooncake conversation trace (8 workers at 0.5, 1, 1.5; 16
# at 1, 2) and the synthetic trace (8 workers at 0.5, 1, 1.5). About 5 minutes on 2 cores.
#
#   scripts/routing-cells.sh OUT [kvrouter bench flags...]   # e.g. --seed 1
#   python3 scripts/routing-cells.py OUT                     # the table and the goals
#
# Expects target/release/kvrouter (cargo build --release -p kvrouter).
set -euo pipefail
out=$1
shift
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
b=$root/target/release/kvrouter
t=${TRACES:-$root/../shared/traces}
cell() {
    local name=$1
    shift
    "$b" bench "$@" --json "$out/$name.json" > "$out/$name.txt" 2> "$out/$name.err"
}
cell ag6000 --trace "$t/kvct_agentic_dev_b512.jsonl.zst" --workers 16 --limit 6000 --speed 0.3,1 "$@"
cell whole --trace "$t/kvct_agentic_dev_b512.jsonl.zst" --workers 16 "$@"
cell conv8 --trace "$t/mooncake_conversation_trace.jsonl" --workers 8 --speed 0.5,1,1.5 "$@"
cell conv16 --trace "$t/mooncake_conversation_trace.jsonl" --workers 16 --speed 1,2 "$@"
cell synth --trace "$t/mooncake_synthetic_trace.jsonl" --workers 8 --speed 0.5,1,1.5 "$@"
