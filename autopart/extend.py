"""Teach autopart an op it does not know: a custom op (``torch.library.custom_op``) or an ATen op without a rule.

An op with no sharding rule still plans and runs: it gets the safe default, every input and output replicated
(gathered before it, computed whole on every rank), and the plan lists it in ``plan.unsupported_ops``. To let the
solver shard it, register a rule; to price its compute, a FLOP count::

    import autopart

    autopart.register_op(torch.ops.mylib.fused_gelu.default, sharding="pointwise",
                         flops=lambda args, kwargs, out: 8 * out.numel())

``sharding`` is ``"pointwise"`` (elementwise: any dimension of the output may be sharded, inputs alike, size-1
inputs broadcast), ``"replicate"``, or a function ``rule(info, n) -> list[Option1D]`` giving the legal placements
on one mesh axis of ``n`` devices (``info``: ``autopart.strategy.NodeInfo`` -- ``info.shape(i)``, ``info.out_shape``,
``info.args``); the solver combines them over the mesh axes and keeps only even shards::

    from autopart.strategy import Option1D
    from autopart.placement import Replicate as R, Shard, Partial

    def rowwise(info, n):  # out = op(x): rows are independent
        return [Option1D((R(),), R()), Option1D((Shard(0),), Shard(0))]

    autopart.register_op(torch.ops.mylib.rownorm.default, sharding=rowwise)

Rules receive local shards at run time: the op must compute on a shard what the rule says (a pointwise op does).
``flops(args, kwargs, out) -> int`` receives the traced tensors (read ``.shape``); backward is priced as once more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autopart.strategy.registry import _OPTIONS_CACHE, _RULES, Option1D, replicate_only


def register_op(op: Any, sharding: str | Callable | None = "pointwise",
                flops: Callable[[tuple, dict, Any], int] | None = None) -> None:
    """Register a sharding rule (and optionally a FLOP count) for ``op``, an ``OpOverload`` or ``OpOverloadPacket``
    (all its overloads). Registering again replaces the earlier rule."""
    if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        raise TypeError(f"register_op needs an op such as torch.ops.mylib.my_op.default, got {op!r} "
                        f"({type(op).__name__}); a Python function must become a torch.library.custom_op first")
    if sharding is not None:
        if sharding == "pointwise":
            from autopart.strategy.pointwise import pointwise_rule

            rule = pointwise_rule
        elif sharding == "replicate":
            rule = replicate_only
        elif callable(sharding):
            rule = _checked(op, sharding)
        else:
            raise ValueError(f"sharding={sharding!r}: use 'pointwise', 'replicate' or a function (info, n) -> "
                             "list[Option1D]")
        _RULES[op] = rule
    if flops is not None:
        from autopart.cost.compute import _FORMULAS, _packet

        _FORMULAS[_packet(op)] = flops
    _OPTIONS_CACHE.clear()  # options memoised before this rule existed


def _checked(op: Any, rule: Callable) -> Callable:
    def wrapped(info, n):
        opts = rule(info, n)
        if not isinstance(opts, list) or not all(isinstance(o, Option1D) for o in opts):
            raise TypeError(f"the sharding rule registered for {op} returned {opts!r}; it must return a list of "
                            "autopart.strategy.Option1D(inputs, output)")
        for o in opts:
            if len(o.inputs) != len(info.inputs):
                raise ValueError(f"the sharding rule registered for {op} gave {len(o.inputs)} input placements for "
                                 f"node {info.node.name}, which has {len(info.inputs)} tensor inputs")
        return opts

    return wrapped
