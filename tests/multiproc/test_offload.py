"""Host offload mechanisms on gloo (on a CPU cluster they never pay, but they must be right): optimizer states
stepped on host copies, and activations saved for backward in host memory."""

from __future__ import annotations

import pytest
import torch

from autopart.plan import Plan
from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import OPT, batches, check, make_model, reference, train

pytestmark = pytest.mark.multiproc


def _offload_run(name: str, offload: str, zero):
    import autopart
    from autopart.runtime import collectives as C
    from autopart.runtime.module import HostOffloadOptimizer

    mesh = autopart.mesh((2,), ("dp",))
    ids0 = batches()[0]
    model = make_model(name)  # alive: the forward without labels below traces it again
    pm = autopart.parallelize(model, mesh, (ids0,), {"labels": ids0}, roles={"dp": "dp"},
                              offload=offload, zero=zero)
    opt = pm.optimizer(torch.optim.AdamW, **OPT)
    assert isinstance(opt, HostOffloadOptimizer) == (offload in ("optimizer", "both"))
    C.REGATHER_STATS["offloaded"] = 0
    losses, full = train(pm, opt)
    host = sum(h.numel() for h in opt.shadows) if isinstance(opt, HostOffloadOptimizer) else 0
    whole = sum(p.numel() for p in model.parameters())
    return (losses, full, str(pm.plan), pm.plan.to_json(), pm(batches()[0]).detach(), C.REGATHER_STATS["offloaded"],
            host, whole, dict(pm.plan.zero))


@pytest.mark.parametrize("offload,zero", [("optimizer", None), ("activations", None), ("both", 3), ("optimizer", 1),
                                          ("optimizer", 2)])
def test_offload_parity(offload, zero):
    """Each mechanism trains as one process does (3 AdamW steps). With ZeRO-1/2 (DeepSpeed's ZeRO-Offload) the
    host holds, and each step moves, only this rank's slice of every parameter: half the model on 2 ranks."""
    results = run_ranks(2, _offload_run, "gpt", offload, zero)
    check("gpt", [r[:5] for r in results], reference("gpt"))
    if offload in ("activations", "both"):
        assert results[0][5] > 0, "no activation went to host memory"
    else:
        assert results[0][5] == 0
    if zero in (1, 2):
        _, _, _, _, _, _, host, whole, levels = results[0]
        assert set(levels.values()) == {zero}
        assert whole / 2 <= host <= whole / 2 + len(levels), (host, whole)  # slices rounded up to whole elements
        assert sum(r[6] for r in results) >= whole


def _pipelined_run(zero: int):
    import autopart
    from autopart.runtime.module import HostOffloadOptimizer

    mesh = autopart.mesh((2, 2), ("pp", "dp"))
    ids0 = batches()[0]
    model = make_model("gpt", 4)
    pm = autopart.parallelize(model, mesh, (ids0,), {"labels": ids0}, roles={"pp": "pp", "dp": "dp"}, zero=zero,
                              offload="optimizer", pipeline={"schedule": "1f1b", "micro_batches": 2})
    opt = pm.optimizer(torch.optim.AdamW, **OPT)
    assert isinstance(opt, HostOffloadOptimizer)
    losses, full = train(pm, opt)
    return losses, full, str(pm.plan), pm.plan.to_json(), pm(batches()[0]).detach()


@pytest.mark.parametrize("zero", [1, 2])
def test_pipelined_zero_offload_parity(zero):
    """pp2 x dp2, 1F1B: each stage's ranks step their ZeRO slices of that stage's parameters on the host."""
    results = run_ranks(4, _pipelined_run, zero)
    check("gpt", results, reference("gpt", 4))
    plan = Plan.from_json(results[0][3])
    assert plan.pipeline and plan.offload == ["optimizer"] and set(plan.zero.values()) == {zero}
