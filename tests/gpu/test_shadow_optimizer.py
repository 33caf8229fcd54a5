"""ShadowOptimizer / HostOffloadOptimizer over CUDA tensors (pinned host copies, non-blocking copies back, the
fused CPU kernel on the host): the same steps as on CPU. One CUDA device; skipped without."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopart.runtime.module import HostOffloadOptimizer, ShadowOptimizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _steps(device: str, make, dtype=torch.float32) -> torch.Tensor:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(1000, dtype=torch.float32).to(device, dtype))
    opt = make([w])
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        w.grad = torch.randn(1000, generator=g).to(device, dtype)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return w.detach().float().cpu()


@pytest.mark.parametrize("kind", ["offload", "offload-fp32-master", "master"])
def test_cuda_parameters_step_as_on_cpu(kind):
    dtype = torch.float32 if kind == "offload" else torch.bfloat16
    if kind == "offload":
        def make(ps):
            return HostOffloadOptimizer(ps, torch.optim.AdamW, lr=1e-2, fused=True)
    elif kind == "offload-fp32-master":
        def make(ps):
            return HostOffloadOptimizer(ps, torch.optim.AdamW, dtype=torch.float32, lr=1e-2, fused=True)
    else:
        def make(ps):
            return ShadowOptimizer(ps, torch.optim.AdamW, dtype=torch.float32, lr=1e-2)
    on_gpu = _steps("cuda", make, dtype)
    on_cpu = _steps("cpu", make, dtype)
    torch.testing.assert_close(on_gpu, on_cpu, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)
