"""Ops of mixture-of-experts routing in its dense (GShard) form: ``einsum``, ``topk``, ``one_hot``; and the node of
a token-local module (a Hugging Face experts layer, ``autopart.regions``).

``torch.export``'s training IR keeps ``torch.einsum`` as one ``aten.einsum`` node (it is decomposed into
permute/view/bmm only later), so the equation itself is the rule: each letter gives one sharding, as for the
matmul family (``matrix.einsum_options``). With the expert input ``einsum('gsec,gsd->egcd')`` split on ``g`` (the
batch) and the experts ``einsum('egcd,edf->egcf')`` split on ``e`` (stacked expert weights ``Shard(0)``), the edge
between them converts ``Shard(1)`` to ``Shard(0)`` of ``[E, G, C, d]``: the all-to-all of expert parallelism, which
the planner prices like any other conversion. ``topk`` and ``one_hot`` act along one dimension (the router's
expert dim, the new class dim) and keep every other dimension's sharding.
"""

from __future__ import annotations

import torch

from autopart import regions
from autopart.placement import Shard
from autopart.strategy.matrix import _matmul_rule
from autopart.strategy.registry import NESTED_INPUTS, NodeInfo, Option1D, R, register, replicate_only

aten = torch.ops.aten


@register(aten.einsum.default)
def _einsum(info: NodeInfo, n: int) -> list[Option1D]:
    """Any explicit equation whose operands name each dimension once (``"gsec,gsd->egcd"``); ellipses, implicit
    outputs and repeated letters in one operand (diagonals) run replicated."""
    equation = info.args[0].replace(" ", "")
    operands = list(info.args[1])
    lhs, arrow, out = equation.partition("->")
    terms = lhs.split(",")
    if not arrow or "." in equation or len(terms) != len(operands) or len(set(out)) != len(out) or \
            any(len(set(t)) != len(t) for t in terms):
        return replicate_only(info, n)
    return _matmul_rule(equation, info, operands)


@register(aten.topk.default)
def _topk(info: NodeInfo, n: int) -> list[Option1D]:
    """Values and indices along ``dim``: any other dim may be split; no Partial (top-k is not linear)."""
    shape = info.shape(0)
    dim = (info.args[2] if len(info.args) > 2 else info.kwargs.get("dim", -1)) % len(shape)
    opts = [Option1D((R,), (R, R))]
    for d in range(len(shape)):
        if d != dim and shape[d] > 1:
            opts.append(Option1D((Shard(d),), (Shard(d), Shard(d))))
    return opts


@register(aten.one_hot.default)
def _one_hot(info: NodeInfo, n: int) -> list[Option1D]:
    """Integer class ids [...] -> [..., num_classes]: every input dim keeps its split; the class dim is whole. Without
    an explicit ``num_classes`` each shard would infer its own from its largest id: replicated only."""
    num_classes = info.args[1] if len(info.args) > 1 else info.kwargs.get("num_classes", -1)
    if num_classes < 0:
        return replicate_only(info, n)
    shape = info.shape(0)
    return [Option1D((R,), R)] + [Option1D((Shard(d),), Shard(d)) for d in range(len(shape)) if shape[d] > 1]


@register(regions.OP)
def _token_local(info: NodeInfo, n: int) -> list[Option1D]:
    """A token-local module's call (``autopart.regions``): everything whole, or the tokens split along one dim of
    their grid (the flat token dim of an experts layer; batch or sequence of a (batch, sequence, hidden) block):
    every tensor argument and output that holds the tokens split with them (``Region.token_dim``), the parameters
    whole (the module runs on the rank's own tokens); with a Hugging Face experts layer, also the tokens split and
    the experts split along dim 0 on the same axis (expert parallelism). Never Partial: the module is not linear."""
    r = regions.region(info.args[0])
    outs = list(info.val)
    opts = [Option1D(tuple(R for _ in info.inputs), tuple(R for _ in outs))]
    args = set(info.args[1][: r.n_args])
    experts = {info.args[1][i] for i in r.expert_inputs} if r.ep_ok and n > 1 else set()
    for d, size in enumerate(r.grid):
        out_dims = [r.token_dim(o, d) for o in outs]
        if size % n or size < n or None in out_dims:
            continue
        in_dims = [r.token_dim(a.meta["val"], d) if a in args else None for a in info.inputs]
        if all(x is None for x in in_dims):
            continue
        opts.append(Option1D(tuple(R if x is None else Shard(x) for x in in_dims), tuple(Shard(x) for x in out_dims)))
        if experts and r.num_experts % n == 0:
            # expert parallelism: the experts split along dim 0 too, each (token, expert) pair sent to its
            # expert's rank and back (``regions._ep_experts``; priced by ``planner.internal_comm_time``)
            opts.append(Option1D(tuple(Shard(0) if a in experts else R if x is None else Shard(x)
                                       for a, x in zip(info.inputs, in_dims)), tuple(Shard(x) for x in out_dims)))
    return opts


def _expert_inputs(node, inputs) -> set[int]:
    """A token-local node's stacked expert weights may split their expert dim over several axes (nested
    expert parallelism, ``regions._ep_experts``)."""
    r = regions.region(node.args[0])
    ids = {id(node.args[1][i]) for i in r.expert_inputs}
    return {j for j, a in enumerate(inputs) if id(a) in ids}


NESTED_INPUTS[regions.OP] = _expert_inputs
