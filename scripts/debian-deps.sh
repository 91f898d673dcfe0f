#!/usr/bin/env bash
# Installs the servers the tests start on their own ports when this machine lacks them:
# nats-server and etcd (Debian packages). Called by scripts/test.sh and scripts/dynamo-stack.sh.
set -euo pipefail
missing=()
command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || missing+=(nats-server)
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || missing+=(etcd-client)
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing the Debian packages ${missing[*]}" >&2
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
