"""lower: give each decided node the local program its option needs.

Requires: ``annotate`` and ``insert_collectives`` ran. Ensures: size arguments of view/reshape/expand are the
local shapes; options whose local program is not "the same op on the shard" are replaced: vocab-parallel
embedding (rows sharded, Partial output), cross-entropy over a sharded batch (sum / global count), mean over a
sharded dimension (divided by the axis size, Partial); a token-local module's node calls the module
(``autopart.regions.run``); a split of a ``Strided`` fused projection cuts the rank's piece of each block (its
sizes divided by the axis sizes); a grouped convolution split by channels convolves its share of the groups;
``repeat_interleave``'s ``output_size`` is the rank's length.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopart import regions
from autopart.placement import Partial, Shard, Strided, local_shape
from autopart.planner import ep_axes
from autopart.runtime import collectives as C
from autopart.strategy.views import slice_block

aten = torch.ops.aten
_SIZE_ARG_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
                 aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default}


def _strided_ways(spec, mesh_shape, block=None) -> int:
    """Over how many ranks a ``Strided`` input's blocks are split (1: it is not strided); with a slice's
    ``block`` (dim, start, length), only a layout strided along that dim counts (a slice along another dim keeps
    its bounds)."""
    ways = 1
    for p, n in zip(spec, mesh_shape):
        ways *= n if isinstance(p, Strided) and (block is None or p.dim == block[0]) else 1
    return ways


def _channels(p) -> bool:
    """``p`` splits a convolution input's channels (dim 1), plainly or in blocks."""
    return isinstance(p, (Shard, Strided)) and p.dim == 1


def lower(gm: fx.GraphModule, mesh_shape: tuple[int, ...]) -> tuple[fx.GraphModule, bool]:
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        out = node.meta.get("autopart.output")
        ins = node.meta.get("autopart.inputs")
        if node.op != "call_function" or out is None or ins is None:
            continue
        val = node.meta.get("val")
        if node.target is regions.OP:
            # the module's own forward on this rank's tokens, autograd through it; its experts split over ep_axes
            node.args = (node.args[0], node.args[1], ep_axes(node, ins))
            node.target = regions.run
            changed = True
        elif node.target in _SIZE_ARG_OPS:
            loc = list(local_shape(tuple(val.shape), out, mesh_shape))
            node.args = (node.args[0], loc) + tuple(node.args[2:])
            changed = True
        elif node.target == aten.embedding.default:
            w_spec = ins[0] if node.args[0] is node.all_input_nodes[0] else ins[1]
            vocab_axes = [i for i, p in enumerate(w_spec) if p == Shard(0)]
            if vocab_axes:
                extra = tuple(node.args[2:])
                node.target = C.vocab_parallel_embedding
                node.args = (node.args[0], node.args[1], vocab_axes[0]) + extra
                changed = True
        elif node.target == aten.cross_entropy_loss.default and (
                any(isinstance(p, Partial) for p in out) or any(p == Shard(1) for p in ins[0])):
            batch_axes = tuple(i for i, p in enumerate(out) if isinstance(p, Partial))
            vocab = [i for i, p in enumerate(ins[0]) if p == Shard(1)]
            args = list(node.args) + [None, 1, -100, 0.0][len(node.args) - 2:]
            reduction = node.kwargs.get("reduction", args[3])
            ignore = node.kwargs.get("ignore_index", args[4])
            node.target = C.sharded_cross_entropy
            node.args = (args[0], args[1], batch_axes, vocab[0] if vocab else None, reduction, ignore)
            node.kwargs = {}
            changed = True
        elif node.target in (aten.split.Tensor, aten.split_with_sizes.default) and \
                (ways := _strided_ways(ins[0], mesh_shape)) > 1:
            size = node.args[1]
            size = [s // ways for s in size] if isinstance(size, (list, tuple)) else size // ways
            node.args = (node.args[0], size) + tuple(node.args[2:])
            changed = True
        elif node.target == aten.tensor_split.indices and (ways := _strided_ways(ins[0], mesh_shape)) > 1:
            # cut at block bounds (the rule offers Strided only there): the same bounds in the rank's piece
            node.args = (node.args[0], [i // ways for i in node.args[1]]) + tuple(node.args[2:])
            changed = True
        elif node.target == aten.slice.Tensor and (block := slice_block(node)) and \
                (ways := _strided_ways(ins[0], mesh_shape, block)) > 1:
            # one block of a strided fused projection: its bounds in the rank's piece of every block
            dim, start, length = block
            node.args = (node.args[0], dim, start // ways, (start + length) // ways)
            changed = True
        elif node.target == aten.conv1d.default and any(_channels(p) for p in ins[0]):
            # a grouped convolution whose groups split over ranks (``strategy.nn._conv1d``): the rank's groups
            ways = 1
            for p, n in zip(ins[0], mesh_shape):
                ways *= n if _channels(p) else 1
            args = list(node.args) + [None, [1], [0], [1], 1][len(node.args) - 2:]
            args[6] = node.kwargs.get("groups", args[6]) // ways
            node.args, node.kwargs = tuple(args), {k: v for k, v in node.kwargs.items() if k != "groups"}
            changed = True
        elif node.target == aten.repeat_interleave.self_int and node.kwargs.get("output_size") is not None:
            # the length along the repeated dim, on this rank (Mamba-2 repeats each group of B and C per head)
            nd = val.dim()
            dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")) % nd
            node.kwargs = {**node.kwargs, "output_size": local_shape(tuple(val.shape), out, mesh_shape)[dim]}
            changed = True
        elif node.target in (aten.mean.dim, aten.mean.default):
            x_spec = ins[0]
            n = 1
            for i, (a, b) in enumerate(zip(x_spec, out)):
                if isinstance(a, Shard) and isinstance(b, Partial):
                    n *= mesh_shape[i]
            if n > 1:
                with graph.inserting_after(node):
                    div = graph.call_function(aten.div.Tensor, (node, float(n)))
                node.replace_all_uses_with(div, delete_user_cb=lambda u, d=div: u is not d)
                div.meta.update({k: v for k, v in node.meta.items() if k.startswith("autopart.output") or k == "val"})
                changed = True
    return gm, changed
