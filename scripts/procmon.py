#!/usr/bin/env python3
"""Runs a command and samples every `kvrouter` process on the host: CPU, RSS and threads.

    python3 scripts/procmon.py OUT -- CMD...

Every 0.5 s it reads /proc for processes whose first argument (argv[0]) contains
`kvrouter`, whoever started them (run no other such process meanwhile), keeping each
one's latest CPU seconds (user + system) and its peak RSS and threads. At the end it
groups them by their subcommand (`bench`, `bench-engine`, `serve`, ...) and
writes `OUT.json` (also printed): the command's exit status, the wall time and, per group,
the processes, their CPU seconds together and the largest RSS and thread count of any one.
CMD's output goes to `OUT.stdout` and `OUT.stderr`. A process's last half second before
it exits may be missed.
"""
import json
import os
import subprocess
import sys
import time


def main():
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit(__doc__)
    out, cmd = sys.argv[1], sys.argv[3:]
    tick = os.sysconf("SC_CLK_TCK")
    page = os.sysconf("SC_PAGE_SIZE")
    with open(out + ".stdout", "w") as so, open(out + ".stderr", "w") as se:
        p = subprocess.Popen(cmd, stdout=so, stderr=se)
        seen = {}
        t0 = time.time()
        while True:
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        argv = f.read().split(b"\0")
                    if b"kvrouter" not in argv[0]:
                        continue
                    with open(f"/proc/{pid}/stat") as f:
                        st = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                s = seen.setdefault(
                    pid,
                    {"kind": argv[1].decode() if len(argv) > 1 else "", "cpu": 0, "rss": 0, "threads": 0},
                )
                s["cpu"] = max(s["cpu"], (int(st[11]) + int(st[12])) / tick)
                s["rss"] = max(s["rss"], int(st[21]) * page)
                s["threads"] = max(s["threads"], int(st[17]))
            if p.poll() is not None:
                break
            time.sleep(0.5)
    groups = {}
    for s in seen.values():
        g = groups.setdefault(s["kind"], {"processes": 0, "cpu_s": 0.0, "rss_max": 0, "threads_max": 0})
        g["processes"] += 1
        g["cpu_s"] = round(g["cpu_s"] + s["cpu"], 2)
        g["rss_max"] = max(g["rss_max"], s["rss"])
        g["threads_max"] = max(g["threads_max"], s["threads"])
    res = {"rc": p.returncode, "wall_s": round(time.time() - t0, 1), "groups": groups}
    with open(out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res))
    sys.exit(p.returncode)


if __name__ == "__main__":
    main()
