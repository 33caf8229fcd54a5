"""autopart.calibrate without a process group: the fit, the ring conversion, the cache, planning with the result."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import autopart
from autopart.calibrate import (
    build_cluster,
    cache_path,
    calibrate,
    fingerprint,
    fit_alpha_beta,
    link_params,
    load_calibration,
    save_calibration,
)
from autopart.cost import Cluster, Link, collective_time
from autopart.cost.comm import COLLECTIVES

SIZES = [4096, 65536, 524288, 2**21, 2**23]


def test_fit_recovers_alpha_beta_exactly():
    a, b = 120e-6, 1 / 0.8e9
    times = [a + b * s for s in SIZES]
    fa, fb = fit_alpha_beta(SIZES, times)
    assert fa == pytest.approx(a, rel=1e-9)
    assert fb == pytest.approx(b, rel=1e-9)


def test_fit_with_noise_and_clamps():
    rng = np.random.default_rng(0)
    a, b = 300e-6, 1 / 2e9
    times = [(a + b * s) * (1 + 0.03 * rng.standard_normal()) for s in SIZES]
    fa, fb = fit_alpha_beta(SIZES, times)
    assert fa == pytest.approx(a, rel=0.15)
    assert fb == pytest.approx(b, rel=0.1)
    # pure bandwidth (the free fit's intercept would go negative): alpha clamps to 0, beta through the origin
    fa, fb = fit_alpha_beta([1e6, 2e6, 4e6], [0.9e-3, 2.1e-3, 4.0e-3])
    assert fa == 0.0 and fb == pytest.approx(1e-9, rel=0.1)
    # flat (latency only, noise makes the slope negative): beta stays positive, alpha about the flat time
    fa, fb = fit_alpha_beta([1e3, 1e4, 1e5], [1.0e-3, 0.99e-3, 0.98e-3])
    assert fb > 0 and 0 < fa <= 1e-3
    with pytest.raises(ValueError, match="2 distinct sizes"):
        fit_alpha_beta([1e3], [1e-3])


@pytest.mark.parametrize("kind", COLLECTIVES)
@pytest.mark.parametrize("n", [2, 4])
def test_ring_conversion_reproduces_measured_times(kind, n):
    """Fit a collective's measured T(S), convert to the ring model's link: the cost model gives T(S) back."""
    a, b = 200e-6, 1 / 1e9
    fa, fb = fit_alpha_beta(SIZES, [a + b * s for s in SIZES])
    alpha, beta = link_params(kind, fa, fb, n)
    link = Link(alpha=1.0, beta=1.0, per_collective=((kind, alpha, beta),))
    for s in SIZES:
        assert collective_time(kind, s, n, link) == pytest.approx(a + b * s, rel=1e-9)
    # the collectives not measured keep the link's own alpha and beta
    other = next(k for k in COLLECTIVES if k != kind and k != "send_recv")
    assert collective_time(other, 1e6, n, link) == collective_time(other, 1e6, n, Link(1.0, 1.0))


def test_link_per_collective_validates_and_round_trips():
    link = Link(alpha=1e-4, beta=1e-9, per_collective=[["all_gather", 2e-4, 2e-9]])
    assert link.per_collective == (("all_gather", 2e-4, 2e-9),)
    hash(link)
    assert link.for_collective("all_gather") == Link(2e-4, 2e-9)
    assert link.for_collective("all_reduce") is link
    with pytest.raises(ValueError, match="per_collective"):
        Link(alpha=1e-4, beta=1e-9, per_collective=(("broadcast", 1e-4, 1e-9),))


def _fake_calibration(mesh_shape=(2, 2), slow_all_reduce=False) -> Cluster:
    """A calibrated cluster built from synthetic raw measurements, as ``calibrate`` builds it."""
    raw = {}
    for axis in range(len(mesh_shape)):
        for kind in COLLECTIVES:
            a, b = (5e-3, 1 / 0.05e9) if slow_all_reduce and kind == "all_reduce" else (100e-6, 1 / 1e9)
            raw[f"{axis}/{kind}"] = [a + b * s for s in SIZES]
    dev = {"gemm": [{"flops": 40e9}, {"flops": 60e9}], "attention": {"flops": 20e9},
           "elementwise": {"bandwidth": 5e9}, "host_bandwidth": 5e9}
    return build_cluster(mesh_shape, raw, SIZES, dev, 4 * 2**30, 2**29)


def test_build_cluster_carries_measurements():
    c = _fake_calibration()
    assert c.name == "calibrated" and c.mesh_shape == (2, 2)
    assert c.device.achievable_flops == pytest.approx(50e9)
    assert c.device.mem_bandwidth == pytest.approx(5e9)
    for link in c.links:
        assert {k for k, _, _ in link.per_collective} == set(COLLECTIVES)
        assert collective_time("all_gather", 2**20, 2, link) == pytest.approx(100e-6 + 2**20 / 1e9, rel=1e-6)
    assert Cluster.from_json(json.loads(json.dumps(c.to_json()))) == c


def test_cache_round_trip_keyed_by_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPART_CACHE", str(tmp_path))
    c = _fake_calibration((2, 2))
    fp = fingerprint("gloo", 4, (2, 2))
    assert fp["world_size"] == 4 and fp["mesh_shape"] == [2, 2] and fp["torch"] == torch.__version__
    path = save_calibration(c, fp, {"note": "synthetic"})
    assert path.startswith(str(tmp_path)) and path == cache_path(fp)
    assert load_calibration((2, 2), backend="gloo") == c
    assert load_calibration(path=path) == c
    with pytest.raises(ValueError, match="autopart calibrate --nproc 4 --mesh 4"):
        load_calibration((4,), backend="gloo")  # no 4-rank group was measured
    with pytest.raises(ValueError, match="--nproc 2"):
        load_calibration((2,), backend="gloo")  # another world size: other contention, not reused
    # another torch version (or device, backend) is another fingerprint
    other = dict(fp, torch="0.0.0")
    save_calibration(_fake_calibration((2, 2), slow_all_reduce=True), other, {}, str(tmp_path))
    assert load_calibration((2, 2), backend="gloo") == c
    assert cache_path(other) != cache_path(fp)


def test_a_calibration_of_an_earlier_version_is_named_not_used(tmp_path):
    """A cache an earlier autopart wrote (another ``VERSION``) is not used, and the error says it is there."""
    import importlib

    cal = importlib.import_module("autopart.calibrate")  # the module: ``autopart.calibrate`` is the function
    path = save_calibration(_fake_calibration((2, 2)), fingerprint("gloo", 4, (2, 2)), {}, str(tmp_path))
    with open(path) as f:
        doc = json.load(f)
    doc["version"] = cal.VERSION - 1
    with open(path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(ValueError, match=rf"earlier format, version {cal.VERSION - 1}.*--nproc 4 --mesh 2x2"):
        load_calibration((2, 2), backend="gloo", directory=str(tmp_path))


def test_same_hardware_other_mesh_by_group_size(tmp_path):
    c = _fake_calibration((2, 2))
    save_calibration(c, fingerprint("gloo", 4, (2, 2)), {}, str(tmp_path))
    flipped = load_calibration((2, 2), backend="gloo", directory=str(tmp_path))
    assert flipped == c
    c4 = _fake_calibration((4,))
    save_calibration(c4, fingerprint("gloo", 4, (4,)), {}, str(tmp_path))
    got = load_calibration((4, 1), backend="gloo", directory=str(tmp_path))
    assert got.mesh_shape == (4, 1) and got.links[0] == c4.links[0] and got.device == c4.device


def _tiny_gpt():
    from autopart.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=2, d_model=32))
    ids = torch.randint(0, 64, (4, 16))
    return model, ids


def test_calibrated_cluster_plans(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPART_CACHE", str(tmp_path))
    fast = _fake_calibration((2,))
    save_calibration(fast, fingerprint("nccl" if torch.cuda.is_available() else "gloo", 2, (2,)), {})
    model, ids = _tiny_gpt()
    kw = dict(example_kwargs={"labels": ids}, roles={"dp": "dp"}, zero=0, pipeline="off")
    by_name = autopart.plan(model, autopart.mesh((2,), ("dp",)), (ids,), cluster="calibrated", **kw)
    by_object = autopart.plan(model, autopart.mesh((2,), ("dp",)), (ids,), cluster=autopart.load_calibration((2,)),
                              **kw)
    assert by_name.cluster == fast.to_json() == by_object.cluster
    assert by_name.predicted["step_time_s"] == pytest.approx(by_object.predicted["step_time_s"])
    assert by_name.predicted["comm_s"] > 0
    # the data-parallel gradient all-reduce is priced with the measured all-reduce: a slower one costs more
    slow = _fake_calibration((2,), slow_all_reduce=True)
    p_slow = autopart.plan(model, autopart.mesh((2,), ("dp",)), (ids,), cluster=slow, **kw)
    assert p_slow.predicted["comm_s"] > 5 * by_name.predicted["comm_s"]
    assert p_slow.predicted["compute_s"] == pytest.approx(by_name.predicted["compute_s"])


def test_no_calibration_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPART_CACHE", str(tmp_path / "empty"))
    model, ids = _tiny_gpt()
    with pytest.raises(ValueError, match="autopart calibrate --nproc 2"):
        autopart.plan(model, autopart.mesh((2,), ("dp",)), (ids,), {"labels": ids}, cluster="calibrated")


def test_calibrate_one_process_measures_the_device(tmp_path):
    """Without a process group: one rank, no link measured, the device's rates positive and cached. The optimizer
    step's rate is measured (AdamW, foreach), no faster than a plain add moves memory on a CPU."""
    c = calibrate(quick=True, directory=str(tmp_path))
    assert c.mesh_shape == (1,)
    d = c.device
    assert 1e8 < d.peak_flops < 1e15 and 1e8 < d.mem_bandwidth < 1e14 and d.mfu == 1.0
    # the lower bound is a sanity floor: on 2 cores shared with other tests' ranks it measured 70 MB/s
    assert 1e7 < d.optimizer_bandwidth < 2 * d.mem_bandwidth
    assert load_calibration((1,), directory=str(tmp_path)) == c


def test_runtime_overhead_priced_per_op_and_parameter():
    """The calibrated framework time per graph op and per parameter lands in the plan's compute, once per node;
    a pipeline unit pays it once per micro-batch (``Unit.fixed_s``), not split between them."""
    from dataclasses import replace

    from autopart.pipelining import block_units
    from autopart.trace import trace

    dev = {"gemm": [{"flops": 40e9}, {"flops": 60e9}], "gemm_alone_flops": 80e9, "attention": {"flops": 20e9},
           "elementwise": {"bandwidth": 5e9}, "host_bandwidth": 5e9, "host_ranks": 4, "device": "cpu",
           "runtime": {"per_op": 1e-4, "per_param": 3e-4, "per_zero3_param": 2e-3, "per_optimizer_param": 5e-5}}
    raw = {f"0/{k}": [100e-6 + s / 1e9 for s in SIZES] for k in COLLECTIVES}
    c = build_cluster((2,), raw, SIZES, dev, 4 * 2**30, 2**29)
    d = c.device
    assert (d.op_latency, d.param_latency, d.zero3_latency, d.optimizer_param_latency, d.host_ranks,
            d.alone_speedup) == (1e-4, 3e-4, 2e-3, 5e-5, 4, 2.0)  # 80 / 40
    assert Cluster.from_json(json.loads(json.dumps(c.to_json()))) == c
    assert build_cluster((2,), raw, SIZES, dev | {"device": "cuda"}, 2**30, 0).device.alone_speedup == 1.0
    # a GPU's collectives run beside its compute (NCCL's own stream), gloo's on the cores the ranks compute on
    assert build_cluster((2,), raw, SIZES, dev | {"device": "cuda"}, 2**30, 0).device.comm_overlap
    assert not c.device.comm_overlap
    model, ids = _tiny_gpt()
    t = trace(model, (ids,), {"labels": ids})
    kw = dict(traced=t, roles={"dp": "dp"}, zero=0, pipeline="off")
    plain_cluster = replace(c, device=replace(d, op_latency=0.0, param_latency=0.0, zero3_latency=0.0,
                                              optimizer_param_latency=0.0))
    plain = autopart.plan(model, autopart.mesh((2,), ("dp",)), (ids,), {"labels": ids}, cluster=plain_cluster, **kw)
    priced = autopart.plan(model, autopart.mesh((2,), ("dp",)), (ids,), {"labels": ids}, cluster=c, **kw)
    ops = sum(1 for r in priced.nodes.values() if r["op"] not in ("param", "buffer", "constant", "input"))
    params = sum(1 for r in priced.nodes.values() if r["op"] == "param")
    assert ops > 40 and params > 20
    assert priced.predicted["compute_s"] - plain.predicted["compute_s"] == pytest.approx(ops * 1e-4 + params * 3e-4)
    # the optimizer steps each parameter once per step, not in the compute
    assert priced.predicted["optimizer_step_s"] - plain.predicted["optimizer_step_s"] == pytest.approx(params * 5e-5)
    units, unit_of = block_units(priced, t, (2,), c)
    in_units = sum(1 for n in unit_of if priced.nodes[n]["op"] not in ("param", "buffer", "constant", "input"))
    tied = sum(len({unit_of[u.name] for u in n.users if u.name in unit_of}) - 1 for n in t.graph.nodes
               if n.name in priced.nodes and priced.nodes[n.name]["op"] == "param")  # a tied weight in two units
    plain_units, _ = block_units(plain, t, (2,), plain_cluster)
    assert sum(u.fixed_s - v.fixed_s for u, v in zip(units, plain_units)) == \
        pytest.approx(in_units * 1e-4 + (params + tied) * 3e-4)
    u = units[0]  # the runtime's overhead is paid by every micro-batch whole, not split between them
    bare = dataclasses.replace(u, fixed_s=0.0).cost(4)
    assert u.cost(4).fwd_s + u.cost(4).bwd_s == pytest.approx(bare.fwd_s + bare.bwd_s + u.fixed_s)
    assert bare.fwd_s + bare.bwd_s >= u.time_s / 4 * (1 - 1e-12)
    # ZeRO-3 parameters cost the runtime more per step
    kw["zero"] = 3
    z_plain = autopart.plan(model, autopart.mesh((2,), ("dp",)), (ids,), {"labels": ids}, cluster=plain_cluster, **kw)
    z_priced = autopart.plan(model, autopart.mesh((2,), ("dp",)), (ids,), {"labels": ids}, cluster=c, **kw)
    assert sum(1 for level in z_priced.zero.values() if level == 3) == params  # every parameter (tied: once)
    assert z_priced.predicted["compute_s"] - z_plain.predicted["compute_s"] == \
        pytest.approx(ops * 1e-4 + params * (3e-4 + 2e-3))


def test_zero3_collectives_priced_back_to_back():
    """A ZeRO-3 parameter's collectives (its gather, the gather again in backward if its op keeps it -- not a
    bias --, its gradient's reduce-scatter) are priced at the links measured back to back (``Link.chained``):
    they come one per parameterized op, an op's compute apart. Activations' collectives keep the after-compute
    links; a cluster without a chained set prices both the same."""
    from dataclasses import replace

    from autopart.planner import saves_input
    from autopart.strategy import tensor_inputs
    from autopart.trace import trace

    dev = {"gemm": [{"flops": 40e9}], "attention": {"flops": 20e9}, "elementwise": {"bandwidth": 5e9},
           "host_bandwidth": 5e9, "device": "cpu"}
    after = build_cluster((2,), {f"0/{k}": [3e-3 + s / 1e9 for s in SIZES] for k in COLLECTIVES}, SIZES, dev,
                          4 * 2**30, 2**29)
    lockstep = build_cluster((2,), {f"0/{k}": [1e-3 + s / 2e9 for s in SIZES] for k in COLLECTIVES}, SIZES, dev,
                             4 * 2**30, 2**29)
    link, fast = after.links[0], lockstep.links[0]
    chained = replace(after, links=(replace(link, chained=fast.per_collective),))
    assert Cluster.from_json(json.loads(json.dumps(chained.to_json()))) == chained
    assert chained.links[0].in_chain().for_collective("all_gather") == fast.for_collective("all_gather")
    model, ids = _tiny_gpt()
    t = trace(model, (ids,), {"labels": ids})
    kw = dict(traced=t, roles={"dp": "dp"}, zero=3, pipeline="off")
    plans = [autopart.plan(model, autopart.mesh((2,), ("dp",)), (ids,), {"labels": ids}, cluster=c, **kw)
             for c in (after, chained)]
    assert plans[0].zero == plans[1].zero and set(plans[0].zero.values()) == {3}
    nodes = {n.name: n for n in t.graph.nodes}
    times = [{(r["value"], r["user"]): r["time_s"] for r in p.collectives} for p in plans]
    steps = {(r["value"], r["user"]): r["steps"] for r in plans[0].collectives}
    assert times[0].keys() == times[1].keys()
    kept = once = 0
    for (value, user), t0 in times[0].items():
        if value not in t.params:
            assert times[1][(value, user)] == t0
            continue
        n = nodes[user]
        nbytes = nodes[value].meta["val"].numel() * 4  # fp32, gathered whole
        gathers = 2 if saves_input(n, [a.name for a in tensor_inputs(n)].index(value)) else 1
        kept, once = kept + (gathers == 2), once + (gathers == 1)
        (_, fwd, bwd), = steps[(value, user)]  # one mesh axis: all-gather, and its gradient's reduce-scatter
        assert fwd == "all_gather" and bwd in ("reduce_scatter", "shard")  # shard: its sum is taken elsewhere
        for lk, tl in ((link, t0), (fast, times[1][(value, user)])):
            assert tl == pytest.approx(gathers * collective_time("all_gather", nbytes, 2, lk) + (
                collective_time("reduce_scatter", nbytes, 2, lk) if bwd == "reduce_scatter" else 0.0), rel=1e-6)
    assert kept >= 8 and once >= 4  # weights kept for backward; a linear's bias and the embedding tables are not
    assert plans[1].predicted["step_time_s"] < plans[0].predicted["step_time_s"]


def test_pipeline_slots_priced_by_the_ranks_busy_on_a_shared_host():
    """4 ranks sharing cores, a rank 2x faster alone: GPipe p=2, m=4 on stages of 2 ranks runs its 10 unit slots
    (5 forward, 5 backward) with both stages busy in 8 and one stage (half the host, the rate of a rank alone) in
    the fill and drain slots: 4 stage times instead of m + p - 1 = 5. A rank that owns its device, a stage that
    fills the host, or one stage per host: no change."""
    from autopart.solver.pipeline import CoreSharing, LayerCost, PipelineOptions, partition, slot_units

    gpipe = PipelineOptions(2, 4, "gpipe")
    assert slot_units(gpipe) == 5
    assert slot_units(replace_sharing(gpipe, CoreSharing(2, 4, 2.0))) == pytest.approx(4.0)
    for sh in (CoreSharing(2, 4, 1.0), CoreSharing(4, 4, 2.0), CoreSharing(2, 2, 2.0)):
        assert slot_units(replace_sharing(gpipe, sh)) == pytest.approx(5.0)
    # 1F1B, 4 stages of one rank, m = 4: every slot counts by the busy ranks, none below alone's rate
    one = PipelineOptions(4, 4, "1f1b", sharing=CoreSharing(1, 4, 2.0))
    assert 0.5 * 7 < slot_units(one) < 7
    layers = [LayerCost(fwd_s=1e-3 * (i + 1), bwd_s=2e-3, act_bytes=1.0, state_bytes=1.0) for i in range(4)]
    plan = partition(layers, replace_sharing(gpipe, CoreSharing(2, 4, 2.0)), 1e9)
    assert plan.step_s == pytest.approx(4.0 * max(plan.stage_time_s))


def replace_sharing(opts, sharing):
    from dataclasses import replace

    return replace(opts, sharing=sharing)


def test_tanh_gelu_priced_at_its_own_calibrated_rate():
    """GPT-2's tanh gelu runs its bytes at the rate calibration measured for it, not at erf gelu's (2.1-2.8x
    faster on a CPU); other transcendental ops and plain gelu keep ``math_bandwidth``."""
    from dataclasses import replace

    from autopart.cost.compute import math_variant, roofline_time

    aten = torch.ops.aten
    dev = {"gemm": [{"flops": 40e9}], "gemm_alone_flops": 0.0, "attention": {"flops": 20e9},
           "transcendental": {"bandwidth": 4e9}, "transcendental_variants": {"gelu:tanh": {"bandwidth": 1e9}},
           "elementwise": {"bandwidth": 5e9}, "host_bandwidth": 5e9, "device": "cpu",
           "runtime": {"per_op": 1e-4, "per_param": 0.0, "per_zero3_param": 0.0}}
    raw = {f"0/{k}": [100e-6 + s / 1e9 for s in SIZES] for k in COLLECTIVES}
    c = build_cluster((2,), raw, SIZES, dev, 4 * 2**30, 2**29)
    d = c.device
    assert d.math_variants == (("gelu:tanh", 1e9),)
    assert Cluster.from_json(json.loads(json.dumps(c.to_json()))) == c
    assert math_variant(aten.gelu.default, {"approximate": "tanh"}) == "gelu:tanh"
    assert math_variant(aten.gelu.default, {}) is None and math_variant(aten.exp.default, {}) is None
    nbytes = 8e6
    assert roofline_time(0, nbytes, d, aten.gelu.default, {"approximate": "tanh"}) == pytest.approx(nbytes / 1e9 + 1e-4)
    assert roofline_time(0, nbytes, d, aten.gelu.default, {"approximate": "none"}) == pytest.approx(nbytes / 4e9 + 1e-4)
    assert roofline_time(0, nbytes, d, aten._softmax.default) == pytest.approx(nbytes / 4e9 + 1e-4)
    # in a plan: every gelu node (the model's MLPs use the tanh form) at 4x its erf price, nothing else moves
    model, ids = _tiny_gpt()
    kw = dict(roles={"dp": "dp"}, zero=0, pipeline="off")
    erf = replace(c, device=replace(d, math_variants=()))
    plans = [autopart.plan(model, autopart.mesh((2,), ("dp",)), (ids,), {"labels": ids}, cluster=x, **kw).nodes
             for x in (c, erf)]
    gelus = [n for n, r in plans[0].items() if "gelu" in r["op"]]
    assert len(gelus) == 2
    for n, r in plans[0].items():
        want = 4 * (plans[1][n]["compute_s"] - 1e-4) + 1e-4 if n in gelus else plans[1][n]["compute_s"]
        assert r["compute_s"] == pytest.approx(want), (n, r["op"])


def test_gradient_bucket_copies_priced_at_the_memory_bandwidth():
    """The gradient bucket's copies into its flat buffer and back are priced with its collective: 4x the bytes
    for an all-reduce, 3x plus 2x the rank's slice for a reduce-scatter (ZeRO-1/2), at ``mem_bandwidth``."""
    from dataclasses import replace

    from autopart.cost import hierarchical_time
    from autopart.planner import grad_reduction_time

    dev = {"gemm": [{"flops": 40e9}], "gemm_alone_flops": 0.0, "attention": {"flops": 20e9},
           "elementwise": {"bandwidth": 5e9}, "host_bandwidth": 5e9, "device": "cpu"}
    raw = {f"{a}/{k}": [100e-6 + s / 1e9 for s in SIZES] for a in (0, 1) for k in COLLECTIVES}
    c = build_cluster((2, 4), raw, SIZES, dev, 4 * 2**30, 2**29)
    nbytes = 2e6
    for axes, ways in (((1,), 4), ((0, 1), 8)):
        levels = [(c.mesh_shape[a], c.link(a)) for a in sorted(axes, reverse=True)]
        assert grad_reduction_time(nbytes, axes, False, c) == pytest.approx(
            hierarchical_time("all_reduce", nbytes, levels) + 4 * nbytes / 5e9)
        assert grad_reduction_time(nbytes, axes, True, c) == pytest.approx(
            hierarchical_time("reduce_scatter", nbytes, levels) + (3 + 2 / ways) * nbytes / 5e9)
    # in a plan's prediction: the whole model's gradients, copied 4x
    model, ids = _tiny_gpt()
    kw = dict(roles={"dp": "dp"}, zero=0, pipeline="off")
    c1 = build_cluster((2,), {k: v for k, v in raw.items() if k.startswith("0/")}, SIZES, dev, 4 * 2**30, 2**29)
    slow = replace(c1, device=replace(c1.device, mem_bandwidth=2.5e9))
    fast, half = (autopart.plan(model, autopart.mesh((2,), ("dp",)), (ids,), {"labels": ids}, cluster=x, **kw)
                  for x in (c1, slow))
    grad_bytes = sum(model.get_parameter(fqn).numel() * 4 for fqn in fast.reduced)
    assert fast.reduced and grad_bytes > 0.9 * sum(p.numel() * 4 for p in model.parameters())
    # halving the bandwidth doubles the copies' time: the reduction grows by 4 x the reduced bytes / 5 GB/s
    assert half.predicted["grad_reduction_s"] - fast.predicted["grad_reduction_s"] == pytest.approx(
        4 * grad_bytes / 5e9, rel=1e-6)


def test_pipeline_units_pay_a_share_of_the_gradient_bucket():
    """A pipeline's stages reduce their gradients in the runtime's buckets: the units' reduction of a model whose
    gradients fill less than one bucket costs what one bucket's reduction does, not one collective's latency per
    parameter (which priced pp2xdp2's reduction at 6x its sharding plan's on the calibrated CPU)."""
    from autopart.pipelining import block_units
    from autopart.planner import grad_reduction_time
    from autopart.trace import trace

    dev = {"gemm": [{"flops": 40e9}], "gemm_alone_flops": 0.0, "attention": {"flops": 20e9},
           "elementwise": {"bandwidth": 5e9}, "host_bandwidth": 5e9, "device": "cpu"}
    raw = {f"0/{k}": [1e-3 + s / 1e9 for s in SIZES] for k in COLLECTIVES}  # 1 ms a call: latency-bound
    c = build_cluster((2,), raw, SIZES, dev, 4 * 2**30, 2**29)
    model, ids = _tiny_gpt()
    t = trace(model, (ids,), {"labels": ids})
    plan = autopart.plan(model, autopart.mesh((2,), ("dp",)), (ids,), {"labels": ids}, cluster=c, traced=t,
                         roles={"dp": "dp"}, zero=0, pipeline="off")
    units, _ = block_units(plan, t, (2,), c)
    grad_bytes = sum(model.get_parameter(fqn).numel() * 4 for fqn in plan.reduced)
    one_bucket = grad_reduction_time(grad_bytes, (0,), False, c)
    assert len(plan.reduced) > 20 and one_bucket > 1e-3
    assert grad_reduction_time(grad_bytes, (0,), False, c.__class__(
        c.name, c.device, c.mesh_shape, (Link(0.0, c.links[0].beta),), c.reserve_bytes)) < \
        sum(u.reduce_s + u.late_s for u in units) <= one_bucket * (1 + 1e-9)
    # the tied embedding/head, held by the first and the last stage, is reduced by each after the schedule, once
    # they summed it (``late_s``); every other parameter from the last micro-batch's backward
    from autopart.planner import grad_reduction_share

    tied = grad_reduction_share(model.wte.weight.numel() * 4, (0,), False, c)
    assert units[0].late_s == pytest.approx(tied) and units[-1].late_s == pytest.approx(tied)
    assert all(u.reduce_s > 0 for u in units)


def test_linear_rate_counts_the_flops_the_planner_prices():
    """The matmul rate is a linear layer's forward and backward (three GEMMs) over the FLOPs ``cost.compute``
    prices that node with, so that pricing the node at the measured rate gives back the measured seconds."""
    from autopart.calibrate import _linear_rate
    from autopart.cost.compute import backward_flops, node_flops

    t, i, o = 64, 32, 48
    r = _linear_rate(t, i, o, torch.float32, "cpu", 2, 0.01, lambda: None, alone=True)
    x, w = torch.empty(t, i), torch.empty(o, i)
    target = torch.ops.aten.linear.default
    fwd = node_flops(target, (x, w), {}, torch.empty(t, o))
    assert fwd + backward_flops(target, fwd) == 6 * t * i * o
    assert r["flops"] * r["seconds"] == pytest.approx(6 * t * i * o, rel=1e-9)
    assert (r["tokens"], r["in"], r["out"]) == (t, i, o) and r["seconds"] > 0


def test_gemm_form_fits_rate_and_latency_and_floors_small_gemms():
    """The calibrated GEMM form: rate and per-GEMM latency recovered from linear layers' timings, priced by
    ``roofline_time`` as measured from the smallest size up, and below it at that size's rate, not extrapolated
    (a tiny model's GEMMs would otherwise each cost the whole latency)."""
    from autopart.calibrate import gemm_form
    from autopart.cost.compute import roofline_time

    rate, lat = 120e9, 40e-6
    shapes = [(256, 256, 256), (256, 256, 1024), (1024, 1024, 1024), (2048, 256, 1024)]
    gemms = [{"tokens": t, "in": i, "out": o, "flops": 6 * t * i * o / (3 * (2 * t * i * o / rate + lat))}
             for t, i, o in shapes]
    r, a, fmin = gemm_form(gemms)
    assert r == pytest.approx(rate, rel=1e-6) and a == pytest.approx(lat, rel=1e-6)
    assert fmin == 2 * 256 ** 3
    assert gemm_form([{"flops": 40e9}, {"flops": 60e9}]) == (50e9, 0.0, 0.0)  # no shapes: the median rate
    dev = build_cluster((1,), {}, [], {"gemm": gemms, "attention": {"flops": 20e9}, "elementwise": {"bandwidth": 5e9},
                                       "host_bandwidth": 5e9}, 2**30, 0).device
    mm = torch.ops.aten.mm.default
    for t, i, o in shapes:  # each measured linear priced back at its measured seconds (forward and backward)
        f = 6 * t * i * o
        assert roofline_time(f, 0, dev, mm, with_backward=True) - dev.op_latency == pytest.approx(
            3 * (2 * t * i * o / rate + lat), rel=1e-6)
    tiny = 2 * 8 * 8 * 8
    per_flop_at_min = (fmin / rate + lat) / fmin
    assert roofline_time(tiny, 0, dev, mm) - dev.op_latency == pytest.approx(tiny * per_flop_at_min, rel=1e-9)
    assert roofline_time(tiny, 0, dev, mm) < lat / 100


def test_calibrate_cli_refuses_a_cache_it_cannot_write_before_measuring(tmp_path, capsys, monkeypatch):
    """``autopart calibrate --cache DIR`` where DIR cannot be made (under a file): exit 1 with the folder and the fix,
    before any rank is spawned; it ended in a rank's traceback after the measurements."""
    import importlib

    from autopart.cli import main

    cal = importlib.import_module("autopart.calibrate")  # (the package's ``calibrate`` is the function)
    spawned = []
    monkeypatch.setattr(cal, "calibrate_spawn", lambda *a, **k: spawned.append(a))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["calibrate", "--nproc", "2", "--cache", str(blocker / "cache")]) == 1
    err = capsys.readouterr().err
    assert "cannot cache a calibration in" in err and str(blocker / "cache") in err and "--cache DIR" in err
    assert not spawned
