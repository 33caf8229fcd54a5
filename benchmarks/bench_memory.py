"""Predicted vs measured per-rank memory of one training step, on real gloo ranks.

    PYTHONPATH=. python benchmarks/bench_memory.py [--configs dp2,tp2,...] [--detail tp2]

Reference GPT (d_model 256, 4 layers, 4 heads, vocab 1024, seq 128), global batch 8, AdamW (default, single-tensor
on CPU). Per configuration: ``autopart.parallelize`` on a fresh gloo world, one warm-up step (so AdamW's states
exist), then one measured step (``forward_backward`` + ``opt.step()`` + ``opt.zero_grad()``) under
``autopart.runtime.memtrack.MemoryTracker`` with the parameters, gradients (as backward makes them) and optimizer
states registered. Measured = peak live tensor bytes on a rank, the max over ranks; predicted = the plan's
``predicted["memory_bytes"]["total"]``. Options the current ``parallelize`` rejects (``zero=``, a checkpoint mode)
are listed as skipped with the error. ``--detail NAME`` prints, for rank 0 of that configuration, the storages
live at the peak grouped by the op that made them.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import weakref

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "multiproc"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CFG = dict(vocab_size=1024, max_seq_len=128, n_layer=4, n_head=4, d_model=256)
BATCH, SEQ = 8, 128
CATS = ("parameters", "gradients", "optimizer_states", "activations", "buffers")

# name -> (mesh shape, axis names, roles, extra parallelize kwargs)
CONFIGS = {
    "1dev": ((1,), ("dp",), {"dp": "dp"}, {}),
    "dp2": ((2,), ("dp",), {"dp": "dp"}, {}),
    "tp2": ((2,), ("tp",), {"tp": "tp"}, {}),
    "dp2xtp2": ((2, 2), ("dp", "tp"), {"dp": "dp", "tp": "tp"}, {}),
    "dp2+ckpt-full": ((2,), ("dp",), {"dp": "dp"}, {"checkpoint": "full"}),
    "dp2+ckpt-sel": ((2,), ("dp",), {"dp": "dp"}, {"checkpoint": "selective"}),
    "tp2+ckpt-full": ((2,), ("tp",), {"tp": "tp"}, {"checkpoint": "full"}),
    "tp2+ckpt-sel": ((2,), ("tp",), {"tp": "tp"}, {"checkpoint": "selective"}),
    "dp2+zero1": ((2,), ("dp",), {"dp": "dp"}, {"zero": 1}),
    "dp2+zero2": ((2,), ("dp",), {"dp": "dp"}, {"zero": 2}),
    "dp2+zero3": ((2,), ("dp",), {"dp": "dp"}, {"zero": 3}),
}


def _rank(name: str, detail: bool):
    import autopart
    from autopart.models.gpt import GPT, GPTConfig
    from autopart.runtime.memtrack import MemoryTracker, optimizer_state_tensors

    shape, names, roles, kw = CONFIGS[name]
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG["vocab_size"], (BATCH, SEQ), generator=g)
    try:
        pm = autopart.parallelize(model, autopart.mesh(shape, names), (ids,), {"labels": ids}, roles=roles, **kw)
    except (TypeError, ValueError, NotImplementedError) as exc:
        return {"skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    originals = [weakref.ref(p) for p in model.parameters()]
    del model
    gc.collect()
    orig_alive = sum(r().numel() * r().element_size() for r in originals if r() is not None)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)

    def step():
        loss = pm.forward_backward(ids, labels=ids)
        opt.step()
        opt.zero_grad()
        return loss

    step()
    gc.collect()
    dist.barrier()
    with MemoryTracker() as mt:
        mt.track(list(pm.parameters()), "parameters")
        mt.track(list(pm.buffers()) + [ids], "buffers")
        mt.track(optimizer_state_tensors(opt), "optimizer_states")
        mt.track_gradients(list(pm.parameters()))
        base = mt.current_bytes
        loss = pm.forward_backward(ids, labels=ids)
        fb_peak, fb_breakdown, fb_op = mt.peak_bytes, mt.peak_breakdown, mt.peak_op
        fb_by_op = mt.peak_by_op() if detail else {}
        mt.reset_peak()
        opt.step()
        opt.zero_grad()
        del loss
        gc.collect()
    opt_peak, opt_breakdown, opt_op = mt.peak_bytes, mt.peak_breakdown, mt.peak_op
    dist.barrier()
    phase = "fwd+bwd" if fb_peak >= opt_peak else "optimizer"
    return {"predicted": dict(pm.plan.predicted["memory_bytes"]),
            "checkpoint": dict(getattr(pm.plan, "checkpoint", {}) or {}),
            "base": base, "peak": max(fb_peak, opt_peak), "phase": phase,
            "breakdown": fb_breakdown if phase == "fwd+bwd" else opt_breakdown,
            "fb_peak": fb_peak, "fb_breakdown": fb_breakdown, "fb_op": fb_op, "fb_by_op": fb_by_op,
            "opt_peak": opt_peak, "opt_breakdown": opt_breakdown, "opt_op": opt_op,
            "end": mt.current_bytes, "orig_alive": orig_alive, "cuda_peak": mt.cuda_peak_bytes}


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def main() -> None:
    from harness import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--detail", default="", help="a configuration whose rank-0 peak is listed by op")
    a = ap.parse_args()
    rows, skipped, details = [], [], {}
    for name in a.configs.split(","):
        world = 1
        for n in CONFIGS[name][0]:
            world *= n
        res = run_ranks(world, _rank, name, name == a.detail)
        if "skipped" in res[0]:
            skipped.append((name, res[0]["skipped"]))
            continue
        worst = max(range(world), key=lambda r: res[r]["peak"])
        rows.append((name, world, res, worst))
        if name == a.detail:
            details[name] = res[0]
    print(f"reference GPT {CFG}, global batch {BATCH} x seq {SEQ}, AdamW, torch {torch.__version__}; MiB per rank")
    print("| config | ranks | predicted total | measured peak (max rank) | measured / predicted | peak in | "
          "predicted P / G / OS / A / B | measured at peak P / G / OS / A / B | ranks' peaks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, world, res, worst in rows:
        r = res[worst]
        pred = r["predicted"]
        pb = " / ".join(_mib(pred.get(c, 0.0)) for c in CATS)
        mb = " / ".join(_mib(r["breakdown"][c]) for c in CATS)
        peaks = ", ".join(_mib(x["peak"]) for x in res)
        print(f"| {name} | {world} | {_mib(pred['total'])} | {_mib(r['peak'])} | {r['peak'] / pred['total']:.2f} | "
              f"{r['phase']} | {pb} | {mb} | {peaks} |")
    for name, why in skipped:
        print(f"| {name} | - | - | - | - | skipped: {why} | | | |")
    print("\nper rank: live before the step (P+OS+B), fwd+bwd peak (at op), optimizer peak (at op), full-size "
          "original parameters still alive after `del model`")
    for name, _world, res, _ in rows:
        for rk, r in enumerate(res):
            print(f"  {name} rank {rk}: base {_mib(r['base'])}, fwd+bwd {_mib(r['fb_peak'])} at {r['fb_op']} "
                  f"{ {k: _mib(v) for k, v in r['fb_breakdown'].items() if v} }, optimizer {_mib(r['opt_peak'])} "
                  f"at {r['opt_op']}, end {_mib(r['end'])}, original params alive {_mib(r['orig_alive'])}"
                  + (f", cuda max_memory_allocated {_mib(r['cuda_peak'])}" if r["cuda_peak"] is not None else ""))
    for name, r in details.items():
        print(f"\n{name}, rank 0, storages live at the fwd+bwd peak by the op that made them (count, MiB):")
        for op, (c, b) in r["fb_by_op"].items():
            print(f"  {op:45s} {c:4d} {_mib(b):>8s}")


if __name__ == "__main__":
    main()
