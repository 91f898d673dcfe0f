#!/usr/bin/env bash
# The shipped binary never links NVIDIA Dynamo's crates: `kvrouter bench` depends on
# kvrouter-bench, whose `dynamo` feature (side-by-side comparisons with dynamo-kv-router)
# must stay off in the binary's own dependency graph. Fails if any dynamo crate, or the
# feature, reaches it.
set -euo pipefail
cd "$(dirname "$0")/.."

tree=$(cargo tree -p kvrouter -e normal,build,features --locked --prefix none)
if grep -E '^(dynamo-|kvrouter-bench feature "dynamo")' <<<"$tree" | sort -u | grep .; then
    echo "shipped.sh: the kvrouter binary depends on NVIDIA Dynamo's crates (above)" >&2
    exit 1
fi
echo "shipped.sh: the kvrouter binary links no dynamo crate"
