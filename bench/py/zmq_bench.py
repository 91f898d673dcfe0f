"""Plays engines on the vLLM-native ZMQ wire for `kvrouter-bench zmq`, and is the raw
libzmq (pyzmq) SUB loop it compares against.

  pub FILE BASE_PORT N [--rate BLOCKS_PER_S]   bind N PUB sockets on BASE_PORT..; after "go"
                                               on stdin, send FILE's messages (each to its
                                               publisher, with that publisher's next seq);
                                               print "start T" (time.time()) and "sent"
  sub BASE_PORT N MESSAGES                     connect N SUBs; print "ready"; count MESSAGES,
                                               print "end T" at the last one

FILE holds records: u32 publisher index, u32 block events, u32 length, payload (LE).
"""

import struct
import sys
import time

import zmq


def load(path):
    out = []
    with open(path, "rb") as f:
        data = f.read()
    i = 0
    while i < len(data):
        pub, blocks, n = struct.unpack_from("<III", data, i)
        i += 12
        out.append((pub, blocks, data[i : i + n]))
        i += n
    return out


def publish(path, base, n, rate):
    msgs = load(path)
    ctx = zmq.Context()
    socks = []
    for k in range(n):
        s = ctx.socket(zmq.PUB)
        s.set_hwm(1_000_000)
        s.bind(f"tcp://*:{base + k}")
        socks.append(s)
    seqs = [0] * n
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "go":
            break
    t0 = time.time()
    print(f"start {t0!r}", flush=True)
    sent = 0
    for pub, blocks, payload in msgs:
        if rate:
            due = t0 + sent / rate
            now = time.time()
            if due > now:
                time.sleep(due - now)
        socks[pub].send_multipart([b"", seqs[pub].to_bytes(8, "big"), payload], copy=False)
        seqs[pub] += 1
        sent += blocks
    print("sent", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
    for s in socks:
        s.close(linger=0)


def subscribe(base, n, total):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.set_hwm(1_000_000)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    for k in range(n):
        sub.connect(f"tcp://127.0.0.1:{base + k}")
    time.sleep(0.5)
    print("ready", flush=True)
    cpu = time.process_time()
    for _ in range(total):
        sub.recv_multipart(copy=False)
    # The process's CPU seconds (libzmq's I/O thread and this loop) over the messages.
    print(f"end {time.time()!r}", flush=True)
    print(f"cpu {time.process_time() - cpu!r}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "pub":
        rate = float(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[5] == "--rate" else None
        publish(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), rate)
    else:
        subscribe(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
