"""The one place autopart touches private torch APIs. Each helper names what it wraps; keep this module thin."""

from __future__ import annotations

from typing import Any

import torch


def is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def fake_store():
    """A store for the ``fake`` process-group backend (torch.testing._internal.distributed.fake_pg)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor without autograd (DTensor._local_tensor)."""
    return t._local_tensor  # type: ignore[attr-defined]


def dispatch_mode_class() -> type:
    """The base class of Python dispatch modes (torch.utils._python_dispatch.TorchDispatchMode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def queue_backward_callback(fn) -> None:
    """Run ``fn`` when the backward pass now running ends (``Variable._execution_engine.queue_callback``, as
    FSDP uses); call it from inside backward (a hook or an autograd Function's backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)  # type: ignore[attr-defined]
