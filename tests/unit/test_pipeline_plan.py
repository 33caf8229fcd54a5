"""Pipeline planning and splitting without processes: per-block costs, the plan's pipeline section, and stage graphs
that, run one after another in one process, compute what the whole program computes."""

from __future__ import annotations

import re

import pytest
import torch

import autopart
from autopart.models.gpt import GPT, GPTConfig
from autopart.passes import run_passes
from autopart.pipelining import assign_stages, block_units
from autopart.planner import needs_grad_map
from autopart.runtime.module import Program
from autopart.runtime.pipeline import split_stages
from autopart.solver.pipeline import bubble_fraction
from autopart.trace import trace

LAYERS = 4


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, max_seq_len=32, n_layer=LAYERS, n_head=4, d_model=32))


IDS = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_forced_pipeline_section(schedule, virtual):
    model = _model()
    p = autopart.plan(model, autopart.mesh((2, 2), ("pp", "tp")), (IDS,), {"labels": IDS},
                      roles={"pp": "pp", "tp": "tp"},
                      pipeline={"schedule": schedule, "micro_batches": 4, "virtual": virtual})
    pp = p.pipeline
    assert pp["degree"] == 2 and pp["schedule"] == schedule and pp["micro_batches"] == 4
    assert pp["micro_batch_size"] * pp["micro_batches"] == IDS.shape[0]
    assert tuple(p.mesh_shape) == (1, 2) and pp["world_mesh_shape"] == [2, 2]
    chunks = 2 * virtual
    assert [lay for st in pp["stages"] for lay in st["layers"]] == [f"blocks.{i}" for i in range(LAYERS)]
    assert [st["rank"] for st in pp["stages"]] == [c % 2 for c in range(chunks)]
    from autopart.solver.pipeline import PipelineOptions

    assert pp["bubble_fraction"] == pytest.approx(bubble_fraction(PipelineOptions(2, 4, schedule, virtual)))
    # step = (m v + p - 1) x the slowest chunk + the slowest rank's gradient reduction and optimizer step
    slowest = max(st["time_s"] for st in pp["stages"])
    assert pp["pipeline_s"] == pytest.approx((4 * virtual + 1) * slowest)
    assert pp["optimizer_step_s"] > 0
    assert pp["step_time_s"] == pytest.approx(pp["pipeline_s"] + pp["gradient_reduction_s"] + pp["optimizer_step_s"]
                                              + pp["param_gather_s"])
    assert pp["grid"].count("rank ") == 2 and "F3" in pp["grid"] and "B3" in pp["grid"]
    # 1F1B holds p - k micro-batches in flight on stage k, GPipe all m
    if schedule == "1f1b":
        assert [st["in_flight"] for st in pp["stages"]] == [2, 1]
    if schedule == "gpipe":
        assert all(st["in_flight"] == 4 for st in pp["stages"])
    # the plan's memory is its largest rank's, which holds all of its chunks (interleaved: 2 of them)
    rank_total = max(sum(st["memory_bytes"]["total"] for st in pp["stages"] if st["rank"] == r) for r in (0, 1))
    assert p.predicted["memory_bytes"]["total"] == pytest.approx(rank_total, rel=1e-12)
    if virtual > 1:
        assert rank_total > max(st["memory_bytes"]["total"] for st in pp["stages"])
    text = str(p)
    assert "pipeline: 2 stages" in text and "schedule" in text


def test_zero2_in_a_pipeline_reduces_and_holds_the_whole_gradient():
    """A pipeline's ZeRO-2 parameter reduce-scatters its whole gradient, as ZeRO-1's does, and holds it whole until
    its last accumulation (runtime/grads.py). The pipeline model read both off the slice ZeRO-2 keeps after the
    step: its reduction priced 1/dp of the bytes (2 of 4 ranks here: half), its stages' gradients a slice."""
    model = _model()
    mesh = autopart.mesh((2, 2), ("pp", "dp"))
    plans = {z: autopart.plan(model, mesh, (IDS,), {"labels": IDS}, roles={"pp": "pp", "dp": "dp"}, zero=z,
                              cluster="h100-80gb", pipeline={"schedule": "1f1b", "micro_batches": 4})
             for z in (1, 2)}
    one, two = plans[1].pipeline, plans[2].pipeline
    assert set(plans[2].zero.values()) == {2}
    assert two["gradient_reduction_s"] == pytest.approx(one["gradient_reduction_s"], rel=1e-9)
    for a, b in zip(one["stages"], two["stages"]):
        assert b["memory_bytes"]["gradients"] == pytest.approx(a["memory_bytes"]["gradients"], rel=1e-9)
        assert b["memory_bytes"]["gradients"] > 0
    # the node records: ZeRO-2's whole gradient is ZeRO-1's
    whole = {n: r["grad_whole_bytes"] for n, r in plans[2].nodes.items() if "grad_whole_bytes" in r}
    assert whole and all(w == pytest.approx(plans[1].nodes[n]["grad_bytes"]) for n, w in whole.items())


def test_block_units_fold_embedding_and_head():
    model = _model()
    t = trace(model, (IDS,), {"labels": IDS})
    p = autopart.plan(model, (2,), (IDS,), {"labels": IDS}, roles={"axis0": "dp"}, traced=t, pipeline="off")
    units, unit_of = block_units(p, t, (2,), autopart.preset("cpu", (2,)))
    assert [u.name for u in units] == [f"blocks.{i}" for i in range(LAYERS)]
    # the embedding lookup sits in the first block's unit, the loss in the last
    ops = {n: p.nodes[n]["op"] for n in unit_of}
    emb = [n for n, op in ops.items() if "embedding" in op]
    ce = [n for n, op in ops.items() if "cross_entropy" in op]
    assert emb and all(unit_of[n] == 0 for n in emb) and ce and all(unit_of[n] == LAYERS - 1 for n in ce)
    # the tied embedding/head weight is held by both end units: states sum to the plan's plus one more copy
    plan_states = sum(r["memory_bytes"] for r in p.nodes.values() if r["op"] == "param")
    wte = next(r["memory_bytes"] for n, r in p.nodes.items() if r["op"] == "param" and "lm_head" in n)
    assert sum(u.state_bytes for u in units) == pytest.approx(plan_states + wte)
    # the interior boundaries carry the hidden state (and the labels, used by the loss in the last block)
    hidden = IDS.shape[0] // 2 * IDS.shape[1] * 32 * 4
    assert all(u.out_bytes >= hidden for u in units[:-1]) and units[-1].out_bytes == 0
    assert all(u.checkpointable and u.ckpt_act_bytes < u.act_bytes for u in units)


def test_stage_graphs_compose_to_the_program():
    """Split the rank program of a pp=2 (interleaved: 4 chunks) plan and run the chunks in order in one process:
    the loss equals the unsplit program's, and every value crossing a boundary is passed exactly once per chunk."""
    model = _model()
    p = autopart.plan(model, autopart.mesh((2,), ("pp",)), (IDS,), {"labels": IDS}, roles={"pp": "pp"},
                      pipeline={"schedule": "interleaved", "virtual": 2, "micro_batches": 2})
    b = p.pipeline["micro_batch_size"]
    ids = IDS[:b]
    t = trace(model, (ids,), {"labels": ids})
    micro = autopart.plan(model, autopart.mesh((1,), ("pp",)), (ids,), {"labels": ids}, traced=t, pipeline="off",
                          pins=dict(p.params))
    gm = run_passes(t, micro, needs_grad_map(t))
    prog = Program(gm, micro, t.params, t.buffers, t.constant_values, t.tied, t.user_inputs, t.input_paths)
    stage_of = assign_stages(gm, micro, p.pipeline["stage_of_layer"])
    graphs = split_stages(prog, stage_of, 4)
    named = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())

    def feed_of(kind, name):
        return {"param": lambda: named[prog.params[name]].detach(), "buffer": lambda: buffers[prog.buffers[name]],
                "constant": lambda: prog.constants[name]}[kind]()

    full_feed = []
    user = iter([ids, ids])
    for n in gm.graph.find_nodes(op="placeholder"):
        name = prog.tied.get(n.name, n.name)
        full_feed.append(named[prog.params[name]].detach() if name in prog.params else next(user))
    want = gm(*full_feed)[0]
    live = [ids, ids]
    for g in graphs:
        it = iter(live)
        feed = [next(it) if kind == "live" else feed_of(kind, name) for kind, name in g.feeds]
        assert len(g.live_in) == len(live)
        live = list(g.gm(*feed))
    torch.testing.assert_close(live[0], want, rtol=0, atol=0)
    assert graphs[0].live_out == graphs[1].live_in and "labels" in graphs[2].live_in


def test_two_block_reduction_prices_the_whole_model():
    """The pipeline search ranks candidates on the graph cut to 2 of its L identical blocks, tied groups priced L
    times: same ILP optimum and the same per-block costs as the whole graph."""
    import dataclasses

    from autopart.pipelining import expand_units, reduce_blocks
    from autopart.planner import PlanOptions, _sharding_plan

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, max_seq_len=32, n_layer=6, n_head=4, d_model=64))
    ids = torch.randint(0, 128, (8, 32))
    t = trace(model, (ids,), {"labels": ids})
    red, n = reduce_blocks(t)
    assert n == 6 and len(list(red.graph.nodes)) < len(list(t.graph.nodes)) / 2
    cluster = autopart.preset("cpu", (2, 2))
    o = PlanOptions(pipeline="off", checkpoint="none", memory_limit=float("inf"))
    full = _sharding_plan(t, cluster, ("a", "b"), o)
    small = _sharding_plan(red, cluster, ("a", "b"), dataclasses.replace(o, virtual_layers=n))
    assert small.solver["objective"] == pytest.approx(full.solver["objective"], rel=1e-9)
    assert small.solver["free_memory_row_bytes"] == pytest.approx(full.solver["free_memory_row_bytes"], rel=1e-9)
    want, _ = block_units(full, t, (2, 2), cluster)
    got = expand_units(block_units(small, red, (2, 2), cluster)[0], n)
    assert [u.name for u in got] == [u.name for u in want]
    for a, b in zip(want, got):
        for f in ("time_s", "fixed_s", "fwd_s", "act_bytes", "ckpt_act_bytes", "state_bytes", "grad_bytes",
                  "reduce_s", "late_s", "out_bytes"):
            assert getattr(b, f) == pytest.approx(getattr(a, f), rel=1e-9, abs=1e-15), (a.name, f)


def _llama70b_tp8_pp2_on_64(batch: int, seq: int, micro_batches: int):
    """A 4-layer Llama-70B scored in Megatron's layout (tp 8, pp 2, dp 4 on 64 H100s): the trace and the plan,
    checked to pipeline with the micro-batches asked."""
    import importlib

    _, model, inputs, kwargs, _ = importlib.import_module("autopart.advise").build(
        model="llama:70b", layers=4, batch=batch, seq=seq)
    t = trace(model, inputs, kwargs)
    p = autopart.evaluate(model, 64, inputs, kwargs, cluster="h100-80gb", tp=8, pp=2, micro_batches=micro_batches,
                          traced=t, zero=None, offload=None, optimizer_bytes_per_param=12.0)
    assert p.pipeline["degree"] == 2 and p.pipeline["micro_batches"] == micro_batches
    return t, p


def test_sequence_split_tables_do_not_bind_micro_batches(monkeypatch):
    """Under tensor-parallel overlap (GPU presets) a stage may split a tensor whose dim 0 is not the batch on the tp
    axis (the RoPE tables by sequence, [seq, head_dim]): that is no batch split, so Megatron's 70B layout (tp 8,
    pp 2, dp 4 on 64 H100s, 8 micro-batches of 8 sequences) still pipelines; counting it asked micro-batches whose
    size divides over 32 ranks, and no pipeline fitted."""
    from autopart import pipelining
    from autopart.placement import Shard, parse_spec

    # the stage sharding solved at the traced batch, which splits the tables (solved again for 8 micro-batches,
    # each paying every collective's latency, the plan runs 34 collectives instead of 47 and keeps the tables whole)
    monkeypatch.setattr(pipelining, "REFINE_PASSES", False)
    t, p = _llama70b_tp8_pp2_on_64(batch=64, seq=4096, micro_batches=8)
    vals = {n.name: n.meta.get("val") for n in t.graph.nodes}
    tp = p.axis_names.index("tp")
    other = [name for name, rec in p.nodes.items() if rec["op"] not in ("param", "buffer", "constant")
             and not isinstance(rec["output"], list) and isinstance(vals.get(name), torch.Tensor)
             and vals[name].dim() > 0 and vals[name].shape[0] != 64
             and isinstance(parse_spec(rec["output"])[tp], Shard) and parse_spec(rec["output"])[tp].dim == 0]
    assert other  # a non-batch dim 0 split on tp: the case the micro-batch check must not count


def test_tables_as_long_as_the_batch_do_not_bind_micro_batches():
    """The same tables when the sequence is as long as the batch (256 sequences of 256 tokens; the design guide's
    4096 GPUs x 4096 tokens): their dim 0 is the batch's size, but no input flows into them, so they are no batch
    split either. Counting them capped Llama-70B on 4096 H100s at as many micro-batches as stages."""
    from autopart.pipelining import _batch_shards

    t, p = _llama70b_tp8_pp2_on_64(batch=256, seq=256, micro_batches=64)
    dp = p.axis_names.index("dp")
    assert _batch_shards(p, t, p.mesh_shape) == p.mesh_shape[dp]


def test_per_layer_checkpoint_dict_with_stages():
    """checkpoint={layer: "full" | "none"} with pipeline stages: exactly the named blocks are recomputed, in
    whichever stage holds them. Their stage keeps less activation memory and takes longer (their forward again);
    "selective" per layer applies in its stage the same way; an unknown layer is refused by name."""
    kw = dict(roles={"pp": "pp", "tp": "tp"}, pipeline={"schedule": "1f1b", "micro_batches": 4})
    mesh = autopart.mesh((2, 2), ("pp", "tp"))
    plain = autopart.plan(_model(), mesh, (IDS,), {"labels": IDS}, checkpoint="none", **kw)
    named = {"blocks.0": "full", "blocks.3": "full", "blocks.1": "none"}
    p = autopart.plan(_model(), mesh, (IDS,), {"labels": IDS}, checkpoint=named, **kw)
    assert p.checkpoint == {"blocks.0": "full", "blocks.3": "full"}
    by_stage = [(st["checkpointed"], st) for st in p.pipeline["stages"]]
    assert sorted(lay for ck, _ in by_stage for lay in ck) == ["blocks.0", "blocks.3"]
    for (ck, st), ref in zip(by_stage, plain.pipeline["stages"]):
        assert st["layers"] == ref["layers"]  # the same partition (the model's blocks are alike)
        if ck:  # recompute keeps each block's input instead of its activations, and costs its forward again
            assert st["memory_bytes"]["activations"] < ref["memory_bytes"]["activations"]
            assert st["time_s"] > ref["time_s"]
    assert p.pipeline["step_time_s"] > plain.pipeline["step_time_s"]
    # per-layer "selective" too: in the stage plan (solved on the whole graph), beside the "full" blocks
    mixed = autopart.plan(_model(), mesh, (IDS,), {"labels": IDS}, checkpoint={"blocks.1": "selective",
                                                                              "blocks.3": "full"}, **kw)
    assert mixed.checkpoint == {"blocks.1": "selective", "blocks.3": "full"}
    assert [st["checkpointed"] for st in mixed.pipeline["stages"]] == [[], ["blocks.3"]]
    assert mixed.pipeline["stages"][0]["time_s"] > plain.pipeline["stages"][0]["time_s"]  # blocks.1's attention
    assert mixed.pipeline["stages"][0]["memory_bytes"]["activations"] < \
        plain.pipeline["stages"][0]["memory_bytes"]["activations"]
    with pytest.raises(ValueError, match="blocks.9"):
        autopart.plan(_model(), mesh, (IDS,), {"labels": IDS}, checkpoint={"blocks.9": "full"}, **kw)


def test_activation_collectives_pay_their_latency_per_micro_batch():
    """Tensor parallelism's collectives run once per micro-batch, each paying its links' latency whatever the
    micro-batch's bytes: a record's ``latency_s`` is its collectives' alpha terms, and a pipeline unit pays it
    once per micro-batch (``fixed_s``), its bytes split between them (``time_s``)."""
    import dataclasses

    from autopart.cost.comm import COLLECTIVES, collective_time

    model = _model()
    t = trace(model, (IDS,), {"labels": IDS})
    cluster = autopart.preset("cpu", (2,))
    p = autopart.plan(model, (2,), (IDS,), {"labels": IDS}, roles={"axis0": "tp"}, traced=t, pipeline="off",
                      cluster=cluster)
    acts = [c for c in p.collectives if p.nodes[c["value"]]["op"] != "param"]
    assert len(acts) >= LAYERS
    link = cluster.link(0)
    for c in acts:
        alphas = sum(collective_time(k, 0.0, 2, link) for _, fwd, bwd in c["steps"] for k in (fwd, bwd)
                     if k in COLLECTIVES)  # "shard": a local slice
        assert 0 < c["latency_s"] == pytest.approx(min(alphas, c["time_s"]))
    units, unit_of = block_units(p, t, (2,), cluster)
    plain = dataclasses.replace(p, collectives=[{**c, "latency_s": 0.0} for c in p.collectives])
    before, _ = block_units(plain, t, (2,), cluster)
    for k, (u, v) in enumerate(zip(units, before)):
        lat = sum(c["latency_s"] for c in acts if unit_of[c["user"]] == k)
        assert lat > 0
        assert u.fixed_s - v.fixed_s == pytest.approx(lat) and v.time_s - u.time_s == pytest.approx(lat)
        # m micro-batches pay it m times: one micro-batch's forward and backward at m = 4
        assert u.cost(4).fwd_s + u.cost(4).bwd_s == pytest.approx(v.time_s / 4 + v.fixed_s + 3 / 4 * lat)


def test_stage_shardings_priced_for_the_micro_batch_count(monkeypatch):
    """The search solves each stage mesh at the traced batch; its winner, run in m micro-batches, is solved again
    with what every micro-batch pays priced m times (``PlanOptions.latency_passes``: an activation collective's
    latency, a ZeRO-3 parameter's gathers) and kept when the pipeline model prices it faster. Here the stage plan
    priced once per step stores the MLP weights sharded and gathers them in each of 8 micro-batches; priced for
    8, it keeps them whole (ZeRO-1: states sharded, gathered once after the step)."""
    from autopart import pipelining

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=512, max_seq_len=128, n_layer=4, n_head=4, d_model=256))
        ids = torch.randint(0, 512, (32, 128))
    t = trace(model, (ids,), {"labels": ids})
    kw = dict(cluster=autopart.preset("cpu", (2, 4)), traced=t,
              pipeline={"stages": 2, "micro_batches": 8, "axis": "axis0"})
    refined = autopart.plan(model, (2, 4), (ids,), {"labels": ids}, **kw)
    monkeypatch.setattr(pipelining, "REFINE_PASSES", False)
    blind = autopart.plan(model, (2, 4), (ids,), {"labels": ids}, **kw)
    assert refined.pipeline["micro_batches"] == blind.pipeline["micro_batches"] == 8
    assert refined.predicted["step_time_s"] < 0.95 * blind.predicted["step_time_s"]
    gathers = {name: sum(c["time_s"] for c in p.collectives if p.nodes[c["value"]]["op"] == "param")
               for name, p in (("refined", refined), ("blind", blind))}
    assert gathers["blind"] > 0 == gathers["refined"]  # per micro-batch: 8 x in the step
    assert refined.pipeline["step_time_s"] == pytest.approx(refined.predicted["step_time_s"])


def test_collectives_inside_a_lowering_pay_their_latency_per_micro_batch():
    """A batch-sharded mean cross-entropy sums its count over the data-parallel ranks inside its lowering, and its
    partial loss is all-reduced as the graph's output: two all-reduces each micro-batch runs whatever its size.
    The node records their latency (``comm_latency_s``), the pipeline unit holding it pays that per micro-batch,
    and gradient accumulation does too (``planner.per_micro_batch_s``)."""
    import dataclasses

    from autopart.cost.comm import collective_time
    from autopart.planner import per_micro_batch_s

    model = _model()
    t = trace(model, (IDS,), {"labels": IDS})
    cluster = autopart.preset("cpu", (2,))
    p = autopart.plan(model, (2,), (IDS,), {"labels": IDS}, roles={"axis0": "dp"}, traced=t, pipeline="off",
                      cluster=cluster)
    inside = {n: r["comm_latency_s"] for n, r in p.nodes.items() if "comm_latency_s" in r}
    assert list(inside) == ["cross_entropy_loss"] and p.nodes["cross_entropy_loss"]["output"] == "P"
    # (the loss is a scalar: its conversion of "no bytes" still moves its 4)
    assert inside["cross_entropy_loss"] == pytest.approx(2 * collective_time("all_reduce", 0.0, 2, cluster.link(0)),
                                                         rel=1e-4)
    units, unit_of = block_units(p, t, (2,), cluster)
    plain_nodes = {n: {k: v for k, v in r.items() if k != "comm_latency_s"} for n, r in p.nodes.items()}
    before, _ = block_units(dataclasses.replace(p, nodes=plain_nodes), t, (2,), cluster)
    k = unit_of["cross_entropy_loss"]
    assert units[k].fixed_s - before[k].fixed_s == pytest.approx(inside["cross_entropy_loss"])
    assert before[k].time_s - units[k].time_s == pytest.approx(inside["cross_entropy_loss"])
    comm = per_micro_batch_s(p.nodes, p.collectives, cluster.device)[1]
    assert comm - per_micro_batch_s(plain_nodes, p.collectives, cluster.device)[1] == \
        pytest.approx(inside["cross_entropy_loss"])


def _frozen_llama(batch: int = 16):
    from autopart.models import Llama, LlamaConfig

    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab_size=256, max_seq_len=64, n_layer=4, n_head=8, n_kv_head=2, d_model=256,
                                  d_ff=512)).to(torch.bfloat16)
    model.requires_grad_(False)
    return model, torch.randint(0, 256, (batch, 1), device="meta")


def test_pipelined_serving_holds_every_sequences_kv_cache():
    """Decoding in a pipeline of 8 micro-batches: each stage holds the K/V cache of every sequence of the batch
    for its layers, however few micro-batches are in flight (a sequence's cache stays on the stage between steps).
    It was counted with the activations of the micro-batches in flight: an 8th and a 4th of it here."""
    model, ids = _frozen_llama()
    tokens = 4096
    p = autopart.plan(model, autopart.mesh((2,), ("pp",)), (ids,), {}, cluster="h100-80gb", roles={"pp": "pp"},
                      pipeline={"stages": 2, "micro_batches": 8, "schedule": "1f1b"}, kv_cache_tokens=tokens)
    per_layer = 2 * 16 * 2 * tokens * (256 // 8) * 2  # K and V: batch 16, 2 K/V heads of 32, bf16
    stages = p.pipeline["stages"]
    assert [s["in_flight"] for s in stages] == [2, 1]
    for s in stages:
        mem = s["memory_bytes"]
        assert mem["kv_cache"] == pytest.approx(per_layer * len(s["layers"]))
        assert mem["total"] >= mem["states"] + mem["kv_cache"] + mem["activations"] - 1
    assert p.predicted["memory_bytes"]["kv_cache"] == pytest.approx(2 * per_layer)  # the rank's chunk: its 2 layers


def test_forward_only_refuses_recompute_and_activation_offload():
    """Serving saves nothing for backward: recompute and activation offload would only have dropped the K/V cache
    from the memory rows (a plan that does not fit, said to fit). Forced, a clear error; unforced, never tried."""
    model, ids = _frozen_llama()
    mesh = autopart.mesh((2,), ("tp",))
    with pytest.raises(ValueError, match="checkpoint='full' on a forward-only graph"):
        autopart.plan(model, mesh, (ids,), {}, cluster="h100-80gb", checkpoint="full", kv_cache_tokens=64)
    with pytest.raises(ValueError, match="offload='activations' on a forward-only graph"):
        autopart.plan(model, mesh, (ids,), {}, cluster="h100-80gb", offload="activations", kv_cache_tokens=64)


def test_forced_stages_that_do_not_fit_carry_the_closest_pipelines_figures():
    """With the stages forced there is no plan without stages to describe; the error carries the figures of the
    pipeline closest to fitting (its least per-device peak, the limit, the binding stage and its terms), which
    ``advise`` reads as it reads a plan without stages' (``Advice.no_fit``)."""
    from autopart.advise import no_fit_record

    model = _model()
    with pytest.raises(autopart.NoPlanFits) as err:
        autopart.plan(model, autopart.mesh((4,), ("x",)), (IDS,), {"labels": IDS}, memory_budget=100_000,
                      pipeline={"stages": 2})
    e = err.value.figures
    assert e is err.value and "not planned (pipeline stages=2 forced)" in str(e)
    assert e.limit == pytest.approx(100_000 * 0.9) and e.min_memory > e.limit
    assert e.binding.startswith("pipeline stage ") and "checkpointed" in e.binding
    kinds = [k for k, _, _ in e.terms]
    assert kinds == ["model states (parameter, gradient, optimizer)", "activations"]
    assert sum(b for _, _, b in e.terms) == pytest.approx(e.min_memory)
    # the least of the peaks the message lists for each configuration tried
    needs = [float(m) for m in re.findall(r"needs ([0-9.e+]+) bytes", str(e))]
    assert needs and e.min_memory == pytest.approx(min(needs), rel=1e-3)
    assert no_fit_record(err.value)["smallest_peak_bytes"] == e.min_memory


def test_1f1b_needs_as_many_micro_batches_as_stages():
    """torch's Schedule1F1B refuses fewer micro-batches than stages (its runtime error came only at the first step):
    forced, the plan says so and names GPipe; searched, such a pipeline runs GPipe (the same order there), and
    1F1B only where m >= p."""
    model = _model()
    mesh = autopart.mesh((2, 2), ("pp", "tp"))
    with pytest.raises(autopart.NoPlanFits, match=r"p=2 m=1: 1F1B needs m >= p micro-batches.*'gpipe'"):
        autopart.plan(model, mesh, (IDS,), {"labels": IDS}, roles={"pp": "pp", "tp": "tp"},
                      pipeline={"schedule": "1f1b", "micro_batches": 1})
    p = autopart.plan(model, mesh, (IDS,), {"labels": IDS}, roles={"pp": "pp", "tp": "tp"},
                      pipeline={"micro_batches": 1})
    assert p.pipeline["micro_batches"] == 1 and p.pipeline["schedule"] == "gpipe", p.pipeline
    searched = autopart.plan(model, mesh, (IDS,), {"labels": IDS}, roles={"pp": "pp", "tp": "tp"})
    tried = searched.pipeline["candidates"]  # e.g. {"schedule": "1f1b(p=2, m=2)", "degree": 2, ...}
    assert any(c["schedule"].startswith("1f1b") for c in tried), tried
    assert all(c["micro_batches"] >= c["degree"] for c in tried if c["schedule"].startswith("1f1b")), tried
    assert searched.pipeline["schedule"] != "1f1b" or searched.pipeline["micro_batches"] >= 2


class _SharedBuffer(torch.nn.Module):
    """Four blocks; ``seen`` (a running mean of the last block's output) is read before the first block and updated
    after the last; ``norms`` are each block's own batch norms (their statistics updated and read by one block)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(4)])
        self.norms = torch.nn.ModuleList([torch.nn.BatchNorm1d(8) for _ in range(4)])
        self.register_buffer("seen", torch.zeros(8))

    def forward(self, x, labels):
        x = x + self.seen
        for block, norm in zip(self.blocks, self.norms):
            x = norm(torch.relu(block(x)))
        self.seen.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return torch.nn.functional.mse_loss(x, labels)


@pytest.mark.parametrize("chunks,ranks,fails", [(2, 2, True), (4, 2, True), (2, 1, False), (1, 1, False)])
def test_a_buffer_updated_in_one_stage_and_used_on_another_rank_is_refused(chunks, ranks, fails):
    """A buffer the graph updates in place, used by chunks on two pipeline ranks, would go stale on one of them
    (each rank holds its own copy): ``buffer_chunks`` refuses it, naming the buffer and its users. Each block's
    own batch-norm statistics stay on one rank and pass, as does everything on one rank (chunks of an
    interleaved schedule there run in one process)."""
    from types import SimpleNamespace

    from autopart.pipelining import buffer_chunks
    from autopart.planner import analyze

    x, y = torch.randn(16, 8), torch.randn(16, 8)
    t = trace(_SharedBuffer().train(), (x, y))
    info = analyze(t, (1,))
    plan = SimpleNamespace(nodes={n.name: {"layer": info.layer.get(n.name, "")} for n in t.gm.graph.nodes})
    stage_of_layer = {f"blocks.{i}": i * chunks // 4 for i in range(4)}
    stage_of = assign_stages(t.gm, plan, stage_of_layer)
    layer_of = {n: r["layer"] for n, r in plan.nodes.items()}
    if fails:
        with pytest.raises(NotImplementedError, match=r"buffer 'seen' is updated in place .* pipeline ranks \[0, 1\]"):
            buffer_chunks(t.gm, t.buffers, t.tied, stage_of, ranks, layer_of)
    else:
        buffer_chunks(t.gm, t.buffers, t.tied, stage_of, ranks, layer_of)
    # the batch norms' statistics alone (each block's own) pass on any split
    no_seen = {k: v for k, v in t.buffers.items() if v != "seen"}
    used = buffer_chunks(t.gm, no_seen, t.tied, stage_of, ranks, layer_of)
    assert used and all(len(cs) == 1 and fqn.startswith("norms.") for fqn, cs in used.items())  # a stage holds them


def test_pins_on_a_later_block_with_stages_searched():
    """The pipeline search and the recipes rank on the graph reduced to two blocks; a pin naming a node or
    parameter of a later block (absent there) made the default plan raise 'no parameter or graph node has that
    name'. Such pins now plan on the whole graph, and the plan keeps them."""
    model = _model()
    t = trace(model, (IDS,), {"labels": IDS})
    sdpa = [n.name for n in t.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]
    pins = {"blocks.3.attn.q.weight": "S(0)", sdpa[3]: "S(1)"}
    p = autopart.plan(model, autopart.mesh((4,), ("x",)), (IDS,), {"labels": IDS}, traced=t, pins=pins)
    assert p.nodes["p_blocks_3_attn_q_weight"]["output"].startswith("S(0)"), p.nodes["p_blocks_3_attn_q_weight"]
    assert p.nodes[sdpa[3]]["output"] == "S(1)", p.nodes[sdpa[3]]
    with pytest.raises(autopart.PlanInputError, match="did you mean 'blocks.3.attn.q.weight'"):  # a typo: named
        autopart.plan(model, autopart.mesh((4,), ("x",)), (IDS,), {"labels": IDS}, traced=t,
                      pins={"blocks.3.attn.q.weigth": "S(0)"})
