"""Graph rewrites from the traced graph and a Plan to one rank's program.

Each pass is ``GraphModule -> (GraphModule, changed)`` with its Requires/Ensures in its module docstring;
``run_passes`` composes them and lints after each (``torch.fx.passes`` style).
"""

from __future__ import annotations

import torch.fx as fx

from autopart.passes.annotate import annotate
from autopart.passes.checkpoint import checkpoint_regions
from autopart.passes.collectives import insert_collectives
from autopart.passes.context import context_parallel
from autopart.passes.lower import lower
from autopart.passes.tp_overlap import tp_overlap
from autopart.passes.verify import verify


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    g = fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    for a, b in zip(gm.graph.nodes, g.nodes):
        b.meta = dict(a.meta)
    return fx.GraphModule(gm, g)


def run_passes(traced, plan, needs_grad: dict[str, bool]) -> fx.GraphModule:
    """The per-rank program for ``plan`` (identical on every rank: rank-dependent values are read at run time)."""
    if plan.fingerprint != traced.fingerprint:
        raise ValueError(f"plan was made for graph {plan.fingerprint} but the model traces to {traced.fingerprint}: "
                         "re-plan after changing the model or the example inputs' shapes")
    gm = copy_graph_module(traced.gm)
    mesh = tuple(plan.mesh_shape)
    pipeline = [
        ("annotate", lambda g: annotate(g, plan, traced.params)),
        ("insert_collectives", lambda g: insert_collectives(g, mesh, needs_grad, plan.options.get("reduce_dtype"))),
        ("lower", lambda g: lower(g, mesh)),
        ("context", lambda g: context_parallel(g, plan)),
        ("tp_overlap", lambda g: tp_overlap(g, plan)),
        ("verify", lambda g: verify(g, mesh)),
        ("checkpoint", lambda g: checkpoint_regions(g, plan)),
    ]
    for name, p in pipeline:
        gm, _ = p(gm)
        try:
            gm.graph.lint()
        except Exception as exc:  # noqa: BLE001
            raise AssertionError(f"pass {name} left an ill-formed graph: {exc}") from exc
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
