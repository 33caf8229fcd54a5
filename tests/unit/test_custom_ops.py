"""Custom ops: without a rule they plan replicated and are listed; ``autopart.register_op`` lets the solver shard
them and prices them."""

from __future__ import annotations

import pytest

import autopart
from autopart.extend import register_op
from autopart.strategy.registry import _RULES
from tests.custom_op_model import OP, data, make


def _plan():
    x, y = data(1)[0]
    return autopart.plan(make(), autopart.mesh((2,), ("tp",)), (x, y), roles={"tp": "tp"}, pipeline="off")


def _custom_node(plan):
    return next(n for n, r in plan.nodes.items() if "scaled_tanh" in r["op"])


def test_unknown_op_replicated_then_sharded_by_a_rule():
    _RULES.pop(OP, None)
    before = _plan()
    assert any("scaled_tanh" in op for op in before.unsupported_ops)
    assert before.nodes[_custom_node(before)]["output"] == "R"
    try:
        register_op(OP, sharding="pointwise", flops=lambda args, kwargs, out: 10 * out.numel())
        after = _plan()
        assert not any("scaled_tanh" in op for op in after.unsupported_ops)
        node = after.nodes[_custom_node(after)]
        assert node["output"] == "S(1)"  # Megatron MLP: the activation stays split between the two linears
        assert node["compute_s"] > 0
        assert after.predicted["step_time_s"] < before.predicted["step_time_s"]
        assert sum(after.collective_counts().values()) < sum(before.collective_counts().values())
    finally:
        _RULES.pop(OP, None)


def test_register_op_checks_its_input():
    with pytest.raises(TypeError, match="custom_op"):
        register_op(lambda x: x)
    with pytest.raises(ValueError, match="sharding="):
        register_op(OP, sharding="sometimes")

    def bad(info, n):
        return ["S(0)"]

    try:
        register_op(OP, sharding=bad)
        with pytest.raises(TypeError, match="Option1D"):
            _plan()
    finally:
        _RULES.pop(OP, None)


def test_replicate_only_ops_on_a_data_axis_gather_the_batch():
    """mse_loss has no rule: under a pinned 'dp' role its inputs' batch is gathered for it (an all-gather on the dp
    axis, priced), it runs whole, and it is listed; the rest of the model stays batch-split."""
    x, y = data(1)[0]
    register_op(OP, sharding="pointwise")
    try:
        plan = autopart.plan(make(), autopart.mesh((2,), ("dp",)), (x, y), roles={"dp": "dp"}, pipeline="off")
    finally:
        _RULES.pop(OP, None)
    assert any("mse_loss" in op for op in plan.unsupported_ops), plan.unsupported_ops
    loss = next(r for r in plan.nodes.values() if "mse_loss" in r["op"])
    assert loss["output"] == "R" and all(spec == "R" for spec in loss["inputs"])
    assert plan.nodes[_custom_node(plan)]["output"] == "S(0)"
    assert plan.collective_counts()[("all_gather", "dp")] == 2, plan.collective_counts()  # its two inputs
