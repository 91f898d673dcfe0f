#!/usr/bin/env bash
# The whole test suite. Installs nats-server and etcd (Debian packages) when they are
# missing, since the io tests start their own servers on free ports.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/debian-deps.sh
cargo test --workspace --locked "$@"
