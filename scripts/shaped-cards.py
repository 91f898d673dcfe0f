#!/usr/bin/env python3
"""Copies a byte-level model card (GPT-2's shape) into OUT/llama3-shape and OUT/qwen2-shape,
with Llama 3's and Qwen 2's steps before the vocabulary: Llama 3's Split pattern and
`ignore_merges`; NFC and Qwen 2's Split pattern. Both then use ByteLevel without its own
pattern. The card's vocabulary, merges and chat template stay, so the cards time the
encoders' steps, not those models' vocabularies (docs/BENCHMARKS.md).

Usage: scripts/shaped-cards.py CARD_DIR OUT_DIR
"""
import json
import shutil
import sys
from pathlib import Path

LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def main() -> None:
    card, out = Path(sys.argv[1]), Path(sys.argv[2])
    for name, pattern, normalizer, ignore_merges in [
        ("llama3-shape", LLAMA3, None, True),
        ("qwen2-shape", QWEN2, {"type": "NFC"}, False),
    ]:
        dest = out / name
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(card, dest)
        spec = json.loads((dest / "tokenizer.json").read_text())
        spec["normalizer"] = normalizer
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]}
        spec["model"]["ignore_merges"] = ignore_merges
        (dest / "tokenizer.json").write_text(json.dumps(spec))
        print(dest)


if __name__ == "__main__":
    main()
