"""Megatron sequence parallelism on real gloo ranks: with the norms and residual stream split along the sequence on
the tensor-parallel axis, each block's two all-reduces become all-gather + reduce-scatter pairs, and training
matches one process (loss every step, parameters after 3 AdamW steps, 1e-5)."""

from __future__ import annotations

import pytest

from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import batches, check, distributed, make_model, reference

pytestmark = pytest.mark.multiproc


def sp_pins(name: str) -> dict[str, str]:
    """Every norm and residual add inside a block split on the sequence dim (dim 1 of (batch, seq, hidden))."""
    from autopart.trace import trace

    ids = batches()[0]
    t = trace(make_model(name), (ids,), {"labels": ids})
    pins = {}
    for n in t.graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        in_block = any(".blocks." in f".{path}." or path.startswith("blocks.") for path, _ in stack.values())
        op = str(n.target)
        if in_block and ("layer_norm" in op or "rms_norm" in op or op == "aten.add.Tensor") and \
                len(n.meta["val"].shape) == 3:
            pins[n.name] = "S(1)"
    return pins


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_sequence_parallel_parity(name: str) -> None:
    from autopart.plan import Plan

    pins = sp_pins(name)
    assert len(pins) >= 8, pins
    results = run_ranks(2, distributed, name, (2,), ("tp",), {"tp": "tp"}, False, None, None, 2, pins)
    check(name, results, reference(name))
    plan = Plan.from_json(results[0][3])
    fwd, bwd = plan.collective_counts("blocks.0"), plan.collective_counts("blocks.0", "bwd")
    # Megatron-SP: the block's all-reduces are reduce-scatters (after the row-parallel matmuls) and all-gathers
    # (before the column-parallel ones), forward and backward
    assert fwd[("reduce_scatter", "tp")] >= 2 and fwd[("all_gather", "tp")] >= 2, fwd
    assert fwd[("all_reduce", "tp")] == 0, fwd
    assert bwd[("reduce_scatter", "tp")] >= 2 and bwd[("all_gather", "tp")] >= 2, bwd
