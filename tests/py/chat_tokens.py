#!/usr/bin/env python3
"""The reference for the proxy's tokenisation: transformers' apply_chat_template.

Usage: chat_tokens.py CARD_DIR < requests.jsonl ; prints, per request, one JSON line
{"text": rendered prompt, "ids": token ids} or {"error": ...}. Each request is prepared
as vLLM prepares an OpenAI chat request before its template sees it: text content parts
joined by newlines, tool-call arguments given as JSON strings parsed into objects; the
rendered text is then encoded without special tokens (the template wrote them).
"""
import json
import sys

from transformers import AutoTokenizer

tok = AutoTokenizer.from_pretrained(sys.argv[1])
for line in sys.stdin:
    req = json.loads(line)
    msgs = []
    for m in req["messages"]:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"] if p.get("type") == "text")
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                c = json.loads(json.dumps(c))
                f = c.get("function") or {}
                if isinstance(f.get("arguments"), str):
                    f["arguments"] = json.loads(f["arguments"])
                calls.append(c)
            m["tool_calls"] = calls
        msgs.append(m)
    try:
        text = tok.apply_chat_template(msgs, tools=req.get("tools"), tokenize=False,
                                       add_generation_prompt=req.get("add_generation_prompt", True),
                                       **(req.get("chat_template_kwargs") or {}))
        ids = tok(text, add_special_tokens=False)["input_ids"]
        print(json.dumps({"text": text, "ids": ids}), flush=True)
    except Exception as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
