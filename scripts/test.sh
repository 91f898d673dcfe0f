#!/usr/bin/env bash
# The whole test suite. Installs nats-server (Debian package) when it is missing, since the
# io tests start their own servers on free ports.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nats-server >/dev/null 2>&1 && [ ! -x /usr/sbin/nats-server ]; then
    echo "nats-server not found: installing the Debian package" >&2
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nats-server
fi

cargo test --workspace --locked "$@"
