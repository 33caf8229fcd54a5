"""ZeRO (sharded data parallelism) on real gloo processes: parity with one process, and the plan's layout."""

from __future__ import annotations

import math

import pytest
import torch

from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import OPT, batches, check, make_model, reference

pytestmark = pytest.mark.multiproc


def _zero_run(name: str, shape: tuple, names: tuple, roles: dict, zero: int):
    import autopart
    from autopart.runtime import collectives as C

    model = make_model(name)
    mesh = autopart.mesh(shape, names)
    ids0 = batches()[0]
    pm = autopart.parallelize(model, mesh, (ids0,), {"labels": ids0}, roles=roles, zero=zero)
    opt = pm.optimizer(torch.optim.AdamW, **OPT)
    losses = []
    C.REGATHER_STATS["packed"] = 0
    for ids in batches():
        losses.append(pm.forward_backward(ids, labels=ids).item())
        opt.step()
        opt.zero_grad()
    # optimizer states live only for this rank's shard
    state_numel = sum((v.to_local() if hasattr(v, "to_local") else v).numel()
                      for s in opt.state.values() for k, v in s.items() if k == "exp_avg")
    full = {k: v.clone() for k, v in pm.full_state_dict().items()}
    return (losses, full, str(pm.plan), pm.plan.to_json(), pm(batches()[0]).detach(), state_numel,
            C.REGATHER_STATS["packed"])


CASES = [("gpt", (2,), ("dp",), {"dp": "dp"}, 2), ("gpt", (2,), ("dp",), {"dp": "dp"}, 3),
         ("llama", (2,), ("dp",), {"dp": "dp"}, 1), ("gpt", (2, 2), ("dp", "tp"), {"dp": "dp", "tp": "tp"}, 3),
         ("llama", (2, 2), ("dp", "tp"), {"dp": "dp", "tp": "tp"}, 2),
         ("gpt", (2, 2), ("dp", "tp"), {"dp": "dp", "tp": "tp"}, 1)]


@pytest.mark.parametrize("name,shape,names,roles,zero", CASES, ids=[f"{c[0]}-{'x'.join(c[2])}-zero{c[4]}"
                                                                   for c in CASES])
def test_zero_parity(name, shape, names, roles, zero):
    from autopart.plan import Plan

    results = run_ranks(math.prod(shape), _zero_run, name, shape, names, roles, zero)
    check(name, [r[:5] for r in results], reference(name))
    plan = Plan.from_json(results[0][3])
    assert plan.zero and set(plan.zero.values()) == {zero}, plan.zero
    from autopart.placement import Replicate, Shard, parse_spec

    # ZeRO-1 keeps parameters replicated on dp (only optimizer states are sliced); 2 and 3 shard them along a dim
    kind = Replicate if zero == 1 else Shard
    assert all(isinstance(parse_spec(plan.params[k])[names.index("dp")], kind) for k in plan.zero)
    n_params = sum(p.numel() for p in make_model(name).parameters())
    dp = shape[names.index("dp")]
    tp = shape[names.index("tp")] if "tp" in names else 1
    # each rank holds optimizer states for about 1/(dp*tp) of the parameters (small ones may stay replicated)
    assert results[0][5] < n_params / dp * 1.05 / (1 if tp == 1 else tp / 1.6), (results[0][5], n_params)
    if zero == 3:
        assert results[0][6] > 0, "ZeRO-3 parameters were not re-gathered for backward"
    else:
        assert results[0][6] == 0
