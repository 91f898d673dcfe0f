#!/usr/bin/env python3
"""What the slowest 1 % of requests waited for, from `kvrouter bench --outcomes F`.

    python3 scripts/slowest.py F [--block-size N] [--policies a,b]   # N as given to the bench

Per speed and policy: the p99 TTFT; for the slowest 1 % their prompt and uncached tokens,
their own prefill alone on an idle engine (the CSV's `alone_ms`, from the harness engine's
own model), their wait for admission, and the prefill already ahead of them when they
arrived: on their own worker, on the least loaded other worker, and on the fleet's mean
worker (what a perfect balance of the same work would leave). "Ahead" is the own prefill
of each request waiting there, plus what is left of each one prefilling (its first token
less the arrival). Where the run has `dynamo` at that speed, it also counts the slowest
requests that no placement could bring under half of Dynamo's p99: the fleet's mean
prefill ahead plus their own prefill is already over it. Needs an in-process run (the
networked modes do not know when the engine admitted a request).
"""
import argparse
import csv
import math
import statistics as st
from collections import defaultdict


def p99(values):
    v = sorted(values)
    return v[math.ceil(0.99 * len(v)) - 1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outcomes")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--policies", default="")
    args = ap.parse_args()
    runs = defaultdict(list)
    with open(args.outcomes) as f:
        for r in csv.DictReader(f):
            runs[(r["speed"], r["policy"])].append(
                dict(
                    worker=r["worker"],
                    arrival=float(r["arrival_ms"]),
                    admitted=float(r["admitted_ms"]),
                    first=float(r["first_ms"]),
                    tokens=int(r["input_tokens"]),
                    uncached=int(r["input_tokens"]) - int(r["cached_blocks"]) * args.block_size,
                    alone=float(r["alone_ms"]),
                )
            )
    wanted = set(filter(None, args.policies.split(",")))
    for (speed, policy), rs in runs.items():
        if wanted and policy not in wanted:
            continue
        for r in rs:
            r["ttft"] = r["first"] - r["arrival"]
        dynamo = runs.get((speed, "dynamo"))
        bound = p99(r["first"] - r["arrival"] for r in dynamo) / 2 if dynamo else None
        workers = sorted({r["worker"] for r in rs})
        tail = sorted(rs, key=lambda r: r["ttft"])[-max(1, len(rs) // 100):]
        own, least, mean, over = [], [], [], 0
        # Behind a long prefill: one request on the same worker still had over 5 s to its
        # first token (engines give each step's budget to running prefills first).
        behind, behind_uncached, behind_largest = 0, [], []
        per_worker = defaultdict(int)
        for r in tail:
            t = r["arrival"]
            ahead = dict.fromkeys(workers, 0.0)
            for o in rs:
                if o is r:
                    continue
                if o["arrival"] <= t < o["admitted"]:
                    ahead[o["worker"]] += o["alone"]
                elif o["admitted"] <= t < o["first"]:
                    ahead[o["worker"]] += o["first"] - t
            own.append(ahead[r["worker"]])
            blocking = [
                o
                for o in rs
                if o is not r
                and o["worker"] == r["worker"]
                and o["arrival"] <= t < o["first"]
                and o["first"] - t > 5000
            ]
            if blocking:
                behind += 1
                behind_uncached.append(r["uncached"])
                behind_largest.append(max(o["uncached"] for o in blocking))
            least.append(min(v for w, v in ahead.items() if w != r["worker"]))
            mean.append(sum(ahead.values()) / len(workers))
            per_worker[r["worker"]] += 1
            if bound is not None and mean[-1] + r["alone"] > bound:
                over += 1
        s = lambda ms: f"{ms / 1000:.1f} s"
        print(f"speed {speed}, {policy}: {len(rs)} requests, p99 TTFT {s(p99(r['ttft'] for r in rs))}")
        print(
            f"  slowest {len(tail)}: TTFT {s(st.mean(r['ttft'] for r in tail))} mean;"
            f" prompt {st.mean(r['tokens'] for r in tail) / 1000:.0f} k tokens,"
            f" {st.mean(r['uncached'] for r in tail) / 1000:.0f} k uncached;"
            f" own prefill alone {s(st.mean(r['alone'] for r in tail))};"
            f" waited for admission {s(st.mean(r['admitted'] - r['arrival'] for r in tail))};"
            f" most on one worker {max(per_worker.values())}"
        )
        print(
            f"  prefill ahead at arrival (medians): own worker {s(st.median(own))},"
            f" least loaded other {s(st.median(least))}, fleet mean {s(st.median(mean))}"
        )
        if behind:
            print(
                f"  {behind} arrived behind a request on their worker with over 5 s to its first"
                f" token (medians: its uncached prompt {st.median(behind_largest) / 1000:.0f} k,"
                f" theirs {st.median(behind_uncached) / 1000:.0f} k)"
            )
        if bound is not None:
            print(
                f"  half of dynamo's p99 {s(bound)}: fleet mean ahead + own prefill over it"
                f" for {over} of {len(tail)}"
            )


if __name__ == "__main__":
    main()
