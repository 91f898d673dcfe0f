"""Plays engines on the vLLM-native ZMQ wire for `kvrouter-bench zmq`, and is the raw
libzmq (pyzmq) SUB loop it compares against.

  pub FILE N [--rate BLOCKS_PER_S]   bind N PUB sockets, each on a port the system picks;
                                     print "ready P1,P2,..." (their ports); after "go" on
                                     stdin, send FILE's messages (each to its publisher,
                                     with that publisher's next seq); print "start T"
                                     (time.time()) and "sent"
  sub P1,P2,... MESSAGES             connect a SUB to every port; print "ready"; count
                                     MESSAGES, print "end T" at the last one

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


def publish(path, n, rate):
    msgs = load(path)
    ctx = zmq.Context()
    socks = []
    for k in range(n):
        s = ctx.socket(zmq.PUB)
        s.set_hwm(1_000_000)
        # Port 0: the system picks a free one as it binds, so no other process can take
        # it between a check and the bind.
        s.bind("tcp://127.0.0.1:*")
        socks.append(s)
    ports = [s.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1] for s in socks]
    seqs = [0] * n
    print("ready " + ",".join(ports), flush=True)
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


def subscribe(ports, total):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.set_hwm(1_000_000)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    for port in ports:
        sub.connect(f"tcp://127.0.0.1:{port}")
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
        rate = float(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[4] == "--rate" else None
        publish(sys.argv[2], int(sys.argv[3]), rate)
    else:
        subscribe(sys.argv[2].split(","), int(sys.argv[3]))
