"""Pointwise ops (found by ``torch.Tag.pointwise``) and identity-like ops: shard any dimension the output has,
broadcasting inputs that are size 1 there; ``Partial`` passes through the ops that are linear in it."""

from __future__ import annotations

import torch

from autopart.placement import Shard, Strided
from autopart.strategy.registry import NodeInfo, Option1D, P, R, register

aten = torch.ops.aten

# op -> which inputs may carry Partial: "all" (sum of partials: add/sub), "one" (exactly one P, others R),
# "first" (only the first tensor input P, others R: division by a replicated tensor)
_LINEAR = {
    aten.add.Tensor: "all",
    aten.sub.Tensor: "all",
    aten.mul.Tensor: "one",
    aten.div.Tensor: "first",
    aten.neg.default: "one",
}


def _is_float(info: NodeInfo) -> bool:
    v = info.val
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


def _shard_options(info: NodeInfo) -> list[Option1D]:
    """Each output dim split, with the inputs that span it; and in blocks where a fused projection's consumers cut
    it in blocks (``views.fused_blocks``: Mamba-2's xBC through the convolution's activation)."""
    from autopart.strategy.views import fused_blocks

    out = info.out_shape
    nd = len(out)
    opts = [Option1D(tuple(R for _ in info.inputs), R)]
    for d in range(nd):
        if out[d] == 1:
            continue
        layouts = [Shard]
        k = fused_blocks(info.node, d) if info.node is not None else None
        if k:
            layouts.append(lambda dim, k=k: Strided.of(dim, k))
        for layout in layouts:
            ins = []
            for i in range(len(info.inputs)):
                s = info.shape(i)
                di = d - (nd - len(s))
                ins.append(R if di < 0 or s[di] == 1 else layout(di))
            opts.append(Option1D(tuple(ins), layout(d)))
    return opts


def pointwise_rule(info: NodeInfo, n: int) -> list[Option1D]:
    if not isinstance(info.val, torch.Tensor):
        from autopart.strategy.registry import replicate_only

        return replicate_only(info, n)
    opts = _shard_options(info)
    kind = _LINEAR.get(info.node.target)
    k = len(info.inputs)
    if kind and _is_float(info) and k:
        non_tensor_scalar = any(not hasattr(a, "meta") and isinstance(a, (int, float)) for a in info.args)
        # an input passed twice (``x * x``, ``x / x``) is one distinct input: the op is not linear in it
        once = [sum(a is x for a in info.args) == 1 for x in info.inputs]
        if kind == "all" and not non_tensor_scalar:
            opts.append(Option1D(tuple(P for _ in range(k)), P))
        elif kind == "one":
            for i in range(k):
                if once[i]:
                    opts.append(Option1D(tuple(P if j == i else R for j in range(k)), P))
        elif kind == "first" and info.index(info.args[0]) == 0 and once[0]:
            opts.append(Option1D(tuple(P if j == 0 else R for j in range(k)), P))
    return opts


def _identity_like(info: NodeInfo, n: int) -> list[Option1D]:
    """Unary ops that keep the layout (casts, copies, aliases): every placement passes through, Partial too."""
    opts = _shard_options(info)
    if _is_float(info) and len(info.inputs) == 1:
        opts.append(Option1D((P,), P))
    return opts


register(
    aten.clone.default, aten.contiguous.default, aten.alias.default, aten.to.dtype, aten.to.dtype_layout,
    aten.to.device, aten._to_copy.default, aten.detach.default, aten.lift_fresh_copy.default,
)(_identity_like)


# elementwise ops torch does not tag pointwise (Python operator aliases, where with a scalar branch); not linear
@register(
    aten.__and__.Tensor, aten.__or__.Tensor, aten.__xor__.Tensor, aten.where.ScalarOther, aten.where.ScalarSelf,
    aten.where.Scalar,
)
def _untagged(info: NodeInfo, n: int) -> list[Option1D]:
    return _shard_options(info) if isinstance(info.val, torch.Tensor) else pointwise_rule(info, n)


@register(aten.dropout.default, aten.native_dropout.default)
def _dropout(info: NodeInfo, n: int) -> list[Option1D]:
    # the mask is drawn per rank: shard or replicate the data, never Partial (the mask would scale addends apart)
    return _shard_options(info)


# the rules above: any dim of the output split with the inputs that span it (``views.fused_blocks`` walks through
# their ops)
ELEMENTWISE_RULES = (pointwise_rule, _identity_like, _untagged, _dropout)


@register(aten.type_as.default)
def _type_as(info: NodeInfo, n: int) -> list[Option1D]:
    """``x.type_as(other)``: x cast to other's dtype. x's layout passes (Partial too: a cast is linear up to
    rounding, as ``_identity_like``); other gives only its dtype, so it may stay as it is (split alike) or whole."""
    k = len(info.inputs)
    if k == 1:  # x.type_as(x)
        return _identity_like(info, n)
    same = info.shape(1) == info.shape(0)
    opts = [Option1D((R, R), R)]
    if _is_float(info):
        opts.append(Option1D((P, R), P))
    for d in range(len(info.shape(0))):
        if info.shape(0)[d] > 1:
            opts.append(Option1D((Shard(d), R), Shard(d)))
            if same:
                opts.append(Option1D((Shard(d), Shard(d)), Shard(d)))
    return opts

