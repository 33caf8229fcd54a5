"""Master weights (``ShadowOptimizer`` with a dtype): the optimizer updates finer copies of the parameters."""

from __future__ import annotations

import torch
import torch.nn as nn

from autopart.runtime.module import ShadowOptimizer


def test_updates_below_the_parameters_rounding_accumulate():
    """bf16 weights of 1.0 and steps of 1e-4 (bf16's spacing at 1.0 is 2^-7 = 0.0078): stepped directly, the
    weights never move; with fp32 master weights, 100 steps move them by ~0.01, as fp32 weights would."""
    def run(master: bool) -> float:
        w = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        opt = ShadowOptimizer([w], torch.optim.SGD, dtype=torch.float32, lr=1e-4) if master else \
            torch.optim.SGD([w], lr=1e-4)
        for _ in range(100):
            w.grad = torch.ones_like(w)
            opt.step()
            opt.zero_grad()
        return float(w.detach().float().mean())

    assert run(master=False) == 1.0
    assert abs(run(master=True) - (1.0 - 100 * 1e-4)) < 2 ** -8  # within the final bf16 rounding


def test_gradients_cast_up_and_weights_cast_down():
    w = nn.Parameter(torch.zeros(3, dtype=torch.float32))
    opt = ShadowOptimizer([w], torch.optim.SGD, dtype=torch.float64, lr=1.0)
    w.grad = torch.tensor([1e-9, 2.0, -3.0])
    opt.step()
    assert opt.shadows[0].dtype == torch.float64 and opt.shadows[0].grad.dtype == torch.float64
    assert w.dtype == torch.float32 and w.tolist() == torch.tensor([-1e-9, -2.0, 3.0]).tolist()
    # weights loaded into the module: the copies take them where they differ beyond rounding, keep the rest
    opt.shadows[0].data[0] = -1e-9 + 1e-17  # finer than fp32 can say
    with torch.no_grad():
        w[1] = 5.0
    opt.sync_from_device()
    assert opt.shadows[0][0].item() == -1e-9 + 1e-17 and opt.shadows[0][1].item() == 5.0


def test_bf16_parameters_without_master_weights_warn():
    """pm.optimizer over bf16 parameters without master_dtype warns (and names the fix); with it, it does not."""
    from tests.multiproc.harness import run_ranks

    assert run_ranks(1, _bf16_optimizer_warnings) == [(True, False)]


def _bf16_optimizer_warnings():
    import warnings

    import autopart
    from tests.multiproc.parity import batches, make_model

    model = make_model("gpt").to(torch.bfloat16)
    ids = batches()[0]
    pm = autopart.parallelize(model, autopart.mesh((1,), ("dp",)), (ids,), {"labels": ids})
    out = []
    for master in (None, torch.float32):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pm.optimizer(torch.optim.AdamW, master_dtype=master, lr=1e-3)
        out.append(any("master_dtype=torch.float32" in str(w.message) for w in caught))
    return tuple(out)
