"""The gradient sum over several data-parallel mesh axes as ``cost.comm.hierarchical_time`` prices it, on 4 real
gloo ranks (mesh (2, 2), both axes data parallel): ``runtime.grads.hierarchical_all_reduce`` equals the sum, and
the reduction's after-backward path (pipelines take it) keeps parity with one process for plain and ZeRO-1
parameters (reduce-scatter innermost axis first)."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import OPT, batches, check, make_model, reference, train

pytestmark = pytest.mark.multiproc


def _sum_run():
    import torch.distributed as dist

    import autopart
    from autopart.runtime import grads

    dm = autopart.mesh((2, 2), ("a", "b")).device_mesh
    groups = [dm.get_group(i) for i in range(2)]
    out = {}
    for numel in (12, 7):  # 7: padded to the inner axis
        torch.manual_seed(dist.get_rank())
        mine = torch.randn(numel, dtype=torch.float64)
        flat = mine.clone()
        grads.hierarchical_all_reduce(flat, [0, 1], groups, [2, 2])
        every = [torch.empty_like(mine) for _ in range(4)]
        dist.all_gather(every, mine)
        out[numel] = (flat, torch.stack(every).sum(0))
    return out


def test_hierarchical_all_reduce_sums():
    for res in run_ranks(4, _sum_run):
        for flat, want in res.values():
            torch.testing.assert_close(flat, want, rtol=1e-12, atol=1e-12)


def _pins(model, ids) -> dict[str, str]:
    """Batch on ``a``, sequence on ``b`` through every linear and layer norm (attention gathers the sequence):
    the weights' gradients are then summed over both axes."""
    from autopart.trace import trace

    pins = {"ids": "S(0)S(1)"}
    for n in trace(model, (ids,), {"labels": ids}).graph.nodes:
        if n.op == "call_function" and n.name.startswith(("linear", "layer_norm")) and n.meta["val"].dim() == 3:
            pins[n.name] = "S(0)S(1)"
    return pins


def _after_backward_run(zero: int):
    import autopart
    from autopart.runtime import grads

    grads.OVERLAP_WITH_BACKWARD = False  # the after-backward path, axis by axis on the mesh's groups
    model = make_model("gpt")
    ids0 = batches()[0]
    pm = autopart.parallelize(model, autopart.mesh((2, 2), ("a", "b")), (ids0,), {"labels": ids0},
                              roles={"a": "dp"}, zero=zero, pipeline="off", pins=_pins(model, ids0))
    losses, full = train(pm, pm.optimizer(torch.optim.AdamW, **OPT))
    reduced = {tuple(a) for a in pm.plan.reduced.values()}
    return losses, full, str(pm.plan), reduced, pm(batches()[0]).detach(), dict(pm.plan.zero)


@pytest.mark.parametrize("zero", [0, 1])
def test_after_backward_reduction_over_two_axes(zero):
    results = run_ranks(4, _after_backward_run, zero)
    check("gpt", [r[:5] for r in results], reference("gpt"))
    assert (0, 1) in results[0][3], results[0][3]  # some gradient summed over both axes
    assert bool(results[0][5]) == bool(zero), results[0][5]


def _two_modules_run():
    import autopart

    out, own = [], []
    for _ in range(2):  # two modules in one process, each on a mesh of its own
        model = make_model("gpt")
        ids0 = batches()[0]
        pm = autopart.parallelize(model, autopart.mesh((2, 2), ("a", "b")), (ids0,), {"labels": ids0},
                                  roles={"a": "dp"}, pipeline="off", pins=_pins(model, ids0))
        own.append(dict(pm._grads._own))
        out.append((pm, pm.optimizer(torch.optim.AdamW, **OPT), model))  # the model: the forward-only call traces
    # their steps in turn: the second module's reductions on the groups the first one's use too
    losses = [[], []]
    for ids in batches():
        for (pm, opt, _), mine in zip(out, losses):
            mine.append(pm.forward_backward(ids, labels=ids).item())
            opt.step()
            opt.zero_grad()
    shared = sorted(k for k in own[0] if own[1].get(k) is own[0][k])
    return [(mine, {k: v.clone() for k, v in pm.full_state_dict().items()}, str(pm.plan), None,
             pm(batches()[0]).detach()) for (pm, _, _), mine in zip(out, losses)], sorted(own[0]), shared


def test_modules_in_one_process_share_their_gradient_groups():
    """A second module parallelized in the same process makes no gradient groups of its own (each gloo group
    keeps threads that wake while idle): it reduces on the first one's, both stepping in turn, each in parity."""
    results = run_ranks(4, _two_modules_run)
    for which in range(2):
        check("gpt", [r[0][which] for r in results], reference("gpt"))
    for _, axes, shared in results:
        assert axes and shared == axes, (axes, shared)
