"""Host offload mechanisms on gloo (on a CPU cluster they never pay, but they must be right): optimizer states
stepped on host copies, and activations saved for backward in host memory."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import OPT, batches, check, make_model, reference, train

pytestmark = pytest.mark.multiproc


def _offload_run(name: str, offload: str, zero):
    import autopart
    from autopart.runtime import collectives as C
    from autopart.runtime.module import HostOffloadOptimizer

    mesh = autopart.mesh((2,), ("dp",))
    ids0 = batches()[0]
    pm = autopart.parallelize(make_model(name), mesh, (ids0,), {"labels": ids0}, roles={"dp": "dp"},
                              offload=offload, zero=zero)
    opt = pm.optimizer(torch.optim.AdamW, **OPT)
    assert isinstance(opt, HostOffloadOptimizer) == (offload in ("optimizer", "both"))
    C.REGATHER_STATS["offloaded"] = 0
    losses, full = train(pm, opt)
    return losses, full, str(pm.plan), pm.plan.to_json(), pm(batches()[0]).detach(), C.REGATHER_STATS["offloaded"]


@pytest.mark.parametrize("offload,zero", [("optimizer", None), ("activations", None), ("both", 3)])
def test_offload_parity(offload, zero):
    results = run_ranks(2, _offload_run, "gpt", offload, zero)
    check("gpt", [r[:5] for r in results], reference("gpt"))
    if offload in ("activations", "both"):
        assert results[0][5] > 0, "no activation went to host memory"
    else:
        assert results[0][5] == 0
