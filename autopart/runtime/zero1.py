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
* after ``step``: the slices are all-gathered back, axis by axis, innermost first, into the whole parameters, in
  flat buckets (``gather_bucket``); the ZeRO-1/2 parameters' gradients are released first (the step has used them,
  and ``opt.zero_grad`` does not see them), so that the gathered buffer does not add to them.

The after-step gather runs in buckets as Megatron's distributed optimizer does: parameters replicated over the same
mesh axes (and of one dtype) are packed, in module order, into flat buckets of at most ``grads.BUCKET_BYTES``
*gathered* bytes, and each bucket takes one ``all_gather_into_tensor`` per axis instead of one per parameter: the
latency is paid per bucket (on 48 ranks 47 ring steps per collective). The size counts the gathered parameters,
not the slices, because that is the buffer the gather allocates: one bucket in flight stays at most
``BUCKET_BYTES`` whatever the number of ranks, as the gradient's reduce-scatter bucket (measured on the whole
gradients it reduces, ``runtime/grads.py``). The slice layout (``zero1_slice``) is the per-parameter one; packing
only concatenates the padded slices, so state_dicts and the reduce-scatter agree with it.

Because it is a genuine ``torch.optim.Optimizer``, LR schedulers, ``state_dict`` and ``load_state_dict`` (of this
rank's slices) work unchanged. Gradient clipping goes through the module (``pm.clip_grad_norm_``) before ``step``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from autopart.runtime import grads as _grads

# collectives issued by the after-step gather (all_gather_into_tensor calls), and buckets gathered
STATS = {"all_gathers": 0, "buckets": 0}

# How many gather buckets the after-step gather holds at once (their gathered buffers, packed slices and, over
# several axes, the intermediate gathers): the planner's optimizer-step memory moment prices this many buckets.
GATHER_IN_FLIGHT = 1


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


def gather_bucket(packed: torch.Tensor, widths: list[int], ways: list[int], all_gather) -> list[torch.Tensor]:
    """Whole flat parameters from this rank's bucket ``packed``: its padded slices (``widths[i]`` = ``S_i`` elements
    each) concatenated, gathered over axes of ``ways`` ranks, innermost first.

    ``all_gather(flat, i)`` returns the ``ways[i] * flat.numel()`` elements of the ranks' ``flat`` on axis ``i``, in
    rank order. After the gather over ``n`` ranks the result is ``(n, bucket)``, rank ``j``'s packed bucket in row
    ``j``, so parameter ``i``'s pieces are the column block ``(n, w_i)`` at its offset, which read row by row is
    what gathering that parameter alone would give (the mixed-radix order of ``zero1_slice``). The blocks are
    re-packed, ``n * w_i`` wide, for the next axis. Returned: per parameter its block of the last gather, a view of
    the gathered buffer (``unpack_into`` copies it into the parameter without a contiguous copy of its own)."""
    blocks = [packed]
    cur = packed
    for i, n in enumerate(ways):
        blocks = list(all_gather(cur, i).view(n, -1).split(widths, dim=1))
        widths = [w * n for w in widths]
        if i + 1 < len(ways):
            cur = torch.cat([b.reshape(-1) for b in blocks])
    return blocks


def unpack_into(flat: torch.Tensor, block: torch.Tensor) -> None:
    """Copy the gathered ``(n, w)`` ``block`` (row by row: the padded flat parameter) into the 1-D ``flat``: whole
    rows through one strided copy, then the part of the last row that is not padding."""
    w = block.shape[1]
    rows, rem = divmod(flat.numel(), w)
    flat[: rows * w].view(rows, w).copy_(block[:rows])
    if rem:
        flat[rows * w:].copy_(block[rows, :rem])


def _buckets(slices: list[_Slice], sizes: list[int], limit: int) -> list[list[_Slice]]:
    """The slices in gather buckets: per set of axes and dtype, in order, closed when the next parameter would take
    the bucket's gathered bytes past ``limit`` (a larger parameter gets a bucket of its own). Every rank of a group
    holds the same parameters with the same local shapes (they are replicated over its axes), so the ranks agree."""
    out: list[list[_Slice]] = []
    open_: dict[tuple, tuple[list[_Slice], int]] = {}
    for s in slices:
        key = (tuple(s.axes), s.leaf.dtype)
        nbytes = s.size * math.prod(sizes[a] for a in s.axes) * s.leaf.element_size()
        b, used = open_.get(key, (None, 0))
        if b is None or used + nbytes > limit:
            b, used = [], 0
            out.append(b)
        b.append(s)
        open_[key] = (b, used + nbytes)
    return out


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
    buckets = _buckets(slices, sizes, _grads.BUCKET_BYTES)

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

    def all_gather(cur: torch.Tensor, axis: int) -> torch.Tensor:
        out = torch.empty(cur.numel() * sizes[axis], dtype=cur.dtype, device=cur.device)
        dist.all_gather_into_tensor(out, cur, group=groups[axis])
        STATS["all_gathers"] += 1
        return out

    @torch.no_grad()
    def post_step(optimizer, args, kw) -> None:
        for s in slices:  # the step has consumed the gradients: free them before the gathers allocate
            s.param.grad = None
            s.leaf.grad = None
        for bucket in buckets:
            inner = list(reversed(bucket[0].axes))  # innermost axis first: blocks come out in mixed-radix order
            widths = [s.size for s in bucket]
            packed = bucket[0].leaf.new_zeros(sum(widths))
            for s, off in zip(bucket, itertools.accumulate([0] + widths)):
                packed[off: off + s.end - s.start].copy_(s.leaf.detach())
            blocks = gather_bucket(packed, widths, [sizes[a] for a in inner],
                                   lambda cur, i, inner=inner: all_gather(cur, inner[i]))
            del packed
            STATS["buckets"] += 1
            for s, block in zip(bucket, blocks):
                unpack_into((s.param.data._local_tensor if isinstance(s.param.data, DTensor) else s.param.data)
                            .view(-1), block)

    opt.register_step_pre_hook(pre_step)
    opt.register_step_post_hook(post_step)
    opt.autopart_zero1_slices = len(slices)
    opt.autopart_zero1_buckets = [(tuple(b[0].axes), len(b)) for b in buckets]  # (axes, parameters) per bucket
    return opt
