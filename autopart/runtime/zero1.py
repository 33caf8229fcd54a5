"""ZeRO-1 and ZeRO-2: optimizer states (and, for ZeRO-2, gradients) sharded over the ranks holding a parameter
replicated (Megatron-LM's distributed optimizer, DeepSpeed stages 1 and 2).

A parameter the plan marks ZeRO-1 or ZeRO-2 (``plan.zero[fqn]`` 1 or 2) stays replicated for forward and backward;
its gradient is reduce-scattered so that each rank receives the sum of its slice only (``runtime/grads.py``):
ZeRO-1 keeps the whole gradient buffer (valid on the slice), ZeRO-2 frees it and keeps the slice in the slice
leaf's ``.grad``. Its optimizer state covers only this rank's slice of the flat local tensor: with ``D`` ranks
over the mesh axes it is replicated on (``planner.zero1_ways``) and ``N`` elements, rank ``r`` (its mixed-radix
index over those axes, outer axis first) owns elements ``[r*S, min((r+1)*S, N))`` with ``S = ceil(N / D)``. Any
``N`` works: no tensor dimension has to divide by ``D``, which is what lets a 4096-wide
layer be sharded 48 ways.

The optimizer is the user's class itself (``torch.optim.AdamW``...), built over the parameters that are not ZeRO-1
plus one leaf per ZeRO-1 slice, in a second parameter group. A slice leaf is a view of the parameter's local
storage, so the optimizer updates the parameter in place; no copy of the weights is kept. Two optimizer hooks
(torch's ``register_step_pre_hook`` / ``register_step_post_hook``) do the rest:

* before ``step``: each slice leaf's gradient is the matching view of the (reduced) parameter gradient (ZeRO-2:
  the reduce-scatter already put it there);
* after ``step``: every slice is all-gathered back, axis by axis, innermost first, into the whole parameter, and
  the ZeRO-1/2 parameters' gradients are released (``opt.zero_grad`` does not see them).

Because it is a genuine ``torch.optim.Optimizer``, LR schedulers, ``state_dict`` and ``load_state_dict`` (of this
rank's slices) work unchanged. Gradient clipping goes through the module (``pm.clip_grad_norm_``) before ``step``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate


@dataclass
class _Slice:
    param: nn.Parameter  # the module's DTensor parameter
    leaf: nn.Parameter  # the optimizer's view of this rank's slice of the flat local tensor
    start: int
    end: int
    size: int  # S: the padded slice length every rank sends
    axes: list[int]  # mesh axes the parameter is replicated on (sharded over here), outer first


def zero1_slice(numel: int, coords: list[int], sizes: list[int], axes: list[int]) -> tuple[int, int, int]:
    """(start, end, padded size) of this rank's slice of a flat parameter of ``numel`` elements."""
    ways = math.prod(sizes[a] for a in axes)
    rank = 0
    for a in axes:
        rank = rank * sizes[a] + coords[a]
    size = -(-numel // ways)
    start = min(rank * size, numel)
    return start, min(start + size, numel), size


def sharded_state_optimizer(module, cls: type, **kwargs) -> torch.optim.Optimizer:
    """``cls`` over ``module``'s parameters with the plan's ZeRO-1/2 parameters replaced by this rank's slices;
    the module's gradient reduction reduce-scatters their gradients into the slices from then on."""
    zero = module.plan.zero
    groups = module._groups
    coords, sizes = module._coords, module._sizes
    plain: list[nn.Parameter] = []
    slices: list[_Slice] = []
    by_key: dict[str, _Slice] = {}
    for fqn, key in module._key_of.items():
        p = module._params[key]
        if zero.get(fqn) not in (1, 2) or not p.requires_grad:
            plain.append(p)
            continue
        local = p.data._local_tensor if isinstance(p.data, DTensor) else p.data
        if not local.is_contiguous():
            raise RuntimeError(f"ZeRO-1 parameter {fqn}: its local tensor is not contiguous; report this")
        placements = p.placements if isinstance(p, DTensor) else ()
        axes = [i for i, pl in enumerate(placements) if isinstance(pl, Replicate) and sizes[i] > 1]
        start, end, size = zero1_slice(local.numel(), coords, sizes, axes)
        leaf = nn.Parameter(local.view(-1)[start:end])  # aliases the parameter's storage
        slices.append(_Slice(p, leaf, start, end, size, axes))
        by_key[key] = slices[-1]
    param_groups: list[dict[str, Any]] = []
    if plain:
        param_groups.append({"params": plain})
    if slices:  # a group of its own: foreach kernels do not mix DTensor and plain tensors
        param_groups.append({"params": [s.leaf for s in slices]})
    opt = cls(param_groups, **kwargs)  # kwargs as ParallelModule.optimizer defaults them (foreach)
    if not slices:
        return opt
    module._grads.attach(by_key)
    scattered = {id(s) for k, s in by_key.items() if module._grads.scattered(k)}

    def pre_step(optimizer, args, kw) -> None:
        for s in slices:
            if id(s) in scattered:  # ZeRO-2: the reduce-scatter accumulated the slice into the leaf
                continue
            g = s.param.grad
            if g is None:
                s.leaf.grad = None
                continue
            g = g._local_tensor if isinstance(g, DTensor) else g
            s.leaf.grad = g.reshape(-1)[s.start:s.end]

    @torch.no_grad()
    def post_step(optimizer, args, kw) -> None:
        for s in slices:
            local = s.param.data._local_tensor if isinstance(s.param.data, DTensor) else s.param.data
            flat = local.view(-1)
            cur = torch.zeros(s.size, dtype=flat.dtype, device=flat.device)
            cur[: s.end - s.start].copy_(flat[s.start:s.end])
            for a in reversed(s.axes):  # innermost axis first: blocks come out in mixed-radix rank order
                out = torch.empty(cur.numel() * sizes[a], dtype=cur.dtype, device=cur.device)
                dist.all_gather_into_tensor(out, cur, group=groups[a])
                cur = out
            flat.copy_(cur[: flat.numel()])
            s.param.grad = None
            s.leaf.grad = None

    opt.register_step_pre_hook(pre_step)
    opt.register_step_post_hook(post_step)
    opt.autopart_zero1_slices = len(slices)
    return opt
