"""Expert parallelism chosen by the solver, not pinned: a 64-expert MoE (``MoEConfig.preset("moe-64e")``, 2 of its
layers: they are tied, so more would only repeat them) on ``h100-80gb`` nodes of 8, planned on the ``meta`` device
with no process group.

Per layer the stacked experts hold 3 x 64 x 2048 x 5632 x 4 B = 8.9 GB, 35 GB with gradients and Adam states if
replicated: the plan has to split them, and the cheapest way is by expert. Checked: every expert weight is
``Shard(0)`` (the expert dim) on one mesh axis, tokens are dispatched split by group (the batch) on that axis, the
expert products run on the local experts, and exactly the two edges of expert parallelism carry an all-to-all on it:
the dispatched tokens [E, G, C, d] from ``Shard(1)`` (groups) to ``Shard(0)`` (experts) before the experts, and back
before the combine; forward and backward. Before the all-to-all was priced at its real size (1/n of what it was), the
same plans kept experts ``Shard(0)`` but gathered the tokens instead.

Measured (2 cores): export ~1 s, each plan 3-8 s. On (8, 8) and (16, 8) the expert axis is the node axis (the
intra-node axis goes to attention's tensor parallelism and the capacity dim of the experts).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import autopart
from autopart.models.moe import MoE, MoEConfig, expert_nodes
from autopart.placement import Shard, parse_spec
from autopart.trace import trace

pytestmark = pytest.mark.slow

SEQ = 2048
NAMES = ("node", "gpu")
CFG = dataclasses.replace(MoEConfig.preset("moe-64e"), n_layer=2, max_seq_len=SEQ)


@functools.cache
def _plan(nodes: int) -> tuple[autopart.Plan, dict]:
    shape = (nodes, 8)
    batch = nodes * 8  # one sequence per GPU
    with torch.device("meta"):
        model = MoE(CFG)
        ids = torch.randint(0, CFG.vocab_size, (batch, SEQ))
    t = trace(model, (ids,), {"labels": ids})
    plan = autopart.plan(model, autopart.mesh(shape, NAMES), (ids,), {"labels": ids},
                         cluster=autopart.preset("h100-80gb", shape), traced=t, pipeline="off")
    return plan, expert_nodes(t.graph)


@pytest.mark.parametrize("nodes", [8, 16])
def test_many_experts_get_expert_parallelism(nodes: int) -> None:
    plan, moe = _plan(nodes)
    budget = autopart.preset("h100-80gb", (nodes, 8)).memory_budget
    assert plan.predicted["memory_bytes"]["total"] <= budget
    experts = [f"blocks.{i}.moe.{w}" for i in range(CFG.n_layer) for w in ("w_gate", "w_up", "w_down")]
    axes = {a for fqn in experts for a, p in enumerate(parse_spec(plan.params[fqn])) if p == Shard(0)}
    assert len(axes) == 1, {fqn: plan.params[fqn] for fqn in experts}
    ep = axes.pop()
    assert all(parse_spec(plan.params[fqn])[ep] == Shard(0) for fqn in experts), plan.params
    for name in moe["dispatch"]:  # tokens routed where they are, split by group (the batch) on that axis
        assert parse_spec(plan.nodes[name]["output"])[ep] == Shard(1), (name, plan.nodes[name])
    for name in moe["experts"]:  # the experts computed where their weights are
        assert parse_spec(plan.nodes[name]["output"])[ep] == Shard(0), (name, plan.nodes[name])
    a2a = {(c["value"], c["user"]) for c in plan.collectives
           if any(axis == ep and fwd == bwd == "all_to_all" for axis, fwd, bwd in c["steps"])}
    for i in range(CFG.n_layer):
        dispatch, gate, down, combine = (moe["dispatch"][i], moe["experts"][3 * i], moe["experts"][3 * i + 2],
                                         moe["combine"][i])
        assert {(dispatch, gate), (down, combine)} <= a2a, (i, a2a)
        for direction in ("fwd", "bwd"):
            counts = plan.collective_counts(f"blocks.{i}", direction)
            assert counts[("all_to_all", NAMES[ep])] == 2, (i, direction, dict(counts))
