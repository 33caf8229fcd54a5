"""Fused projections split in blocks (``placement.Strided``): Hugging Face GPT-2's ``c_attn`` ([q | k | v] in one
``Conv1D``) planned for tensor parallelism with and without the strided layout (models on ``meta``, no process
group, 2 CPU cores; predicted, not measured).

    PYTHONPATH=. python benchmarks/bench_fused_qkv.py                      # GPT-2 medium shape, tp 2/4/8, h100-80gb
    PYTHONPATH=. python benchmarks/bench_fused_qkv.py --layers 4 --tp 2,4

Without it, a contiguous split of [q | k | v] over the tp ranks gives a rank columns of q and k (or k and v), not
its heads of each, so plans either keep the projection whole or convert its output (an all-to-all per layer) before
the attention. With it, each rank holds its piece of q, of k and of v: Megatron's layout, no collective between the
projection and the attention. Reported per setting: predicted step, the first block's time (compute and the
conversions it runs, forward and backward) and its collectives, and how ``c_attn`` is split.
"""

from __future__ import annotations

import argparse
import time

import torch

import autopart
from autopart.strategy import registry, views
from autopart.trace import trace


def build(layers: int, h: int, heads: int, seq: int, batch: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=50304, n_positions=seq, n_embd=h, n_layer=layers, n_head=heads, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="meta")
    return model, ids


def run(args) -> list[dict]:
    model, ids = build(args.layers, args.hidden, args.heads, args.seq, args.batch)
    traced = trace(model, (ids,), {"labels": ids})
    rows = []
    for tp in [int(x) for x in args.tp.split(",")]:
        for strided in (False, True):
            views.STRIDED = strided
            registry._OPTIONS_CACHE.clear()  # the rules' options depend on the switch
            t0 = time.perf_counter()
            p = autopart.plan(model, autopart.mesh((tp,), ("tp",)), (ids,), {"labels": ids}, traced=traced,
                              cluster=autopart.preset(args.cluster, (tp,)), roles={"tp": "tp"}, pipeline="off")
            plan_s = time.perf_counter() - t0
            block = sum(r.get("compute_s", 0.0) for r in p.nodes.values() if r["layer"] == "transformer.h.0") + \
                sum(r["time_s"] for r in p.collectives if r["layer"] == "transformer.h.0")
            rec = {"tp": tp, "strided": strided, "step_s": p.predicted["step_time_s"], "plan_s": plan_s,
                   "c_attn": p.params["transformer.h.0.attn.c_attn.weight"],
                   "fwd": p.collective_counts("transformer.h.0", "fwd"),
                   "bwd": p.collective_counts("transformer.h.0", "bwd"), "block": block}
            rows.append(rec)
            print(rec, flush=True)
    views.STRIDED = True
    print(f"\nHF GPT-2, {args.layers} layers, h {args.hidden}, {args.heads} heads, batch {args.batch} x {args.seq}, "
          f"{args.cluster}, roles tp:\n")
    print("| tp | c_attn | predicted step s | vs without | block 0 ms | block 0 collectives fwd (bwd) | planning s |")
    print("|---|---|---|---|---|---|---|")
    for a, b in zip(rows[::2], rows[1::2]):
        for r in (a, b):
            coll = ", ".join(f"{k}@{ax}x{c}" for (k, ax), c in sorted(r["fwd"].items())) or "-"
            collb = ", ".join(f"{k}@{ax}x{c}" for (k, ax), c in sorted(r["bwd"].items())) or "-"
            ratio = f"{r['step_s'] / a['step_s']:.3f}" if r is b else "1"
            print(f"| {r['tp']} | {r['c_attn']} | {r['step_s']:.4f} | {ratio} | {1e3 * r['block']:.3f} | "
                  f"{coll} ({collb}) | {r['plan_s']:.1f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tp", default="2,4,8")
    ap.add_argument("--cluster", default="h100-80gb")
    run(ap.parse_args())


if __name__ == "__main__":
    main()
