"""Grouped-query attention with its heads split wider than its K/V heads, on real gloo processes.

The reference Llama has 4 query heads and 2 K/V heads. Split 4 ways, every rank holds one query head, and the K/V
heads cannot split alike: K and V reach the attention whole on the axis and each rank attends with the one K/V head
its query head uses (``runtime.context.kv_heads_for_rank``: ranks 0-1 head 0, ranks 2-3 head 1), their gradients
summed over the axis. On a 2 x 2 mesh the first axis splits query and K/V heads alike (one K/V head each) and the
second splits the query heads wider (the K/V head held is the one). The attention is pinned to the split (the
solver would not pick tensor parallelism for a model this small); loss and parameters after 3 AdamW steps within
1e-5 of one process.
"""

from __future__ import annotations

import pytest
import torch

import autopart
from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import check, make_model, reference

pytestmark = pytest.mark.multiproc

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _pins(cp: bool) -> dict[str, str]:
    from autopart.trace import trace
    from tests.multiproc.parity import batches

    model, ids = make_model("llama"), batches()[0]
    graph = trace(model, (ids,), {"labels": ids}).graph
    pins = {n.name: "S(2)S(1) [cp_ring]" if cp else "S(1)" for n in graph.nodes if n.target == SDPA}
    return {**pins, "ids": "S(1)R"} if cp else pins


def _run(cp: bool):
    from tests.multiproc.parity import OPT, batches, forward_only_kwargs, logits_of, train

    model, ids0 = make_model("llama"), batches()[0]
    mesh = autopart.mesh((2, 4), ("cp", "tp")) if cp else autopart.mesh((4,), ("tp",))
    pm = autopart.parallelize(model, mesh, (ids0,), {"labels": ids0}, roles={"tp": "tp"}, pipeline="off",
                              pins=_pins(cp))
    losses, full = train(pm, torch.optim.AdamW(pm.parameters(), **OPT))
    program = next(iter(pm._programs.values())).gm.code
    logits = logits_of(pm(ids0, **forward_only_kwargs("llama", ids0)))
    return losses, full, str(pm.plan), pm.plan.to_json(), logits.detach(), program


@pytest.mark.parametrize("cp", [False, True])
def test_llama_gqa_heads_wider_than_kv_heads_parity(cp: bool) -> None:
    from autopart.plan import Plan

    results = run_ranks(8 if cp else 4, _run, cp)
    check(f"llama gqa tp4{' x cp2 ring' if cp else ''}", [r[:5] for r in results], reference("llama"))
    plan = Plan.from_json(results[0][3])
    sdpa = [r for r in plan.nodes.values() if r["op"] == "aten.scaled_dot_product_attention.default"]
    assert len(sdpa) == 2
    for r in sdpa:  # q split over the heads on tp, K and V whole there (and all three over the sequence on cp)
        q, kv = ("S(2)S(1)", "S(2)R") if cp else ("S(1)", "R")
        assert r["inputs"] == [q, kv, kv] and r["output"] == q, r
    axis = 1 if cp else 0
    for r in results:  # K and V through the head picker on the tp axis, in both attentions (inside the ring's call)
        assert r[5].count("kv_heads_for_rank(") == 4 and r[5].count(f", {axis})") >= 4, r[5]
        assert r[5].count("context_attention(") == (2 if cp else 0), r[5]


def _run_pipelined():
    from autopart.trace import trace
    from tests.multiproc.parity import OPT, batches, forward_only_kwargs, logits_of, train

    model, ids0 = make_model("llama", 4), batches()[0]
    graph = trace(model, (ids0,), {"labels": ids0}).graph
    pins = {n.name: "RS(1)" for n in graph.nodes if n.target == SDPA}  # pins on every block: planned whole
    pm = autopart.parallelize(model, autopart.mesh((2, 4), ("pp", "tp")), (ids0,), {"labels": ids0},
                              roles={"pp": "pp", "tp": "tp"}, pipeline={"schedule": "1f1b", "micro_batches": 2},
                              pins=pins)
    losses, full = train(pm, torch.optim.AdamW(pm.parameters(), **OPT))
    logits = logits_of(pm(ids0, **forward_only_kwargs("llama", ids0)))
    return losses, full, str(pm.plan), pm.plan.to_json(), logits.detach()


def test_llama_gqa_heads_wider_than_kv_heads_in_pipeline_stages() -> None:
    """Two 1F1B stages of two blocks, each stage tensor parallel 4 with K/V whole (8 ranks), pinned on all four
    attentions (a pin on a block past the second used to be refused by the pipeline search's two-block graph)."""
    from autopart.plan import Plan

    results = run_ranks(8, _run_pipelined)
    check("llama gqa pp2 x tp4", results, reference("llama", 4))
    plan = Plan.from_json(results[0][3])
    assert plan.pipeline["degree"] == 2 and plan.pipeline["micro_batches"] == 2
    sdpa = [r for r in plan.nodes.values() if r["op"] == "aten.scaled_dot_product_attention.default"]
    assert len(sdpa) == 4 and all(r["inputs"] == ["RS(1)", "RR", "RR"] for r in sdpa), sdpa
