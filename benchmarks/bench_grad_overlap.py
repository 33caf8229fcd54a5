"""Step time with the gradient reduction overlapped with backward vs after it, on real gloo ranks.

    PYTHONPATH=. python benchmarks/bench_grad_overlap.py [--configs dp2,dp2xtp2] [--steps 10] [--rounds 2]

Reference GPT of bench_step_time.py (d_model 256, 4 layers, 4 heads, vocab 1024, seq 128), global batch 8, AdamW
(foreach). Per configuration, one gloo world; two modules of the same plan, one built with
``runtime.grads.OVERLAP_WITH_BACKWARD`` on (buckets launched from backward on dedicated groups, the default) and
one with it off (the post-backward path: buckets reduced after backward on the mesh's groups, what the runtime
did before). A step is ``forward_backward`` + ``opt.step()`` + ``opt.zero_grad()``, timed between barriers;
``--rounds`` interleaved rounds of ``--steps`` steps per mode after one warm-up step; the table gives the median
over the pooled steps (rank 0's clock) and the buckets each backward launched from hooks.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CFG = dict(vocab_size=1024, max_seq_len=128, n_layer=4, n_head=4, d_model=256)
BATCH, SEQ = 8, 128
CONFIGS = {"dp2": ((2,), ("dp",), {"dp": "dp"}), "dp2xtp2": ((2, 2), ("dp", "tp"), {"dp": "dp", "tp": "tp"})}


def _run(name: str, steps: int, rounds: int) -> dict:
    import autopart
    from autopart.models.gpt import GPT, GPTConfig
    from autopart.runtime import grads

    shape, names, roles = CONFIGS[name]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG["vocab_size"], (BATCH, SEQ), generator=g)
    mesh = autopart.mesh(shape, names)
    mods = {}
    plan = None
    for overlap in (True, False):
        grads.OVERLAP_WITH_BACKWARD = overlap
        torch.manual_seed(0)
        model = GPT(GPTConfig(**CFG))
        pm = autopart.parallelize(model, mesh, (ids,), {"labels": ids}, roles=roles, pipeline="off",
                                  **({"plan": plan} if plan is not None else {}))
        plan = pm.plan
        mods[overlap] = (pm, pm.optimizer(torch.optim.AdamW, lr=1e-3))
    times: dict[bool, list[float]] = {True: [], False: []}
    hooks = {True: 0, False: 0}
    for r in range(rounds):
        for overlap in (True, False):
            pm, opt = mods[overlap]
            for i in range(steps + (1 if r == 0 else 0)):
                before = grads.STATS["launched_in_backward"]
                dist.barrier()
                t0 = time.perf_counter()
                pm.forward_backward(ids, labels=ids)
                opt.step()
                opt.zero_grad()
                dist.barrier()
                if r or i:  # the first step of the first round warms up
                    times[overlap].append(time.perf_counter() - t0)
                    hooks[overlap] = grads.STATS["launched_in_backward"] - before
    return {"ms": {k: 1e3 * statistics.median(v) for k, v in times.items()}, "hooks": hooks,
            "buckets": len(mods[True][0]._grads.buckets()), "predicted_ms": 1e3 * plan.predicted["step_time_s"]}


def main() -> None:
    from tests.multiproc.harness import run_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="dp2,dp2xtp2")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    print("| config | ranks | buckets | launched from hooks per step | after backward (ms) | overlapped (ms) | "
          "speed-up |")
    print("|---|---|---|---|---|---|---|")
    for name in a.configs.split(","):
        res = run_ranks(math.prod(CONFIGS[name][0]), _run, name, a.steps, a.rounds)[0]
        off, on = res["ms"][False], res["ms"][True]
        print(f"| {name} | {math.prod(CONFIGS[name][0])} | {res['buckets']} | {res['hooks'][True]} | {off:.1f} | "
              f"{on:.1f} | {off / on:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
