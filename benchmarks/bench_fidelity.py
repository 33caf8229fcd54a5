"""Fidelity of the cost model on this machine: predicted vs measured step time, calibrated cluster, 4 gloo ranks.

    PYTHONPATH=. python benchmarks/bench_fidelity.py [--steps 10] [--warmup 2] [--configs dp4,tp4,...] [--recalibrate]
        [--shared]

For each configuration of the reference GPT (``CFG`` below; batch ``BATCH`` x ``SEQ``) autopart plans with the
calibrated cluster (``autopart.calibrate`` on the same 4 ranks, measured first unless cached; ``--recalibrate``
measures again) and the configuration's options forced (roles, ``zero=``, ``checkpoint=``, ``pipeline=``), runs
the plan, and times ``pm.forward_backward`` (forward, backward, gradient reduction) and the optimizer's step (AdamW
built by ``pm.optimizer``: ZeRO-1/2's slices, as the plan runs it) between barriers on every rank, the slowest rank
each; measured = the median over ``--steps`` steps after ``--warmup`` of their sum, what ``step_time_s`` predicts.
The optimizer step is reported apart too, predicted (``optimizer_step_s``) and measured.
Each configuration runs in a world of 4 fresh ranks of its own, as a training run has its plan (the calibration in
another, first); two rounds of all the configurations in turn, ``--steps`` / 2 timed steps each, so that drift on
the machine hits them alike. ``--shared`` sets every configuration up in one world first and times them there (the
method before 2026-12-06): each rank then also holds the others' models, traced graphs and process groups, which
slows some steps (dp4 265 -> 329 ms with six others alive) and speeds others (dp4-zero3).

Prints a markdown table, the Spearman rank correlation of predicted and measured times and the median absolute
relative error |predicted - measured| / measured, with the load average before and after.

On a machine shared with other sessions, give the run its own session with autogroup priority: the kernel shares
CPU time between sessions first (``kernel.sched_autogroup_enabled``), so other sessions' ``nice`` does not leave
this one the cores (4 ranks calibrated 19-38 instead of ~70 GFLOP/s a rank that way):

    setsid bash -c 'echo -15 > /proc/self/autogroup; exec env PYTHONPATH=. python benchmarks/bench_fidelity.py \
        --recalibrate'
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "multiproc"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CFG = dict(vocab_size=1024, max_seq_len=128, n_layer=4, n_head=4, d_model=256)
BATCH, SEQ = 8, 128
WORLD = 4

# name -> (mesh shape, axis names, parallelize options)
CONFIGS: dict[str, tuple[tuple[int, ...], tuple[str, ...], dict]] = {
    "dp4": ((4,), ("dp",), dict(roles={"dp": "dp"}, zero=0, pipeline="off")),
    "dp4-zero2": ((4,), ("dp",), dict(roles={"dp": "dp"}, zero=2, pipeline="off")),
    "dp4-zero3": ((4,), ("dp",), dict(roles={"dp": "dp"}, zero=3, pipeline="off")),
    "dp4-ckpt-full": ((4,), ("dp",), dict(roles={"dp": "dp"}, zero=0, checkpoint="full", pipeline="off")),
    "tp4": ((4,), ("tp",), dict(roles={"tp": "tp"}, pipeline="off")),
    "dp2xtp2": ((2, 2), ("dp", "tp"), dict(roles={"dp": "dp", "tp": "tp"}, zero=0, pipeline="off")),
    "dp2xtp2-zero3": ((2, 2), ("dp", "tp"), dict(roles={"dp": "dp", "tp": "tp"}, zero=3, pipeline="off")),
    "dp2xtp2-ckpt-sel": ((2, 2), ("dp", "tp"), dict(roles={"dp": "dp", "tp": "tp"}, zero=0, checkpoint="selective",
                                                    pipeline="off")),
    # the batch split over both axes at once (nested in mesh order): DDP and ZeRO-1 on a (node, gpu) mesh
    "dp2xdp2": ((2, 2), ("node", "gpu"), dict(roles={"node": "dp", "gpu": "dp"}, zero=0, pipeline="off")),
    "dp2xdp2-zero1": ((2, 2), ("node", "gpu"), dict(roles={"node": "dp", "gpu": "dp"}, zero=1, pipeline="off")),
    "pp2xdp2-1f1b": ((2, 2), ("pp", "dp"), dict(roles={"pp": "pp", "dp": "dp"}, zero=0,
                                                pipeline={"schedule": "1f1b", "micro_batches": 2})),
    "pp2xtp2-gpipe": ((2, 2), ("pp", "tp"), dict(roles={"pp": "pp", "tp": "tp"},
                                                 pipeline={"schedule": "gpipe", "micro_batches": 4})),
    "pp4-1f1b": ((4,), ("pp",), dict(roles={"pp": "pp"}, pipeline={"schedule": "1f1b", "micro_batches": 4})),
    "free-2x2": ((2, 2), ("a", "b"), dict()),
    # interleaved with fewer micro-batches than stages: its 4 chunks one after the other (free-2x2's choice until
    # the schedule's length was priced so, at 3 chunk times)
    "pp2-interleaved-m1": ((2, 2), ("a", "b"), dict(pipeline={"stages": 2, "micro_batches": 1,
                                                              "schedule": "interleaved"})),
}


def _model():
    from autopart.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG))


def _ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CFG["vocab_size"], (BATCH, SEQ), generator=g)


def _calibrated(mesh_shape: tuple[int, ...], recalibrate: bool):
    from autopart.calibrate import calibrate, load_calibration

    if not recalibrate:
        try:
            return load_calibration(mesh_shape), False
        except ValueError:
            pass
    t0 = time.perf_counter()
    c = calibrate(mesh_shape)
    dist.barrier()
    return c, time.perf_counter() - t0


def _time(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out.append(float(t))
    return out


def _calibrate_all(shapes: list[tuple[int, ...]], recalibrate: bool) -> dict:
    """The calibrated cluster of each mesh shape (measured, or from the cache), in a world of its own."""
    clusters, cal_s = {}, {}
    for shape in shapes:
        clusters[shape], cal_s[shape] = _calibrated(shape, recalibrate)
    alone = {}
    if dist.get_rank() == 0:
        import json

        from autopart.calibrate import cache_path, fingerprint

        for shape in clusters:
            try:
                with open(cache_path(fingerprint(dist.get_backend(), WORLD, shape))) as f:
                    alone[str(shape)] = json.load(f)["measurements"]["device"].get("gemm_alone_flops", 0.0)
            except (OSError, KeyError, ValueError):
                pass
    return {"clusters": {str(k): v.to_json() for k, v in clusters.items()},
            "calibration_s": {str(k): v for k, v in cal_s.items()}, "alone": alone}


def _setup(name: str, cluster, ids) -> tuple:
    """Plan and build one configuration: its step's two halves (forward-backward, optimizer) and its row."""
    import autopart

    shape, axes, kw = CONFIGS[name]
    t0 = time.perf_counter()
    pm = autopart.parallelize(_model(), autopart.mesh(shape, axes), (ids,), {"labels": ids}, cluster=cluster, **kw)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-4)  # ZeRO-1/2: over this rank's slices

    def fb():
        pm.forward_backward(ids, labels=ids)

    def opt_step():
        opt.step()
        opt.zero_grad()

    plan = pm.plan
    pipe = plan.pipeline or {}
    row = {"predicted_s": plan.predicted["step_time_s"], "compute_s": plan.predicted.get("compute_s"),
           "comm_s": plan.predicted.get("comm_s"), "opt_s": plan.predicted.get("optimizer_step_s", 0.0),
           "setup_s": time.perf_counter() - t0,
           "zero": sorted(set(plan.zero.values())), "checkpoint": sorted(set(plan.checkpoint.values())),
           "pipeline": (f"pp={pipe.get('degree')} m={pipe.get('micro_batches')} {pipe.get('schedule')}"
                        if pipe else ""), "mesh": plan.mesh_shape, "fb": [], "opt": []}
    return fb, opt_step, row


def _steps(fb, opt_step, n: int, row: dict | None = None) -> None:
    """``n`` steps (forward-backward, then the optimizer's); with ``row``, each half timed into its lists."""
    for _ in range(n):
        if row is None:
            fb()
            opt_step()
        else:
            row["fb"] += _time(fb, 1)
            row["opt"] += _time(opt_step, 1)


def run_one(name: str, cluster_json: dict, steps: int, warmup: int) -> dict:
    """One configuration in a world of its own, as a training run has it: planned, warmed up, ``steps`` timed."""
    from autopart.cost import Cluster

    fb, opt_step, row = _setup(name, Cluster.from_json(cluster_json), _ids())
    _steps(fb, opt_step, warmup)
    _steps(fb, opt_step, steps, row)
    return row


def run_shared(names: list[str], clusters_json: dict, steps: int, warmup: int) -> dict:
    """``--shared``: every configuration set up in one world first, then timed in turn (two rounds). Each rank then
    holds every configuration's model, optimizer, traced graph and process groups (their gloo threads wake
    ~100 times a second each, idle): measured on dp4, 265 -> 329 ms a forward-backward and 25% more CPU with six
    others alive (``--shared`` is kept for that comparison)."""
    from autopart.cost import Cluster

    ids = _ids()
    setups, rows = {}, {}
    for name in names:
        fb, opt_step, rows[name] = _setup(name, Cluster.from_json(clusters_json[str(CONFIGS[name][0])]), ids)
        setups[name] = (fb, opt_step)
        _steps(fb, opt_step, warmup)
    for _ in range(2):
        for name in names:
            _steps(*setups[name], max(1, steps // 2), rows[name])
    return rows


def run(names: list[str], steps: int, warmup: int, recalibrate: bool, shared: bool = False) -> dict:
    """Calibrate (one world), then time every configuration: each in a world of its own (two rounds of the
    configurations in turn, ``steps // 2`` timed steps each, so that drift on the machine hits them alike), or, with
    ``shared``, all in one world."""
    from harness import run_ranks

    cal = run_ranks(WORLD, _calibrate_all, sorted({CONFIGS[n][0] for n in names}), recalibrate)[0]
    if shared:
        rows = run_ranks(WORLD, run_shared, names, cal["clusters"], steps, warmup)[0]
    else:
        half = max(1, steps // 2)
        rows = {}
        for _ in range(2):
            for name in names:
                row = run_ranks(WORLD, run_one, name, cal["clusters"][str(CONFIGS[name][0])], half, warmup)[0]
                if name not in rows:
                    rows[name] = row
                    continue
                if abs(row["predicted_s"] - rows[name]["predicted_s"]) > 1e-9 * rows[name]["predicted_s"]:
                    raise RuntimeError(f"{name}: planned differently in two worlds ({rows[name]['predicted_s']} "
                                       f"vs {row['predicted_s']} s predicted)")
                rows[name]["fb"] += row["fb"]
                rows[name]["opt"] += row["opt"]
    return {"rows": rows, **cal}


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else float("nan")


def main() -> None:
    from autopart.calibrate import describe
    from autopart.cost import Cluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--recalibrate", action="store_true")
    ap.add_argument("--shared", action="store_true",
                    help="set every configuration up in one world of ranks first (the method before 2026-12-06)")
    a = ap.parse_args()
    names = a.configs.split(",")
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise SystemExit(f"unknown configurations {bad}; known: {list(CONFIGS)}")
    load0 = os.getloadavg()
    t0 = time.time()
    res = run(names, a.steps, a.warmup, a.recalibrate, a.shared)
    load1 = os.getloadavg()
    for shape, c in res["clusters"].items():
        took = res["calibration_s"][shape]
        print(f"calibrated cluster for mesh {shape} ({f'measured in {took:.1f} s' if took else 'from cache'}):")
        print(describe(Cluster.from_json(c)))
        if res["alone"].get(shape):
            print(f"matmul on one rank while the others wait: {res['alone'][shape] / 1e9:.3g} GFLOP/s")
    print(f"\nreference GPT {CFG}, batch {BATCH} x seq {SEQ}, {WORLD} gloo ranks x 1 thread, torch "
          f"{torch.__version__}; median of {len(next(iter(res['rows'].values()))['fb'])} steps after {a.warmup} "
          f"warm-up; load average {load0[0]:.2f} before, {load1[0]:.2f} after; {time.time() - t0:.0f} s\n")
    print("| config | mesh | pipeline | ZeRO | checkpoint | predicted ms (compute + comm + optimizer) | measured ms "
          "(forward-backward + optimizer) | measured / predicted | optimizer step ms: predicted, measured |")
    print("|---|---|---|---|---|---|---|---|---|")
    pred, meas = [], []
    for name in names:
        r = res["rows"][name]
        m = statistics.median(f + o for f, o in zip(r["fb"], r["opt"]))
        p = r["predicted_s"]
        pred.append(p)
        meas.append(m)
        split = f" ({r['compute_s'] * 1e3:.0f} + {r['comm_s'] * 1e3:.0f} + {r['opt_s'] * 1e3:.0f})" \
            if r["compute_s"] is not None and r["comm_s"] is not None else ""
        print(f"| {name} | {'x'.join(map(str, r['mesh']))} | {r['pipeline'] or '-'} | "
              f"{','.join(map(str, r['zero'])) or '-'} | {','.join(r['checkpoint']) or '-'} | {p * 1e3:.1f}{split} | "
              f"{m * 1e3:.1f} ({statistics.median(r['fb']) * 1e3:.0f} + {statistics.median(r['opt']) * 1e3:.0f}) | "
              f"{m / p:.2f} | {r['opt_s'] * 1e3:.1f}, {statistics.median(r['opt']) * 1e3:.1f} |")
    errs = [abs(p - m) / m for p, m in zip(pred, meas)]
    print(f"\nSpearman rank correlation {spearman(pred, meas):.3f} over {len(names)} configurations (target >= 0.8); "
          f"median |predicted - measured| / measured {statistics.median(errs) * 100:.1f}% (target <= 25%)")


if __name__ == "__main__":
    main()
