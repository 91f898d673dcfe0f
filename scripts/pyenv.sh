#!/usr/bin/env bash
# A Python venv with the real third-party peers the tests talk to: pyzmq (libzmq),
# msgspec (vLLM's serializer), the openai SDK (the proxy's client) and transformers with
# tokenizers (the reference for chat templates and token ids), tiktoken (which
# scripts/real-cards.sh reads BPE ranks with). Idempotent and safe to call from parallel tests; prints the
# interpreter's path. The venv lives in target/ (git-ignored); KVROUTER_PYENV overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
V=${KVROUTER_PYENV:-target/pyenv}
mkdir -p "$(dirname "$V")"
exec 9>"$V.lock"
flock 9
if ! "$V/bin/python" -c 'import zmq, msgspec, openai, transformers, tokenizers, jinja2, tiktoken' >/dev/null 2>&1; then
    [ -x "$V/bin/python" ] || python3 -m venv "$V" >&2
    "$V/bin/pip" install -q --disable-pip-version-check 'pyzmq>=26' 'msgspec>=0.18' \
        'openai>=1.40' 'transformers>=4.45' 'tokenizers>=0.20' 'jinja2>=3.1' 'tiktoken>=0.7' >&2
fi
echo "$(cd "$V" && pwd)/bin/python"
