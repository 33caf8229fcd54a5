"""insert_collectives: make every edge's placements agree by inserting autograd-aware conversions.

Requires: ``annotate`` ran. Ensures: for every decided node and each tensor input, the value reaching it has
exactly the spec in ``meta["autopart.inputs"]``; graph outputs are Replicate on every axis. Conversions follow
``autopart.planner.conversion_steps`` (the same table the cost model prices), one call per mesh axis, and
identical conversions of one value are shared between users.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopart.placement import Replicate
from autopart.planner import conversion_steps
from autopart.runtime import collectives as C
from autopart.strategy import tensor_inputs

Spec = tuple


def _split(node: fx.Node, axes: int) -> tuple[bool, ...]:
    ins = node.meta["autopart.inputs"]
    out = node.meta["autopart.output"]
    outs = out if out and isinstance(out[0], tuple) else (out,)
    return tuple(any(not isinstance(s[i], Replicate) for s in ins) or
                 any(not isinstance(o[i], Replicate) for o in outs) for i in range(axes))


def _emit(graph: fx.Graph, value: fx.Node, src: Spec, dst: Spec, split, needs_grad, mesh_shape,
          reduced=(), reduce_dtype: str | None = None) -> fx.Node:
    steps = conversion_steps(src, dst, split, needs_grad, mesh_shape, reduced)
    if steps is None:
        raise AssertionError(f"plan asks for impossible conversion {src} -> {dst} of {value.name}")
    cur = value
    spec = list(src)
    for st in steps:
        a, b = st.src, st.dst
        if st.fwd == "none":
            cur = graph.call_function(C.grad_all_reduce, (cur, st.axis))
        elif st.fwd == "all_gather" and value.meta.get("autopart.regather"):
            cur = graph.call_function(C.all_gather_param, (cur, st.axis, a.dim, st.bwd, reduce_dtype))
        elif st.fwd == "all_gather" and needs_grad and value.op == "call_function":
            # an activation: a user that saves it gathered keeps the shard (autopart.planner.regather_spec)
            cur = graph.call_function(C.all_gather_activation, (cur, st.axis, a.dim, st.bwd))
        elif st.fwd == "all_gather":
            cur = graph.call_function(C.all_gather, (cur, st.axis, a.dim, st.bwd))
        elif st.fwd == "all_reduce":
            cur = graph.call_function(C.all_reduce, (cur, st.axis, st.bwd))
        elif st.fwd == "shard":
            cur = graph.call_function(C.shard, (cur, st.axis, b.dim))
        elif st.fwd == "reduce_scatter":
            cur = graph.call_function(C.reduce_scatter, (cur, st.axis, b.dim))
        elif st.fwd == "all_to_all":
            cur = graph.call_function(C.all_to_all, (cur, st.axis, a.dim, b.dim))
        elif st.fwd == "mask":
            cur = graph.call_function(C.mask_partial, (cur, st.axis))
        spec[st.axis] = b
        cur.meta["autopart.output"] = tuple(spec)
        cur.meta["autopart.collective"] = (st.fwd, st.bwd, st.axis)
        if "val" in value.meta:
            cur.meta["val"] = value.meta["val"]
    return cur


def insert_collectives(gm: fx.GraphModule, mesh_shape: tuple[int, ...], needs_grad: dict[str, bool],
                       reduce_dtype: str | None = None) -> tuple[fx.GraphModule, bool]:
    """``reduce_dtype``: the dtype ZeRO-3 parameters' gradients are reduce-scattered in (``PlanOptions.reduce_dtype``;
    None: their own)."""
    graph = gm.graph
    changed = False
    cache: dict = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or "autopart.inputs" not in node.meta:
            continue
        split = _split(node, len(mesh_shape))
        for j, a in enumerate(tensor_inputs(node)):
            src = a.meta.get("autopart.output")
            dst = node.meta["autopart.inputs"][j]
            if src is None or src == dst and not any(split):
                continue
            base = a.args[0] if a.op == "call_function" and getattr(a.target, "__name__", "") == "getitem" else a
            g = needs_grad.get(base.name, False)
            reduced = _reduced_tuple(base, len(mesh_shape))
            key = (a, dst, split if g else None)
            if key not in cache:
                with graph.inserting_before(node):
                    cache[key] = _emit(graph, a, src, dst, split, g, mesh_shape, reduced, reduce_dtype)
            new = cache[key]
            if new is not a:
                node.replace_input_with(a, new)
                changed = True
    out = next(iter(graph.find_nodes(op="output")))
    leaves, tree = torch.utils._pytree.tree_flatten(out.args)
    rr = tuple(Replicate() for _ in mesh_shape)
    new_args = []
    for a in leaves:
        if isinstance(a, fx.Node) and a.meta.get("autopart.output") not in (None, rr) \
                and not isinstance(a.meta["autopart.output"][0], tuple):
            base = a.args[0] if a.op == "call_function" and getattr(a.target, "__name__", "") == "getitem" else a
            with graph.inserting_before(out):
                a = _emit(graph, a, a.meta["autopart.output"], rr, (False,) * len(mesh_shape),
                          needs_grad.get(base.name, False), mesh_shape)
            changed = True
        new_args.append(a)
    out.args = torch.utils._pytree.tree_unflatten(new_args, tree)
    return gm, changed


def _reduced_tuple(node: fx.Node, axes: int) -> tuple[bool, ...]:
    red = node.meta.get("autopart.reduced")
    if not red:
        return ()
    return tuple(i in red for i in range(axes))
