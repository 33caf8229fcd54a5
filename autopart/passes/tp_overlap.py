"""tp_overlap: tensor-parallel communication overlap, the collectives next to a linear run as collective matmuls.

Requires: ``insert_collectives`` and ``lower`` ran. Ensures, where ``plan.options["tp_comm_overlap"]`` is true
(``planner.PlanOptions.tp_comm_overlap``; nothing changes where it is false or a pattern does not match):

- an all-gather of an activation (``all_gather`` / ``all_gather_activation``, Megatron sequence parallelism's gather
  before the column-parallel matmuls) whose every user is an ``aten.linear`` taking it as its input (not as weight
  or bias), on a dimension other than the last, becomes one ``all_gather_linear`` call computing all those linears
  (Q, K and V share one gather); each linear becomes a ``getitem`` of it, keeping its name and meta;
- an ``aten.linear`` whose only user is a ``reduce_scatter`` on a dimension other than the last (the row-parallel
  matmul's partial sums, scattered along the sequence) becomes ``linear_reduce_scatter``, keeping the linear's name;
  the reduce-scatter's users read it.

Both run their collective as ring steps behind the matmuls of the pieces already exchanged (Wang et al., ASPLOS'23;
``runtime.collectives``), forward and backward; ``planner.tp_overlap_hidden`` prices the same patterns. The
weights and biases of a gather's linears are moved before the first of them if they were computed after it (a
ZeRO-3 parameter's gather).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopart.planner import linear_input_fused, linear_output_fused
from autopart.runtime import collectives as C

_GATHERS = (C.all_gather, C.all_gather_activation)


def _not_last(dim: int, node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() >= 2 and dim % val.dim() != val.dim() - 1


def _hoist(node, before: fx.Node, pos: dict[fx.Node, int]) -> None:
    """Move ``node`` (and what it is computed from) before ``before`` if it comes after it."""
    if not isinstance(node, fx.Node) or pos[node] < pos[before]:
        return
    for a in node.all_input_nodes:
        _hoist(a, before, pos)
    before.prepend(node)
    pos[node] = pos[before] - 0.5  # before ``before``, after what was hoisted before it


def _fuse_gather(graph: fx.Graph, gather: fx.Node, pos: dict[fx.Node, int]) -> bool:
    x, axis, dim, bwd = gather.args
    users = sorted(gather.users, key=pos.__getitem__)
    if not linear_input_fused(gather) or not _not_last(dim, gather):
        return False
    first = users[0]
    weights = tuple(u.args[1] for u in users)
    biases = tuple(u.args[2] if len(u.args) > 2 else None for u in users)
    for a in weights + biases:
        _hoist(a, first, pos)
    with graph.inserting_before(first):
        fused = graph.call_function(C.all_gather_linear, (x, axis, dim, bwd, weights, biases))
    fused.meta["val"] = tuple(u.meta.get("val") for u in users)
    fused.meta["autopart.tp_overlap"] = ("all_gather", bwd, axis)
    if "nn_module_stack" in first.meta:  # the first linear's module: a selective checkpoint region finds it there
        fused.meta["nn_module_stack"] = first.meta["nn_module_stack"]
    pos[fused] = pos[first] - 0.5
    for i, u in enumerate(users):
        u.target, u.args, u.kwargs = operator.getitem, (fused, i), {}
        u.meta.pop("autopart.inputs", None)  # its inputs are the fused call's now, which verify does not check
    graph.erase_node(gather)
    return True


def _fuse_scatter(graph: fx.Graph, scatter: fx.Node) -> bool:
    lin, axis, dim = scatter.args
    if not linear_output_fused(lin) or not _not_last(dim, lin):
        return False
    x, w = lin.args[0], lin.args[1]
    b = lin.args[2] if len(lin.args) > 2 else None
    lin.target, lin.args = C.linear_reduce_scatter, (x, w, b, axis, dim)
    lin.meta["autopart.output"] = scatter.meta["autopart.output"]
    lin.meta["autopart.tp_overlap"] = ("reduce_scatter", "all_gather", axis)
    scatter.replace_all_uses_with(lin)
    graph.erase_node(scatter)
    return True


def tp_overlap(gm: fx.GraphModule, plan) -> tuple[fx.GraphModule, bool]:
    if not plan.options.get("tp_comm_overlap"):
        return gm, False
    graph = gm.graph
    pos = {n: i for i, n in enumerate(graph.nodes)}
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _GATHERS:
            changed |= _fuse_gather(graph, node, pos)
        elif node.target is C.reduce_scatter and isinstance(node.args[0], fx.Node):
            changed |= _fuse_scatter(graph, node)
    return gm, changed
