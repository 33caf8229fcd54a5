"""Pipeline bubble on 2 CPU stages: measured idle time per rank vs the plan's predicted bubble.

    python benchmarks/bench_pipeline_bubble.py [--steps 5] [--warmup 2] [--micro 2,4,8]
        [--schedules gpipe,1f1b] [--json PATH]

Two gloo processes (one thread each) run ``autopart.parallelize(..., roles={"pp": "pp"},
pipeline={"schedule": s, "micro_batches": m})`` on a GPT (d_model 256, 4 layers, 4 heads, vocab 512, seq 128) with
a fixed micro-batch of ``--micro-size`` sequences, so the global batch is ``micro_size * m``.

Measurement: each rank's ``PipelineStage`` gets its instance methods ``forward_one_chunk`` / ``backward_one_chunk``
(and ``backward_weight_one_chunk``, unused by GPipe / 1F1B) wrapped to record ``perf_counter`` (start, end) per
call. A timed step is one ``pm.forward_backward`` after a barrier; its wall time includes the schedule, the loss
broadcast and the gradient reduction of tied parameters. Busy = the sum of the wrapped calls' durations (the stage's
compute; the p2p waits and the loss function between calls count as idle). Idle fraction of a rank =
``1 - busy / step_wall``, the median over the timed steps.

Predictions, per configuration:

* plan: ``pm.plan.pipeline["bubble_fraction"]`` = (p-1)/(m+p-1), the idle fraction of every stage when the stages
  are balanced and communication is free;
* from measured stage times: with ``t_k = busy_k / m`` the per-micro-batch time of stage k, the bottleneck model's
  step is ``(m + p - 1) * max_k t_k`` and rank k's idle fraction ``1 - m * t_k / step`` (imbalance included, p2p
  and per-step overheads not);
* the plan's predicted step time (``pipeline["step_time_s"]``, cost model of the ``cpu`` cluster preset).

A text timeline of one timed step of 1F1B with 4 micro-batches (or the first configuration run) is printed as well.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CFG = dict(vocab_size=512, max_seq_len=128, n_layer=4, n_head=4, d_model=256)
SEQ = 128
P = 2  # pipeline stages = processes
WRAPPED = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


def _stages_of(schedule) -> list:
    if hasattr(schedule, "_stages"):
        return list(schedule._stages)
    return [schedule._stage]


def _instrument(stage, events: list) -> None:
    """Wrap the stage instance's chunk methods: each call appends (kind, micro-batch, stage index, start, end)."""
    for name, kind in WRAPPED.items():
        orig = getattr(stage, name, None)
        if orig is None or getattr(orig, "_bubble_wrapped", False):
            continue

        def wrapped(self, chunk_id, *args, _orig=orig, _kind=kind, **kwargs):
            t0 = time.perf_counter()
            try:
                return _orig(chunk_id, *args, **kwargs)
            finally:
                events.append((_kind, int(chunk_id), int(self.stage_index), t0, time.perf_counter()))

        wrapped._bubble_wrapped = True
        setattr(stage, name, types.MethodType(wrapped, stage))


def _run_config(schedule_name: str, m: int, micro_size: int, warmup: int, steps: int) -> dict:
    import autopart
    from autopart.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG["vocab_size"], (micro_size * m, SEQ), generator=g)
    mesh = autopart.mesh((P,), ("pp",))
    t_plan = time.perf_counter()
    pm = autopart.parallelize(model, mesh, (ids,), {"labels": ids}, roles={"pp": "pp"},
                              pipeline={"schedule": schedule_name, "micro_batches": m})
    plan_s = time.perf_counter() - t_plan
    pipe = pm.plan.pipeline
    assert pipe["schedule"] == schedule_name and pipe["micro_batches"] == m and pipe["degree"] == P, pipe

    def zero():
        for prm in pm.parameters():
            prm.grad = None

    # build the schedule (as forward_backward does) and wrap its stages before any step runs
    prog, n_micro, _ = pm._micro((ids,), {"labels": ids})
    assert n_micro == m
    schedule, _, _ = pm._runner(prog, n_micro, train=True)
    events: list = []
    stages = _stages_of(schedule)
    for st in stages:
        _instrument(st, events)

    for _ in range(warmup):
        pm.forward_backward(ids, labels=ids)
        zero()
    assert any(v[0] is schedule for v in pm.__dict__["_runners"].values()), "forward_backward built another schedule"

    walls, busys, timeline = [], [], None
    for i in range(steps):
        dist.barrier()
        events.clear()
        t0 = time.perf_counter()
        pm.forward_backward(ids, labels=ids)
        t1 = time.perf_counter()
        zero()
        walls.append(t1 - t0)
        busys.append(sum(e - s for _, _, _, s, e in events))
        if i == steps - 1:
            timeline = [(k, mb, si, (s - t0) * 1e3, (e - t0) * 1e3) for k, mb, si, s, e in events]
    n_calls = {k: sum(1 for ev in timeline if ev[0] == k) for k in "FBW"}
    return {
        "schedule": schedule_name, "m": m, "rank": dist.get_rank(), "pp_rank": pm.pp_rank,
        "stage_indices": [st.stage_index for st in stages], "plan_s": plan_s,
        "step_s": walls, "busy_s": busys, "timeline_ms": timeline, "calls": n_calls,
        "plan_pipeline": {k: pipe.get(k) for k in ("degree", "micro_batches", "micro_batch_size", "schedule",
                                                       "bubble_fraction", "pipeline_s", "step_time_s")},
        "plan_stage_time_s": [s["time_s"] for s in pipe["stages"]],
    }


def _rank_main(schedules: list[str], micro: list[int], micro_size: int, warmup: int, steps: int) -> list[dict]:
    out = []
    for sched in schedules:
        for m in micro:
            out.append(_run_config(sched, m, micro_size, warmup, steps))
    return out


def _summarise(per_rank: list[list[dict]]) -> list[dict]:
    rows = []
    for cfgs in zip(*per_rank):
        cfgs = sorted(cfgs, key=lambda c: c["pp_rank"])
        c0 = cfgs[0]
        m, steps = c0["m"], len(c0["step_s"])
        step_walls = [max(c["step_s"][i] for c in cfgs) for i in range(steps)]
        idle = [statistics.median(1 - b / w for b, w in zip(c["busy_s"], c["step_s"])) for c in cfgs]
        busy = [statistics.median(c["busy_s"]) for c in cfgs]
        t_k = [b / m for b in busy]
        ideal_step = (m + P - 1) * max(t_k)
        ideal_idle = [1 - m * t / ideal_step for t in t_k]
        pl = c0["plan_pipeline"]
        rows.append({
            "schedule": c0["schedule"], "m": m, "micro_batch_size": pl["micro_batch_size"],
            "measured_step_s": statistics.median(step_walls), "measured_idle": idle, "busy_s": busy,
            "per_micro_batch_s": t_k, "bottleneck_step_s": ideal_step, "predicted_idle_from_measured": ideal_idle,
            "plan_bubble_fraction": pl["bubble_fraction"], "plan_step_time_s": pl["step_time_s"],
            "plan_pipeline_s": pl["pipeline_s"], "plan_stage_time_s": c0["plan_stage_time_s"],
            "plan_s": [c["plan_s"] for c in cfgs], "step_s": [c["step_s"] for c in cfgs],
            "all_busy_s": [c["busy_s"] for c in cfgs], "calls": [c["calls"] for c in cfgs],
        })
    return rows


def _table(rows: list[dict]) -> str:
    lines = [
        "| schedule | m | measured step (ms) | measured idle rank0 / rank1 | predicted bubble (plan) "
        "| predicted idle from measured stage times rank0 / rank1 | plan's predicted step (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        idle = " / ".join(f"{x:.1%}" for x in r["measured_idle"])
        pred = " / ".join(f"{x:.1%}" for x in r["predicted_idle_from_measured"])
        lines.append(f"| {r['schedule']} | {r['m']} | {r['measured_step_s'] * 1e3:.1f} | {idle} "
                     f"| {r['plan_bubble_fraction']:.1%} | {pred} | {r['plan_step_time_s'] * 1e3:.1f} |")
    return "\n".join(lines)


def _timeline(cfgs: list[dict], width: int = 96) -> str:
    cfgs = sorted(cfgs, key=lambda c: c["pp_rank"])
    c0 = cfgs[0]
    span = max(e for c in cfgs for *_, e in c["timeline_ms"]) or 1.0
    out = [f"timeline of the last timed step, {c0['schedule']}, m={c0['m']} (ms from the step's start on each rank, "
           "after a barrier):"]
    for c in cfgs:
        acts = [f"{k}{mb} {s:.1f}-{e:.1f}" for k, mb, _, s, e in c["timeline_ms"]]
        out.append(f"  rank {c['rank']} (stage {','.join(map(str, c['stage_indices']))}): " + ", ".join(acts))
    out.append(f"  chart, 1 column = {span / width:.2f} ms; digit = forward of micro-batch i, letter = backward "
               "(a = 0, b = 1, ...), '.' = not in a chunk call:")
    for c in cfgs:
        row = ["."] * width
        for k, mb, _, s, e in c["timeline_ms"]:
            ch = str(mb % 10) if k == "F" else chr(ord("a") + mb % 26) if k == "B" else "w"
            for col in range(int(s / span * width), max(int(s / span * width) + 1, int(e / span * width))):
                row[min(col, width - 1)] = ch
        out.append(f"  rank {c['rank']} |{''.join(row)}|")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro", default="2,4,8", help="numbers of micro-batches, comma-separated")
    ap.add_argument("--micro-size", type=int, default=2, help="sequences per micro-batch (fixed)")
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--json", default=None, help="write the per-configuration results here")
    args = ap.parse_args()
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    micro = [int(x) for x in args.micro.split(",") if x.strip()]

    from tests.multiproc.harness import run_ranks

    t0 = time.perf_counter()
    per_rank = run_ranks(P, _rank_main, schedules, micro, args.micro_size, args.warmup, args.steps)
    total = time.perf_counter() - t0
    rows = _summarise(per_rank)

    print(f"GPT {CFG}, seq {SEQ}, micro-batch {args.micro_size} sequences, {P} gloo ranks x 1 thread, "
          f"torch {torch.__version__}; {args.warmup} warm-up + {args.steps} timed steps, medians; total {total:.0f} s")
    print()
    print(_table(rows))
    print()
    print("busy per micro-batch (ms, measured t_k rank0 / rank1) vs plan's stage time_s per micro-batch (ms):")
    for r in rows:
        meas = " / ".join(f"{t * 1e3:.1f}" for t in r["per_micro_batch_s"])
        plan = " / ".join(f"{t * 1e3:.1f}" for t in r["plan_stage_time_s"])
        print(f"  {r['schedule']:>6} m={r['m']}: measured {meas}; plan {plan}; bottleneck-model step "
              f"{r['bottleneck_step_s'] * 1e3:.1f} ms vs measured {r['measured_step_s'] * 1e3:.1f} ms")
    print()
    pick = next((i for i, r in enumerate(rows) if r["schedule"] == "1f1b" and r["m"] == 4), 0)
    print(_timeline([cfgs[pick] for cfgs in per_rank]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {"model": CFG, "seq": SEQ, "micro_size": args.micro_size, "steps": args.steps,
                                  "warmup": args.warmup, "torch": torch.__version__},
                       "rows": rows, "timeline": [cfgs[pick] for cfgs in per_rank]}, f, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
