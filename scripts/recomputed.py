#!/usr/bin/env python3
"""Prefixes computed twice on one worker, from `kvrouter bench --outcomes F` and its trace.

    python3 scripts/recomputed.py F TRACE [--limit N] [--block-size N] [--policies a,b]

TRACE is the trace the bench replayed (`.jsonl` or `.jsonl.zst`; `zstd` must be on the
PATH for the latter), `--limit` the bench's, `--block-size` the engine's (64 by default).
Per speed and policy: the requests admitted on their worker while a prefill sharing a
prefix with them was still running there (admitted before them, first token after) that
did not find all of that shared prefix cached, and the prompt tokens of it they computed
again beside the prefill. An engine that gives a running prefill the whole step's budget
starts no request beside it (one admitted in the prefill's last step finds it all), so
nothing is computed twice; with `--long-prefill-token-threshold` a request can start
beside it and find only the chunks already scheduled (docs/BENCHMARKS.md, "Why, cell by
cell"). Only full blocks are cached, so the shared prefix is counted in whole blocks of
`--block-size`. Needs an in-process run (the networked modes do not know when the engine
admitted a request).
"""
import argparse
import csv
import json
import subprocess
from collections import defaultdict

TRACE_BLOCK = 512


def read_trace(path, limit):
    if path.endswith(".zst"):
        text = subprocess.run(
            ["zstd", "-dc", path], check=True, capture_output=True, text=True
        ).stdout
    else:
        with open(path) as f:
            text = f.read()
    out = []
    for line in text.splitlines():
        if limit and len(out) == limit:
            break
        if line.strip():
            r = json.loads(line)
            out.append((r["hash_ids"], r["input_length"]))
    return out


def common(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outcomes")
    ap.add_argument("trace")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--policies", default="")
    args = ap.parse_args()
    trace = read_trace(args.trace, args.limit)
    wanted = set(filter(None, args.policies.split(",")))
    runs = defaultdict(lambda: defaultdict(list))
    with open(args.outcomes) as f:
        for r in csv.DictReader(f):
            if wanted and r["policy"] not in wanted:
                continue
            if not r["admitted_ms"] or not r["cached_blocks"]:
                raise SystemExit("needs an in-process run's outcomes (admitted_ms, cached_blocks)")
            runs[(r["speed"], r["policy"])][r["worker"]].append(
                (
                    float(r["admitted_ms"]),
                    int(r["request"]),
                    float(r["first_ms"]),
                    int(r["cached_blocks"]) * args.block_size,
                )
            )
    for (speed, policy), workers in runs.items():
        joined = requests = tokens = recomputed = 0
        for rs in workers.values():
            # In the order the engine admitted them (the queue's order within a step).
            rs.sort()
            running = []
            for admitted, i, first, cached in rs:
                requests += 1
                tokens += trace[i][1]
                running = [q for q in running if q[2] > admitted]
                shared = 0
                for _, j, _, _ in running:
                    shared = max(shared, common(trace[i][0], trace[j][0]))
                running.append((admitted, i, first, cached))
                full = trace[i][1] // args.block_size * args.block_size
                shared = min(shared * TRACE_BLOCK, full)
                if shared > cached:
                    joined += 1
                    recomputed += shared - cached
        print(
            f"speed {speed}, {policy}: {joined} of {requests} requests started beside a running "
            f"prefill sharing their prefix and computed part of it again: "
            f"{recomputed / 1e6:.2f} M of the {tokens / 1e6:.0f} M prompt tokens "
            f"({100 * recomputed / max(tokens, 1):.1f} %)"
        )


if __name__ == "__main__":
    main()
