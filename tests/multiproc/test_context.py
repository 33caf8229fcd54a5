"""Context parallelism on real gloo processes.

* The runtime's two attentions (``autopart.runtime.context``: ring and all-gather of K/V) against one process's
  ``scaled_dot_product_attention``: output and dq, dk, dv of every rank's rows, causal and not, grouped-query and
  not, contiguous and balanced layouts, an explicit boolean mask (two packed causal documents), on 2 and 4 ranks.
* The reference Llama (grouped-query attention, RoPE) under cp=2 and cp=4 with each strategy, balanced (16 tokens)
  and contiguous (12 tokens on 4 ranks): the loss of every step and the gathered parameters after 3 AdamW steps
  within 1e-5 of one process, forward-only logits in the natural order. On a model this small the
  solver would not split the sequence, so the layout is pinned through ``pins=``: ids ``S(1)``, every
  attention ``S(2) [cp_ring]`` or ``S(2) [cp_allgather]`` (the tag picks the strategy).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autopart
from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import OPT, batches, check, make_model

pytestmark = pytest.mark.multiproc

CASES = [(strategy, layout, h, hk, causal, False) for strategy in ("cp_ring", "cp_allgather")
         for layout in ("contiguous", "balanced") for h, hk, causal in ((4, 2, True), (4, 4, False), (4, 4, True))]
# an explicit boolean mask (contiguous rows): causal within two packed documents (positions 0-4 and 5-15), as
# Hugging Face builds it; some of a block's rows see none of its keys
CASES += [(strategy, "contiguous", 4, 2, False, True) for strategy in ("cp_ring", "cp_allgather")]


def _packed_mask(s: int) -> torch.Tensor:
    pos = torch.arange(s)
    doc = (pos >= 5).long()
    return (pos[:, None] >= pos[None, :]) & (doc[:, None] == doc[None, :])


def _attention_errors() -> list[float]:
    import torch.distributed as dist

    from autopart.runtime import collectives as C
    from autopart.runtime.context import balanced_permutation, context_attention

    rank, n = dist.get_rank(), dist.get_world_size()
    worst = []
    for strategy, layout, h, hk, causal, masked in CASES:
        g = torch.Generator().manual_seed(0)
        b, s, d = 2, 16, 8
        q, w = (torch.randn(b, h, s, d, generator=g) for _ in range(2))
        k, v = (torch.randn(b, hk, s, d, generator=g) for _ in range(2))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        mask = _packed_mask(s) if masked else None
        ref = F.scaled_dot_product_attention(*full, attn_mask=mask, is_causal=causal, enable_gqa=h != hk)
        (ref * w).sum().backward()
        perm = balanced_permutation(s, n) if layout == "balanced" else torch.arange(s)

        def mine(t, perm=perm):
            return t[:, :, perm].chunk(n, 2)[rank]

        local = [mine(t).clone().requires_grad_() for t in (q, k, v)]
        rows = mask.chunk(n, 0)[rank] if masked else None  # this rank's query rows, every key column
        with C.axis_groups([dist.group.WORLD], [rank], [n]):
            out = context_attention(*local, 0, strategy, causal, None, layout, rows)
            (out * mine(w)).sum().backward()
        errs = [(out - mine(ref)).abs().max().item()]
        errs += [(a.grad - mine(b.grad)).abs().max().item() for a, b in zip(local, full)]
        worst.append(max(errs))
    return worst


@pytest.mark.parametrize("n", [2, 4])
def test_attention_matches_one_process(n: int) -> None:
    results = run_ranks(n, _attention_errors)
    for rank, errs in enumerate(results):
        for case, err in zip(CASES, errs):
            assert err < 1e-5, (n, rank, case, err)


def _cp_pins(model, ids, tag: str, tp: bool) -> dict[str, str]:
    from autopart.trace import trace

    graph = trace(model, (ids,), {"labels": ids}).graph
    pins = {"ids": "S(1)R" if tp else "S(1)"}  # labels: where the solver prices them (forward-only has none)
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    pins.update({n.name: f"S(2){'S(1)' if tp else ''} [{tag}]" for n in graph.nodes if n.target == sdpa})
    return pins


def _reference(s: int, name: str = "llama"):
    model = make_model(name)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    losses = []
    for ids in batches(s=s):
        loss = model(ids, labels=ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        logits = model(batches(s=s)[0])
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}, logits


def _distributed(n: int, tag: str, s: int, tp: bool = False, checkpoint: str | None = None, name: str = "llama"):
    from autopart.runtime.context import STATS

    model = make_model(name)
    ids0 = batches(s=s)[0]
    mesh = autopart.mesh((n, 2), ("cp", "tp")) if tp else autopart.mesh((n,), ("cp",))
    pm = autopart.parallelize(model, mesh, (ids0,), {"labels": ids0}, pins=_cp_pins(model, ids0, tag, tp),
                              roles={"tp": "tp"} if tp else {}, pipeline="off", checkpoint=checkpoint)
    opt = torch.optim.AdamW(pm.parameters(), **OPT)
    losses = []
    before = dict(STATS)
    for ids in batches(s=s):
        loss = pm.forward_backward(ids, labels=ids)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    used = {k: STATS[k] - before[k] for k in STATS}
    full = {k: v.clone() for k, v in pm.full_state_dict().items()}
    logits = pm(ids0)  # forward only: a new signature, planned on first use with the same pins (un-permuted)
    gm = next(iter(pm._programs.values())).gm
    program = "\n".join(m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule))  # checkpoint regions
    layout = gm.meta.get("autopart.context")
    return losses, full, str(pm.plan), pm.plan.to_json(), logits.detach(), used, program, layout


# (ranks, strategy, sequence): 16 tokens split 2 or 4 ways run the balanced layout (rank i holds chunks i and
# 2n-1-i of 2n); 12 tokens on 4 ranks cannot be cut in 8 chunks and run contiguous rows
RUNS = [(2, "cp_ring", 16), (2, "cp_allgather", 16), (4, "cp_ring", 16), (4, "cp_allgather", 16),
        (4, "cp_ring", 12), (4, "cp_allgather", 12)]


def _check_cp(results, n: int, tag: str, s: int, hops_per_attention: int | None = None) -> None:
    from autopart.plan import Plan

    plan = Plan.from_json(results[0][3])
    sdpa = [k for k, r in plan.nodes.items() if r["op"] == "aten.scaled_dot_product_attention.default"]
    assert len(sdpa) == 2 and all(plan.nodes[k]["tag"] == tag for k in sdpa), {k: plan.nodes[k] for k in sdpa}
    for layer in ("blocks.0", "blocks.1"):  # inside a block nothing crosses cp but the attention's own exchange
        for d in ("fwd", "bwd"):
            assert not any(axis == "cp" for _, axis in plan.collective_counts(layer, d)), plan.collective_counts(layer)
    steps, layers = 3, 2
    balanced = s % (2 * n) == 0
    hops = 3 * n - 2 if hops_per_attention is None else hops_per_attention
    for used, program, layout in (r[5:] for r in results):
        assert layout == ({"axis": 0, "n": n, "s": s, "layout": "balanced"} if balanced else None), layout
        assert program.count("context_attention(") == layers, program
        assert ("'balanced'" in program) == balanced and ("sequence_positions(" in program) == balanced, program
        if tag == "cp_ring":  # per attention: n-1 K/V hops forward; n-1 K/V and n dK/dV hops backward
            assert used == {"ring_hops": steps * layers * hops, "kv_gathers": 0}, used
        else:
            assert used["ring_hops"] == 0 and used["kv_gathers"] >= steps * layers, used


@pytest.mark.parametrize("n,tag,s", RUNS)
def test_llama_context_parallel_parity(n: int, tag: str, s: int) -> None:
    results = run_ranks(n, _distributed, n, tag, s)
    check(f"llama cp{n} {tag} s{s}", [r[:5] for r in results], _reference(s))
    _check_cp(results, n, tag, s)


def test_llama_cp2_tp2_parity() -> None:
    """Sequence split over cp, heads over tp (Megatron), ring attention on each rank's heads."""
    results = run_ranks(4, _distributed, 2, "cp_ring", 16, True)
    check("llama cp2 x tp2 ring", [r[:5] for r in results], _reference(16))
    _check_cp(results, 2, "cp_ring", 16)


def test_llama_cp2_full_checkpoint_parity() -> None:
    """Full activation checkpointing: the attention (and its K/V exchange) runs again in backward."""
    results = run_ranks(2, _distributed, 2, "cp_allgather", 16, False, "full")
    check("llama cp2 all-gather full recompute", [r[:5] for r in results], _reference(16))
    _check_cp(results, 2, "cp_allgather", 16)


def test_gpt_cp2_position_embeddings_parity() -> None:
    """GPT's learned position embeddings look up ``arange(s)``: under the balanced layout the pass gives them the
    permuted positions (``sequence_positions``), so each rank embeds its own chunks' positions."""
    results = run_ranks(2, _distributed, 2, "cp_ring", 16, False, None, "gpt")
    check("gpt cp2 ring", [r[:5] for r in results], _reference(16, "gpt"))
    _check_cp(results, 2, "cp_ring", 16)


def _hf_llama_cp2(tag: str):
    from tests.multiproc.parity import distributed

    model, ids = make_model("hf-llama"), batches()[0]
    pins = _cp_pins(model, ids, tag, False)
    pins["input_ids"] = pins.pop("ids")  # Hugging Face's name of the token ids
    return distributed("hf-llama", (2,), ("cp",), {}, pipeline="off", pins=pins)


def test_hf_llama_mask_cp2_parity() -> None:
    """Hugging Face's Llama gives SDPA no ``is_causal`` but a boolean mask built from the positions (causal, and
    its packed-sequence check): the mask is split on its query rows with the sequence, each ring step's block cut
    from its key columns (``runtime.context._pairs``); contiguous rows (the mask blocks the balanced layout)."""
    from autopart.plan import Plan
    from tests.multiproc.parity import reference

    results = run_ranks(2, _hf_llama_cp2, "cp_ring")
    check("hf-llama cp2 ring, mask tensor", results, reference("hf-llama"))
    plan = Plan.from_json(results[0][3])
    sdpa = [r for r in plan.nodes.values() if r["op"] == "aten.scaled_dot_product_attention.default"]
    assert len(sdpa) == 2 and all(r["tag"] == "cp_ring" and r["inputs"][3] == "S(2)" for r in sdpa), sdpa
