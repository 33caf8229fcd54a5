"""annotate: copy the plan's decisions onto the graph.

Requires: a traced graph whose node names match ``plan.nodes`` (same fingerprint).
Ensures: every decided node carries ``meta["autopart.inputs"]`` (spec per distinct tensor input) and
``meta["autopart.output"]`` (spec, or tuple of specs for multi-output ops); ``getitem`` nodes carry their element's
spec; parameters carry ``meta["autopart.reduced"]`` (axes their gradient is summed over after backward) and
``meta["autopart.regather"]`` (ZeRO-3: the gathered copy is freed after use and gathered again for backward).
"""

from __future__ import annotations

import operator

import torch.fx as fx

from autopart.placement import parse_spec


def annotate(gm: fx.GraphModule, plan, params: dict[str, str]) -> tuple[fx.GraphModule, bool]:
    for node in gm.graph.nodes:
        rec = plan.nodes.get(node.name)
        if rec is not None:
            node.meta["autopart.inputs"] = tuple(parse_spec(s) for s in rec["inputs"])
            out = rec["output"]
            node.meta["autopart.output"] = tuple(parse_spec(s) for s in out) if isinstance(out, list) \
                else parse_spec(out)
            if node.op == "placeholder" and node.name in params:
                node.meta["autopart.reduced"] = tuple(plan.reduced.get(params[node.name], ()))
                node.meta["autopart.regather"] = plan.zero.get(params[node.name], 0) == 3
        elif node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0].meta.get("autopart.output")
            if isinstance(src, tuple) and src and isinstance(src[0], tuple):
                node.meta["autopart.output"] = src[node.args[1]]
    return gm, True
