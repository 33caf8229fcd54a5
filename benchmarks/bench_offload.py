"""The offloaded optimizer step on the host: torch's AdamW kernels, and how far the planner's price is.

    PYTHONPATH=. python benchmarks/bench_offload.py                 # 1 thread, 5M / 20M / 80M fp32 parameters
    PYTHONPATH=. python benchmarks/bench_offload.py --threads 2 --sizes 20e6

An offloaded optimizer (``offload="optimizer"``, ``runtime.module.HostOffloadOptimizer``) steps host copies of the
rank's parameters, or of its ZeRO-1/2 slices. The planner prices that step as a memory-bound pass
(``planner.optimizer_offload_seconds``): per fp32 parameter of Adam, 28 bytes of host memory (parameter, exp_avg,
exp_avg_sq read and written, gradient read) at ``Device.host_step_bandwidth``. This measures, per size, one AdamW
step with each of torch's implementations (the for-loop, ``foreach``, ``fused``: what the runtime picks on host
copies) and a plain copy (read + write) of the same bytes, and reports the bytes/s each reached at 28 bytes per
parameter: the fused kernel runs at the bandwidth a copy reaches (the pass the planner prices), the others are
several times slower (their extra passes and temporaries).
"""

from __future__ import annotations

import argparse
import time

import torch


def _time(fn, repeat: int) -> float:
    fn()  # warm-up: allocations, first-touch page faults
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="5e6,20e6,80e6", help="parameters per step (comma-separated)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for n in (int(float(x)) for x in args.sizes.split(",")):
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n)
        src, dst = torch.randn(7 * n // 2), torch.empty(7 * n // 2)  # 28 bytes per parameter: 14 read, 14 written
        row = {"params": n, "copy": _time(lambda s=src, d=dst: d.copy_(s), args.repeat)}
        for name, kw in (("loop", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
            opt = torch.optim.AdamW([p], lr=1e-3, **kw)
            row[name] = _time(opt.step, args.repeat)
        rows.append(row)
    print(f"torch {torch.__version__}, {args.threads} thread(s); best of {args.repeat}; GB/s at 28 bytes per "
          "parameter\n")
    print("| parameters | copy of 28 B/param: ms, GB/s | loop: ms, GB/s | foreach: ms, GB/s | fused: ms, GB/s | "
          "foreach / fused |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[k] * 1e3:.1f}, {28 * r['params'] / r[k] / 1e9:.1f}" for k in ("copy", "loop", "foreach", "fused")]
        print(f"| {r['params'] / 1e6:g}M | " + " | ".join(cells) + f" | {r['foreach'] / r['fused']:.1f}x |")


if __name__ == "__main__":
    main()
