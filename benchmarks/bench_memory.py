"""Predicted vs measured per-rank memory of one training step, on real gloo ranks.

    PYTHONPATH=. python benchmarks/bench_memory.py [--configs dp2,tp2,...] [--detail tp2]
    PYTHONPATH=. python benchmarks/bench_memory.py --sweep

Reference GPT (d_model 256, 4 layers, 4 heads, vocab 1024, seq 128), global batch 8, AdamW as ``pm.optimizer`` makes
it (foreach: what the planner's optimizer-step moment prices). Per configuration: ``autopart.parallelize`` on a
fresh gloo world, one warm-up step (so AdamW's states exist), then one measured step (``forward_backward`` +
``opt.step()`` + ``opt.zero_grad()``) under ``autopart.runtime.memtrack.MemoryTracker`` with the parameters,
gradients (as backward makes them) and optimizer states registered. Measured = peak live tensor bytes on a rank, the
max over ranks; predicted = the plan's ``predicted["memory_bytes"]["total"]``. Options the current ``parallelize``
rejects (``zero=``, a checkpoint mode) are listed as skipped with the error. ``--detail NAME`` prints, for rank 0 of
that configuration, the storages live at the peak grouped by the op that made them.

Pipelined configurations (``pp2-*``): parameters, gradients and optimizer states exist only on a rank's stage;
the predicted figure for a rank is the total of the plan's stage record(s) on that rank
(``plan.pipeline["stages"]``, summed per ``rank`` under interleaving), the plan's own total being their max. The
recv buffers ``torch.distributed.pipelining`` allocates once (before the measured step) are registered as
activations. A per-rank table lists predicted vs measured for every configuration run.

``--sweep``: the reference GPT on 2 ranks, ``roles={"dp": "dp"}``; plans with no budget (loose predicted total T),
then with ``memory_budget = f * T`` for f in 1.0, 0.8, 0.65, 0.5, 0.4, 0.3, 0.25 (until the planner raises
``ValueError``), lists the techniques each plan chose (ZeRO, checkpointing, offload, pipeline) and runs each plan
(``parallelize(..., plan=)``) on 2 gloo ranks, measured as above.
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
    # Megatron sequence parallelism: norms and residual adds of every block pinned S(1) ("pins": "sp", resolved
    # on the traced graph by tests/multiproc/test_sequence_parallel.sequence_pins)
    "tp2+sp": ((2,), ("tp",), {"tp": "tp"}, {"pins": "sp"}),
    "tp2+sp+ckpt-sel": ((2,), ("tp",), {"tp": "tp"}, {"pins": "sp", "checkpoint": "selective"}),
    "tp2+sp+ckpt-full": ((2,), ("tp",), {"tp": "tp"}, {"pins": "sp", "checkpoint": "full"}),
    "dp2+zero1": ((2,), ("dp",), {"dp": "dp"}, {"zero": 1}),
    "dp2+zero2": ((2,), ("dp",), {"dp": "dp"}, {"zero": 2}),
    "dp2+zero3": ((2,), ("dp",), {"dp": "dp"}, {"zero": 3}),
    # gradient accumulation without stages: 4 micro-batches of 2 (one a rank), reduced once from the last backward
    "dp2+acc4": ((2,), ("dp",), {"dp": "dp"}, {"pipeline": {"stages": 1, "micro_batches": 4}}),
    "dp2+zero1+acc4": ((2,), ("dp",), {"dp": "dp"}, {"zero": 1, "pipeline": {"stages": 1, "micro_batches": 4}}),
    "dp2+zero2+acc4": ((2,), ("dp",), {"dp": "dp"}, {"zero": 2, "pipeline": {"stages": 1, "micro_batches": 4}}),
    "dp2+zero3+acc4": ((2,), ("dp",), {"dp": "dp"}, {"zero": 3, "pipeline": {"stages": 1, "micro_batches": 4}}),
    "pp2-1f1b": ((2,), ("pp",), {"pp": "pp"}, {"pipeline": {"schedule": "1f1b", "micro_batches": 4}}),
    "pp2-gpipe": ((2,), ("pp",), {"pp": "pp"}, {"pipeline": {"schedule": "gpipe", "micro_batches": 4}}),
    "pp2xtp2-1f1b": ((2, 2), ("pp", "tp"), {"pp": "pp", "tp": "tp"},
                     {"pipeline": {"schedule": "1f1b", "micro_batches": 4}}),
}
SWEEP_FRACTIONS = (1.0, 0.8, 0.65, 0.5, 0.4, 0.3, 0.25)
SWEEP_SPEC = ((2,), ("dp",), {"dp": "dp"})


def _model_and_ids():
    from autopart.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG["vocab_size"], (BATCH, SEQ), generator=g)
    return model, ids


def _pipeline_recv_buffers(pm) -> list[torch.Tensor]:
    """The recv buffers of this rank's pipeline stages (allocated by torch.distributed.pipelining when the
    schedule first runs, reused every step; best effort over its private attributes)."""
    out = []
    for entry in pm.__dict__.get("_runners", {}).values():
        sched = entry[0]
        stages = list(getattr(sched, "_stages", None) or [getattr(sched, "_stage", None)])
        for st in stages:
            for infos in [*getattr(st, "args_recv_info", {}).values(), *getattr(st, "grad_recv_info", {}).values()]:
                for info in infos if isinstance(infos, (tuple, list)) else [infos]:
                    buf = getattr(info, "buffer", None)
                    if isinstance(buf, torch.Tensor):
                        out.append(buf)
    return out


def _rank(name: str, detail: bool, plan_json: str | None = None, budget: float | None = None):
    import autopart
    from autopart.plan import Plan
    from autopart.runtime.memtrack import MemoryTracker, optimizer_state_tensors

    if plan_json is not None:  # --sweep: run the plan made (with this budget) by the parent process
        shape, names, roles = SWEEP_SPEC
        kw = {"plan": Plan.from_json(plan_json), "memory_budget": budget}
    else:
        shape, names, roles, kw = CONFIGS[name]
    model, ids = _model_and_ids()
    if kw.get("pins") == "sp":
        from test_sequence_parallel import sequence_pins

        from autopart.trace import trace

        kw = {**kw, "pins": sequence_pins(trace(model, (ids,), {"labels": ids}).graph)}
    try:
        pm = autopart.parallelize(model, autopart.mesh(shape, names), (ids,), {"labels": ids}, roles=roles, **kw)
    except (TypeError, ValueError, NotImplementedError) as exc:
        return {"skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    originals = [weakref.ref(p) for p in model.parameters()]
    del model
    gc.collect()
    orig_alive = sum(r().numel() * r().element_size() for r in originals if r() is not None)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)  # the plan's optimizer (ZeRO-1/2: sliced states), foreach

    def step():
        loss = pm.forward_backward(ids, labels=ids)
        opt.step()
        opt.zero_grad()
        return loss

    step()
    gc.collect()
    dist.barrier()
    recv = _pipeline_recv_buffers(pm) if pm.plan.pipeline else []
    with MemoryTracker() as mt:
        mt.track(list(pm.parameters()), "parameters")
        mt.track(list(pm.buffers()) + [ids], "buffers")
        mt.track(recv, "activations")
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
    pipe = pm.plan.pipeline or {}
    if pipe:  # this rank's stage(s): the records of chunks on its pipeline rank, summed
        pp_rank = int(pm.pp_rank)
        recs = [s for s in pipe["stages"] if int(s["rank"]) == pp_rank]
        rank_pred = {k: sum(float(s["memory_bytes"][k]) for s in recs)
                     for k in ("states", "gradients", "activations", "total")}
        stage_info = {"pp_rank": pp_rank, "chunks": [int(s["index"]) for s in recs],
                      "layers": [len(s["layers"]) for s in recs], "degree": int(pipe["degree"]),
                      "schedule": pipe["schedule"], "micro_batches": int(pipe["micro_batches"]),
                      "in_flight": [s.get("in_flight") for s in recs]}
    else:
        mb = pm.plan.predicted["memory_bytes"]
        rank_pred = {"states": float(mb.get("parameters", 0.0)) + float(mb.get("optimizer_states", 0.0))
                     + float(mb.get("buffers", 0.0)), "gradients": float(mb.get("gradients", 0.0)),
                     "activations": float(mb.get("activations", 0.0)), "total": float(mb["total"])}
        stage_info = {}
    return {"predicted": dict(pm.plan.predicted["memory_bytes"]), "rank_predicted": rank_pred, "stage": stage_info,
            "param_bytes": sum(_local_bytes(p) for p in pm.parameters()),
            "recv_bytes": sum(t.untyped_storage().nbytes() for t in recv),
            "checkpoint": dict(getattr(pm.plan, "checkpoint", {}) or {}),
            "base": base, "peak": max(fb_peak, opt_peak), "phase": phase,
            "breakdown": fb_breakdown if phase == "fwd+bwd" else opt_breakdown,
            "fb_peak": fb_peak, "fb_breakdown": fb_breakdown, "fb_op": fb_op, "fb_by_op": fb_by_op,
            "opt_peak": opt_peak, "opt_breakdown": opt_breakdown, "opt_op": opt_op,
            "end": mt.current_bytes, "orig_alive": orig_alive, "cuda_peak": mt.cuda_peak_bytes}


def _local_bytes(p: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    t = p.to_local() if isinstance(p, DTensor) else p
    return t.numel() * t.element_size()


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def _three(d: dict) -> str:
    """P+OS+B / G / A of a measured breakdown, or states / gradients / activations of a predicted one."""
    if "states" in d:
        return " / ".join(_mib(d[k]) for k in ("states", "gradients", "activations"))
    return " / ".join(_mib(x) for x in (d["parameters"] + d["optimizer_states"] + d["buffers"], d["gradients"],
                                         d["activations"]))


def _techniques(p) -> str:
    from collections import Counter

    parts = []
    if p.zero:
        parts.append(f"ZeRO-{'/'.join(str(v) for v in sorted(set(p.zero.values())))} on {len(p.zero)} params")
    if p.checkpoint:
        parts.append("ckpt " + ", ".join(f"{m} x{c}" for m, c in sorted(Counter(p.checkpoint.values()).items())))
    if p.offload:
        parts.append("offload " + "+".join(p.offload))
    if p.pipeline:
        parts.append(f"pp{p.pipeline['degree']} {p.pipeline['schedule']} m={p.pipeline['micro_batches']}")
    return "; ".join(parts) or "none (plain DP)"


def sweep() -> None:
    from harness import run_ranks

    import autopart
    from autopart.plan import peak_moment
    from autopart.trace import trace

    shape, names, roles = SWEEP_SPEC
    model, ids = _model_and_ids()
    kw = {"traced": trace(model, (ids,), {"labels": ids})}  # traced once, shared by every plan of the sweep
    loose = autopart.plan(model, autopart.mesh(shape, names), (ids,), {"labels": ids}, roles=roles, **kw)
    total = float(loose.predicted["memory_bytes"]["total"])
    rows, stopped = [], None
    for f in SWEEP_FRACTIONS:
        budget = f * total
        try:
            p = autopart.plan(model, autopart.mesh(shape, names), (ids,), {"labels": ids}, roles=roles,
                              memory_budget=budget, **kw)
        except ValueError as exc:
            stopped = (f, budget, str(exc).splitlines()[0])
            break
        res = run_ranks(2, _rank, "sweep", False, p.to_json(), budget)
        if "skipped" in res[0]:
            rows.append((f, budget, p, None, res[0]["skipped"]))
            continue
        rows.append((f, budget, p, res, None))
    print(f"reference GPT {CFG}, global batch {BATCH} x seq {SEQ}, AdamW, torch {torch.__version__}; mesh {shape} "
          f"{names}, roles {roles}, cluster 'cpu'")
    print(f"loose plan (no budget): predicted total T = {_mib(total)} MiB, predicted step "
          f"{loose.predicted['step_time_s'] * 1e3:.1f} ms, techniques: {_techniques(loose)}\n")
    print("| budget MiB (f x T) | techniques | predicted step (ms) | predicted peak (MiB), at | "
          "measured peak, max rank (MiB) | measured / predicted | measured <= budget? |")
    print("|---|---|---|---|---|---|---|")
    for f, budget, p, res, why in rows:
        pred = float(p.predicted["memory_bytes"]["total"])
        head = (f"| {_mib(budget)} ({f:.2f}) | {_techniques(p)} | {p.predicted['step_time_s'] * 1e3:.1f} | "
                f"{_mib(pred)}, {peak_moment(p.predicted['memory_bytes']) or 'a pipeline stage'} |")
        if res is None:
            print(f"{head} skipped: {why} | | |")
            continue
        peak = max(r["peak"] for r in res)
        print(f"{head} {_mib(peak)} | {peak / pred:.2f} | {'yes' if peak <= budget else 'NO'} |")
    if stopped is not None:
        f, budget, msg = stopped
        print(f"| {_mib(budget)} ({f:.2f}) | plan raised ValueError: {msg} | | | | | |")
    print("\nper rank (measured): peak, phase, P+OS+B / G / A at the peak (MiB)")
    for f, _budget, _p, res, _why in rows:
        for rk, r in enumerate(res or []):
            print(f"  f={f:.2f} rank {rk}: peak {_mib(r['peak'])} in {r['phase']}, {_three(r['breakdown'])}")


def main() -> None:
    from harness import run_ranks

    from autopart.plan import peak_moment

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--detail", default="", help="a configuration whose rank-0 peak is listed by op")
    ap.add_argument("--sweep", action="store_true", help="memory-budget sweep of the 2-rank dp plan")
    a = ap.parse_args()
    if a.sweep:
        sweep()
        return
    rows, skipped, details = [], [], {}
    for name in a.configs.split(","):
        world = 1
        for n in CONFIGS[name][0]:
            world *= n
        try:
            res = run_ranks(world, _rank, name, name == a.detail)
        except AssertionError as exc:  # a rank raised: keep going, report the root cause's last lines
            lines = [ln for ln in str(exc).splitlines() if ln.strip()]
            print(f"{name} failed:\n  " + "\n  ".join(lines[:1] + lines[-6:]), file=sys.stderr)
            skipped.append((name, "FAILED: " + lines[-1][:200]))
            continue
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
        if "parameters_and_optimizer" in pred:  # pipelined: the max over stages of each part
            pb = "P+OS " + " / ".join(_mib(pred[c]) for c in ("parameters_and_optimizer", "gradients", "activations"))
        else:
            pb = " / ".join(_mib(pred.get(c, 0.0)) for c in CATS)
        mb = " / ".join(_mib(r["breakdown"][c]) for c in CATS)
        peaks = ", ".join(_mib(x["peak"]) for x in res)
        print(f"| {name} | {world} | {_mib(pred['total'])} | {_mib(r['peak'])} | {r['peak'] / pred['total']:.2f} | "
              f"{r['phase']} | {pb} | {mb} | {peaks} |")
    for name, why in skipped:
        print(f"| {name} | - | - | - | - | skipped: {why} | | | |")
    print("\npredicted vs measured per rank (pipelined: the predicted total of the rank's stage(s); P+OS+B / G / A "
          "= parameters + optimizer states (+ buffers) / gradients / activations, MiB)")
    print("| config | rank | stage | predicted (rank) | measured peak | measured / predicted | predicted P+OS / G / A "
          "| measured at peak P+OS+B / G / A | local param MiB | pp recv buffers |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, _world, res, _ in rows:
        for rk, r in enumerate(res):
            rp, st = r["rank_predicted"], r["stage"]
            stage = (f"pp {st['pp_rank']} (chunks {st['chunks']}, {sum(st['layers'])} units, in flight "
                     f"{st['in_flight']})" if st else "-")
            print(f"| {name} | {rk} | {stage} | {_mib(rp['total'])} | {_mib(r['peak'])} | "
                  f"{r['peak'] / rp['total']:.2f} | {_three(rp)} | {_three(r['breakdown'])} | "
                  f"{_mib(r['param_bytes'])} | {_mib(r['recv_bytes']) if st else '-'} |")
    print("\nthe optimizer step (the plan's third memory moment, peak_optimizer) vs the measured peak of "
          "`opt.step()` + `opt.zero_grad()`, max over ranks, MiB (pipelined plans: not priced per stage)")
    print("| config | predicted optimizer step | of which temporaries / gather in flight | measured optimizer phase "
          "| measured / predicted | plan's peak moment |")
    print("|---|---|---|---|---|---|")
    for name, _world, res, _ in rows:
        pred = res[0]["predicted"]
        opt_peak = max(r["opt_peak"] for r in res)
        if "peak_optimizer" not in pred:
            print(f"| {name} | - | - | {_mib(opt_peak)} | - | - |")
            continue
        print(f"| {name} | {_mib(pred['peak_optimizer'])} | {_mib(pred['optimizer_temporaries'])} / "
              f"{_mib(pred['gather_in_flight'])} | {_mib(opt_peak)} | {opt_peak / pred['peak_optimizer']:.2f} | "
              f"{peak_moment(pred)} |")
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
