"""Every unpinned plan is scored against the standard recipes and is never predicted slower than the best one."""

from __future__ import annotations

import pytest
import torch

import autopart
from autopart import planner
from autopart.models import GPT, GPTConfig
from autopart.recipes import RECIPES, recipe_options
from tests.unit.gpu_rates import fp32_at_the_bf16_rate  # noqa: F401 - applies to this module


def _model_ids():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, max_seq_len=64, n_layer=4, n_head=4, d_model=64))
    return model, torch.randint(0, 256, (8, 64))


def test_unpinned_plan_is_never_slower_than_a_recipe():
    model, ids = _model_ids()
    p = autopart.plan(model, autopart.mesh((2, 2), ("a", "b")), (ids,), {"labels": ids})
    rows = p.solver["recipes"]
    assert [r["recipe"] for r in rows] == list(RECIPES)
    fits = [r for r in rows if r["fits"]]
    # every recipe applies: DDP, ZeRO-1 and FSDP split the batch over both axes at once (nested in mesh order)
    assert {r["recipe"] for r in fits} == set(RECIPES)
    ddp2 = autopart.plan(model, autopart.mesh((2, 2), ("a", "b")), (ids,), {"labels": ids}, recipes=False,
                         roles={"a": "dp", "b": "dp"}, zero=0)
    assert ddp2.inputs["ids"] == "S(0)S(0)", ddp2.inputs
    assert all(spec == "RR" for spec in ddp2.params.values())
    step = p.predicted["step_time_s"]
    for r in fits:
        assert r["step_time_s"] >= step * (1 - 1e-9), r
        assert r["gain"] == pytest.approx(r["step_time_s"] / step - 1)
    assert sum(r["chosen"] for r in rows) <= 1
    # the recipes differ where they should (on one axis of 4): ZeRO-1 and FSDP hold less than DDP; ZeRO-1 pays
    # its parameter gather and steps a quarter of the optimizer's work
    flat = autopart.plan(model, autopart.mesh((4,), ("a",)), (ids,), {"labels": ids})
    by = {r["recipe"]: r for r in flat.solver["recipes"] if r["fits"]}
    assert {"ddp", "zero1", "fsdp"} <= set(by)
    assert by["zero1"]["memory_bytes"] < by["ddp"]["memory_bytes"]
    assert by["fsdp"]["memory_bytes"] < by["zero1"]["memory_bytes"]
    ddp, zero1 = (autopart.evaluate(model, 4, (ids,), {"labels": ids}, recipe=r, gpus_per_node=4).predicted
                  for r in ("ddp", "zero1"))
    assert zero1["optimizer_step_s"] == pytest.approx(ddp["optimizer_step_s"] / 4, rel=0.01)
    assert zero1["param_gather_s"] > 0 == ddp["param_gather_s"]
    assert "standard recipes under the same cost model" in str(p)


def test_forced_options_skip_recipes_and_evaluate_scores_one():
    model, ids = _model_ids()
    p = autopart.plan(model, autopart.mesh((2,), ("dp",)), (ids,), {"labels": ids}, roles={"dp": "dp"})
    assert "recipes" not in p.solver
    fsdp = autopart.evaluate(model, 4, (ids,), {"labels": ids}, recipe="fsdp", gpus_per_node=2)
    assert fsdp.mesh_shape == (4,) and set(fsdp.zero.values()) == {3}  # the batch over every GPU
    meg = autopart.evaluate(model, 4, (ids,), {"labels": ids}, recipe="megatron", gpus_per_node=2)
    assert "tensor" in meg.axis_role(1)  # weights split on the intra-node axis
    with pytest.raises(ValueError, match="unknown recipe"):
        recipe_options("zero7", ("dp",), (2,))
    assert recipe_options("megatron-fsdp", ("dp",), (2,)) is None


def test_recipes_keeping_whole_states_are_bounded_without_a_solve():
    """DDP and ZeRO-1 hold every parameter and gradient whole: when those alone exceed the budget the recipe is
    reported as not fitting without a solve; the bound is below what the memory model gives DDP when it is solved."""
    from autopart.recipes import whole_states_bytes
    from autopart.trace import trace

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, max_seq_len=8, n_layer=2, n_head=4, d_model=64))
    ids = torch.randint(0, 512, (4, 8))
    t = trace(model, (ids,), {"labels": ids})
    whole = whole_states_bytes(t)
    n = sum(q.numel() for q in model.parameters())
    assert whole == pytest.approx(2 * 4 * n)  # fp32 parameters and their gradients
    ddp = autopart.evaluate(model, 4, (ids,), {"labels": ids}, recipe="ddp", gpus_per_node=4, traced=t)
    assert ddp.predicted["memory_bytes"]["total"] >= whole
    p = autopart.plan(model, autopart.mesh((4,), ("a",)), (ids,), {"labels": ids}, traced=t,
                      memory_budget=whole)  # planned against 90% of it
    rows = {r["recipe"]: r for r in p.solver["recipes"]}
    for name in ("ddp", "zero1"):
        assert not rows[name]["fits"] and "bound, not solved" in rows[name]["why"], rows[name]
    assert rows["fsdp"]["fits"] and p.predicted["memory_bytes"]["total"] <= 0.9 * whole * (1 + 1e-6)
    # a 1-D mesh has no data-parallel axis left for Megatron's ZeRO level: scored, not refused over ``zero=``
    assert "zero=" not in rows["megatron"].get("why", "")


def test_zero_chosen_by_the_planner_is_never_slower_than_none():
    """Where the planner chooses ZeRO-1/2 itself (``zero=None``), its choice is checked against the same plan
    without sliced states, by the record: the ILP prices each parameter's slice of the optimizer step, reduction and
    gather apart, and over a 4096-rank ring its choices of ZeRO-1 (for the step they slice) made Mamba 2.8B's step
    4% slower than no ZeRO at all (0.209 s against 0.200 s)."""
    import importlib

    from autopart.trace import trace

    adv = importlib.import_module("autopart.advise")
    _, model, inputs, kwargs, _ = adv.build("mamba", "2.8b", batch=4096, seq=4096)
    t = trace(model, inputs, kwargs)
    step = {zero: autopart.evaluate(model, 4096, inputs, kwargs, cluster="h100-80gb", zero=zero, offload=None,
                                    traced=t, optimizer_bytes_per_param=12.0).predicted["step_time_s"]
            for zero in (0, 1, None)}
    assert step[None] <= min(step[0], step[1]) * (1 + 1e-9), step
    assert step[1] > step[0] * 1.02, step  # the case: ZeRO-1 slower here, so the check has something to catch


def test_never_slower_than_a_recipe_solved_on_the_whole_graph():
    """The recipes are scored on the 2-block graph by their ILP objective, which exceeds the step their plan records
    (``planner.OBJECTIVE_OVER_RECORD``): one within that factor of the plan is solved on the whole graph, so the plan
    is never slower than any recipe's own record. GPT-1.3B on 16 H100s: ZeRO-1 scores 0.0735 s by its objective and
    records 0.0510 s, under the search's 0.0565 s (it was dropped when only rows within 5% were solved)."""
    from autopart.trace import trace

    with torch.device("meta"):
        model = GPT(GPTConfig.preset("gpt-1.3b"))
        ids = torch.randint(0, model.cfg.vocab_size, (16, 2048))
    t = trace(model, (ids,), {"labels": ids})
    kw = dict(cluster=autopart.preset("h100-80gb", (16,)), traced=t)
    p = autopart.plan(model, autopart.mesh((16,), ("dp",)), (ids,), {"labels": ids}, **kw)
    step = p.predicted["step_time_s"]
    rows = {r["recipe"]: r for r in p.solver["recipes"] if r["fits"]}
    assert set(rows) == {"ddp", "zero1", "fsdp", "megatron", "megatron-1f1b"}
    for name in ("ddp", "zero1", "fsdp"):
        own = autopart.plan(model, autopart.mesh((16,), ("dp",)), (ids,), {"labels": ids},
                            **recipe_options(name, ("dp",), (16,)), **kw).predicted["step_time_s"]
        assert step <= own * (1 + 1e-9), (name, step, own)
        if "scored_on" in rows[name]:  # its objective: at least its record, and then it could not have won
            assert rows[name]["step_time_s"] >= own * (1 - 1e-9)
            assert rows[name]["step_time_s"] >= step * 1.05 * planner.OBJECTIVE_OVER_RECORD
        else:
            assert rows[name]["step_time_s"] == pytest.approx(own, rel=1e-9)
    assert rows["zero1"]["chosen"] and step == pytest.approx(rows["zero1"]["step_time_s"], rel=1e-12)


def test_data_parallel_recipes_need_a_batch_that_splits():
    """DDP, ZeRO-1 and FSDP over 4 devices of a batch of 2 are not data parallel (every device would compute
    the whole batch): rows 'not planned' with the reason, not scored as such plans."""
    model, ids = _model_ids()
    ids = ids[:2]
    p = autopart.plan(model, autopart.mesh((4,), ("a",)), (ids,), {"labels": ids})
    rows = {r["recipe"]: r for r in p.solver["recipes"]}
    for name in ("ddp", "zero1", "fsdp"):
        assert not rows[name]["fits"] and rows[name]["why"] == "not planned: a batch of 2 does not split over 4 devices"
    assert "  ddp            not planned: a batch of 2" in str(p)


def test_small_model_on_a_2d_mesh_is_data_parallel_over_both_axes():
    """A small model on a (2, 4) mesh of CPU ranks: the free plan splits the batch over both axes at once (nested
    in mesh order), which it could not before, and is never slower than DDP over both; it was data parallel on one
    axis with the other replicated or splitting something else."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, max_seq_len=64, n_layer=4, n_head=4, d_model=64))
    ids = torch.randint(0, 256, (16, 64))
    p = autopart.plan(model, autopart.mesh((2, 4), ("node", "gpu")), (ids,), {"labels": ids})
    assert p.inputs == {"ids": "S(0)S(0)", "labels": "S(0)S(0)"}, p.inputs
    assert "node: data, gpu: data" in str(p)
    ddp = next(r for r in p.solver["recipes"] if r["recipe"] == "ddp")
    assert ddp["fits"] and p.predicted["step_time_s"] <= ddp["step_time_s"] * (1 + 1e-9)
    one_axis = autopart.plan(model, autopart.mesh((2, 4), ("node", "gpu")), (ids,), {"labels": ids},
                             roles={"node": "tp", "gpu": "dp"})
    assert p.predicted["step_time_s"] < one_axis.predicted["step_time_s"]
