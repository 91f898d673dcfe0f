#!/usr/bin/env python3
"""The openai SDK as a client of kvrouter's OpenAI front, for the proxy's tests.

Usage: openai_client.py BASE_URL SCENARIO... ; prints one JSON line per scenario.
"""
import json
import sys
import urllib.error
import urllib.request

import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base + "/v1", api_key="sk-test-secret", max_retries=0, timeout=30)
MESSAGES = [
    {"role": "system", "content": "You are a careful assistant who answers in one line."},
    {"role": "user", "content": "Tell me about the Python standard library, its modules and how they are organised. " * 4},
]


def out(**kv):
    print(json.dumps(kv), flush=True)


def raw(path, body, headers=None):
    req = urllib.request.Request(base + path, data=body, method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


for sc in sys.argv[2:]:
    try:
        if sc == "models":
            out(scenario=sc, ids=[m.id for m in client.models.list().data])
        elif sc == "chat":
            r = client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES)
            c = r.parse()
            out(scenario=sc, content=c.choices[0].message.content, cached=c.usage.prompt_tokens_details.cached_tokens,
                worker=r.headers.get("x-kvrouter-worker-id"), request_id=r.headers.get("x-kvrouter-request-id"))
        elif sc == "chat_stream":
            parts, usage, n = [], None, 0
            stream = client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True,
                                                    stream_options={"include_usage": True})
            for ch in stream:
                n += 1
                if ch.choices and ch.choices[0].delta.content:
                    parts.append(ch.choices[0].delta.content)
                if ch.usage:
                    usage = ch.usage.completion_tokens
            out(scenario=sc, content="".join(parts), chunks=n, usage=usage)
        elif sc == "completion":
            c = client.completions.create(model="tiny", prompt="def main():\n    return 1\n" * 8, max_tokens=4)
            out(scenario=sc, content=c.choices[0].text)
        elif sc == "completion_stream":
            parts = [ch.choices[0].text for ch in client.completions.create(
                model="tiny", prompt="import os\n" * 20, stream=True) if ch.choices]
            out(scenario=sc, content="".join(parts))
        elif sc == "session":
            # A conversation that grows turn by turn, as an agent's does: each turn sends
            # the whole history again.
            ws, messages = [], []
            for i in range(4):
                messages.append({"role": "user", "content": f"session turn {i} " * (30 + i)})
                r = client.chat.completions.with_raw_response.create(
                    model="tiny", messages=messages, extra_headers={"X-Dynamo-Session-ID": "agent-7"})
                ws.append(r.headers.get("x-kvrouter-worker-id"))
                messages.append({"role": "assistant", "content": r.parse().choices[0].message.content})
            out(scenario=sc, workers=ws)
        elif sc == "disconnect":
            stream = client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, user="slow")
            read = 0
            for _ in stream:
                read += 1
                if read == 3:
                    break
            stream.close()
            out(scenario=sc, read=read)
        elif sc == "die_after_first":
            got = []
            try:
                for ch in client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True,
                                                         user="die_after_first"):
                    if ch.choices and ch.choices[0].delta.content:
                        got.append(ch.choices[0].delta.content)
                out(scenario=sc, error=None, got=got)
            except openai.APIError as e:
                out(scenario=sc, error=type(e).__name__, message=str(e), got=got)
        elif sc == "bad":
            res = {}
            res["malformed"] = raw("/v1/chat/completions", b'{"model": "tiny", "messages": [')
            res["unknown_model"] = raw("/v1/chat/completions", json.dumps({"model": "nope", "messages": MESSAGES}).encode())
            res["no_messages"] = raw("/v1/chat/completions", json.dumps({"model": "tiny"}).encode())
            res["oversize"] = raw("/v1/completions", json.dumps({"model": "tiny", "prompt": "x" * (2 << 20)}).encode())
            res["template_raises"] = raw("/v1/chat/completions", json.dumps(
                {"model": "strict", "messages": [{"role": "tool", "content": "x"}]}).encode())
            res["not_object"] = raw("/v1/completions", b"[1, 2]")
            try:
                client.chat.completions.create(model="nope", messages=MESSAGES)
                res["sdk_unknown_model"] = None
            except openai.NotFoundError as e:
                res["sdk_unknown_model"] = e.status_code
            out(scenario=sc, **res)
        else:
            out(scenario=sc, error="unknown scenario")
    except Exception as e:  # report, do not hide: the test asserts on it
        out(scenario=sc, exception=f"{type(e).__name__}: {e}")
