#!/usr/bin/env python3
"""Makes two model cards with real vocabularies, for tests and benchmarks that must not
rest on the tiny card's 1,000-odd tokens (Hugging Face itself is out of reach here):

- OUT/llama3: Llama 3's 128,000 BPE ranks (`llama_models/llama3/tokenizer.model` of the
  `llama-models` wheel), with Meta-Llama-3-8B-Instruct's 256 special tokens, Llama 3's
  pre-tokenizer pattern, `ignore_merges`, a post-processor that puts `<|begin_of_text|>`
  first, and Meta-Llama-3-8B-Instruct's chat template
  (tests/fixtures/chat-templates/llama3.jinja).
- OUT/qwen2.5: Qwen's 151,643 BPE ranks (`dashscope/resources/qwen.tiktoken` of the
  `dashscope` wheel, the vocabulary Qwen 2 and 2.5 use), with Qwen 2.5's 22 added tokens,
  NFC, Qwen 2's pattern and Qwen 2.5's chat template
  (tests/fixtures/chat-templates/qwen2.5.jinja).

The ranks become `tokenizer.json` through `transformers`' own tiktoken converter, as
Hugging Face's cards of those models were made; each card is checked against the steps
written here, not against the published `tokenizer.json` (which cannot be fetched). The
converter lists every split of a token that both halves are tokens of (Qwen: 294,166
merges), so this Qwen card merges as Qwen's own tiktoken encoder does; the published card
lists one merge per token and may differ from it on rare words.

Usage: scripts/real-cards.py LLAMA3_TOKENIZER_MODEL QWEN_TIKTOKEN OUT_DIR
(scripts/real-cards.sh fetches the wheels, checks their files' hashes and calls this.)
"""
import json
import shutil
import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, normalizers, processors
from transformers.convert_slow_tokenizer import TikTokenConverter

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "tests/fixtures/chat-templates"

LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# Meta-Llama-3-8B-Instruct's 256 special tokens from id 128000 on (Llama 3.1 and later
# renamed some reserved ones; the ids the template writes are the same).
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>"]
LLAMA3_SPECIAL += [f"<|reserved_special_token_{i}|>" for i in range(4)]
LLAMA3_SPECIAL += ["<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>",
                   "<|eot_id|>"]
LLAMA3_SPECIAL += [f"<|reserved_special_token_{i}|>" for i in range(5, 251)]
assert len(LLAMA3_SPECIAL) == 256

# Qwen 2.5's added tokens from id 151643 on; the last eight are not special.
QWEN25_ADDED = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]
QWEN25_SPECIAL = 14


def added_decoder(tok, first_id, names, special):
    out = {}
    for i, name in enumerate(names):
        assert tok.token_to_id(name) == first_id + i, name
        out[str(first_id + i)] = {"content": name, "lstrip": False, "normalized": False,
                                  "rstrip": False, "single_word": False,
                                  "special": special(i)}
    return out


def write(dest, tok, config):
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    print(dest)


def llama3(ranks, out):
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=LLAMA3).converted()
    assert tok.get_vocab_size() == 128000
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in LLAMA3_SPECIAL])
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
            special_tokens=[("<|begin_of_text|>", 128000)]),
    ])
    config = {
        "added_tokens_decoder": added_decoder(tok, 128000, LLAMA3_SPECIAL, lambda _: True),
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": (TEMPLATES / "llama3.jinja").read_text().rstrip("\n"),
        "clean_up_tokenization_spaces": True,
        "model_max_length": 1000000000000000019884624838656,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    write(out / "llama3", tok, config)


def qwen25(ranks, out):
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN2).converted()
    assert tok.get_vocab_size() == 151643
    # Qwen 2's BPE merges every word (the converter sets ignore_merges for Llama 3).
    spec = json.loads(tok.to_str())
    spec["model"]["ignore_merges"] = False
    spec["normalizer"] = {"type": "NFC"}
    spec["added_tokens"] = []
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_tokens([AddedToken(t, normalized=False, special=i < QWEN25_SPECIAL)
                    for i, t in enumerate(QWEN25_ADDED)])
    assert isinstance(tok.normalizer, normalizers.NFC)
    config = {
        "add_bos_token": False,
        "added_tokens_decoder": added_decoder(tok, 151643, QWEN25_ADDED,
                                              lambda i: i < QWEN25_SPECIAL),
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": (TEMPLATES / "qwen2.5.jinja").read_text().rstrip("\n"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
    }
    write(out / "qwen2.5", tok, config)


def main():
    llama_ranks, qwen_ranks, out = (Path(a) for a in sys.argv[1:4])
    out.mkdir(parents=True, exist_ok=True)
    llama3(llama_ranks, out)
    qwen25(qwen_ranks, out)


if __name__ == "__main__":
    main()
