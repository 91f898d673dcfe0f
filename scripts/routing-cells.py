#!/usr/bin/env python3
"""Summarises scripts/routing-cells.sh runs: per cell, mean / p99 TTFT (s) of the main
policies, the lowest of all in bold, and the routing goals for `kv-aware`.

    python3 scripts/routing-cells.py OUT [OUT...]
"""
import json
import os
import sys

CELLS = [
    ("ag6000", "0.3", "agentic dev 6,000, 16, 0.3"),
    ("ag6000", "1", "agentic dev 6,000, 16, 1"),
    ("whole", None, "agentic dev whole, 16, 1"),
    ("conv8", "0.5", "conversation, 8, 0.5"),
    ("conv8", "1", "conversation, 8, 1"),
    ("conv8", "1.5", "conversation, 8, 1.5"),
    ("conv16", "1", "conversation, 16, 1"),
    ("conv16", "2", "conversation, 16, 2"),
    ("synth", "0.5", "synthetic, 8, 0.5"),
    ("synth", "1", "synthetic, 8, 1"),
    ("synth", "1.5", "synthetic, 8, 1.5"),
]
SHOWN = ["kv-aware", "kv-time", "dynamo", "approximate", "least-loaded"]


def secs(ms):
    s = ms / 1000
    return f"{s:.2f}" if s < 10 else f"{s:.1f}" if s < 100 else f"{s:,.0f}"


def main(dirs):
    for d in dirs:
        print(f"## {d}")
        print("| cell | floor p99 | " + " | ".join(SHOWN) + " | lowest both | p99 / dynamo | vs approximate | hit % | busiest/idlest |")
        print("|---|" + "---:|" * (len(SHOWN) + 6))
        lowest = 0
        for name, speed, label in CELLS:
            with open(os.path.join(d, name + ".json")) as f:
                j = json.load(f)
            if speed is not None:
                j = j[speed]
            ttft = {p: (v["ttft_ms"]["mean"], v["ttft_ms"]["p99"]) for p, v in j.items()}
            best = (min(v[0] for v in ttft.values()), min(v[1] for v in ttft.values()))
            ours = ttft["kv-aware"]
            both = ours == best
            lowest += both
            cols = []
            for p in SHOWN:
                m, q = ttft[p]
                cols.append(
                    (f"**{secs(m)}**" if m == best[0] else secs(m))
                    + " / "
                    + (f"**{secs(q)}**" if q == best[1] else secs(q))
                )
            ka = j["kv-aware"]
            rpw = ka["requests_per_worker"]
            approx = ttft["approximate"]
            worse = [w for w, a, o in (("mean", approx[0], ours[0]), ("p99", approx[1], ours[1])) if o > a]
            print(
                f"| {label} | {secs(ka['ttft_floor_ms']['p99'])} | "
                + " | ".join(cols)
                + f" | {'yes' if both else 'no'} | ×{ours[1] / ttft['dynamo'][1]:.2f}"
                + f" | {'worse: ' + ', '.join(worse) if worse else 'not worse'}"
                + f" | {ka['prefix_hit_ratio'] * 100:.1f} | {max(rpw) / max(1, min(rpw)):.2f} |"
            )
        print(f"\nkv-aware has the lowest mean and p99 in {lowest} cells of {len(CELLS)}\n")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
