"""checkpoint_regions: run the layers ``plan.checkpoint`` names under activation checkpointing.

Requires: the other passes ran (collectives inserted, program lowered); node names match ``plan.nodes``.
Ensures: each checkpointed region, a contiguous run of call_function nodes, is extracted into a submodule
``ckpt_<layer>[_<k>]`` and called as ``checkpointed(self.ckpt_..., *inputs)``, which runs it under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: backward keeps only the region's inputs and reruns
its forward (its forward collectives included, identically on every rank). Placeholders, their names and order, and
every node outside the regions are unchanged; the program still prints as Python (``gm.code``).

Policy (``_regions``), which nodes a layer's region holds:

- a node's layer is ``plan.nodes[n]["layer"]``; a call_function node without a plan entry (a conversion inserted by
  ``insert_collectives``, a division added by ``lower``) takes the layer of its first user that has one (a
  ``getitem`` that of its source), else that of the nearest node before it;
- ``"full"``: every maximal contiguous run of the layer's call_function nodes is one region;
- ``"selective"``: the attention part only, defined as the contiguous run of the layer's nodes from the first to
  the last node whose innermost ``nn_module_stack`` path has a segment naming an attention module (``attn``,
  ``self_attn``, ``attention``, ...; ``attn_norm`` is not one). That run holds the q/k/v/o projections as well as
  the core attention (Korthikanti et al. 2022 recompute only the core): it saves the projections' outputs too, at
  the price of recomputing their matmuls. Conversions feeding the first attention node (e.g. the tensor-parallel
  copy before the q projection) lie before the run and stay outside, except a sequence-parallel all-gather used
  only by the run, which joins it (the region keeps its shard, not the gathered input); the all-reduce after the o
  projection belongs to its user, the residual add, and stays outside too.

Mechanism: ``torch.fx.passes.utils.fuser_utils.fuse_as_graphmodule`` extracts each region (its outside users become
the region's outputs); the region's place in the graph takes a ``call_function`` to ``checkpointed`` (plus a
``getitem`` per output where it has several).
"""

from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx
from torch.fx.passes.utils.fuser_utils import erase_nodes, fuse_as_graphmodule

from autopart.runtime import collectives as C

_ATTENTION = re.compile(r"\w*(attn|attention)")


def checkpointed(region: fx.GraphModule, *args):
    """``region(*args)`` under non-reentrant activation checkpointing. The recompute runs during backward, outside
    the runtime's ``axis_groups`` context, so the mesh axes' process groups in force now are captured for it."""
    state = (C._STATE.groups, C._STATE.coords, C._STATE.sizes)

    def run(*a):
        with C.axis_groups(*state):
            return region(*a)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)


def _layers(gm: fx.GraphModule, plan) -> dict[fx.Node, str]:
    """Layer of every call_function node (see the module docstring for nodes the plan does not know)."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    layer: dict[fx.Node, str] = {n: plan.nodes[n.name]["layer"] for n in nodes if n.name in plan.nodes}
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in reversed(nodes):  # users come later: resolved before n
        if n in layer or n.target is operator.getitem:
            continue
        lay = next((layer[u] for u in sorted(n.users, key=pos.__getitem__) if u in layer), None)
        if lay is not None:
            layer[n] = lay
    prev = ""
    for n in nodes:
        if n.target is operator.getitem and n not in layer and n.args[0] in layer:
            layer[n] = layer[n.args[0]]
        prev = layer.setdefault(n, prev)
    return layer


def _is_attention(node: fx.Node) -> bool:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return False
    path = list(stack.values())[-1][0]
    return any(_ATTENTION.fullmatch(seg) for seg in path.split("."))


def _regions(gm: fx.GraphModule, plan) -> list[tuple[str, list[fx.Node]]]:
    """(layer, nodes) per checkpointed region, in graph order."""
    layer = _layers(gm, plan)
    runs: list[tuple[str, list[fx.Node]]] = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            if runs and runs[-1][1]:
                runs.append(("", []))  # a placeholder or get_attr between nodes breaks contiguity
            continue
        if runs and runs[-1][0] == layer[n]:
            runs[-1][1].append(n)
        else:
            runs.append((layer[n], [n]))
    out = []
    for lay, nodes in runs:
        mode = plan.checkpoint.get(lay) if lay else None
        if mode == "selective":
            idx = [i for i, n in enumerate(nodes) if _is_attention(n)]
            lo = idx[0] if idx else 0
            # a sequence-parallel all-gather feeding only the run joins it: the region then keeps the shard and
            # gathers again as it recomputes, as the all-gather alone would (planner.regather_spec)
            while idx and lo > 0 and nodes[lo - 1].target is C.all_gather_activation and \
                    set(nodes[lo - 1].users) <= set(nodes[lo: idx[-1] + 1]):
                lo -= 1
            nodes = nodes[lo: idx[-1] + 1] if idx else []
        elif mode != "full":
            nodes = []
        if nodes:
            out.append((lay, nodes))
    return out


def checkpoint_regions(gm: fx.GraphModule, plan) -> tuple[fx.GraphModule, bool]:
    if not plan.checkpoint:
        return gm, False
    regions = _regions(gm, plan)
    count: dict[str, int] = {}
    for lay, nodes in regions:
        base = "ckpt_" + re.sub(r"\W", "_", lay)
        k = count.get(base, 0)
        count[base] = k + 1
        name = base if k == 0 else f"{base}_{k}"
        part = dict.fromkeys(nodes)
        sub, ins, outs = fuse_as_graphmodule(gm, nodes, name, part)
        if not outs:  # dead code: nothing outside uses the region
            continue
        gm.add_submodule(name, sub)
        with gm.graph.inserting_after(nodes[-1]):
            attr = gm.graph.get_attr(name)
        with gm.graph.inserting_after(attr):
            call = gm.graph.create_node("call_function", checkpointed, (attr, *ins), name=f"{name}_out")
        if len(outs) == 1:
            outs[0].replace_all_uses_with(call, propagate_meta=True)
        else:
            with gm.graph.inserting_after(call):
                for i, o in reversed(list(enumerate(outs))):
                    o.replace_all_uses_with(gm.graph.call_function(operator.getitem, (call, i)), propagate_meta=True)
        call.meta["autopart.checkpoint"] = (lay, plan.checkpoint[lay])
        erase_nodes(gm, nodes)
    gm.recompile()
    return gm, bool(regions)
