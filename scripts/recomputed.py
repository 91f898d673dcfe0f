#!/usr/bin/env python3
"""Prefixes computed twice on one worker, from `kvrouter bench --outcomes F` and its trace.

    python3 scripts/recomputed.py F TRACE [--limit N] [--block-size N] [--policies a,b]

TRACE is the trace the bench replayed (`.jsonl` or `.jsonl.zst`; `zstd` must be on the
PATH for the latter), `--limit` the bench's, `--block-size` the engine's (64 by default).
Per speed and policy: how many requests were admitted on their worker while a prefill
sharing a prefix with them was still running there (admitted before them, first token
after), and how many prompt tokens of that shared prefix they did not find cached and
computed again beside it. An engine that gives a running prefill the whole step's
budget admits no request until the prefill ends, so nothing is computed twice; with
`--long-prefill-token-threshold` a request can start beside it and find only the
chunks already scheduled (docs/BENCHMARKS.md, "Why, cell by cell"). Needs an in-process
run (the networked modes do not know when the engine admitted a request).
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
                    float(r["first_ms"]),
                    int(r["request"]),
                    int(r["cached_blocks"]) * args.block_size,
                )
            )
    for (speed, policy), workers in runs.items():
        joined = requests = tokens = recomputed = 0
        for rs in workers.values():
            rs.sort()
            running = []
            for admitted, first, i, cached in rs:
                requests += 1
                tokens += trace[i][1]
                running = [q for q in running if q[1] > admitted]
                shared = 0
                for _, _, j, _ in running:
                    shared = max(shared, common(trace[i][0], trace[j][0]))
                running.append((admitted, first, i, cached))
                shared = min(shared * TRACE_BLOCK, trace[i][1])
                if shared:
                    joined += 1
                    recomputed += max(0, shared - cached)
        print(
            f"speed {speed}, {policy}: {joined} of {requests} requests admitted while a prefill "
            f"sharing their prefix ran on their worker; {recomputed / 1e6:.2f} M of their "
            f"{tokens / 1e6:.0f} M prompt tokens ({100 * recomputed / max(tokens, 1):.1f} %) "
            f"computed again beside it"
        )


if __name__ == "__main__":
    main()
