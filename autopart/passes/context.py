"""context: lower context-parallel attention to ``autopart.runtime.context``.

Requires: ``annotate`` and ``insert_collectives`` ran (q, k, v reach the node ``Shard(2)`` on the sequence axis).
Ensures: every ``scaled_dot_product_attention`` node whose output is ``Shard(2)`` on a mesh axis calls
``autopart.runtime.context.context_attention(q, k, v, axis, strategy, is_causal, scale, layout, attn_mask)`` instead
(the mask, if any, split on its query rows), with the strategy the plan chose (the node record's ``tag``: ``"cp_ring"``
or ``"cp_allgather"``) and the layout of the rows each rank holds: ``"contiguous"`` (rank i holds the i-th n-th of the
sequence) or, when the attention is causal and ``strategy.context.balanced_ok`` holds, ``"balanced"`` (chunks i and
2n−1−i). A balanced program runs on the permuted sequence: ``arange(s)`` position sources become
``runtime.context.sequence_positions``, causal attention not split on the sequence gets the mask of the permuted
positions, and ``gm.meta["autopart.context"]`` (``{"axis", "n", "s", "layout"}``) tells the runtime to permute user
inputs and un-permute outputs.

Grouped-query attention whose heads are split over more devices of an axis than it has K/V heads, K and V reaching
it whole on that axis (``strategy.context.gqa_split``), reads its one K/V head: the node's key and value go through
``autopart.runtime.context.kv_heads_for_rank(x, axis)`` first (the lowering composes with the sequence split of
another axis, which then exchanges that head).

State-space sequence ops (``strategy.context.SEQUENCE_OPS``) whose output is ``Shard(1)`` on a mesh axis call
``autopart.runtime.ssm.context_scan`` (``"cp_state"``) or ``context_conv1d`` (``"cp_halo"``) on that axis; they
need the contiguous layout, which ``balanced_ok`` guarantees (they block the balanced one).
"""

from __future__ import annotations

import torch.fx as fx

from autopart.placement import Shard
from autopart.runtime import context as RC
from autopart.strategy import tensor_inputs
from autopart.strategy.context import (
    ATTENTION_TAGS,
    SDPA,
    SEQUENCE_OPS,
    _sdpa_args,
    balanced_ok,
    gqa_split,
    position_source,
)


def _cp_nodes(gm: fx.GraphModule) -> list[tuple[fx.Node, int]]:
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == SDPA:
            axes = [i for i, p in enumerate(node.meta.get("autopart.output") or ()) if p == Shard(2)]
            if axes:
                out.append((node, axes[0]))
    return out


def _balance(gm: fx.GraphModule, cp: list[tuple[fx.Node, int]], mesh_shape) -> dict | None:
    """The balanced layout's record when it applies (one axis, one length, a causal attention, nothing blocking)."""
    shapes = {(axis, node.meta["val"].shape[2]) for node, axis in cp}
    if len(shapes) != 1 or not any(_sdpa_args(node)["is_causal"] for node, _ in cp):
        return None
    axis, s = shapes.pop()
    n = mesh_shape[axis]
    return {"axis": axis, "n": n, "s": s, "layout": "balanced"} if balanced_ok(gm.graph, s, n) else None


def _rewrite_positions(gm: fx.GraphModule, ctx: dict) -> None:
    for node in list(gm.graph.nodes):
        if position_source(node, ctx["s"]):
            kw = {k: v for k, v in node.kwargs.items() if k in ("dtype", "device")}
            node.target, node.args, node.kwargs = RC.sequence_positions, (ctx["s"], ctx["n"]), kw
        elif node.op == "call_function" and node.target == SDPA and _sdpa_args(node)["is_causal"] \
                and node.meta["val"].shape[2] == ctx["s"]:
            a = _sdpa_args(node)
            node.target = RC.permuted_causal_attention
            node.args = (a["query"], a["key"], a["value"], ctx["n"], a["scale"], bool(a["enable_gqa"]))
            node.kwargs = {}


def _lower_sequence_op(node: fx.Node, plan) -> bool:
    from autopart.runtime import ssm as RS

    axes = [i for i, p in enumerate(node.meta.get("autopart.output") or ()) if p == Shard(1)]
    if not axes:
        return False
    tag, want = plan.nodes.get(node.name, {}).get("tag", ""), SEQUENCE_OPS[node.target]
    if tag != want:
        raise ValueError(f"node {node.name} splits {node.target} over the sequence on mesh axis {axes[0]} but its "
                         f"plan record names strategy {tag!r}, not {want!r}: the plan was made by an older autopart "
                         f"or edited by hand; re-plan")
    node.target = RS.context_scan if tag == "cp_state" else RS.context_conv1d
    node.kwargs = {**node.kwargs, "axis": axes[0]}
    return True


def _lower_gqa(gm: fx.GraphModule, mesh_shape: tuple[int, ...]) -> bool:
    changed = False
    for node in list(gm.graph.nodes):
        specs = node.meta.get("autopart.inputs")
        if node.op != "call_function" or node.target != SDPA or specs is None:
            continue
        split = gqa_split(node, tensor_inputs(node), specs, mesh_shape)  # conversions carry the traced value
        if not split:
            continue
        a = _sdpa_args(node)
        for key in ("key", "value"):
            x = a[key]
            with gm.graph.inserting_before(node):
                y = gm.graph.call_function(RC.kv_heads_for_rank, (x, split.axis))
            y.meta["autopart.output"] = x.meta.get("autopart.output")
            node.replace_input_with(x, y)
        changed = True
    return changed


def context_parallel(gm: fx.GraphModule, plan) -> tuple[fx.GraphModule, bool]:
    changed = _lower_gqa(gm, tuple(plan.mesh_shape))
    cp = _cp_nodes(gm)
    ctx = _balance(gm, cp, tuple(plan.mesh_shape)) if cp else None
    layout = "balanced" if ctx else "contiguous"
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in SEQUENCE_OPS:
            changed |= _lower_sequence_op(node, plan)
        if node.op != "call_function" or node.target != SDPA:
            continue
        out = node.meta.get("autopart.output") or ()
        axes = [i for i, p in enumerate(out) if p == Shard(2)]
        if not axes:
            continue
        tag = plan.nodes.get(node.name, {}).get("tag", "")
        if tag not in ATTENTION_TAGS:
            raise ValueError(f"node {node.name} splits attention over the sequence on mesh axis {axes[0]} but its "
                             f"plan record names no context-parallel strategy (tag {tag!r}, expected one of "
                             f"{ATTENTION_TAGS}): the plan was made by an older autopart or edited by hand; re-plan")
        a = _sdpa_args(node)
        node.target = RC.context_attention
        node.args = (a["query"], a["key"], a["value"], axes[0], tag, bool(a["is_causal"]), a["scale"], layout,
                     a["attn_mask"])
        node.kwargs = {}
        changed = True
    if ctx:
        _rewrite_positions(gm, ctx)
        gm.meta["autopart.context"] = ctx
    return gm, changed
