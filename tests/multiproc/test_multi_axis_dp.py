"""Data parallelism over several mesh axes at once (the batch split in pieces nested in mesh order, as DTensor
nests them): DDP, ZeRO-1/2/3 on a 2-D mesh whose axes are both data parallel, and two data-parallel axes beside a
tensor-parallel one, on real gloo processes: parity with one process over 3 AdamW steps."""

from __future__ import annotations

import math
from functools import partial

import pytest

from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import check, distributed, reference

pytestmark = pytest.mark.multiproc

# (model, mesh shape, axis names, roles, ZeRO level)
DP2 = {"node": "dp", "gpu": "dp"}
CASES = [("gpt", (2, 2), ("node", "gpu"), DP2, 0), ("gpt", (2, 2), ("node", "gpu"), DP2, 1),
         ("llama", (2, 2), ("node", "gpu"), DP2, 2), ("gpt", (2, 2), ("node", "gpu"), DP2, 3),
         ("llama", (2, 2, 2), ("node", "gpu", "tp"), {**DP2, "tp": "tp"}, 1)]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-zero{c[4]}" for c in CASES])
def test_batch_split_over_two_axes(case):
    from autopart.placement import Replicate, parse_spec
    from autopart.plan import Plan

    name, shape, names, roles, zero = case
    results = run_ranks(math.prod(shape), partial(distributed, zero=zero), name, shape, names, roles)
    check(name, results, reference(name))
    plan = Plan.from_json(results[0][3])
    dp = [i for i, a in enumerate(names) if roles[a] == "dp"]
    assert all(str(parse_spec(s)[i]) == "S(0)" for s in plan.inputs.values() for i in dp), plan.inputs
    assert set(plan.zero.values()) == ({zero} if zero else set()), plan.zero
    if zero in (0, 1, 2):  # the parameters are whole on both data-parallel axes
        assert all(isinstance(parse_spec(s)[i], Replicate) for s in plan.params.values() for i in dp), plan.params


HSDP = {"blocks.0.mlp.fc.weight": "RS(0)", "blocks.1.attn.q.weight": "RS(1)", "lm_head.weight": "RS(0)"}


def test_hybrid_sharded_data_parallel():
    """HSDP: the batch split over both axes, these weights ZeRO-3 sharded on the inner axis and replicated on the
    outer one (their gradients reduce-scattered inside, all-reduced across), the others whole: parity."""
    from autopart.plan import Plan

    results = run_ranks(4, partial(distributed, pins=HSDP), "gpt", (2, 2), ("node", "gpu"), DP2)
    check("gpt", results, reference("gpt"))
    plan = Plan.from_json(results[0][3])
    assert plan.inputs["ids"] == "S(0)S(0)"
    assert {k: plan.params[k] for k in HSDP} == HSDP and all(plan.zero[k] == 3 for k in HSDP), plan.zero
