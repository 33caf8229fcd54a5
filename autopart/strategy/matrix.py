"""Matmul-family rules written once as einsum equations (``"mk,kn->mn"``), as DTensor does.

For an equation, each index letter gives one sharding: a letter kept in the output shards that dimension in
every operand holding it and in the output; a contracted letter shards it in the operands and leaves the output
``Partial``. The product is linear in each operand, so one ``Partial`` operand with the others replicated gives a
``Partial`` output. A bias added to a ``Partial`` product must itself be ``Partial`` (added once over the axis).
A product whose output one split cuts into blocks along its last dim (a fused projection,
``views.fused_blocks``) may also split that dim ``Strided``, with the weight's and the bias's matching dim.
"""

from __future__ import annotations

import torch

from autopart.placement import Placement, Shard, Strided
from autopart.strategy.registry import NodeInfo, Option1D, P, R, register

aten = torch.ops.aten


def einsum_options(equation: str) -> list[tuple[tuple[Placement, ...], Placement]]:
    lhs, out = equation.split("->")
    operands = lhs.split(",")
    letters = sorted(set("".join(operands)))
    opts: list[tuple[tuple[Placement, ...], Placement]] = [(tuple(R for _ in operands), R)]
    for c in letters:
        ins = tuple(Shard(op.index(c)) if c in op else R for op in operands)
        opts.append((ins, Shard(out.index(c)) if c in out else P))
    for i in range(len(operands)):
        opts.append((tuple(P if j == i else R for j in range(len(operands))), P))
    return opts


def _batch_letters(rank: int) -> str:
    return "abcdefgh"[: rank]


def _matmul_rule(equation: str, info: NodeInfo, tensor_args: list, bias_arg=None) -> list[Option1D]:
    """Map einsum options onto the node's distinct tensor inputs (an operand may repeat: ``mm(x, x)``)."""
    opts = []
    for ins, out in einsum_options(equation):
        placement: dict[int, Placement] = {}
        ok = True
        for a, p in zip(tensor_args, ins):
            i = info.index(a)
            if i is None:
                continue
            if i in placement and placement[i] != p:
                ok = False
            placement[i] = p
        if not ok:
            continue
        bi = info.index(bias_arg)
        if bi is not None:
            bias_shape = info.shape(bi)
            if out == P:
                bp: Placement = P
            elif isinstance(out, Shard) and out.dim == len(info.out_shape) - 1 and bias_shape and bias_shape[-1] > 1:
                bp = Shard(len(bias_shape) - 1)
            elif isinstance(out, Shard) and len(bias_shape) == len(info.out_shape) and bias_shape[out.dim] > 1:
                bp = Shard(out.dim)
            else:
                bp = R
            placement[bi] = bp
        if len(placement) != len(info.inputs):
            continue
        opts.append(Option1D(tuple(placement[i] for i in range(len(info.inputs))), out))
    return opts + _strided(equation, info, tensor_args, bias_arg)


def _strided(equation: str, info: NodeInfo, tensor_args: list, bias_arg) -> list[Option1D]:
    """The fused-projection option: the output's last dim ``Strided`` in the blocks one split cuts it into, with
    every operand holding that letter (the weight) and the bias split alike, the rest whole."""
    from autopart.strategy.views import fused_blocks

    lhs, out = equation.split("->")
    c = out[-1]
    k = fused_blocks(info.node, -1) if info.node is not None else None
    if not k:
        return []
    placement: dict[int, Placement] = {}
    for a, op in zip(tensor_args, lhs.split(",")):
        i = info.index(a)
        if i is None:
            continue
        p = Strided.of(op.index(c), k) if c in op else R
        if placement.get(i, p) != p:
            return []
        placement[i] = p
    bi = info.index(bias_arg)
    if bi is not None:
        bias_shape = info.shape(bi)
        if bi in placement or not bias_shape or bias_shape[-1] != info.out_shape[-1]:
            return []
        placement[bi] = Strided.of(len(bias_shape) - 1, k)
    if len(placement) != len(info.inputs) or not any(isinstance(p, Strided) for p in placement.values()):
        return []
    return [Option1D(tuple(placement[i] for i in range(len(info.inputs))), Strided.of(len(info.out_shape) - 1, k))]


@register(aten.linear.default)
def _linear(info: NodeInfo, n: int) -> list[Option1D]:
    x, w = info.args[0], info.args[1]
    b = info.args[2] if len(info.args) > 2 else None
    batch = _batch_letters(len(info.shape(info.index(x))) - 1)
    return _matmul_rule(f"{batch}k,nk->{batch}n", info, [x, w], b)


@register(aten.addmm.default)
def _addmm(info: NodeInfo, n: int) -> list[Option1D]:
    b, x, w = info.args[0], info.args[1], info.args[2]
    return _matmul_rule("mk,kn->mn", info, [x, w], b)


@register(aten.mm.default)
def _mm(info: NodeInfo, n: int) -> list[Option1D]:
    return _matmul_rule("mk,kn->mn", info, [info.args[0], info.args[1]])


@register(aten.bmm.default)
def _bmm(info: NodeInfo, n: int) -> list[Option1D]:
    return _matmul_rule("bmk,bkn->bmn", info, [info.args[0], info.args[1]])


@register(aten.outer.default)
def _outer(info: NodeInfo, n: int) -> list[Option1D]:
    return _matmul_rule("m,n->mn", info, [info.args[0], info.args[1]])


@register(aten.matmul.default)
def _matmul(info: NodeInfo, n: int) -> list[Option1D]:
    a, b = info.args[0], info.args[1]
    ra, rb = len(info.shape(info.index(a))), len(info.shape(info.index(b)))
    if ra < 2 or rb < 2:
        from autopart.strategy.registry import replicate_only

        return replicate_only(info, n)
    nb = max(ra, rb) - 2
    batch = _batch_letters(nb)
    ea = batch[nb - (ra - 2):] + "mk"
    eb = batch[nb - (rb - 2):] + "kn"
    return _matmul_rule(f"{ea},{eb}->{batch}mn", info, [a, b])
