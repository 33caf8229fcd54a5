"""A custom op with a registered pointwise rule runs sharded on tp=2 (Megatron MLP around it) and matches one
process."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import OPT

pytestmark = pytest.mark.multiproc


def _run(axis: str):
    import autopart
    from tests.custom_op_model import OP, data, make

    autopart.register_op(OP, sharding="pointwise")  # every rank plans and runs it
    batches = data()
    pm = autopart.parallelize(make(), autopart.mesh((2,), (axis,)), batches[0], roles={axis: axis})
    node = next(r for r in pm.plan.nodes.values() if "scaled_tanh" in r["op"])
    opt = torch.optim.AdamW(pm.parameters(), **OPT)
    losses = []
    for x, y in batches:
        losses.append(pm.forward_backward(x, y).item())
        opt.step()
        opt.zero_grad()
    return losses, {k: v.clone() for k, v in pm.full_state_dict().items()}, node["output"]


@pytest.mark.parametrize("axis", ["tp"])
def test_custom_op_parity(axis: str) -> None:
    from tests.custom_op_model import data, make

    model = make()
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    ref = []
    for x, y in data():
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    for losses, params, spec in run_ranks(2, _run, axis):
        assert spec == ("S(1)" if axis == "tp" else "S(0)"), spec  # the op really ran on shards
        assert losses == pytest.approx(ref, abs=1e-5)
        for k, v in model.named_parameters():
            torch.testing.assert_close(params[k], v.detach(), rtol=0, atol=1e-5)
