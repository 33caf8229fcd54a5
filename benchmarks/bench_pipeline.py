"""Pipeline planning benchmarks (models on ``meta``, no process group, 2 CPU cores).

    PYTHONPATH=. python benchmarks/bench_pipeline.py planning     # Llama-70B on (128, 8) a100-80gb: time to plan
    PYTHONPATH=. python benchmarks/bench_pipeline.py megatron     # Megatron-Core H100 table: published vs autopart
    PYTHONPATH=. python benchmarks/bench_pipeline.py megatron --rows 1.7B,70B

``planning``: one export, then ``autopart.plan`` with every decision enabled (shardings, ZeRO, checkpointing,
offload, pipeline axis/degree/micro-batches/schedule), unpinned and with the Megatron roles pinned (dp across nodes,
tp inside, zero=0). Reported: time after tracing, split into the plan without pipeline and the pipeline search.

``megatron``: for each row of the Megatron-Core H100 table (shared/REFERENCE.md: GPT, seq 4096, vocab 131072, bf16
weights; Adam with fp32 master weights = 12 optimizer bytes per parameter), the published (tp, pp, dp) scored by
``autopart.evaluate`` (micro-batch of one sequence per data-parallel rank, 1F1B) with zero=1 (Megatron's
distributed optimizer, as Megatron ran it: optimizer states flat-sliced over dp, gradients reduce-scattered, the
parameters all-gathered after the step) and with zero=0, beside autopart's own plan for the same GPU count and
batch on ``h100-80gb`` nodes (mesh (GPUs/8, 8), nothing pinned). Reported per score: the data-parallel gradient
reduction (all of it, and what backward does not hide) and ZeRO-1's parameter all-gather after the step (what the
next forward does not hide, and all of it: the runtime waits for each bucket before its parameters' first use, as
Megatron's --overlap-param-gather), per rank. Gradients are reduced in fp32 (``--reduce-dtype``), as Megatron-LM does
with bf16 weights (``accumulate_allreduce_grads_in_fp32``), and accumulated in fp32 (``--grad-dtype``: its
``main_grad``, 4 bytes per parameter).
TFLOP/s per GPU use Megatron's count 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) per step.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import time

import torch

import autopart
from autopart.models.gpt import GPT, GPTConfig
from autopart.models.llama import Llama, LlamaConfig
from autopart.trace import trace

advise_mod = importlib.import_module("autopart.advise")  # the module; autopart.advise is the function

# model, h, heads, layers, TP, PP, DP, GPUs, batch, published TFLOP/s per GPU
MEGATRON = [
    ("1.7B", 2048, 16, 24, 1, 1, 48, 48, 192, 408.8),
    ("7.1B", 4096, 32, 30, 2, 1, 48, 96, 192, 465.9),
    ("16B", 6144, 48, 32, 4, 1, 48, 192, 192, 489.1),
    ("32B", 7168, 56, 48, 8, 1, 48, 384, 192, 459.6),
    ("70B", 8192, 64, 84, 8, 2, 48, 768, 384, 419.7),
    ("177B", 12288, 96, 96, 8, 6, 48, 2304, 1152, 432.8),
    ("462B", 18432, 144, 112, 8, 16, 48, 6144, 3072, 459.9),
]
SEQ, VOCAB = 4096, 131072


def megatron_flops(batch: int, layers: int, h: int, seq: int = SEQ, vocab: int = VOCAB) -> float:
    return 72 * batch * seq * layers * h * h * (1 + seq / (6 * h) + vocab / (12 * layers * h))


def comm_terms(p: autopart.Plan) -> dict:
    """Per rank and step: the gradient reduction (all, exposed) and ZeRO-1's parameter all-gather after the step
    (exposed, all)."""
    pp = p.pipeline
    if pp:  # the stage plan holds every stage's parameters; the pipeline record the slowest rank's tail
        return {"reduction_s": p.predicted["sharding_only"]["grad_reduction_s"] / pp["degree"],
                "reduction_exposed_s": pp["gradient_reduction_s"], "param_gather_s": pp["param_gather_s"],
                "param_gather_total_s": pp["param_gather_total_s"]}
    return {"reduction_s": p.predicted["grad_reduction_s"],
            "reduction_exposed_s": p.predicted["grad_reduction_s"] - p.predicted["hidden_comm_s"],
            "param_gather_s": p.predicted["param_gather_s"],  # bucketed: bandwidth per parameter, latency per bucket
            "param_gather_total_s": p.predicted["param_gather_total_s"]}


def _config(p: autopart.Plan) -> str:
    pp = p.pipeline
    roles = ",".join(f"{n}={s}:{p.axis_role(i)}" for i, (n, s) in enumerate(zip(p.axis_names, p.mesh_shape)))
    extra = []
    if p.zero:
        extra.append(f"zero{max(p.zero.values())}")
    if p.checkpoint:
        extra.append(f"ckpt {len(p.checkpoint)}")
    if p.offload:
        extra.append("offload " + "+".join(p.offload))
    if pp:
        sched = pp["schedule"] + (f"v{pp['virtual']}" if pp["schedule"] == "interleaved" else "")
        return f"pp={pp['degree']} m={pp['micro_batches']} {sched}; {roles}" + (f"; {' '.join(extra)}" if extra else "")
    acc = f" m={p.accumulation['micro_batches']} accumulated" if p.accumulation else ""
    return f"pp=1{acc}; {roles}" + (f"; {' '.join(extra)}" if extra else "")


def planning(args) -> list[dict]:
    shape = (128, 8)
    with torch.device("meta"):
        model = Llama(LlamaConfig.preset("llama-70b"))
        ids = torch.randint(0, model.cfg.vocab_size, (args.batch, 2048))
    t0 = time.perf_counter()
    t = trace(model, (ids,), {"labels": ids})
    export_s = time.perf_counter() - t0
    rows = []
    for label, kw in (("unpinned", {}), ("megatron roles, zero=0", {"roles": {"dp": "dp", "tp": "tp"}, "zero": 0,
                                                            "pipeline": {"axis": "dp"}})):
        t0 = time.perf_counter()
        p = autopart.plan(model, autopart.mesh(shape, ("dp", "tp")), (ids,), {"labels": ids},
                          cluster=autopart.preset("a100-80gb", shape), traced=t, **kw)
        total = time.perf_counter() - t0
        search = (p.pipeline or {}).get("search_s", p.solver.get("pipeline_search_s", 0.0))
        rows.append({"setting": label, "export_s": export_s, "plan_s": total, "pipeline_search_s": search,
                     "chosen": _config(p), "step_s": p.predicted["step_time_s"],
                     "candidates": len((p.pipeline or {}).get("candidates", p.solver.get("pipeline_candidates", [])))})
        print(f"{label}: plan {total:.2f} s after an export of {export_s:.1f} s (pipeline search {search:.2f} s); "
              f"chosen {_config(p)}; predicted step {p.predicted['step_time_s']:.3f} s", flush=True)
    print("\n| setting | export (s) | plan after export (s) | of which pipeline search (s) | chosen | "
          "predicted step (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['export_s']:.1f} | {r['plan_s']:.2f} | {r['pipeline_search_s']:.2f} | "
              f"{r['chosen']} | {r['step_s']:.3f} |")
    return rows


def megatron(args) -> list[dict]:
    rows = []
    wanted = set(args.rows.split(",")) if args.rows else None
    for name, h, heads, layers, tp, pp, dp, gpus, batch, published in MEGATRON:
        if wanted and name not in wanted:
            continue
        cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=layers, n_head=heads, d_model=h, bias=False,
                        fp32_loss=True, tie_embeddings=False)  # Megatron's loss on fp32 logits; its sizes untied
        with torch.device("meta"):
            model = GPT(cfg).to(torch.bfloat16)
            ids = torch.randint(0, VOCAB, (batch, SEQ))
        t0 = time.perf_counter()
        t = trace(model, (ids,), {"labels": ids})
        export_s = time.perf_counter() - t0
        flops = megatron_flops(batch, layers, h)
        rd = None if args.reduce_dtype == "none" else args.reduce_dtype
        gd = None if args.grad_dtype == "none" else args.grad_dtype
        common = dict(cluster=args.cluster, traced=t, optimizer_bytes_per_param=12.0, reduce_dtype=rd, grad_dtype=gd)
        rec = {"model": name, "gpus": gpus, "batch": batch, "published": f"tp={tp} pp={pp} dp={dp}",
               "published_tflops": published, "export_s": export_s}
        for zero in (1, 0):
            key = f"zero{zero}"
            try:
                ev = autopart.evaluate(model, gpus, (ids,), {"labels": ids}, tp=tp, pp=pp, zero=zero,
                                       micro_batches=batch // dp, **common)  # micro-batch 1, as published
                rec[f"{key}_step_s"] = ev.predicted["step_time_s"]
                rec[f"{key}_tflops"] = flops / ev.predicted["step_time_s"] / gpus / 1e12
                rec[f"{key}_plan"] = _config(ev)
                rec[f"{key}_terms"] = comm_terms(ev)
            except ValueError as e:
                rec[f"{key}_step_s"] = rec[f"{key}_tflops"] = float("nan")
                rec[f"{key}_plan"] = "does not fit: " + str(e).splitlines()[0][:120]
                rec[f"{key}_terms"] = {}
        rec["error_zero1"] = rec["zero1_tflops"] / published - 1
        # autopart's own choice: planned on every logical mesh of the nodes (advise's mesh views: tensor parallel
        # 1, 2, 4 or 8 inside a node), the fastest kept
        t0 = time.perf_counter()
        adv = advise_mod.advise(built=(name, model, (ids,), {"labels": ids}, cfg), traced=t, cluster=args.cluster,
                                nodes=gpus // 8, gpus_per_node=8, batch=batch, seq=SEQ, optimizer_bytes_per_param=12.0,
                                reduce_dtype=rd, grad_dtype=gd)
        if adv.fits:
            rec["own_step_s"] = adv.step_time_s
            rec["own_pred_tflops"] = flops / adv.step_time_s / gpus / 1e12
            rec["own_plan"] = _config(adv.plan)
        else:
            rec["own_step_s"] = rec["own_pred_tflops"] = float("nan")
            rec["own_plan"] = "no plan: " + adv.binding[:120]
        rec["own_views"] = {"x".join(map(str, v["mesh"])): v["step_time_s"] for v in adv.views if v["mesh"]}
        rec["own_plan_s"] = time.perf_counter() - t0
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    print("\n| model | GPUs | published (tp, pp, dp) | published TFLOP/s/GPU | score, zero=1: step s, TFLOP/s/GPU, "
          "error | its gradient reduction s (exposed) | its ZeRO-1 all-gather s exposed (all) | score, zero=0: step "
          "s, TFLOP/s/GPU | autopart's choice | its step s, TFLOP/s/GPU | planning s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    def zero0(r: dict) -> str:  # a published configuration that needs ZeRO to fit says so
        return "does not fit" if math.isnan(r["zero0_step_s"]) else f"{r['zero0_step_s']:.3f}, {r['zero0_tflops']:.0f}"

    for r in rows:
        t = r["zero1_terms"]
        terms = (f"{t['reduction_s']:.3f} ({t['reduction_exposed_s']:.3f}) | {t['param_gather_s']:.3f} "
                 f"({t['param_gather_total_s']:.3f})" if t else " | ")
        print(f"| {r['model']} | {r['gpus']} | {r['published']} | {r['published_tflops']} | "
              f"{r['zero1_step_s']:.3f}, {r['zero1_tflops']:.0f}, {100 * r['error_zero1']:+.1f}% | {terms} | "
              f"{zero0(r)} | {r['own_plan']} | "
              f"{r['own_step_s']:.3f}, {r['own_pred_tflops']:.0f} | {r['own_plan_s']:.1f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["planning", "megatron"])
    ap.add_argument("--batch", type=int, default=128, help="planning: global batch of 2048-token sequences")
    ap.add_argument("--rows", default="", help="megatron: comma-separated model names (default: all)")
    ap.add_argument("--cluster", default="h100-80gb", help="megatron: the preset (or cluster file) the rows are "
                    "priced on, e.g. benchmarks/clusters/h100-xla-gemms.toml")
    ap.add_argument("--reduce-dtype", default="float32", help="megatron: the dtype the gradient reduction sums in "
                    "(float32: Megatron-LM's accumulate_allreduce_grads_in_fp32 with bf16; none: the gradients' own)")
    ap.add_argument("--grad-dtype", default="float32", help="megatron: the dtype gradients accumulate in (float32: "
                    "Megatron-LM's main_grad of bf16 weights, 18 bytes of model state per parameter; none: bf16)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    rows = planning(args) if args.what == "planning" else megatron(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
