"""Gradient accumulation without stages (``plan.accumulation``): how it is priced and when the planner takes it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopart
from autopart.models import GPT, GPTConfig
from autopart.plan import Plan
from tests.unit.gpu_rates import fp32_at_the_bf16_rate  # noqa: F401 - applies to this module


def _gpt(layers: int = 2, d: int = 64, batch: int = 16, seq: int = 64, meta: bool = False):
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = GPT(GPTConfig(vocab_size=128, max_seq_len=seq, n_layer=layers, n_head=4, d_model=d))
        ids = torch.randint(0, 128, (batch, seq))
    return model, ids


@pytest.fixture(scope="module")
def gpu_gpt():
    """A GPT whose backward on 8 H100s is long enough to hide part of its gradient reduction."""
    from autopart.trace import trace

    model, ids = _gpt(layers=4, d=1024, batch=32, seq=1024, meta=True)
    return model, ids, trace(model, (ids,), {"labels": ids})


@pytest.mark.parametrize("zero", [0, 1])
def test_accumulation_priced_on_a_gpu_preset(gpu_gpt, zero):
    """Same shardings, m = 4: compute unchanged (no per-op latency on the preset), activations a quarter, the
    reduction hidden only by the last micro-batch's backward (so more of it exposed), ZeRO-1's gather only by the
    first forward; the step grows by exactly the communication no longer hidden and the latency of the
    activations' collectives and of the loss's all-reduce, which every micro-batch pays."""
    model, ids, t = gpu_gpt
    kw = dict(cluster="h100-80gb", traced=t, zero=zero)
    one = autopart.evaluate(model, 8, (ids,), {"labels": ids}, **kw)
    acc = autopart.evaluate(model, 8, (ids,), {"labels": ids}, micro_batches=4, **kw)
    assert not one.accumulation and one.params == acc.params
    assert acc.accumulation == {"micro_batches": 4, "micro_batch_size": 8, "batch": 32}
    a, p1 = acc.predicted["accumulation"], one.predicted
    exposed_1 = p1["grad_reduction_s"] - p1["hidden_comm_s"]
    assert a["one_pass_grad_reduction_exposed_s"] == pytest.approx(exposed_1)
    assert exposed_1 < 0.5 * p1["grad_reduction_s"]  # one pass hides most of it ...
    assert a["grad_reduction_exposed_s"] > 1.5 * exposed_1  # ... the last of 4 micro-batches much less
    assert acc.predicted["compute_s"] == pytest.approx(p1["compute_s"])
    lat = sum(c["latency_s"] for c in acc.collectives if acc.nodes[c["value"]]["op"] != "param")
    inside = {n: r["comm_latency_s"] for n, r in acc.nodes.items() if "comm_latency_s" in r}
    assert set(inside) == {n for n, r in acc.nodes.items() if "cross_entropy" in r["op"]}  # the loss's all-reduce
    lat += sum(inside.values())
    assert 0 < lat < 1e-3  # a few collectives' latency on NVLink
    assert a["per_micro_batch_s"] == pytest.approx(lat)  # no per-op latency on the preset
    extra = 3 * lat + (a["grad_reduction_exposed_s"] - exposed_1) + (a["param_gather_exposed_s"] - p1["param_gather_s"])
    assert acc.predicted["step_time_s"] == pytest.approx(p1["step_time_s"] + extra, rel=1e-9)
    if zero:
        assert a["param_gather_exposed_s"] > p1["param_gather_s"]
    act1, act4 = p1["memory_bytes"]["activations"], acc.predicted["memory_bytes"]["activations"]
    assert act4 == pytest.approx(act1 / 4, rel=0.02)
    assert acc.predicted["memory_bytes"]["total"] < p1["memory_bytes"]["total"]
    back = Plan.from_json(acc.to_json())
    assert back.accumulation == acc.accumulation
    assert "gradient accumulation: 4 micro-batches of 8 (batch 32)" in str(back)


def test_zero2_holds_the_whole_gradient_through_accumulation(gpu_gpt):
    """ZeRO-2 keeps only its gradient slice in one pass; over several micro-batches the runtime accumulates the whole
    gradient and reduce-scatters it into the slice from the last backward only (runtime/grads.py), so until then
    it holds what ZeRO-1 holds (``accumulated_gradients``), and the slice after the reduction (``gradients``: the
    end of backward, the optimizer step). Once, it counted the slice throughout (8x too little on 8 ranks), then the
    whole gradient throughout (beside the reduction buckets that take its place)."""
    model, ids, t = gpu_gpt
    kw = dict(cluster="h100-80gb", traced=t)
    mem = {(z, m): autopart.evaluate(model, 8, (ids,), {"labels": ids}, zero=z, micro_batches=m, **kw)
           .predicted["memory_bytes"] for z in (1, 2) for m in (1, 4)}
    grads = {k: v["gradients"] for k, v in mem.items()}
    assert grads[(2, 1)] == pytest.approx(grads[(1, 1)] / 8, rel=0.01)  # after the reduction: the slice
    assert grads[(2, 4)] == pytest.approx(grads[(2, 1)]) and grads[(1, 4)] == pytest.approx(grads[(1, 1)])
    assert "accumulated_gradients" not in mem[(1, 1)] and "accumulated_gradients" not in mem[(2, 1)]
    # accumulating: both hold the whole gradient, at the end of every forward after the first
    assert mem[(2, 4)]["accumulated_gradients"] == pytest.approx(mem[(1, 4)]["accumulated_gradients"]) == \
        pytest.approx(grads[(1, 1)])
    for z in (1, 2):
        m = mem[(z, 4)]
        states = m["parameters"] + m["optimizer_states"] + m["buffers"]
        assert m["peak_forward"] >= states + m["accumulated_gradients"] + m["activations"]


def test_end_of_forward_holds_accumulated_gradients_at_every_zero_level(gpu_gpt):
    """Under accumulation the end-of-forward row holds the gradients accumulated so far, at every ZeRO level: the
    plan's ``peak_forward`` exceeds the one-pass row's states and activations by them, and a budget between the
    two rows is refused where it once passed (the ILP's row held no gradient)."""
    model, ids, t = gpu_gpt
    kw = dict(cluster="h100-80gb", traced=t, micro_batches=4)
    binding = 0
    for z in (0, 1, 2, 3):
        p = autopart.evaluate(model, 8, (ids,), {"labels": ids}, zero=z, **kw)
        m = p.predicted["memory_bytes"]
        assert m["accumulated_gradients"] == pytest.approx(m["gradients"] * (8 if z == 2 else 1), rel=0.01), z
        without = m["peak_forward"] - m["accumulated_gradients"]
        assert m["accumulated_gradients"] > 0.05 * without, z  # large enough to matter
        if m["peak_forward"] < max(m["peak_backward"], m["peak_optimizer"]):
            continue
        binding += 1
        budget = (without + m["peak_forward"]) / 2
        try:
            q = autopart.evaluate(model, 8, (ids,), {"labels": ids}, zero=z, checkpoint="none", offload="none",
                                  memory_budget=budget / (1 - autopart.api.MEMORY_MODEL_MARGIN), **kw)
        except ValueError:
            continue
        assert q.predicted["memory_bytes"]["total"] <= budget * (1 + 1e-9), z  # fits by another sharding
    assert binding >= 3  # the end of forward binds at ZeRO-0..3 here (all but ZeRO-0, whose optimizer step may)


def test_small_micro_batches_read_the_weights_again(gpu_gpt):
    """Each micro-batch reads every weight again (and, in backward, again with the gradient written): a micro-batch
    of one 64-token sequence a GPU on an H100 is bound by that, not by its FLOPs, so 8 of them cost more than the
    whole batch in one pass, as a pipeline's micro-batches are priced (``pipelining.Unit.cost``). Large
    micro-batches are compute-bound and pay nothing for it."""
    from autopart.planner import weight_reread_s

    model, ids = _gpt(layers=2, d=1024, batch=16, seq=64, meta=True)
    kw = dict(cluster="h100-80gb", zero=0)
    one = autopart.evaluate(model, 2, (ids,), {"labels": ids}, **kw)
    acc = autopart.evaluate(model, 2, (ids,), {"labels": ids}, micro_batches=8, **kw)
    reread = acc.predicted["accumulation"]["weight_reread_s"]
    reads = sum(r.get("param_read_s", 0.0) for r in acc.nodes.values())
    assert reads > 0 and 0 < reread <= 8 * reads
    assert reread == pytest.approx(weight_reread_s(acc.nodes, 8, autopart.preset("h100-80gb", (2,)).device))
    assert acc.predicted["compute_s"] == pytest.approx(one.predicted["compute_s"] + reread)  # no per-op latency
    assert acc.predicted["step_time_s"] > one.predicted["step_time_s"] + 0.5 * reread
    big_model, big_ids, t = gpu_gpt  # micro-batches of 8 x 1024 tokens
    big = autopart.evaluate(big_model, 8, (big_ids,), {"labels": big_ids}, cluster="h100-80gb", traced=t,
                            micro_batches=4)
    assert big.predicted["accumulation"]["weight_reread_s"] == 0


def test_per_op_latency_paid_by_every_micro_batch():
    """On a device with a framework time per op (a calibrated CPU), every micro-batch pays it."""
    model, ids = _gpt(batch=4, seq=16)
    c = autopart.preset("cpu", (2,))
    c = dataclasses.replace(c, device=dataclasses.replace(c.device, op_latency=1e-4))
    one = autopart.evaluate(model, 2, (ids,), {"labels": ids}, cluster=c)
    acc = autopart.evaluate(model, 2, (ids,), {"labels": ids}, cluster=c, micro_batches=2)
    ops = sum(1 for r in one.nodes.values() if r["op"] not in ("param", "buffer", "constant", "input"))
    per = acc.predicted["accumulation"]["per_micro_batch_s"]
    assert per >= ops * 1e-4
    assert acc.predicted["compute_s"] >= one.predicted["compute_s"] + ops * 1e-4


def test_micro_batches_must_split_the_batch():
    model, ids = _gpt(batch=4, seq=16)
    with pytest.raises(ValueError, match="does not divide the traced batch of 4"):
        autopart.evaluate(model, 2, (ids,), {"labels": ids}, micro_batches=3)
    with pytest.raises(ValueError, match="do not split over the 2 ranks"):
        autopart.evaluate(model, 2, (ids,), {"labels": ids}, micro_batches=4)
    with pytest.raises(ValueError, match="whole number >= 1"):
        autopart.plan(model, (2,), (ids,), {"labels": ids}, pipeline={"stages": 1, "micro_batches": 0})


@pytest.mark.parametrize("pinned", [True, False], ids=["dp-role", "unpinned"])
def test_planner_accumulates_where_activations_do_not_fit(pinned):
    """A budget the one-pass plan fits only with recompute (or offload): the planner takes micro-batches instead,
    which fit, and is faster there (on a GPU preset accumulation costs only the less-hidden reduction). Unpinned,
    the plan without stages that the pipeline search compares against is the one that accumulates."""
    model, ids = _gpt()
    mesh = autopart.mesh((2,), ("dp",))
    kw = dict(roles={"dp": "dp"}, zero=0, cluster="h100-80gb") if pinned else dict(cluster="h100-80gb")
    free = autopart.plan(model, mesh, (ids,), {"labels": ids}, **kw)
    assert not free.accumulation and not free.checkpoint and not free.offload
    total = free.predicted["memory_bytes"]["total"]
    budget = 0.5 * total
    p = autopart.plan(model, mesh, (ids,), {"labels": ids},
                      memory_budget=budget / (1 - autopart.api.MEMORY_MODEL_MARGIN), **kw)
    tried = p.solver["accumulation_tried"]
    assert tried["one_pass_checkpoint"] or tried["one_pass_offload"]  # one pass needed recompute or offload
    assert p.accumulation["micro_batches"] >= 2 and not p.checkpoint and not p.offload and not p.pipeline
    assert p.predicted["memory_bytes"]["total"] <= budget * (1 + 1e-9)
    assert p.predicted["step_time_s"] < tried["one_pass_step_time_s"]
    # nothing said and it fits in one pass: no accumulation
    assert "accumulation_tried" not in free.solver


def test_plan_without_stages_timing_out_keeps_the_pipeline(monkeypatch):
    """Where the plan without stages fits only with recompute or offload, the pipeline search solves it once more
    (with accumulation); when that solve times out (``SolverTimeout``) and a pipeline plan is in hand, the answer
    is the pipeline plan, noting what was not solved (it had failed the whole plan: Llama-405B on (512, 8) H100s)."""
    import autopart.planner as planner
    from autopart.solver.ilp import SolverTimeout

    model, ids = _gpt()
    mesh = autopart.mesh((2,), ("dp",))
    # the H100 preset without NCCL's low-latency protocol: with it this tiny GPT's small collectives make ZeRO-1
    # with selective recompute (48.1 us) beat the 2-stage pipeline (49.9 us) this test needs to win
    h100 = autopart.preset("h100-80gb", (2,))
    cluster = dataclasses.replace(h100, links=tuple(link.default_protocol() for link in h100.links))
    free = autopart.plan(model, mesh, (ids,), {"labels": ids}, cluster=cluster)
    budget = 0.5 * free.predicted["memory_bytes"]["total"] / (1 - autopart.api.MEMORY_MODEL_MARGIN)
    calls = []
    original = planner._accumulated_plan

    def timeout(*args, **kw):
        if "search" not in kw:  # the recipes' and pipeline-off plans: solved as usual
            return original(*args, **kw)
        calls.append(1)  # the pipeline search's plan without stages (it passes search= by name)
        raise SolverTimeout("highs found no solution within 0 s (test)")

    monkeypatch.setattr(planner, "_accumulated_plan", timeout)
    p = autopart.plan(model, mesh, (ids,), {"labels": ids}, cluster=cluster, memory_budget=budget)
    assert calls and p.pipeline["degree"] == 2, p.pipeline
    assert "not solved in time" in p.solver["unsolved"]


@pytest.fixture(scope="module")
def tp_gpt():
    """A GPT on the meta device whose tensor-parallel collectives are latency-bound on the cpu preset's links at
    small micro-batches (32 sequences of 128 tokens, d_model 256)."""
    from autopart.trace import trace

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=512, max_seq_len=128, n_layer=4, n_head=4, d_model=256))
        ids = torch.randint(0, 512, (32, 128))
    return model, ids, trace(model, (ids,), {"labels": ids})


def test_ilp_prices_what_every_micro_batch_pays(tp_gpt):
    """With m accumulation micro-batches the ILP prices each activation collective's latency m times (and a
    parameter's per-pass conversions m times), as the plan's record does (``planner.accumulated``): its objective
    is the predicted step, where pricing them once had it chose a tensor-parallel plan 1.3x slower at m = 16."""
    from autopart.planner import PlanOptions, make_plan

    model, ids, t = tp_gpt
    cluster = autopart.preset("cpu", (2, 2))
    names = ("axis0", "axis1")
    steps = {}
    for passes in (0, 1):  # 0: the micro-batch count (the default); 1: each latency once, as before
        o = PlanOptions(pipeline={"stages": 1, "micro_batches": 16}, latency_passes=passes)
        p = make_plan(t, cluster, names, o)
        assert p.accumulation["micro_batches"] == 16
        steps[passes] = p.predicted["step_time_s"]
        if passes == 0:
            assert p.solver["objective"] == pytest.approx(p.predicted["step_time_s"], rel=0.01)
        else:  # the latency-blind objective misses what 15 more micro-batches pay
            assert p.solver["objective"] < 0.8 * p.predicted["step_time_s"]
    assert steps[0] < 0.85 * steps[1]
    with pytest.raises(ValueError, match="latency_passes"):
        PlanOptions(latency_passes=-1)
