"""A model whose activation is a ``torch.library.custom_op`` autopart has no rule for (shared by the custom-op
tests; importing it registers the op, which spawned ranks need too)."""

from __future__ import annotations

import torch
import torch.nn as nn


@torch.library.custom_op("autopart_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor) -> torch.Tensor:
    return 2.0 * torch.tanh(x)


@scaled_tanh.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return grad * 2.0 * (1 - torch.tanh(x) ** 2)


scaled_tanh.register_autograd(_backward, setup_context=_setup)
OP = torch.ops.autopart_test.scaled_tanh.default


class MLP(nn.Module):
    def __init__(self, d: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.fc2(scaled_tanh(self.fc1(x))), target)


def make() -> MLP:
    torch.manual_seed(0)
    return MLP()


def data(steps: int = 3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(steps)]
