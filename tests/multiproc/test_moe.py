"""Expert parallelism on real gloo processes: the MoE reference model under ep=2, ep=4, ep x dp and ep x tp gives
the loss of every step and the gathered parameters after 3 AdamW steps of one process within 1e-5.

On a model this small the solver keeps every axis data parallel (a few hundred KiB of weights: an all-to-all costs
more than replicating the experts), so the expert-parallel layout is pinned, through the public ``pins=`` option,
on the graph nodes ``autopart.models.moe.expert_nodes`` names:

* ep (1-D mesh ``("ep",)``): tokens split on the batch (``ids`` ``S(0)``), the dispatch einsum's output
  [E, G, C, d] split on G (``S(1)``), the expert einsums split on E (``S(0)``), the combine split on the batch
  again: the planner must convert S(1) -> S(0) before the experts and back after them, the two all-to-alls;
* ep x dp (mesh ``("dp", "ep")``, ``roles={"dp": "dp"}``): the batch split over ``dp``; the expert einsums
  ``S(1)S(0)`` (groups over dp, experts over ep). Two axes cannot split the one batch dim in autopart's placements
  (no nested ``Shard(0)`` on two axes), so on ``ep`` the solver routes tokens however it prices cheapest;
* ep x tp (mesh ``("ep", "tp")``, ``roles={"tp": "tp"}``): the ep pins above, replicated on ``tp``, and the gate
  and up products split on ``f`` there: the all-to-alls on ``ep``, Megatron's column/row split inside every expert
  on ``tp``.

The stored expert weights are not pinned: the plan stores them ``Shard(0)`` on the expert axis because their
only users compute with that shard, which the tests check.
"""

from __future__ import annotations

import math
from functools import partial

import pytest

from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import batches, check, distributed, make_model, reference

pytestmark = pytest.mark.multiproc


def ep_pins(model, ids, names: tuple[str, ...]) -> dict[str, str]:
    """Pins putting the experts on the ``ep`` axis (see the module docstring)."""
    from autopart.models.moe import expert_nodes
    from autopart.trace import trace

    nodes = expert_nodes(trace(model, (ids,), {"labels": ids}).graph)
    if names == ("ep",):
        pins = {"ids": "S(0)"}
        pins.update({n: "S(1)" for n in nodes["dispatch"]})
        pins.update({n: "S(0)" for n in nodes["experts"] + nodes["combine"]})
        return pins
    if names == ("dp", "ep"):
        return {n: "S(1)S(0)" for n in nodes["experts"]}
    if names == ("ep", "tp"):
        pins = {"ids": "S(0)R"}
        pins.update({n: "S(1)R" for n in nodes["dispatch"]})
        pins.update({n: "S(0)R" for n in nodes["combine"]})
        pins.update({n: "S(0)S(3)" for n in nodes["experts"][0::3] + nodes["experts"][1::3]})  # gate, up
        return pins
    raise ValueError(f"no expert-parallel pins for mesh axes {names}")


CONFIGS = {
    "ep2": ((2,), ("ep",), {}),
    "ep4": ((4,), ("ep",), {}),
    "dp2xep2": ((2, 2), ("dp", "ep"), {"dp": "dp"}),
    "ep2xtp2": ((2, 2), ("ep", "tp"), {"tp": "tp"}),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_expert_parallel_parity(config: str) -> None:
    from autopart.placement import Shard, parse_spec
    from autopart.plan import Plan

    shape, names, roles = CONFIGS[config]
    ids = batches()[0]
    pins = ep_pins(make_model("moe"), ids, names)
    results = run_ranks(math.prod(shape), partial(distributed, pipeline="off", pins=pins), "moe", shape, names,
                        roles)
    check(f"moe {config}", results, reference("moe"))
    plan_json = results[0][3]
    assert all(r[3] == plan_json for r in results), "ranks ran different plans"
    plan = Plan.from_json(plan_json)
    ep = names.index("ep")
    experts = [k for k in plan.params if k.split(".")[-1] in ("w_gate", "w_up", "w_down")]
    assert len(experts) == 6
    for fqn in experts:  # stored as the experts' shard: no gather of expert weights anywhere
        assert parse_spec(plan.params[fqn])[ep] == Shard(0), (fqn, plan.params[fqn], plan_json)
    for layer in ("blocks.0", "blocks.1"):
        fwd, bwd = plan.collective_counts(layer, "fwd"), plan.collective_counts(layer, "bwd")
        if names == ("ep",):  # dispatch and combine: one all-to-all each way, nothing else in the layer
            assert fwd == {("all_to_all", "ep"): 2} and bwd == {("all_to_all", "ep"): 2}, (layer, fwd, bwd)
        elif names == ("ep", "tp"):  # the all-to-alls on ep; Megatron inside the experts on tp
            assert fwd[("all_to_all", "ep")] == bwd[("all_to_all", "ep")] == 2, (layer, fwd, bwd)
            assert not any(axis == "ep" and kind != "all_to_all" for kind, axis in fwd + bwd), (layer, fwd, bwd)
        else:  # nothing crosses dp inside a layer (data parallel: gradients are reduced after backward)
            assert not any(axis == "dp" for _, axis in fwd + bwd), (layer, fwd, bwd)
    if "tp" in names:  # expert weights split on tp too: gate/up by column (d_ff), down by row
        tp = names.index("tp")
        for fqn in experts:
            assert parse_spec(plan.params[fqn])[tp] == Shard(1 if fqn.endswith("w_down") else 2), plan.params[fqn]
