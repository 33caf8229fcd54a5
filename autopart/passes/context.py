"""context: lower context-parallel attention to ``autopart.runtime.context``.

Requires: ``annotate`` and ``insert_collectives`` ran (q, k, v reach the node ``Shard(2)`` on the sequence axis).
Ensures: every ``scaled_dot_product_attention`` node whose output is ``Shard(2)`` on a mesh axis calls
``autopart.runtime.context.context_attention(q, k, v, axis, strategy, is_causal, scale, layout)`` instead, with the
strategy the plan chose (the node record's ``tag``: ``"cp_ring"`` or ``"cp_allgather"``) and the layout of the
rows each rank holds (``"contiguous"``: rank i holds the i-th n-th of the sequence). Other nodes are unchanged.
"""

from __future__ import annotations

import torch.fx as fx

from autopart.placement import Shard
from autopart.runtime import context as RC
from autopart.strategy.context import CP_TAGS, SDPA, _sdpa_args


def context_parallel(gm: fx.GraphModule, plan, layout: str = "contiguous") -> tuple[fx.GraphModule, bool]:
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target != SDPA:
            continue
        out = node.meta.get("autopart.output") or ()
        axes = [i for i, p in enumerate(out) if p == Shard(2)]
        if not axes:
            continue
        tag = plan.nodes.get(node.name, {}).get("tag", "")
        if tag not in CP_TAGS:
            raise ValueError(f"node {node.name} splits attention over the sequence on mesh axis {axes[0]} but its "
                             f"plan record names no context-parallel strategy (tag {tag!r}, expected one of "
                             f"{CP_TAGS}): the plan was made by an older autopart or edited by hand; re-plan")
        a = _sdpa_args(node)
        node.target = RC.context_attention
        node.args = (a["query"], a["key"], a["value"], axes[0], tag, bool(a["is_causal"]), a["scale"], layout)
        node.kwargs = {}
        changed = True
    return gm, changed
