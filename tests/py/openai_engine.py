#!/usr/bin/env python3
"""Our mock OpenAI engine (not a real one: it generates no text) for the proxy's tests.

Speaks the OpenAI API as vLLM does: POST /v1/chat/completions and /v1/completions,
streamed (SSE, a role chunk, one chunk per token, a usage chunk when
stream_options.include_usage, then [DONE]) or not; GET /v1/models. Each answer names the
engine (--name) so a test sees where a request went, and its usage reports
prompt_tokens_details.cached_tokens (--cached). Faults a real engine cannot be made to
produce on demand come from the request's `user` field:
  "slow"             one token every 200 ms, 200 tokens (for disconnects)
  "drip"             8 tokens, 300 ms apart (an answer longer than a short idle timeout)
  "stall"            8 s after each token (an engine gone silent mid-stream)
  "die_after_first"  sends the first chunk, then drops the connection
  "linger"           waits 3 s after [DONE] before ending the chunked body
  "after_done"       sends one more event after [DONE]
and from --fail: every request's connection is closed before any response.
Each request is logged as one JSON line on stdout: {"event": "request"|"cancelled"|"done",
"name", "request_id", "dp_rank", "path", "body", "peer"} ("peer": the client's port, which
shows a reused connection).
"""
import argparse
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--name", required=True)
ap.add_argument("--fail", action="store_true")
ap.add_argument("--cached", type=int, default=0)
ap.add_argument("--tokens", type=int, default=4)
args = ap.parse_args()
lock = threading.Lock()


def log(**kv):
    with lock:
        print(json.dumps(kv), flush=True)


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):
        if self.path.rstrip("/") == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        else:
            self.send_json(404, {"error": {"message": "no such path"}})

    def send_json(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        n = int(self.headers.get("content-length", "0"))
        req = json.loads(self.rfile.read(n) or b"{}")
        rid = self.headers.get("x-request-id")
        log(event="request", name=args.name, request_id=rid,
            dp_rank=self.headers.get("x-data-parallel-rank"), path=self.path, body=req,
            authorization=self.headers.get("authorization"), peer=self.client_address[1])
        if args.fail:
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        mode = req.get("user") or ""
        ntok = 200 if mode == "slow" else 8 if mode == "drip" else args.tokens
        chat = self.path.endswith("/chat/completions")
        words = [f"{args.name}-t{i} " for i in range(ntok)]
        usage = {"prompt_tokens": 10, "completion_tokens": ntok, "total_tokens": 10 + ntok,
                 "prompt_tokens_details": {"cached_tokens": args.cached}}
        if not req.get("stream"):
            text = "".join(words)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text},
                          "finish_reason": "stop"}
            else:
                choice = {"index": 0, "text": text, "finish_reason": "stop"}
            self.send_json(200, {"id": "cmpl-" + (rid or "x"), "object": "chat.completion" if chat else "text_completion",
                                 "created": 1, "model": req.get("model"), "choices": [choice],
                                 "usage": usage, "engine": args.name})
            log(event="done", name=args.name, request_id=rid)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()

        def chunk(obj):
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def delta(i, content, finish=None, role=False):
            if chat:
                d = {"content": content}
                if role:
                    d = {"role": "assistant", "content": ""}
                c = {"index": 0, "delta": d, "finish_reason": finish}
                obj = "chat.completion.chunk"
            else:
                c = {"index": 0, "text": content, "finish_reason": finish}
                obj = "text_completion"
            return {"id": "cmpl-" + (rid or "x"), "object": obj, "created": 1,
                    "model": req.get("model"), "choices": [c]}

        try:
            if chat:
                chunk(delta(0, "", role=True))
            for i, w in enumerate(words):
                chunk(delta(i, w, "stop" if i == ntok - 1 else None))
                if mode == "die_after_first":
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                if mode == "slow":
                    time.sleep(0.2)
                if mode == "drip":
                    time.sleep(0.3)
                if mode == "stall":
                    time.sleep(8)
            if (req.get("stream_options") or {}).get("include_usage"):
                chunk({"id": "cmpl-" + (rid or "x"), "object": "chat.completion.chunk", "created": 1,
                       "model": req.get("model"), "choices": [], "usage": usage})
            chunk(b"[DONE]")
            if mode == "linger":
                time.sleep(3)
            if mode == "after_done":
                chunk(b"late")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            log(event="done", name=args.name, request_id=rid)
        except (BrokenPipeError, ConnectionResetError):
            log(event="cancelled", name=args.name, request_id=rid)
            self.close_connection = True


srv = ThreadingHTTPServer(("127.0.0.1", args.port), H)
srv.daemon_threads = True
log(event="ready", name=args.name)
srv.serve_forever()
