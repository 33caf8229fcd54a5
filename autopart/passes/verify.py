"""verify: ``graph.lint()`` plus placement consistency on every edge.

Requires: the other passes ran. Ensures (or raises AssertionError naming the node): each decided node's tensor
inputs arrive with the specs its option requires, and graph outputs are Replicate.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopart.placement import Replicate
from autopart.strategy import tensor_inputs


def verify(gm: fx.GraphModule, mesh_shape: tuple[int, ...]) -> tuple[fx.GraphModule, bool]:
    gm.graph.lint()
    for node in gm.graph.nodes:
        ins = node.meta.get("autopart.inputs")
        if node.op != "call_function" or ins is None:
            continue
        for j, a in enumerate(tensor_inputs(node)):
            if j >= len(ins):
                break
            have = a.meta.get("autopart.output")
            if have is not None and have != ins[j]:
                raise AssertionError(f"placement mismatch on edge {a.name} -> {node.name}: value is {have}, "
                                     f"user needs {ins[j]}\n{node.format_node()}")
    out = next(iter(gm.graph.find_nodes(op="output")))
    rr = tuple(Replicate() for _ in mesh_shape)
    for a in torch.utils._pytree.tree_leaves(out.args):
        if isinstance(a, fx.Node) and a.meta.get("autopart.output") not in (None, rr) \
                and a.target is not operator.getitem:
            raise AssertionError(f"graph output {a.name} is {a.meta['autopart.output']}, not replicated")
    return gm, False
