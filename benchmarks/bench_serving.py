"""Serving's throughput objective: the batch of most tokens/s that fits, and within a latency bound.

    PYTHONPATH=. python benchmarks/bench_serving.py [--models llama:8b,llama:70b] [--context 8192]
        [--max-batch 1024] [--max-latency-ms 30] [--json out.json]

Per model: ``autopart.advise_serving`` on one ``h100-80gb`` node (8 GPUs, every logical mesh view), decoding one
token per sequence (``seq=1``) over a K/V cache of ``--context`` tokens per sequence: batch 1, 2, 4, ... until the
cache no longer fits (or ``--max-batch``), then bisected; once without a latency bound and once with
``--max-latency-ms`` (the time between tokens). Prints a table per search and the ratio of the best batch's
tokens/s to batch 1's (the latency plan), both from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    import autopart

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama:8b,llama:70b")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--max-latency-ms", type=float, default=30.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out = []
    for spec in a.models.split(","):
        for bound in (None, a.max_latency_ms / 1e3):
            t0 = time.perf_counter()
            s = autopart.advise_serving(spec, cluster="h100-80gb", nodes=1, seq=1, kv_cache_tokens=a.context,
                                        max_batch=a.max_batch, max_latency_s=bound)
            wall = time.perf_counter() - t0
            what = f"{spec}, context {a.context}" + (f", latency <= {bound * 1e3:g} ms" if bound else "")
            print(f"\n### {what} ({len(s.rows)} batches planned in {wall:.0f} s)\n", flush=True)
            print(s.markdown())
            one = s.rows[0]
            if s.best is not None and one.fits:
                print(f"\nbest: batch {s.best.batch}, {s.best.tokens_per_s:,.0f} tokens/s = "
                      f"{s.best.tokens_per_s / one.tokens_per_s:.1f}x batch 1's ({one.tokens_per_s:,.0f}), latency "
                      f"{s.best.step_time_s * 1e3:.2f} ms = {s.best.step_time_s / one.step_time_s:.1f}x batch 1's")
            print(f"stopped: {s.stopped[:200]}", flush=True)
            out.append({"model": spec, "context": a.context, "max_latency_s": bound, "wall_s": wall,
                        **s.to_json()})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
