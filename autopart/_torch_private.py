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


def unflatten_outputs(leaves: list, spec: Any) -> Any:
    """``leaves`` in the structure ``spec`` (``torch.utils._pytree.tree_unflatten`` of a TreeSpec, such as
    ``ExportedProgram.call_spec.out_spec``); ``leaves`` unchanged (a tuple, or its one element) where ``spec`` is
    None or holds another number of leaves."""
    if spec is not None and getattr(spec, "num_leaves", None) == len(leaves):
        from torch.utils._pytree import tree_unflatten

        return tree_unflatten(list(leaves), spec)
    return leaves[0] if len(leaves) == 1 else tuple(leaves)


def op_schema(target: Any):
    """The ``torch.FunctionSchema`` of an ATen op overload (``OpOverload._schema``: its arguments, whether it
    writes into them); None for anything else (a packet, a Python function)."""
    return target._schema if isinstance(target, torch._ops.OpOverload) else None


def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor without autograd (DTensor._local_tensor)."""
    return t._local_tensor  # type: ignore[attr-defined]


def dtensor_spec(t: torch.Tensor):
    """A DTensor's ``DTensorSpec`` (``DTensor._spec``: mesh, placements, global shape and stride)."""
    return t._spec  # type: ignore[attr-defined]


def dtensor_with_spec(local: torch.Tensor, spec) -> torch.Tensor:
    """A DTensor around ``local`` with ``spec`` (``dtensor_spec``), not differentiable: DTensor's own constructor
    with the spec shared, as FSDP2's ``_from_local_no_grad`` builds its gradients. ``DTensor.from_local`` builds and
    checks a new spec, ~10x the CPU time, which once per parameter and step is most of a small model's runtime
    overhead."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]


def dispatch_mode_class() -> type:
    """The base class of Python dispatch modes (torch.utils._python_dispatch.TorchDispatchMode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def queue_backward_callback(fn) -> None:
    """Run ``fn`` when the backward pass now running ends (``Variable._execution_engine.queue_callback``, as
    FSDP uses); call it from inside backward (a hook or an autograd Function's backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)  # type: ignore[attr-defined]


def flash_attention_cpu(q, k, v, is_causal: bool, attn_mask, scale: float):
    """(output, log-sum-exp ``[b, h, s]``) of attention by the CPU flash kernel
    (``aten._scaled_dot_product_flash_attention_for_cpu``): no score matrix is materialised. ``attn_mask`` is
    additive, of q's dtype; a row it masks wholly gets output 0 and log-sum-exp 0 (not −inf). Inputs whose last
    dim is strided are made contiguous first: the kernel reads them as if its stride were 1 (torch 2.13: garbage
    out of a query that a reduce-scatter along the features left with stride 32 there), which the public
    ``scaled_dot_product_attention`` guards against before calling it."""
    q, k, v = (_last_dim_dense(t) for t in (q, k, v))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=attn_mask,
                                                                     scale=scale)


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def flash_attention_cpu_backward(dout, q, k, v, out, lse, is_causal: bool, attn_mask, scale: float):
    """(dq, dk, dv) of ``flash_attention_cpu`` (``aten._scaled_dot_product_flash_attention_for_cpu_backward``),
    given the output and log-sum-exp the softmax is normalised by (it recomputes the probabilities from them); strided
    last dims made contiguous, as ``flash_attention_cpu``."""
    dout, q, k, v, out = (_last_dim_dense(t) for t in (dout, q, k, v, out))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=attn_mask, scale=scale)


def reparametrize(module: torch.nn.Module, state: dict[str, torch.Tensor]):
    """Context manager: ``module``'s parameters and buffers named in ``state`` replaced by those tensors (what
    ``torch.func.functional_call`` does around a call), for calling its forward without ``__call__``'s hooks."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, state, strict=False)


def fake_mode():
    """A fresh fake-tensor mode (``torch._subclasses.FakeTensorMode``) that accepts real tensors as inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def ignore_fresh_unbacked_symbols(t: Any):
    """Context manager: sizes computed from data inside it (``nonzero``) are not required in the traced outputs
    (the shape environment of ``t``'s fake mode; a null context for a real tensor)."""
    import contextlib

    env = getattr(getattr(t, "fake_mode", None), "shape_env", None)
    return env.ignore_fresh_unbacked_symbols() if env is not None else contextlib.nullcontext()


def strided_shard(dim: int, blocks: int):
    """DTensor's placement for a dim cut into ``blocks`` equal blocks, each split evenly over the axis, a rank
    holding its piece of every block in order (``torch.distributed.tensor.placement_types._StridedShard`` with
    ``split_factor=blocks``: the layout FSDP2 gives a tensor-parallel shard; DTensor redistributes it to and from
    the other placements, and pointwise ops and optimizers run on it)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=blocks)


def is_strided_shard(p: Any) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(p, _StridedShard)
