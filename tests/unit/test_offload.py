"""HostOffloadOptimizer (the plan's optimizer offload) on one process: the same steps as the optimizer it wraps,
and a genuine torch optimizer (LR schedulers, step hooks, state_dict)."""

from __future__ import annotations

import torch
import torch.nn as nn

from autopart.runtime.module import HostOffloadOptimizer


def _pair():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    b = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    b.load_state_dict(a.state_dict())
    return a, b


def test_steps_schedules_and_hooks_as_the_wrapped_optimizer():
    a, b = _pair()
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2)
    off = HostOffloadOptimizer(list(b.parameters()), torch.optim.AdamW, lr=1e-2)
    assert isinstance(off, torch.optim.Optimizer)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (ref, off)]
    calls = []
    off.register_step_pre_hook(lambda o, args, kw: calls.append("pre"))
    off.register_step_post_hook(lambda o, args, kw: calls.append("post"))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 8, generator=g)
        for m, o, s in ((a, ref, scheds[0]), (b, off, scheds[1])):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
            s.step()
    assert calls == ["pre", "post"] * 3
    assert off.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 1e-2 / 8
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-7)
    state = off.state_dict()
    again = HostOffloadOptimizer(list(b.parameters()), torch.optim.AdamW, lr=1e-2)
    again.load_state_dict(state)
    torch.testing.assert_close(again.inner.state[again.shadows[0]]["exp_avg"],
                               off.inner.state[off.shadows[0]]["exp_avg"])


def test_parameter_groups_and_slices():
    """Groups keep their options; a slice leaf (a view of a parameter, as ZeRO-1/2's) is updated in place."""
    w = nn.Parameter(torch.zeros(6))
    leaf = nn.Parameter(w.data.view(-1)[2:5])  # aliases w's storage, as runtime/zero1.py's slice leaves
    other = nn.Parameter(torch.zeros(3))
    off = HostOffloadOptimizer([{"params": [leaf]}, {"params": [other], "lr": 0.0}], torch.optim.SGD, lr=1.0)
    leaf.grad = torch.ones(3)
    other.grad = torch.ones(3)
    off.step()
    assert w.tolist() == [0, 0, -1, -1, -1, 0] and other.tolist() == [0, 0, 0]
