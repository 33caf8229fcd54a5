"""What-if planning's wall time with the mesh views planned side by side (``advise(jobs=...)``).

For each case the model is built on ``meta`` and traced once; ``autopart.advise`` then plans every mesh view one
after another in this process (``jobs=1``) and side by side in forked processes (``jobs=N``, default one per
core), back to back, and the table gives both wall times after tracing, their ratio, each view's own planning
time (the slowest is what enough cores bring the wall time down to) and whether the two advices agree (the same
plan, step, memory and views: they must).

    PYTHONPATH=. python benchmarks/bench_advise.py                      # Llama-8B on 2 nodes, Llama-70B on 8
    PYTHONPATH=. python benchmarks/bench_advise.py --cases llama:70b@8 --jobs 4 --json advise.json
"""

from __future__ import annotations

import argparse
import json
import time

from autopart import forked
from autopart.advise import advise, build
from autopart.trace import trace

CASES = ("llama:8b@2", "llama:70b@8")


def _same(a, b) -> bool:
    return a.without_timings() == b.without_timings()


def run(cases: list[str], jobs: int, seq: int, cluster: str) -> list[dict]:
    rows = []
    for case in cases:
        model, _, nodes = case.partition("@")
        nodes = int(nodes or 1)
        batch = 8 * nodes
        built = build(model, batch=batch, seq=seq)
        t0 = time.perf_counter()
        traced = trace(*built[1:4])
        trace_s = time.perf_counter() - t0
        out = {}
        for j in (1, jobs):
            out[j] = advise(cluster=cluster, nodes=nodes, batch=batch, seq=seq, built=built, traced=traced, jobs=j)
        one, many = out[1], out[jobs]
        rows.append({
            "case": case, "gpus": one.gpus, "trace_s": trace_s, "jobs": jobs,
            "serial_s": one.plan_s, "forked_s": many.plan_s, "speedup": one.plan_s / many.plan_s,
            "views": [(v["mesh"], v.get("plan_s")) for v in one.views],
            "slowest_view_s": max((v.get("plan_s") or 0.0) for v in one.views),
            "step_time_s": many.step_time_s, "same": _same(one, many)})
        r = rows[-1]
        print(f"{case}: {r['serial_s']:.1f} s -> {r['forked_s']:.1f} s with {jobs} processes "
              f"({r['speedup']:.2f}x), same advice: {r['same']}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help="family:size@nodes, comma-separated")
    ap.add_argument("--jobs", type=int, default=None, help="processes (default: one per core)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--cluster", default="h100-80gb")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    jobs = args.jobs or forked.cpus()
    rows = run(args.cases.split(","), jobs, args.seq, args.cluster)
    print(f"\n{forked.cpus()} cores; planning s after tracing\n")
    print("| case | GPUs | trace s | jobs=1 | jobs=" + str(jobs) + " | speedup | each view (jobs=1) | same advice |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        views = ", ".join(f"{'x'.join(map(str, m))} {s:.1f}" if s else f"{'x'.join(map(str, m))} (renamed)"
                          for m, s in r["views"])
        print(f"| {r['case']} | {r['gpus']} | {r['trace_s']:.1f} | {r['serial_s']:.1f} | {r['forked_s']:.1f} | "
              f"{r['speedup']:.2f}x | {views} | {'yes' if r['same'] else 'NO'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
