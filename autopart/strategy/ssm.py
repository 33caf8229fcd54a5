"""Ops of the loop-free selective scan (``autopart.models.mamba``): the causal masks it builds and the zero state it
starts from.

The scan's other ops already have rules: ``einsum`` (the equation is the rule), ``cumsum`` along the sequence
(any other dim may be split), pointwise ``exp``/``masked_fill``, layout ops. With the inner dimension split on a
tensor-parallel axis every tensor of the scan keeps its heads dim split, B and C (shared by all heads) stay
replicated, and the masks, built from constants, are replicated too: no collective inside the scan.
"""

from __future__ import annotations

import torch

from autopart.placement import Shard
from autopart.strategy.registry import NodeInfo, Option1D, P, R, register, replicate_only

aten = torch.ops.aten


@register(aten.ones.default, aten.zeros.default, aten.full.default)
def _constant(info: NodeInfo, n: int) -> list[Option1D]:
    """A tensor built from sizes alone (a causal mask): replicated; sharding it would need per-rank sizes."""
    return replicate_only(info, n)


@register(aten.tril.default, aten.triu.default)
def _triangle(info: NodeInfo, n: int) -> list[Option1D]:
    """Masks the last two dims: any leading (batch) dim may be split; linear, so Partial passes."""
    shape = info.shape(0)
    opts = [Option1D((R,), R)]
    if info.val.dtype.is_floating_point:
        opts.append(Option1D((P,), P))
    return opts + [Option1D((Shard(d),), Shard(d)) for d in range(len(shape) - 2) if shape[d] > 1]


@register(aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default)
def _like(info: NodeInfo, n: int) -> list[Option1D]:
    """A new tensor with the input's shape: it takes the input's split, or is whole when the input is (Partial
    input: the values do not matter, the local shape is the whole shape)."""
    shape = info.shape(0)
    opts = [Option1D((R,), R), Option1D((P,), R)]
    return opts + [Option1D((Shard(d),), Shard(d)) for d in range(len(shape)) if shape[d] > 1]
