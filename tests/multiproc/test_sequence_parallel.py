"""Megatron sequence parallelism on real gloo ranks: with the norms and residual stream split along the sequence on
the tensor-parallel axis, each block's two all-reduces become all-gather + reduce-scatter pairs, the gathered
inputs of the column-parallel matmuls are kept for backward as their sequence shards and gathered again there
(K22 §4.2.2), and training matches one process (loss every step, parameters after 3 AdamW steps, 1e-5)."""

from __future__ import annotations

import pytest

from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import batches, check, distributed, make_model, reference

pytestmark = pytest.mark.multiproc


def sp_pins(name: str) -> dict[str, str]:
    """Every norm and residual add inside a block split on the sequence dim (dim 1 of (batch, seq, hidden))."""
    from autopart.trace import trace

    ids = batches()[0]
    return sequence_pins(trace(make_model(name), (ids,), {"labels": ids}).graph)


def sequence_pins(graph) -> dict[str, str]:
    """``sp_pins`` of a traced graph (``benchmarks/bench_memory.py`` pins its GPT with it)."""
    pins = {}
    for n in graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        in_block = any(".blocks." in f".{path}." or path.startswith("blocks.") for path, _ in stack.values())
        op = str(n.target)
        if in_block and ("layer_norm" in op or "rms_norm" in op or op == "aten.add.Tensor") and \
                len(n.meta["val"].shape) == 3:
            pins[n.name] = "S(1)"
    return pins


def _counted(*args):
    """``distributed`` and (saved tensors the runtime held as activation shards, all-gathers backward ran for
    them)."""
    from autopart.runtime import collectives as C

    C.REGATHER_STATS["activations"] = C.REGATHER_STATS["activation_gathers"] = 0
    return (*distributed(*args), (C.REGATHER_STATS["activations"], C.REGATHER_STATS["activation_gathers"]))


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_sequence_parallel_parity(name: str) -> None:
    from autopart.plan import Plan
    from tests.multiproc.parity import STEPS

    pins = sp_pins(name)
    assert len(pins) >= 8, pins
    results = run_ranks(2, _counted, name, (2,), ("tp",), {"tp": "tp"}, False, None, None, 2, pins)
    check(name, [r[:-1] for r in results], reference(name))
    plan = Plan.from_json(results[0][3])
    # every column-parallel matmul of a block keeps its sequence-split input (the all-gather's input) and backward
    # gathers it again, once for all the matmuls sharing it (Q, K, V): the plan records which; over the 3 training
    # steps and the forward-only call the runtime held at least that many shards and ran one all-gather per
    # recorded conversion and training step
    regathers = {c["user"]: c["regather"] for c in plan.collectives if c.get("regather")}
    assert sum(1 for u in regathers if plan.nodes[u]["layer"] == "blocks.0") == 2, regathers
    packed, gathers = results[0][-1]
    assert STEPS * sum(regathers.values()) <= packed <= (STEPS + 1) * sum(regathers.values()), (packed, regathers)
    assert gathers == STEPS * len(regathers), (gathers, regathers)
    fwd, bwd = plan.collective_counts("blocks.0"), plan.collective_counts("blocks.0", "bwd")
    # Megatron-SP: the block's all-reduces are reduce-scatters (after the row-parallel matmuls) and all-gathers
    # (before the column-parallel ones), forward and backward
    assert fwd[("reduce_scatter", "tp")] >= 2 and fwd[("all_gather", "tp")] >= 2, fwd
    assert fwd[("all_reduce", "tp")] == 0, fwd
    assert bwd[("reduce_scatter", "tp")] >= 2 and bwd[("all_gather", "tp")] >= 2, bwd
