"""Plans for a Mamba-2.8B-wide model (d_model 2560, d_inner 5120, 80 heads of 64) on 64 H100s, (dp 8, tp 8), built
on the ``meta`` device at 4K and 128K tokens per sequence (no memory, no process group).

Eight layers rather than 64: the layers are tied (solved once), so the structure is the same and the 64-layer
export (~18 s on 2 cores) is not worth it. Checks: Megatron-style tensor parallelism over the inner dimension on
``tp``; nothing reduced across nodes in a block's forward; the plan fits the device; at 4K exactly Mamba-1's two
reductions of activations per block forward (REFERENCE.md). At 128K the solver legitimately adds a third (dt_proj
row-parallel, reducing 80 values a token instead of gathering dt_proj's 160 inputs), so only the structure is
checked there.

What was measured (2 cores, shared): export and plan together ~4 s at either length; the graph has the same nodes
at both lengths.
"""

from __future__ import annotations

import functools

import pytest
import torch

import autopart
from autopart.models.mamba import Mamba, MambaConfig
from autopart.placement import parse_spec
from autopart.trace import trace

pytestmark = pytest.mark.slow

SHAPE, NAMES = (8, 8), ("dp", "tp")
LAYERS = 8


@functools.cache
def _plan(seq: int):
    cfg = MambaConfig(**{**MambaConfig.preset("mamba-2.8b").__dict__, "n_layer": LAYERS, "chunk_size": 256})
    with torch.device("meta"):
        model = Mamba(cfg)
        ids = torch.randint(0, cfg.vocab_size, (8, seq))  # one sequence per data-parallel rank
    traced = trace(model, (ids,), {"labels": ids})
    plan = autopart.plan(model, autopart.mesh(SHAPE, NAMES), (ids,), {"labels": ids}, traced=traced,
                         cluster=autopart.preset("h100-80gb", SHAPE), roles={"dp": "dp", "tp": "tp"},
                         pipeline="off")
    return plan, traced


def _forward_reductions(plan: autopart.Plan, traced, layer: str, axis: str) -> int:
    """Partial sums of the layer's own activations reduced in forward on ``axis`` (all-reduce, or reduce-scatter
    under a sequence-parallel layout), not counting per-token scalars (the RMSNorm statistic of a residual stream
    kept split over the hidden dim)."""
    vals = {n.name: n.meta.get("val") for n in traced.graph.nodes}
    i = NAMES.index(axis)
    n = 0
    for rec in plan.collectives:
        val = vals.get(rec["value"])
        if plan.nodes.get(rec["value"], {}).get("layer") != layer or val is None or val.shape[-1] == 1:
            continue
        n += sum(1 for ax, fwd, _ in rec["steps"] if ax == i and fwd in ("all_reduce", "reduce_scatter"))
    return n


@pytest.mark.parametrize("seq", [4096, 131072])
def test_mamba_plan_is_megatron_on_tp(seq: int) -> None:
    plan, traced = _plan(seq)
    assert not plan.unsupported_ops, plan.unsupported_ops
    budget = autopart.preset("h100-80gb", SHAPE).memory_budget
    assert 0 < plan.predicted["memory_bytes"]["total"] <= budget
    tp = NAMES.index("tp")
    want = {"in_proj.weight": "S(0)", "x_proj.weight": "S(1)", "out_proj.weight": "S(1)", "conv_weight": "S(0)",
            "conv_bias": "S(0)", "A_log": "S(0)", "D": "S(0)"}
    for i in range(LAYERS):
        got = {w: str(parse_spec(plan.params[f"blocks.{i}.mixer.{w}"])[tp]) for w in want}
        assert got == want, f"blocks.{i} on tp: {got}"
        fwd = plan.collective_counts(f"blocks.{i}", "fwd")
        assert fwd[("all_reduce", "dp")] == fwd[("reduce_scatter", "dp")] == 0, f"blocks.{i}: {dict(fwd)}"
    if seq == 4096:
        for i in range(LAYERS):
            assert _forward_reductions(plan, traced, f"blocks.{i}", "tp") == 2, dict(plan.collective_counts(
                f"blocks.{i}"))


def test_graph_is_the_same_at_4k_and_128k() -> None:
    assert len(_plan(4096)[1].graph.nodes) == len(_plan(131072)[1].graph.nodes)
