"""MemoryTracker: exact live-byte counts on allocations whose sizes are known by hand."""

from __future__ import annotations

import torch
import torch.nn as nn

from autopart.runtime.memtrack import MemoryTracker, optimizer_state_tensors

MiB = 2**20


def test_peak_and_current_exact():
    with MemoryTracker() as mt:
        a = torch.empty(MiB, dtype=torch.uint8)
        b = torch.empty(3 * MiB, dtype=torch.uint8)
        assert mt.current_bytes == 4 * MiB
        del a
        assert mt.current_bytes == 3 * MiB
        c = torch.empty(MiB // 4, dtype=torch.float32)  # 1 MiB again: peak stays 4 MiB
        del c
    assert mt.peak_bytes == 4 * MiB
    assert mt.current_bytes == 3 * MiB
    assert mt.peak_breakdown["activations"] == 4 * MiB
    del b


def test_views_counted_once():
    with MemoryTracker() as mt:
        a = torch.zeros(256, 1024)  # 1 MiB
        views = [a.view(-1), a[1:], a.t(), a.reshape(1024, 256), a.narrow(0, 0, 3)]
        assert mt.current_bytes == MiB
        del a
        assert mt.current_bytes == MiB  # the views keep the storage alive
        del views
        assert mt.current_bytes == 0
    assert mt.peak_bytes == MiB


def test_registered_tensors_and_relabel():
    p = torch.zeros(MiB // 4)
    with MemoryTracker() as mt:
        mt.track([p, p.view(-1)], "parameters")
        assert mt.current == {"parameters": MiB, "gradients": 0, "optimizer_states": 0, "activations": 0,
                              "buffers": 0}
        t = torch.ones(MiB // 4)
        mt.track(t, "gradients")
        assert mt.current["gradients"] == MiB and mt.current["activations"] == 0
    assert mt.peak_bytes == 2 * MiB


def test_linear_forward_backward_hand_count():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    x = torch.randn(16, 64)
    with MemoryTracker() as mt:
        mt.track(lin.parameters(), "parameters")
        mt.track(x, "activations")
        mt.track_gradients(lin.parameters())
        y = lin(x)
        loss = y.square().sum()
        loss.backward()
        del y
    f = 4
    params = (64 * 32 + 32) * f
    # live at the peak (the bias gradient, last op of backward): parameters, x, y (saved by square), loss, the seed
    # gradient ones(()), dL/dy, and both parameter gradients
    act = 16 * 64 * f + 16 * 32 * f + f + f + 16 * 32 * f
    assert mt.peak_bytes == params + act + params
    assert mt.peak_breakdown == {"parameters": params, "gradients": params, "optimizer_states": 0,
                                 "activations": act, "buffers": 0}
    assert mt.peak_op == "aten.sum.dim_IntList"
    # after: y's storage is freed (backward released it, the name is gone); x, the loss and the grads stay
    assert mt.current_bytes == params + 16 * 64 * f + f + params


def test_adamw_states_and_step():
    torch.manual_seed(0)
    lin = nn.Linear(32, 32, bias=False)
    opt = torch.optim.AdamW(lin.parameters(), foreach=False)
    lin(torch.randn(4, 32)).sum().backward()
    opt.step()  # states exist from here
    with MemoryTracker() as mt:
        mt.track(lin.parameters(), "parameters")
        mt.track_gradients(lin.parameters())
        mt.track(optimizer_state_tensors(opt), "optimizer_states")
        pw = 32 * 32 * 4
        states = 2 * pw + 4  # exp_avg, exp_avg_sq, and the step count (a float32 scalar)
        assert mt.current == {"parameters": pw, "gradients": pw, "optimizer_states": states, "activations": 0,
                              "buffers": 0}
        opt.step()
        opt.zero_grad()
    # single-tensor AdamW's temporaries: denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt) holds two at once
    assert mt.peak_bytes == 2 * pw + states + 2 * pw
    assert mt.peak_op == "aten.div.Tensor"
    assert mt.current == {"parameters": pw, "gradients": 0, "optimizer_states": states, "activations": 0,
                          "buffers": 0}
