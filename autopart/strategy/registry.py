"""The strategy registry: for each ATen op, its legal shardings on one mesh axis.

A *rule* sees one node and answers, for a single mesh axis of size ``n``, the list of legal
``Option1D(inputs, output)``: one placement per distinct tensor input, and the output's placement (a tuple for
ops with several outputs). ``options_for`` combines the per-axis answers across the mesh axes and drops any
combination that would need uneven shards. Rules are registered by decorator, keyed by ``OpOverload`` or by
``OpOverloadPacket`` (all overloads). An op without a rule gets the safe default, everything replicated, and is
reported in the plan.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autopart.placement import Partial, Placement, Replicate, Spec, Strided, is_shard

R = Replicate()
P = Partial()


@dataclass(frozen=True)
class Option1D:
    inputs: tuple[Placement, ...]
    output: Any  # Placement, or tuple[Placement, ...] for multi-output ops


@dataclass(frozen=True)
class OpOption:
    """One legal sharding of a node over the whole mesh."""

    inputs: tuple[Spec, ...]
    output: Any  # Spec, or tuple[Spec, ...] for multi-output ops
    tag: str = ""  # a variant with the same placements: "zero3" = a sharded parameter re-gathered for backward

    def __str__(self) -> str:
        text = self.__dict__.get("_text")  # memoised: every plan's record prints each node's options
        if text is None:
            from autopart.placement import spec_str

            out = self.output
            outs = "(" + ",".join(spec_str(o) for o in out) + ")" if out and isinstance(out[0], tuple) \
                else spec_str(out)
            text = f"{','.join(spec_str(i) for i in self.inputs) or '-'} -> {outs}" + \
                (f" [{self.tag}]" if self.tag else "")
            object.__setattr__(self, "_text", text)
        return text

    def __hash__(self) -> int:
        # memoised (the dataclass's hash walks every placement, in Python, on each lookup of the planner's caches);
        # not pickled: a string's hash differs between processes
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.inputs, self.output, self.tag))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}


Rule = Callable[["NodeInfo", int], list[Option1D]]
_RULES: dict[Any, Rule] = {}


def register(*ops: Any) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for op in ops:
            _RULES[op] = fn
        _OPTIONS_CACHE.clear()
        return fn

    return deco


def rule_for(target: Any) -> Rule | None:
    if target in _RULES:
        return _RULES[target]
    packet = getattr(target, "overloadpacket", None)
    if packet is not None and packet in _RULES:
        return _RULES[packet]
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        from autopart.strategy.pointwise import pointwise_rule

        return pointwise_rule
    return None


def is_tensor_node(a: Any) -> bool:
    return isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """Distinct tensor-valued fx nodes among the node's inputs, in first-use order."""
    out: list[fx.Node] = []
    for a in node.all_input_nodes:
        if is_tensor_node(a) and a not in out:
            out.append(a)
    return out


@dataclass
class NodeInfo:
    """What a rule needs to know about a node: its inputs' and outputs' shapes and the call's arguments."""

    node: fx.Node
    inputs: list[fx.Node]

    @property
    def args(self) -> tuple:
        return self.node.args

    @property
    def kwargs(self) -> dict:
        return self.node.kwargs

    @property
    def val(self) -> Any:
        return self.node.meta.get("val")

    def shape(self, i: int) -> tuple[int, ...]:
        return tuple(self.inputs[i].meta["val"].shape)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.val.shape)

    def index(self, arg: Any) -> int | None:
        return self.inputs.index(arg) if isinstance(arg, fx.Node) and arg in self.inputs else None


def replicate_only(info: NodeInfo, n: int) -> list[Option1D]:
    out = info.val
    outp = tuple(R for _ in out) if isinstance(out, (tuple, list)) else R
    return [Option1D(tuple(R for _ in info.inputs), outp)]


def _shape_of(v: Any) -> tuple[int, ...] | None:
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _divisible(shape: tuple[int, ...] | None, placements: list[Placement], sizes: list[int],
               nested: bool = False) -> bool:
    """Even shards of ``shape`` under ``placements``. A dim split on several axes holds its pieces nested in mesh
    order (DTensor's order): any dim where ``nested`` (expert weights, ``NESTED_INPUTS``), and dim 0 everywhere
    (data parallelism over several axes: the batch, or whatever dim 0 holds, split into as many pieces as the axes
    have devices together; a per-axis rule's option stays right on each piece, since dim 0 maps to dim 0 wherever
    it nests: a rule moving it to another dim nests that dim, which is refused). Where micro-batches follow, the
    planner keeps the nesting to the data-parallel axes (``planner._batch_nesting``)."""
    if shape is None:
        return all(not is_shard(p) for p in placements)
    used: dict[int, int] = {}
    strided: set[int] = set()
    for p, n in zip(placements, sizes):
        if is_shard(p):
            if not shape:
                return False
            d = p.dim % len(shape)
            ways = used.get(d, 1) * n
            if (d in used and (not (nested or d == 0) or d in strided or isinstance(p, Strided))) or \
                    shape[d] % ways != 0 or shape[d] < ways:
                return False
            if isinstance(p, Strided):  # each of its blocks splits evenly
                if not p.fits(shape[d], n):
                    return False
                strided.add(d)
            used[d] = ways
    return True


# per op: node -> the indices (into its distinct tensor inputs) that may be split on one dim over several mesh
# axes (a token-local node's stacked expert weights: ``autopart.strategy.moe``)
NESTED_INPUTS: dict[Any, Callable[[fx.Node, list[fx.Node]], set[int]]] = {}
# per op: (node, its distinct tensor inputs, the option's input specs (one per input, a placement per axis), mesh
# shape) -> whether the per-axis options combine into a legal mesh-wide one, for ops where that depends on more than
# each axis' evenness (grouped-query attention's K/V heads kept whole over an axis: ``strategy.context.gqa_split``)
COMBO_CHECKS: dict[Any, Callable[[fx.Node, list[fx.Node], tuple, tuple[int, ...]], bool]] = {}


def _sig(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), v.dtype)
    if isinstance(v, (tuple, list)):
        return tuple(_sig(x) for x in v)
    return repr(v)


def _call_key(node: fx.Node, inputs: list[fx.Node], mesh_shape: tuple[int, ...]) -> Any:
    """What a rule can see of a call: target, mesh, arguments (tensor inputs by position and shape), output."""
    def enc(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("in", inputs.index(a)) if a in inputs else ("node", _sig(a.meta.get("val")))
        if isinstance(a, (tuple, list)):
            return (type(a).__name__, tuple(enc(x) for x in a))
        if isinstance(a, dict):
            return tuple(sorted((k, enc(v)) for k, v in a.items()))
        return repr(a)

    return (node.target, tuple(mesh_shape), enc(node.args), enc(dict(node.kwargs)),
            tuple(_sig(a.meta.get("val")) for a in inputs), _sig(node.meta.get("val")), _blocks(node))


def _blocks(node: fx.Node) -> tuple:
    """What the rules that offer ``Strided`` see beyond the call (``views.fused_blocks``): into what blocks the
    consumers cut each dim of the output and of the first input (a split's parts, a slice's block)."""
    from autopart.strategy.views import fused_blocks

    val = node.meta.get("val")
    out = tuple(fused_blocks(node, d) for d in range(val.dim())) if isinstance(val, torch.Tensor) else ()
    src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    sval = src.meta.get("val") if src is not None else None
    ins = tuple(fused_blocks(src, d) for d in range(sval.dim())) if isinstance(sval, torch.Tensor) else ()
    return out, ins


_OPTIONS_CACHE: dict[Any, tuple[list[OpOption], bool]] = {}


def options_for(node: fx.Node, mesh_shape: tuple[int, ...]) -> tuple[list[OpOption], bool]:
    """All legal mesh-wide options of ``node``; the flag says whether a real rule (not the default) produced them.
    Memoised on what the rules see (``_call_key``): the repeated blocks of a model, and the same model on other
    meshes, list each distinct call once."""
    inputs = tensor_inputs(node)
    try:
        key = _call_key(node, inputs, mesh_shape)
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _OPTIONS_CACHE:
        opts, known = _OPTIONS_CACHE[key]
        return list(opts), known
    out = _options_for(node, inputs, mesh_shape)
    if key is not None:
        if len(_OPTIONS_CACHE) > 200_000:
            _OPTIONS_CACHE.clear()
        _OPTIONS_CACHE[key] = (list(out[0]), out[1])
    return out


def _options_for(node: fx.Node, inputs: list[fx.Node], mesh_shape: tuple[int, ...]) -> tuple[list[OpOption], bool]:
    info = NodeInfo(node, inputs)
    rule = rule_for(node.target)
    known = rule is not None
    per_axis = [(rule or replicate_only)(info, n) if n > 1 else replicate_only(info, n) for n in mesh_shape]
    out_val = info.val
    multi = isinstance(out_val, (tuple, list))
    in_shapes = [info.shape(i) for i in range(len(info.inputs))]
    options = []
    nested = NESTED_INPUTS[node.target](node, inputs) if node.target in NESTED_INPUTS else set()
    for combo in itertools.product(*per_axis):
        ok = True
        for i, shp in enumerate(in_shapes):
            if not _divisible(shp, [c.inputs[i] for c in combo], list(mesh_shape), i in nested):
                ok = False
                break
        if not ok:
            continue
        if multi:
            for j, v in enumerate(out_val):
                if not _divisible(_shape_of(v), [c.output[j] for c in combo], list(mesh_shape)):
                    ok = False
                    break
            if not ok:
                continue
            output = tuple(tuple(c.output[j] for c in combo) for j in range(len(out_val)))
        else:
            if not _divisible(_shape_of(out_val), [c.output for c in combo], list(mesh_shape)):
                continue
            output = tuple(c.output for c in combo)
        inputs = tuple(tuple(c.inputs[i] for c in combo) for i in range(len(info.inputs)))
        if node.target in COMBO_CHECKS and not COMBO_CHECKS[node.target](node, info.inputs, inputs,
                                                                         tuple(mesh_shape)):
            continue
        options.append(OpOption(inputs, output))
    if not options:  # every sharded option was uneven: replicate is always legal
        base = replicate_only(info, 1)[0]
        options.append(OpOption(tuple(tuple(base.inputs[i] for _ in mesh_shape) for i in range(len(info.inputs))),
                                tuple(tuple(o for _ in mesh_shape) for o in base.output) if multi
                                else tuple(base.output for _ in mesh_shape)))
    return options, known
