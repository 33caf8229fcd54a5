"""Fused projections split in blocks (``placement.Strided``), planned for tensor parallelism with and without the
strided layouts (models on ``meta``, no process group, 2 CPU cores; predicted, not measured).

    PYTHONPATH=. python benchmarks/bench_fused_qkv.py                      # GPT-2 medium shape, tp 2/4/8, h100-80gb
    PYTHONPATH=. python benchmarks/bench_fused_qkv.py --model phi3-gqa    # Phi-4-mini's shape: grouped-query qkv_proj
    PYTHONPATH=. python benchmarks/bench_fused_qkv.py --model mamba2      # Mamba-2 780M's shape: in_proj z|xBC|dt
    PYTHONPATH=. python benchmarks/bench_fused_qkv.py --model mamba2 --groups 8   # its B and C in 8 groups
    PYTHONPATH=. python benchmarks/bench_fused_qkv.py --layers 4 --tp 2,4

Models: ``gpt2`` (HF GPT-2: ``c_attn`` [q | k | v], equal blocks), ``phi3-gqa`` (HF Phi-3 with grouped-query
attention: ``qkv_proj`` [q | k | v] of unequal lengths, ``gate_up_proj`` [gate | up]), ``mamba2`` (HF Mamba-2's
slow path: ``in_proj`` [z | xBC | dt], xBC through a depthwise convolution, then cut into [x | B | C]). Without
the layout, a contiguous split of a fused output over the tp ranks gives a rank columns of q and k (or k and v),
not its heads of each, so plans either keep the projection whole or convert its output (an all-to-all per layer)
before the attention. With it, each rank holds its piece of q, of k and of v: Megatron's layout, no collective
between the projection and the attention.
Settings: ``none`` (no strided layout), ``equal`` (blocks of one length only, as before unequal ones existed),
``all``. Reported per setting: predicted step, the first block's time (compute and the conversions it runs,
forward and backward) and its collectives, and how the fused weight is split.
"""

from __future__ import annotations

import argparse
import time

import torch

import autopart
from autopart.strategy import registry, views
from autopart.trace import trace

MODELS = {  # name: (first block's layer name, the fused weight)
    "gpt2": ("transformer.h.0", "transformer.h.0.attn.c_attn.weight"),
    "phi3-gqa": ("model.layers.0", "model.layers.0.self_attn.qkv_proj.weight"),
    "mamba2": ("backbone.layers.0", "backbone.layers.0.mixer.in_proj.weight"),
}


def build(args):
    name, layers, seq, batch = args.model, args.layers, args.seq, args.batch
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=50304, n_positions=seq, n_embd=args.hidden or 1024, n_layer=layers or 24,
                         n_head=args.heads or 16, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cls = GPT2LMHeadModel
    elif name == "phi3-gqa":  # Phi-4-mini: 24 query heads, 8 key/value heads of 128
        from transformers import Phi3Config, Phi3ForCausalLM

        cfg = Phi3Config(vocab_size=200064, hidden_size=args.hidden or 3072, intermediate_size=8192,
                         num_hidden_layers=layers or 32, num_attention_heads=args.heads or 24, num_key_value_heads=8,
                         max_position_embeddings=seq, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                         attention_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0)
        cls = Phi3ForCausalLM
    elif name == "mamba2":  # Mamba-2 780M: 48 layers of d 1536, heads of 64, state 128, 1 group
        from transformers import Mamba2Config, Mamba2ForCausalLM

        h = args.hidden or 1536
        cfg = Mamba2Config(vocab_size=50288, hidden_size=h, num_hidden_layers=layers or 48, expand=2, head_dim=64,
                           num_heads=2 * h // 64, state_size=128, n_groups=args.groups, conv_kernel=4, chunk_size=256,
                           use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0)
        cls = Mamba2ForCausalLM
    else:
        raise SystemExit(f"--model: one of {', '.join(MODELS)}")
    with torch.device("meta"):
        model = cls(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="meta")
    return model, ids, cfg


def run(args) -> list[dict]:
    model, ids, cfg = build(args)
    layer, fused = MODELS[args.model]
    traced = trace(model, (ids,), {"labels": ids})
    rows = []
    settings = ("none", "equal", "all") if args.model != "gpt2" else ("none", "all")
    for tp in [int(x) for x in args.tp.split(",")]:
        for setting in settings:
            views.STRIDED, views.UNEQUAL = setting != "none", setting == "all"
            registry._OPTIONS_CACHE.clear()  # the rules' options depend on the switches
            t0 = time.perf_counter()
            p = autopart.plan(model, autopart.mesh((tp,), ("tp",)), (ids,), {"labels": ids}, traced=traced,
                              cluster=autopart.preset(args.cluster, (tp,)), roles={"tp": "tp"}, pipeline="off")
            plan_s = time.perf_counter() - t0
            block = sum(r.get("compute_s", 0.0) for r in p.nodes.values() if r["layer"] == layer) + \
                sum(r["time_s"] for r in p.collectives if r["layer"] == layer)
            rec = {"tp": tp, "setting": setting, "step_s": p.predicted["step_time_s"], "plan_s": plan_s,
                   "fused": p.params[fused], "fwd": p.collective_counts(layer, "fwd"),
                   "bwd": p.collective_counts(layer, "bwd"), "block": block}
            rows.append(rec)
            print(rec, flush=True)
    views.STRIDED = views.UNEQUAL = True
    print(f"\n{args.model} ({type(model).__name__}), {cfg.num_hidden_layers} layers, h {cfg.hidden_size}, batch "
          f"{args.batch} x {args.seq}, {args.cluster}, roles tp:\n")
    print(f"| tp | layouts | {fused.rsplit('.', 2)[-2]} | predicted step s | vs none | block 0 ms | "
          "block 0 collectives fwd (bwd) | planning s |")
    print("|---|---|---|---|---|---|---|---|")
    k = len(settings)
    for group in (rows[i:i + k] for i in range(0, len(rows), k)):
        for r in group:
            coll = ", ".join(f"{c}@{ax}x{n}" for (c, ax), n in sorted(r["fwd"].items())) or "-"
            collb = ", ".join(f"{c}@{ax}x{n}" for (c, ax), n in sorted(r["bwd"].items())) or "-"
            print(f"| {r['tp']} | {r['setting']} | {r['fused']} | {r['step_s']:.4f} | "
                  f"{r['step_s'] / group[0]['step_s']:.3f} | {1e3 * r['block']:.3f} | {coll} ({collb}) | "
                  f"{r['plan_s']:.1f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=0, help="0: the model's own (gpt2 24, phi3-gqa 32, mamba2 48)")
    ap.add_argument("--hidden", type=int, default=0, help="0: the model's own (1024, 3072, 1536)")
    ap.add_argument("--heads", type=int, default=0, help="0: the model's own (16, 24)")
    ap.add_argument("--groups", type=int, default=1, help="mamba2: groups of B and C (Codestral Mamba: 8)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tp", default="2,4,8")
    ap.add_argument("--cluster", default="h100-80gb")
    run(ap.parse_args())


if __name__ == "__main__":
    main()
