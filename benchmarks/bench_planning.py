"""Planning time of autopart on this machine: models built on ``meta``, a cluster preset (a100-80gb by default).

    PYTHONPATH=. python benchmarks/bench_planning.py                      # all models x all meshes (minutes)
    PYTHONPATH=. python benchmarks/bench_planning.py --models gpt2-124m,llama-7b --meshes 8,8x8
    PYTHONPATH=. python benchmarks/bench_planning.py --models llama-70b --meshes 128x8 --cluster h100-80gb --repeat 3

Each model is exported once (``autopart.trace.trace``) and the export is reused for every mesh (``traced=``).
Columns: trace = torch.export; strategies+costs = listing and pricing the options; solve = the ILP; passes = graph
rewriting (not part of planning: "-"); total = strategies+costs + solve (+ Plan assembly), i.e. time after tracing;
cpu = the process's CPU time over the same span (``time.process_time``: what a shared machine inflates least);
recipes / search = the two parts of ``make_plan`` (scoring the standard recipes; the free search with pipeline
stages); ILP solves / max gap = every solve made while planning and the largest optimality gap among them.
``--breakdown`` prints the CPU time of every sharding problem solved on the way; ``--profile N`` profiles each plan
call (cProfile on CPU time) and prints its N functions of largest cumulative time.
Global batch: one sequence per device of the first mesh axis (at least 8; ``--per-device``: per device, as
``autopart plan`` traces), full context length of the model.
The models are in bf16 with Adam's fp32 master weights and states (``optimizer_bytes_per_param=12``), as they
train on GPUs: an fp32 model is priced at the GPU's fp32 matmul rate (``Device.fp32_flops``; before that existed
these plans were of fp32 models priced at the bf16 rate).
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import time

import torch

import autopart
from autopart.models.gpt import GPT, GPTConfig
from autopart.models.llama import Llama, LlamaConfig
from autopart.trace import trace

MODELS = {
    "gpt2-124m": lambda: GPT(GPTConfig.preset("gpt2-124m")),
    "gpt-1.3b": lambda: GPT(GPTConfig.preset("gpt-1.3b")),
    "llama-7b": lambda: Llama(LlamaConfig.preset("llama-7b")),
    "llama-70b": lambda: Llama(LlamaConfig.preset("llama-70b")),
}
MESHES = {"8": (8,), "8x8": (8, 8), "16x8": (16, 8), "128x8": (128, 8)}
SEQ = 2048


def _seq_len(model) -> int:
    return min(SEQ, model.cfg.max_seq_len)


def bench(models: list[str], meshes: list[str], time_limit_s: float, extra: dict | None = None,
          cluster: str = "a100-80gb", repeat: int = 1, profile: int = 0, per_device: bool = False) -> list[dict]:
    extra = extra or {}
    rows = []
    for name in models:
        with torch.device("meta"):
            model = MODELS[name]().to(torch.bfloat16)
        extra = {"optimizer_bytes_per_param": 12.0, **extra}
        vocab = model.cfg.vocab_size
        # batch depends on the mesh (divisible by the data-parallel axis): trace once per batch size
        traced: dict[int, object] = {}
        for mname in meshes:
            shape = MESHES[mname]
            batch = max(8, math.prod(shape) if per_device else shape[0])
            with torch.device("meta"):
                ids = torch.randint(0, vocab, (batch, _seq_len(model)))
            if batch not in traced:
                traced[batch] = trace(model, (ids,), {"labels": ids})
            t = traced[batch]
            names = ("dp", "tp")[: len(shape)] if len(shape) == 2 else ("dp",)
            for _ in range(repeat):
                prof = cProfile.Profile(time.process_time) if profile else None
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    if prof is not None:
                        prof.enable()
                    p = autopart.plan(model, autopart.mesh(shape, names), (ids,), {"labels": ids},
                                      cluster=autopart.preset(cluster, shape), traced=t, time_limit_s=time_limit_s,
                                      **extra)
                    err = None
                except Exception as exc:  # noqa: BLE001 - reported in the table
                    p, err = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                finally:
                    if prof is not None:
                        prof.disable()
                total, cpu = time.perf_counter() - t0, time.process_time() - c0
                if prof is not None:  # CPU seconds (the profiler's own overhead inflates Python code ~2-3x)
                    pstats.Stats(prof).sort_stats("cumulative").print_stats(profile)
                s = p.solver if p else {}
                ilp = s.get("ilp", {})
                rows.append({
                    "model": name, "mesh": mname, "batch": batch, "nodes": s.get("graph_nodes", "-"),
                    "groups": s.get("groups", "-"), "trace_s": t.export_seconds,
                    "costs_s": s.get("strategies_and_costs_s"), "solve_s": s.get("solve_s"), "total_s": total,
                    "cpu_s": cpu, "recipes_s": s.get("recipes_s"), "search_s": s.get("search_s"),
                    "solves": ilp.get("solves", "-"), "max_gap": ilp.get("max_gap"),
                    "status": s.get("status", err), "gap": s.get("gap"),
                    "step_s": p.predicted["step_time_s"] if p else None,
                    "mem_gib": p.predicted["memory_bytes"]["total"] / 2**30 if p else None,
                })
                print(_row(rows[-1]), flush=True)
    return rows


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


HEADER = ("| model | mesh | batch | graph nodes | decision groups | trace (export) s | strategies+costs s | solve s "
          "| passes | planning total s (after trace) | cpu s | recipes s | search s | ILP solves | max gap "
          "| solver status | gap | predicted step s | memory/device GiB |")


def _row(r: dict) -> str:
    return (f"| {r['model']} | {r['mesh']} | {r['batch']} | {r['nodes']} | {r['groups']} | {_f(r['trace_s'])} | "
            f"{_f(r['costs_s'])} | {_f(r['solve_s'])} | - | {_f(r['total_s'])} | {_f(r['cpu_s'])} | "
            f"{_f(r['recipes_s'])} | {_f(r['search_s'])} | {r['solves']} | {_f(r['max_gap'], '{:.2%}')} | "
            f"{r['status']} | {_f(r['gap'], '{:.2%}')} | {_f(r['step_s'], '{:.3f}')} | {_f(r['mem_gib'], '{:.1f}')} |")


def _print_each_solve() -> None:
    """Wrap ``planner._sharding_plan`` (every sharding problem a plan solves: recipes, stage meshes, re-solves)."""
    from autopart import planner

    inner = planner._sharding_plan

    def timed(traced, cluster, axis_names, opts):
        c0, err = time.process_time(), ""
        try:
            return inner(traced, cluster, axis_names, opts)
        except Exception as exc:
            err = type(exc).__name__
            raise
        finally:
            print(f"  solve mesh {cluster.mesh_shape} roles {opts.roles or '-'} zero {opts.zero} "
                  f"{'2-block' if opts.virtual_layers else 'whole graph'} memory_limit {opts.memory_limit} "
                  f"cpu {time.process_time() - c0:.2f} s {err}", flush=True)

    planner._sharding_plan = timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {list(MODELS)}")
    ap.add_argument("--meshes", default=",".join(MESHES), help=f"comma-separated subset of {list(MESHES)}")
    ap.add_argument("--time-limit", type=float, default=30.0, help="solver time limit per plan (s)")
    ap.add_argument("--cluster", default="a100-80gb", help="cluster preset (autopart.preset)")
    ap.add_argument("--repeat", type=int, default=1, help="plan each configuration this many times (one export)")
    ap.add_argument("--breakdown", action="store_true",
                    help="print the CPU time of every sharding problem solved (planner._sharding_plan) as it ends")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile every plan call (CPU time) and print its N functions of largest cumulative time")
    ap.add_argument("--per-device", action="store_true",
                    help="one sequence per device (at least 8), as `autopart plan` traces by default, not per "
                         "device of the first mesh axis")
    ap.add_argument("--sharding-only", action="store_true",
                    help="decide shardings (ZeRO placements included) but no checkpointing or offload variants")
    a = ap.parse_args()
    models = [m for m in a.models.split(",") if m]
    meshes = [m for m in a.meshes.split(",") if m]
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {list(MODELS)}")
    for m in meshes:
        if m not in MESHES:
            ap.error(f"unknown mesh {m!r}; choose from {list(MESHES)}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; cluster {a.cluster}; seq {SEQ}")
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    if a.breakdown:
        _print_each_solve()
    extra = {"checkpoint": "none", "offload": "none"} if a.sharding_only else {}
    print("decisions:", "shardings only" if a.sharding_only else "all (shardings, ZeRO, checkpointing, offload)")
    bench(models, meshes, a.time_limit, extra, a.cluster, a.repeat, a.profile, a.per_device)


if __name__ == "__main__":
    main()
