#!/usr/bin/env bash
# loom models of the lock-free tree (publication and reclamation), on stable Rust.
set -euo pipefail
cd "$(dirname "$0")/.."
RUSTFLAGS="--cfg loom --cfg crossbeam_loom" CARGO_TARGET_DIR=target/loom \
    cargo test -p kvrouter-core --release --locked --lib loom_models "$@"
