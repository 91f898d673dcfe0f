"""A stand-in for a vLLM engine's KV-event publisher, on real libzmq (pyzmq) and msgspec,
for kvrouter's tests: the wire of vLLM's ZmqEventPublisher (a PUB that binds when its
endpoint is a wildcard and connects otherwise, a ROUTER replay socket with a bounded buffer,
EventBatch = [ts, events, dp_rank] with tagged events), driven line by line from stdin:

  {"op": "batch", "events": [...], "dp_rank": 0, "send": true}   next seq; "send": false keeps
                                                                 it out of the live stream
                                                                 (replay still has it)
  {"op": "raw", "frames_hex": ["..", ..]}                        any frames, as they are
  {"op": "restart"}                                              seq back to 0, buffer empty
  {"op": "sleep", "s": 0.1}

Events are JSON objects in vLLM's field names with "type"; --form map sends them as tagged
maps (vLLM >= 0.24), --form array as positional arrays (older vLLM, SGLang). --replay-form
new answers replays as [topic, seq, payload] (vLLM >= 0.26), old as [seq, payload].
Prints "ready" once its sockets are set up, "done" when stdin ends.
"""

import argparse
import json
import sys
import threading
import time
from collections import deque
from typing import Any, Optional, Union

import msgspec
import zmq

Hash = Union[int, bytes]


def classes(array_like: bool):
    class Event(msgspec.Struct, array_like=array_like, omit_defaults=True, tag=True):
        pass

    class BlockStored(Event):
        block_hashes: list[Hash]
        parent_block_hash: Optional[Hash]
        token_ids: list[int]
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]
        lora_name: Optional[str]

    class BlockRemoved(Event):
        block_hashes: list[Hash]
        medium: Optional[str]

    class AllBlocksCleared(Event):
        pass

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
        ts: float
        events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
        data_parallel_rank: Optional[int] = None

    return {
        "BlockStored": BlockStored,
        "BlockRemoved": BlockRemoved,
        "AllBlocksCleared": AllBlocksCleared,
    }, EventBatch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pub", required=True)
    ap.add_argument("--replay")
    ap.add_argument("--buffer", type=int, default=10000)
    ap.add_argument("--topic", default="")
    ap.add_argument("--form", choices=["map", "array"], default="map")
    ap.add_argument("--replay-form", choices=["new", "old"], default="new")
    args = ap.parse_args()

    kinds, EventBatch = classes(args.form == "array")
    enc = msgspec.msgpack.Encoder()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.set_hwm(100000)
    # vLLM's rule: bind a wildcard (or ipc/inproc) endpoint, connect to anything else.
    if "*" in args.pub or "::" in args.pub:
        pub.bind(args.pub)
    else:
        pub.connect(args.pub)

    lock = threading.Lock()
    buffer: deque = deque(maxlen=args.buffer)
    state = {"seq": 0}
    topic = args.topic.encode()
    stop = threading.Event()

    def serve_replay() -> None:
        router = ctx.socket(zmq.ROUTER)
        router.bind(args.replay)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        end = (-1).to_bytes(8, "big", signed=True)
        while not stop.is_set():
            if not poller.poll(50):
                continue
            frame = router.recv_multipart()
            if len(frame) != 3 or frame[1] != b"":
                continue
            client, start = frame[0], int.from_bytes(frame[2], "big")
            with lock:
                items = [(s, p) for (s, p) in buffer if s >= start]
            for s, p in items:
                seqb = s.to_bytes(8, "big")
                if args.replay_form == "new":
                    router.send_multipart([client, b"", topic, seqb, p])
                else:
                    router.send_multipart([client, b"", seqb, p])
            if args.replay_form == "new":
                router.send_multipart([client, b"", b"", end, b""])
            else:
                router.send_multipart([client, b"", end, b""])
        router.close(linger=0)

    replay = None
    if args.replay:
        replay = threading.Thread(target=serve_replay, daemon=True)
        replay.start()
    print("ready", flush=True)

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "batch":
            events = []
            for e in cmd["events"]:
                e = dict(e)
                cls = kinds[e.pop("type")]
                events.append(cls(**e))
            payload = enc.encode(
                EventBatch(ts=time.time(), events=events, data_parallel_rank=cmd.get("dp_rank"))
            )
            with lock:
                seq = state["seq"]
                state["seq"] += 1
                buffer.append((seq, payload))
            if cmd.get("send", True):
                pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
        elif op == "raw":
            pub.send_multipart([bytes.fromhex(f) for f in cmd["frames_hex"]])
        elif op == "restart":
            with lock:
                state["seq"] = 0
                buffer.clear()
        elif op == "sleep":
            time.sleep(cmd["s"])
    print("done", flush=True)
    # Keep the replay socket up a little for requests in flight.
    time.sleep(0.2)
    stop.set()
    if replay:
        replay.join()
    pub.close(linger=1000)
    ctx.term()


if __name__ == "__main__":
    main()
