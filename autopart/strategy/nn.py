"""Neural-network ops: embedding, layer norm, softmax, attention, reductions, cross-entropy.

Some options need a different local program than "run the op on the shard" (a *lowering*, done by
``autopart.passes.lower``): vocab-parallel embedding masks ids outside the rank's rows; cross-entropy over a
sharded batch divides the local sum by the global count of non-ignored targets; ``mean`` over a sharded dim
divides by the axis size.
"""

from __future__ import annotations

import torch

from autopart.placement import Shard, Strided
from autopart.strategy.registry import NodeInfo, Option1D, P, R, register, replicate_only

aten = torch.ops.aten


@register(aten.embedding.default)
def _embedding(info: NodeInfo, n: int) -> list[Option1D]:
    w, ids = info.index(info.args[0]), info.index(info.args[1])
    ids_shape, out_nd = info.shape(ids), len(info.out_shape)

    def opt(pw, pi, out):
        ins = [None, None]
        ins[w], ins[ids] = pw, pi
        return Option1D(tuple(ins), out)

    opts = [opt(R, R, R), opt(Shard(1), R, Shard(out_nd - 1))]
    if (info.args[3:4] or (info.kwargs.get("scale_grad_by_freq", False),))[0]:
        # the gradient is scaled by each id's count in the whole batch: rows or ids split over ranks would count
        # theirs alone. Only the embedding dimension splits (every rank sees every id)
        return opts
    opts.append(opt(Shard(0), R, P))
    for d in range(len(ids_shape)):
        if ids_shape[d] > 1:
            opts.append(opt(R, Shard(d), Shard(d)))
    return opts


@register(aten.conv1d.default)
def _conv1d(info: NodeInfo, n: int) -> list[Option1D]:
    """``conv1d(x [b, c, l], w [o, c / groups, k], bias [o], stride, padding, dilation, groups)``: the batch splits
    (weights whole); without groups, the output channels split with the weight's rows and the bias; with groups
    (HF Mamba's depthwise convolution), whole groups split: the input's channels, the weight's rows, the bias and
    the output's channels together, each rank convolving its ``groups / n`` groups (``passes.lower`` makes the
    argument local). (The length needs halos: not offered.)"""
    xi, wi = info.index(info.args[0]), info.index(info.args[1])
    bias = info.args[2] if len(info.args) > 2 else info.kwargs.get("bias")
    bi = info.index(bias)
    groups = info.args[6] if len(info.args) > 6 else info.kwargs.get("groups", 1)
    k = len(info.inputs)

    def opt(px, pw, pb, out):
        ins = [R] * k
        ins[xi], ins[wi] = px, pw
        if bi is not None:
            ins[bi] = pb
        return Option1D(tuple(ins), out)

    if xi == wi or bi in (xi, wi):  # one tensor in two roles: whole
        return replicate_only(info, n)
    opts = [opt(R, R, R, R)]
    if info.shape(xi)[0] > 1:
        opts.append(opt(Shard(0), R, R, Shard(0)))
    if groups == 1 and info.shape(wi)[0] > 1:
        opts.append(opt(R, Shard(0), Shard(0), Shard(1)))
    if groups > 1 and groups % n == 0:
        opts.append(opt(Shard(1), Shard(0), Shard(0), Shard(1)))
    from autopart.strategy.views import _depthwise, fused_blocks

    blocks = fused_blocks(info.node, 1) if info.node is not None else None
    if blocks and _depthwise(info.node):
        # channels in a fused projection's blocks (Mamba-2's [x | B | C]): each rank convolves its piece of each
        opts.append(opt(Strided.of(1, blocks), Strided.of(0, blocks), Strided.of(0, blocks), Strided.of(1, blocks)))
    return opts


@register(aten.layer_norm.default, aten.rms_norm.default)
def _norm(info: NodeInfo, n: int) -> list[Option1D]:
    x = info.shape(0)
    norm_nd = len(info.args[1])
    k = len(info.inputs)
    opts = [Option1D(tuple(R for _ in range(k)), R)]
    for d in range(len(x) - norm_nd):
        if x[d] > 1:
            opts.append(Option1D((Shard(d),) + tuple(R for _ in range(k - 1)), Shard(d)))
    return opts


@register(aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int)
def _softmax(info: NodeInfo, n: int) -> list[Option1D]:
    x = info.shape(0)
    dim = info.args[1] % len(x)
    opts = [Option1D((R,), R)]
    for d in range(len(x)):
        if d != dim and x[d] > 1:
            opts.append(Option1D((Shard(d),), Shard(d)))
    return opts


@register(aten.scaled_dot_product_attention.default)
def _sdpa(info: NodeInfo, n: int) -> list[Option1D]:
    """Batch (dim 0) or heads (dim 1) split; grouped-query attention needs kv heads divisible too (checked by
    the caller's evenness filter). A mask follows where it is not broadcast.

    Grouped-query attention whose heads split wider than its K/V heads: q (and a per-head mask) ``Shard(1)``, K and
    V whole, each device attending with the one K/V head its query heads share (``strategy.context.gqa_split``).

    Sequence (dim 2) split, context parallelism: q, k, v and the output ``Shard(2)`` (a boolean mask on its query rows),
    for self-attention without dropout (``strategy.context.sequence_split_ok``). Running the op on the shards would be
    wrong (local queries need every key): the planner turns this option into its two tagged strategies
    (``autopart.strategy.context``: ring, all-gather of K/V) and ``autopart.passes.context`` lowers it to
    ``autopart.runtime.context``."""
    from autopart.strategy.context import _sdpa_args, sequence_split_inputs, sequence_split_ok

    k = len(info.inputs)
    opts = [Option1D(tuple(R for _ in range(k)), R)]
    for d in (0, 1):
        if info.out_shape[d] <= 1:
            continue
        ins = []
        for i in range(k):
            s = info.shape(i)
            di = d - (4 - len(s))
            ins.append(R if di < 0 or s[di] == 1 else Shard(di))
        opts.append(Option1D(tuple(ins), Shard(d)))
    a = _sdpa_args(info.node)
    qi, ki, vi = (info.index(a[key]) for key in ("query", "key", "value"))
    if a["enable_gqa"] and opts[-1].output == Shard(1) and None not in (qi, ki, vi) and len({qi, ki, vi}) == 3 \
            and len(info.shape(qi)) == len(info.shape(ki)) == 4 and 1 < info.shape(ki)[1] < info.shape(qi)[1]:
        # grouped-query heads split wider than the K/V heads: the heads split above with K and V whole, each device
        # reading the one K/V head its query heads share (``strategy.context.gqa_split`` keeps the combinations
        # where that holds)
        heads = opts[-1]
        opts.append(Option1D(tuple(R if i in (ki, vi) else p for i, p in enumerate(heads.inputs)), Shard(1)))
    if sequence_split_ok(info):
        opts.append(Option1D(sequence_split_inputs(info), Shard(2)))
    return opts


def _reduce_dims(info: NodeInfo) -> tuple[list[int], bool]:
    nd = len(info.shape(0))
    dims = info.args[1] if len(info.args) > 1 else None
    if dims is None or dims == []:
        return list(range(nd)), False
    if isinstance(dims, int):
        dims = [dims]
    keep = bool(info.args[2]) if len(info.args) > 2 else bool(info.kwargs.get("keepdim", False))
    return sorted(d % nd for d in dims), keep


@register(aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.mean.default, aten.amax.default,
          aten.amin.default)
def _reduction(info: NodeInfo, n: int) -> list[Option1D]:
    if not isinstance(info.val, torch.Tensor):
        return replicate_only(info, n)
    x = info.shape(0)
    if info.node.target in (aten.sum.default, aten.mean.default):
        dims, keep = list(range(len(x))), False
    else:
        dims, keep = _reduce_dims(info)
    linear = info.node.target in (aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.mean.default)
    opts = [Option1D((R,), R)]
    if linear and info.val.dtype.is_floating_point:
        opts.append(Option1D((P,), P))
    for d in range(len(x)):
        if x[d] <= 1:
            continue
        if d in dims:
            if linear and info.val.dtype.is_floating_point:
                opts.append(Option1D((Shard(d),), P))
        else:
            e = d if keep else d - sum(1 for r in dims if r < d)
            opts.append(Option1D((Shard(d),), Shard(e)))
    return opts


@register(aten.cross_entropy_loss.default)
def _cross_entropy(info: NodeInfo, n: int) -> list[Option1D]:
    """Batch-sharded logits and targets give a Partial loss (lowered to sum / global count for ``mean``); logits
    sharded over the vocabulary (Megatron's vocab-parallel cross-entropy) give the full loss on every rank, with
    three all-reduces of one value per token inside the op."""
    args = list(info.args) + [None] * (6 - len(info.args))
    weight = args[2] if args[2] is not None else info.kwargs.get("weight")
    label_smoothing = args[5] if args[5] is not None else info.kwargs.get("label_smoothing", 0.0)
    reduction = args[3] if args[3] is not None else info.kwargs.get("reduction", 1)
    k = len(info.inputs)
    opts = [Option1D(tuple(R for _ in range(k)), R)]
    if weight is not None or label_smoothing:
        return opts
    logits, target = info.index(args[0]), info.index(args[1])
    if k != 2:
        return opts
    if info.shape(logits)[0] > 1:
        ins = [None, None]
        ins[logits], ins[target] = Shard(0), Shard(0)
        opts.append(Option1D(tuple(ins), Shard(0) if reduction == 0 else P))
    if len(info.shape(logits)) == 2 and info.shape(logits)[1] > 1:  # vocab-parallel (Megatron)
        ins = [None, None]
        ins[logits], ins[target] = Shard(1), R
        opts.append(Option1D(tuple(ins), R))
    return opts
