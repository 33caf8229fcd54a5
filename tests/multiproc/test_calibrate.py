"""autopart.calibrate on real gloo ranks: quick, positive finite numbers, cached; predictions rank like measurements."""

from __future__ import annotations

import json
import math
import statistics
import time

import pytest
import torch

from tests.multiproc.harness import run_ranks

pytestmark = pytest.mark.multiproc

# (name, global batch, roles, options): predicted step times ~2-3x apart on the calibrated 2-rank cluster
CONFIGS = [
    ("dp2-b2", 2, {"dp": "dp"}, {}),
    ("tp2-b8", 8, {"tp": "tp"}, {}),
    ("dp2-b24", 24, {"dp": "dp"}, {}),
    ("tp2-b48", 48, {"tp": "tp"}, {}),
    ("dp2-b96-full", 96, {"dp": "dp"}, {"checkpoint": "full"}),
]


def _calibrate_and_run(directory: str, steps: int):
    import torch.distributed as dist

    import autopart
    from autopart.calibrate import calibrate
    from autopart.models import GPT, GPTConfig

    t0 = time.perf_counter()
    cluster = calibrate((2,), quick=True, directory=directory)
    took = time.perf_counter() - t0
    rows = []
    for name, batch, roles, kw in CONFIGS:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, max_seq_len=64, n_layer=2, n_head=4, d_model=128))
        ids = torch.randint(0, 256, (batch, 64), generator=torch.Generator().manual_seed(1))
        axis = next(iter(roles))
        pm = autopart.parallelize(model, autopart.mesh((2,), (axis,)), (ids,), {"labels": ids}, cluster=cluster,
                                  roles=roles, pipeline="off", zero=0 if axis == "dp" else None, **kw)
        times = []
        for i in range(steps + 1):
            dist.barrier()
            t = time.perf_counter()
            pm.forward_backward(ids, labels=ids)
            for p in pm.parameters():
                p.grad = None
            t = torch.tensor([time.perf_counter() - t])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i:  # the first is warm-up
                times.append(float(t))
        rows.append((name, pm.plan.predicted["step_time_s"], statistics.median(times)))
    return cluster.to_json(), took, rows


def _ranks(x):
    order = sorted(range(len(x)), key=lambda i: x[i])
    r = [0] * len(x)
    for rank, i in enumerate(order):
        r[i] = rank
    return r


def spearman(x, y) -> float:
    rx, ry = _ranks(x), _ranks(y)
    n = len(x)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def test_calibrate_two_ranks_and_rank_correlation(tmp_path):
    from autopart.calibrate import cache_path, fingerprint, load_calibration
    from autopart.cost import Cluster
    from autopart.cost.comm import COLLECTIVES

    results = run_ranks(2, _calibrate_and_run, str(tmp_path), 4)
    (c0, took, rows), (c1, _, _) = results
    assert c0 == c1  # every rank returns the same cluster
    assert took < 30, f"calibration took {took:.1f} s"
    cluster = Cluster.from_json(c0)
    d = cluster.device
    for value in (d.peak_flops, d.mem_bandwidth, d.host_bandwidth, d.memory_bytes):
        assert math.isfinite(value) and value > 0
    # the runtime's framework time: tens of microseconds or more per op on any CPU, a rank's share of its host.
    # Its split between ops and parameters comes from two models' difference and may put all of it on either side
    # (a fresh clone on the idle machine measured 0 per op, 72 us per parameter): the sum is what must be there
    assert 0 <= d.op_latency < 0.05 and 0 <= d.param_latency < 0.05, (d.op_latency, d.param_latency)
    assert d.op_latency + d.param_latency > 1e-6, (d.op_latency, d.param_latency)
    assert d.host_ranks == 2 and d.alone_speedup >= 1
    assert [k for k, _ in d.math_variants] == ["gelu:tanh"] and d.math_variants[0][1] > 0  # GPT-2's gelu, measured
    link = cluster.links[0]
    assert {k for k, _, _ in link.per_collective} == set(COLLECTIVES)
    for _, alpha, beta in link.per_collective:
        assert math.isfinite(alpha) and alpha >= 0 and math.isfinite(beta) and beta > 0
    assert load_calibration((2,), directory=str(tmp_path)) == cluster  # cached by rank 0
    # the links as a step pays them (after compute) and back to back (the tiny models' overhead steps): both kept
    with open(cache_path(fingerprint("gloo", 2, (2,)), str(tmp_path))) as f:
        m = json.load(f)["measurements"]
    assert set(m["collective_seconds"]) == set(m["collective_seconds_back_to_back"]) == {
        f"0/{k}" for k in COLLECTIVES}
    assert all(t > 0 for v in m["collective_seconds_back_to_back"].values() for t in v)
    assert {k for k, _, _ in link.chained} == set(COLLECTIVES)  # the back-to-back set, for chained ZeRO-3 gathers

    pred = [p for _, p, _ in rows]
    meas = [m for _, _, m in rows]
    table = "\n".join(f"{n}: predicted {p * 1e3:.1f} ms, measured {m * 1e3:.1f} ms" for n, p, m in rows)
    ladder = sorted(pred)
    # clearly different configurations overall (the predictions use this run's calibration, so the spacing of
    # neighbours varies with the machine's load, 1.04-2.5x seen; an adjacent swap still leaves Spearman 0.9). The
    # whole ladder spans 5-9x on an idle machine; a fresh-clone CI run, its calibration sharing the 2 cores with
    # other test workers, priced the smallest step 70.9 ms against 36.9 measured: 4.7x, with Spearman 1.0
    assert ladder[-1] / ladder[0] > 3, table
    rho = spearman(pred, meas)
    assert rho >= 0.6, f"Spearman {rho:.2f}\n{table}"
