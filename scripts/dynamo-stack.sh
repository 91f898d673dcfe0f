#!/usr/bin/env bash
# The tests against the real NVIDIA Dynamo 1.6.1 stack (mocker engines, frontend, RadixTree),
# installed from PyPI by ../shared/dynamo/setup.sh into target/ (about 30 s the first time).
# Usage: scripts/dynamo-stack.sh [TIME_LIMIT_SECS]   (default 600; CI calls it)
set -euo pipefail
cd "$(dirname "$0")/.."
setup=../shared/dynamo/setup.sh
if [ ! -f "$setup" ]; then
    echo "no Dynamo stack installer at $setup: these tests need ../shared/dynamo" >&2
    exit 1
fi
V=${KVROUTER_DYNAMO_VENV:-target/dynamo-venv}
M=${KVROUTER_DYNAMO_MODEL:-target/dynamo-model}
bash scripts/debian-deps.sh
mkdir -p target
bash "$setup" "$V" "$M" >&2
export KVROUTER_DYNAMO_VENV=$(cd "$V" && pwd)
export KVROUTER_DYNAMO_MODEL=$(cd "$M" && pwd)
timeout "${1:-600}" cargo test -p kvrouter --features dynamo-stack --test dynamo_stack --locked -- --nocapture --test-threads 1
