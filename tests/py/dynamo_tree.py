"""NVIDIA Dynamo 1.6.1's own index (dynamo.llm.RadixTree) fed from Dynamo's ZMQ event plane,
for kvrouter's tests: it finds the kv-events publishers in discovery (v1/event_channels of the
file-discovery tree DIR, or of etcd when the first argument is etcd:http://HOST:PORT), subscribes to each (pyzmq), applies every KV event to the RadixTree, and
answers on stdin, one JSON line per command:

  {"op": "paths"}              -> every stored block's local-hash path from its root
  {"op": "scores", "q": [...]} -> {"WORKER/DP": blocks, ...} from RadixTree.find_matches
  {"op": "count"}              -> {"events": N}
  {"op": "tiers"}              -> {"TIER": blocks, ...}: the blocks each storage tier holds, from
                                  the raw events (stored adds, removed and cleared take away, per
                                  worker, dp rank and tier)

Run with the interpreter of the venv ../shared/dynamo/setup.sh makes. Prints
"subscribed N" once its N subscriptions are up.
"""

import base64
import glob
import json
import os
import sys
import threading
import time
import urllib.request

import msgpack
import zmq
from dynamo.llm import RadixTree


def entries(where):
    """The event-channel entries of a file tree or of etcd (its v3 JSON gateway)."""
    if where.startswith("etcd:"):
        b64 = lambda b: base64.b64encode(b).decode()
        body = json.dumps({"key": b64(b"v1/event_channels/"), "range_end": b64(b"v1/event_channels0")})
        req = urllib.request.Request(where[5:] + "/v3/kv/range", data=body.encode(), method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            kvs = json.load(r).get("kvs", [])
        return [json.loads(base64.b64decode(kv["value"])) for kv in kvs]
    out = []
    for path in glob.glob(os.path.join(where, "v1", "event_channels", "*")):
        with open(path) as f:
            out.append(json.load(f))
    return out


def channels(where, want):
    out = []
    for v in entries(where):
        if v.get("topic") == "kv-events" and v["transport"]["kind"] == "Zmq":
            out.append(v["transport"]["config"]["endpoint"])
    return sorted(set(out))[:want] if want else sorted(set(out))


def main():
    dir_, want = sys.argv[1], int(sys.argv[2])
    eps = []
    while len(eps) < want:
        eps = channels(dir_, want)
        if len(eps) < want:
            time.sleep(0.1)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    for ep in eps:
        sub.connect(ep)
    tree = RadixTree()
    lock = threading.Lock()
    # block hash -> (parent block hash, local hash), per worker
    blocks = {}
    state = {"events": 0}
    # (worker, dp rank, tier) -> block hashes, from the events as published
    tiers = {}

    def pump():
        while True:
            frames = sub.recv_multipart()
            if len(frames) != 4 or frames[0] != b"kv-events":
                continue
            env = msgpack.unpackb(frames[3][5:], raw=False)
            for ev in msgpack.unpackb(env["payload"], raw=False, strict_map_key=False):
                w = ev["worker_id"]
                e = ev["event"]
                with lock:
                    tree.apply_event(w, json.dumps(e).encode())
                    state["events"] += 1
                    data = e["data"]
                    held = tiers.setdefault((w, e.get("dp_rank", 0), ev.get("storage_tier", "device")), set())
                    if data == "cleared":
                        held.clear()
                    elif isinstance(data, dict) and "removed" in data:
                        held.difference_update(data["removed"]["block_hashes"])
                    elif isinstance(data, dict) and "stored" in data:
                        held.update(b["block_hash"] for b in data["stored"]["blocks"])
                    if isinstance(data, dict) and "stored" in data:
                        parent = data["stored"].get("parent_hash")
                        for b in data["stored"]["blocks"]:
                            blocks[(w, b["block_hash"])] = (parent, b["tokens_hash"])
                            parent = b["block_hash"]

    threading.Thread(target=pump, daemon=True).start()
    print(f"subscribed {len(eps)}", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        with lock:
            if cmd["op"] == "paths":
                paths = []
                for (w, h), (parent, local) in blocks.items():
                    path = [local]
                    while parent is not None and (w, parent) in blocks:
                        parent, l = blocks[(w, parent)]
                        path.append(l)
                    paths.append(path[::-1])
                out = paths
            elif cmd["op"] == "scores":
                r = tree.find_matches(cmd["q"])
                out = {f"{w}/{dp}": n for (w, dp), n in r.scores.items()}
            elif cmd["op"] == "tiers":
                out = {}
                for (_, _, tier), held in tiers.items():
                    out[tier] = out.get(tier, 0) + len(held)
            else:
                out = {"events": state["events"]}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
