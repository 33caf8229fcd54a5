"""The design guide: which parallelism wins per model size and GPU count, checked against published practice.

    PYTHONPATH=. python benchmarks/bench_design_guide.py                       # h100-80gb, the default grid
    PYTHONPATH=. python benchmarks/bench_design_guide.py --cluster my.toml --gpus 8,64 --sizes llama:1b,llama:70b

Every cell is ``autopart.advise`` on the ``meta`` device (no process group): the model (Llama 3.2 1B, Llama 3 8B,
Llama 2 70B, Llama 3.1 405B, the 1T GPT of Narayanan et al. 2021; Mamba 1.4B and 2.8B) at sequence 4096 with a
global batch of one sequence per GPU, bf16 weights and Adam with an fp32 master copy (16 bytes of model state per
parameter), on ``GPUs / 8`` nodes of 8 (mesh ``(nodes, 8)``, nothing pinned: every decision is the planner's).
Each plan is compared with the recipe published practice gives (``autopart.advise.practice``: data parallel while
it fits, then tensor parallel inside a node, then pipeline stages across nodes); where the families differ the
recipe is scored with ``autopart.evaluate`` and the cost term that decided is printed. Writes ``design_guide.md``,
``design_guide.json`` and ``design_guide.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time

advise = importlib.import_module("autopart.advise")  # the module (autopart.advise is the function)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default="h100-80gb")
    ap.add_argument("--sizes", default=",".join(advise.SWEEP_SIZES))
    ap.add_argument("--gpus", default=",".join(str(g) for g in advise.SWEEP_GPUS))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch-per-gpu", type=int, default=1)
    ap.add_argument("--max-plan-s", type=float, default=240.0, help="cap on one plan's time (each mesh view's)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--jobs", type=int, default=None, help="processes the cells are planned in (default: one per "
                    "core; 1: one after another in this process)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = advise.sweep(tuple(args.sizes.split(",")), tuple(int(g) for g in args.gpus.split(",")),
                        cluster=advise.resolve_cluster(args.cluster), seq=args.seq,
                        batch_per_gpu=args.batch_per_gpu, max_plan_s=args.max_plan_s,
                        log=lambda line: print(line, flush=True), jobs=args.jobs)
    total = time.perf_counter() - t0
    md = advise.sweep_markdown(rows)
    diff = advise.sweep_diff_markdown(rows)
    if diff:
        md += ("\n\nWhere practice was scored (its family differs from the plan's), the step's terms, recipe minus "
               "plan, ms:\n\n" + diff)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "design_guide.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(args.out, "design_guide.json"), "w") as f:
        json.dump(advise.sweep_json(rows), f, indent=1)
    png = advise.sweep_chart(rows, os.path.join(args.out, "design_guide.png"),
                             f"autopart design guide: {args.cluster}, seq {args.seq}, "
                             f"{args.batch_per_gpu} sequence(s) per GPU")
    print("\n" + md)
    agree = sum(r["agrees"] in (True, "tie") for r in rows)
    ties = sum(r["agrees"] == "tie" for r in rows)
    beyond = sum(r["agrees"] is None for r in rows)
    print(f"\n{agree}/{len(rows)} cells agree with published practice ({ties} of them ties: practice's recipe within "
          f"{advise.TIE:.0%} of the plan), {beyond} go beyond it (no recipe of practice "
          f"fits; autopart offloads or recomputes); sweep took {total:.0f} s "
          f"(tracing and planning); wrote {args.out}/design_guide.md, .json and {png}")


if __name__ == "__main__":
    main()
