"""When context parallelism pays: a Llama-2-7B-class model (32 layers, h 4096, 32 heads, meta device) on
``h100-80gb`` nodes, one sequence per data-parallel rank (8 of them, ``dp`` pinned), the other mesh axes free, at
the three lengths of REFERENCE.md's NeMo table with its GPU counts: 16K on 16 GPUs (8, 2), 64K on 64 (8, 2, 4),
256K on 256 (8, 8, 4). Each is planned twice: as is, and with the sequence split of attention removed from the
options (the ``_sdpa`` rule's ``sequence_split_ok`` patched off), to price what context parallelism buys.

What the cost model says (measured when written, 2 cores; ~20 s to trace each length, 5-30 s a plan;
``step s`` is ``plan.predicted["step_time_s"]``):

| seq | mesh | with CP: attention | step s | without CP: attention | step s | gain |
|---|---|---|---|---|---|---|
| 16K | (8, 2) | S(0)S(1): heads on x (Ulysses all-to-alls), no CP | 1.7111 | the same layout | 1.7115 | 1.00x |
| 64K | (8, 2, 4) | S(0)S(1)S(2): heads on x, ring c=4 on y | 2.2231 | S(0)RS(1): heads on y | 3.2502 | 1.46x |
| 256K | (8, 8, 4) | S(0)S(1)S(2): heads on x, ring c=4 on y | 6.3199 | S(0)S(1)R: heads on x | 18.233 | 2.88x |

(``benchmarks/bench_context_plans.py`` prints it. Without CP the heads can be split on one axis only, so attention
runs replicated on the other: placements give a tensor dim to one mesh axis. With CP over 8 on x, the layout NeMo
uses at 256K, the ring's hops cross nodes, which the 16K-token causal steps do not hide on InfiniBand: priced slower
than CP 4 inside the node. At 16K the two solves end 0.4 ms apart on the same layout: their optimality gaps.)

NeMo's table has CP off at 16K and on from 64K (TP4 CP2) to 256K (TP4 CP8); so has the solver. At 16K the two
candidates for the x axis are the ring (c=2) and Ulysses' heads split (four all-to-alls of a layer's q/k/v/output,
0.308 ms each: 39.4 ms a step); the rest (linear layers split on the sequence with their weights gathered, the
gradient reduction) is the same. The ring hides its K/V hops behind 8K-token causal steps and exposes the last
dK/dV hop (0.60 ms a layer, 19.2 ms a step), but it also runs one kernel per step and combines their results in
memory (``strategy.context.ring_merge_time``: the online-softmax merge of the partial output into an fp32
accumulator, flash backward's rowsum(dO·O) pass, the partial dq/dK/dV added into theirs, the accumulators cast back:
2.55 GB a layer at 3.35 TB/s, 0.76 ms, 24.4 ms a step), which one fused kernel over all keys does not. Priced
without those passes the ring won by 20 ms (1.6913 s against 1.7111 s); with them every attention pinned to the
ring gives 1.7153 s, 4 ms (0.25%) slower, and CP stays off. The margin is thin: the deciding terms are the
all-to-alls' 39.4 ms against the ring's 43.6 ms (Megatron TP2 on x, forced with ``roles``, is 1.7365 s).
"""

from __future__ import annotations

import functools

import pytest
import torch

import autopart
from autopart.models.llama import Llama, LlamaConfig
from autopart.trace import trace

pytestmark = pytest.mark.slow

CASES = {16384: (8, 2), 65536: (8, 2, 4), 262144: (8, 8, 4)}
NAMES = ("dp", "x", "y")


@functools.cache
def _traced(s: int):
    with torch.device("meta"):
        model = Llama(LlamaConfig(32000, s, 32, 32, 32, 4096, 11008))
        ids = torch.randint(0, 32000, (8, s))
    return model, ids, trace(model, (ids,), {"labels": ids})


def _plan(s: int, cp: bool) -> autopart.Plan:
    from unittest import mock

    from autopart import planner
    from autopart.strategy import context, registry

    model, ids, t = _traced(s)
    shape = CASES[s]
    registry._OPTIONS_CACHE.clear()
    planner._ANALYZED.clear()
    patch = mock.patch.object(context, "sequence_split_ok", lambda info: False) if not cp else mock.MagicMock()
    with patch:
        try:
            return autopart.plan(model, autopart.mesh(shape, NAMES[:len(shape)]), (ids,), {"labels": ids},
                                 cluster=autopart.preset("h100-80gb", shape), roles={"dp": "dp"}, traced=t,
                                 pipeline="off")
        finally:
            registry._OPTIONS_CACHE.clear()
            planner._ANALYZED.clear()


def _cp(plan: autopart.Plan) -> list[tuple[str, str]]:
    """(tag, output spec) of every attention split over the sequence."""
    return [(r["tag"], r["output"]) for r in plan.nodes.values()
            if r["op"] == "aten.scaled_dot_product_attention.default" and r.get("tag", "").startswith("cp_")]


@functools.cache
def _gain(s: int) -> tuple[float, autopart.Plan]:
    with_cp, without = _plan(s, True), _plan(s, False)
    assert not _cp(without)
    return without.predicted["step_time_s"] / with_cp.predicted["step_time_s"], with_cp


@pytest.mark.parametrize("s", [65536, 262144])
def test_context_parallel_on_for_long_sequences(s: int) -> None:
    gain, plan = _gain(s)
    cp = _cp(plan)
    assert len(cp) == 32, f"{s} tokens: {len(cp)} of 32 attentions split over the sequence\n{plan}"
    assert gain > 1.2, f"{s} tokens: context parallelism predicted only {gain:.2f}x faster"
    budget = autopart.preset("h100-80gb", CASES[s]).memory_budget
    assert plan.predicted["memory_bytes"]["total"] <= budget
    spec = [str(p) for p in autopart.placement.parse_spec(cp[0][1])]  # batch on dp; sequence and heads split
    assert spec[0] == "S(0)" and sorted(spec[1:]) == ["S(1)", "S(2)"], spec


def test_context_parallel_off_at_16k() -> None:
    """NeMo leaves CP off at 16K: with the option offered the solver does not take it (the step time of the plan
    with it removed, within the two solves' optimality gaps)."""
    gain, plan = _gain(16384)
    assert not _cp(plan), f"16K tokens: {len(_cp(plan))} attentions split over the sequence\n{plan}"
    assert gain == pytest.approx(1.0, abs=1e-3), gain


def test_context_parallel_gain_grows_with_the_sequence() -> None:
    gains = [_gain(s)[0] for s in sorted(CASES)]
    assert gains[0] < gains[1] < gains[2], gains
