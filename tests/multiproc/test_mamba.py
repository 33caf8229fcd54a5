"""Mamba and the Mamba/attention hybrid on real gloo processes: loss at every step and the gathered parameters after 3
AdamW steps equal one process within 1e-5 (fp32), for Mamba on tp=2, dp=2 x tp=2, cp=2 and cp=2 x tp=2, and pp=2 x cp=2
under full recompute, and the hybrid on dp=2 x tp=2 and cp=2 (under selective recompute); the plans really are tensor
parallel over the inner dimension, and context parallel ones pass the scan's state and the convolution's halo on ``cp``
(``autopart.runtime.ssm``) with nothing else crossing ``cp`` inside a block, the hybrid's attention in the contiguous
layout (the scan and convolution read the sequence in order). On models this small the solver would not split the
sequence, so the layout is pinned (``pins_for``: ids ``S(1)``, every scan, convolution and attention split on the
sequence), as in ``test_context.py``; so is the scan's heads split on ``tp``."""

from __future__ import annotations

import math

import pytest
import torch

from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import OPT, batches

pytestmark = pytest.mark.multiproc

CONFIGS = {
    "tp2": ((2,), ("tp",), {"tp": "tp"}),
    "dp2xtp2": ((2, 2), ("dp", "tp"), {"dp": "dp", "tp": "tp"}),
    "cp2": ((2,), ("cp",), {}),
    "cp2xtp2": ((2, 2), ("cp", "tp"), {"tp": "tp"}),
    "pp2xcp2": ((2, 2), ("pp", "cp"), {"pp": "pp"}),  # one Mamba block a stage, 1F1B over 2 micro-batches
}
PIPELINE = {"schedule": "1f1b", "micro_batches": 2}
# tp2 and cp2 alone are covered by the 4-rank mixes (kept in CONFIGS for local runs), the hybrid on cp2 by
# test_context_parallel_checkpoint_parity (selective recompute); CI time is the budget
RUNS = [("mamba", "dp2xtp2"), ("hybrid", "dp2xtp2"), ("mamba", "cp2xtp2")]


def make(name: str) -> torch.nn.Module:
    from autopart.models.mamba import Hybrid, HybridConfig, Mamba, MambaConfig

    torch.manual_seed(0)
    # d_inner 64 = 4 heads of 16; chunks of 4 tokens, so the seq-16 batches cross chunk boundaries
    cfg = MambaConfig(vocab_size=128, n_layer=2, d_model=32, d_state=8, headdim=16, chunk_size=4)
    if name == "mamba":
        return Mamba(cfg)
    return Hybrid(HybridConfig(mamba=MambaConfig(**{**cfg.__dict__, "n_layer": 3}), attn_layers=(1,), n_head=4,
                               n_kv_head=2, d_ff=64))


def reference(name: str) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor]:
    model = make(name)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    losses = []
    for ids in batches():
        loss = model(ids, labels=ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        logits = model(batches()[0])
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}, logits


def pins_for(model: torch.nn.Module, ids: torch.Tensor, names: tuple) -> dict[str, str]:
    """Every scan split by heads on ``tp``; with a ``cp`` axis, ids, scans, convolutions and attentions split on
    the sequence there (channels or heads on ``tp``). The heads split is pinned because on this tiny model the cost
    model (rightly, at these latency-bound sizes) prefers gathering the scan's x and dt on tp (two all-gathers of
    ~4K values) to all-reducing the gradients of B and C that a heads split makes partial; at real widths it splits
    the heads by itself (``tests/unit/test_mamba.py``, ``tests/fakepg/test_mamba_plans.py``). A ``pp`` axis is
    kept in the stage mesh at size 1: ``R`` there."""
    from autopart.models.mamba import CAUSAL_CONV1D, SSD_SCAN
    from autopart.trace import trace

    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    # per op: (its spec on dp, cp, tp), its context-parallel strategy
    ops = {SSD_SCAN: (("S(0)", "S(1)", "S(2)"), "cp_state"), CAUSAL_CONV1D: (("S(0)", "S(1)", "S(2)"), "cp_halo"),
           sdpa: (("S(0)", "S(2)", "S(1)"), "cp_ring")}
    axis = {"dp": 0, "cp": 1, "tp": 2}
    cp = "cp" in names
    pins = {"ids": "".join("S(1)" if a == "cp" else "R" for a in names)} if cp else {}
    for n in trace(model, (ids,), {"labels": ids}).graph.nodes:
        if n.target in ops and (cp or n.target == SSD_SCAN):
            specs, tag = ops[n.target]
            pins[n.name] = "".join(specs[axis[a]] if a in axis else "R" for a in names) + (f" [{tag}]" if cp else "")
    return pins


def distributed(name: str, shape: tuple, names: tuple, roles: dict, checkpoint: str | None = None):
    import autopart
    from autopart.runtime import context, ssm

    ids0 = batches()[0]
    model = make(name)  # kept alive: the forward-only call below traces it again
    pm = autopart.parallelize(model, autopart.mesh(shape, names), (ids0,), {"labels": ids0}, roles=roles,
                              pipeline=PIPELINE if "pp" in names else "off", pins=pins_for(model, ids0, names),
                              checkpoint=checkpoint)
    stats = lambda: {**ssm.STATS, **context.STATS}  # noqa: E731
    before = stats()
    opt = torch.optim.AdamW(pm.parameters(), **OPT)
    losses = []
    for ids in batches():
        losses.append(pm.forward_backward(ids, labels=ids).item())
        opt.step()
        opt.zero_grad()
    used = {k: v - before[k] for k, v in stats().items()}
    layout = next(iter(pm._programs.values())).gm.meta.get("autopart.context")  # None: contiguous rows
    logits = pm(batches()[0])  # forward only, no labels: a second signature, planned on first use
    return (losses, {k: v.clone() for k, v in pm.full_state_dict().items()}, pm.plan.to_json(), logits.detach(),
            (used, layout))


@pytest.mark.parametrize(("name", "config"), RUNS, ids=[f"{n}-{c}" for n, c in RUNS])
def test_mamba_parity(name: str, config: str) -> None:
    _parity(name, config)


@pytest.mark.parametrize(("name", "config", "checkpoint"), [("mamba", "pp2xcp2", "full"),
                                                             ("hybrid", "cp2", "selective")])
def test_context_parallel_checkpoint_parity(name: str, config: str, checkpoint: str) -> None:
    """cp=2 under activation checkpointing: the recomputed forward runs its exchanges again during backward (the
    scan's state all-gather and the convolution's halo under ``"full"``; under ``"selective"``, which recomputes
    attention modules only, the hybrid's ring attention and nothing of the Mamba blocks). Mamba runs it inside
    two pipeline stages (1F1B, 2 micro-batches): the stages' context-parallel groups are the stage mesh's."""
    plan = _parity(name, config, checkpoint)
    assert plan.checkpoint and set(plan.checkpoint.values()) == {checkpoint}, plan.checkpoint
    if "pp" in config:
        assert plan.pipeline["degree"] == 2 and plan.pipeline["schedule"] == "1f1b", plan.pipeline


def _parity(name: str, config: str, checkpoint: str | None = None):
    from autopart.placement import parse_spec
    from autopart.plan import Plan

    shape, names, roles = CONFIGS[config]
    results = run_ranks(math.prod(shape), distributed, name, shape, names, roles, checkpoint)
    ref_losses, ref_params, ref_logits = reference(name)
    for rank, (losses, params, plan_json, logits, _) in enumerate(results):
        assert plan_json == results[0][2], "ranks ran different plans"
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= 1e-5, f"{name} {config} rank {rank} step {step}: loss {a} vs one process {b}"
        assert params.keys() >= ref_params.keys()
        for k, v in ref_params.items():
            err = (params[k] - v).abs().max().item()
            assert err <= 1e-5, f"{name} {config} rank {rank}: {k} differs by {err} after 3 steps"
        # O(1)-O(10) logits summed in another order: the 1e-5 spec is on loss and parameters, as in parity.check
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=5e-5)
    plan = Plan.from_json(results[0][2])
    if "cp" in names:
        _check_context_parallel(plan, name, [r[4] for r in results], checkpoint)
    if "tp" not in names:
        return plan
    tp = names.index("tp")
    mixers = sorted({k.rsplit(".mixer.", 1)[0] for k in plan.params if ".mixer." in k})
    assert mixers, plan.params
    for m in mixers:  # Megatron-style: in_proj column-parallel, out_proj row-parallel, the rest split by channel
        for w, spec in (("in_proj.weight", "S(0)"), ("out_proj.weight", "S(1)"), ("conv_weight", "S(0)"),
                        ("dt_proj.weight", "S(0)"), ("D", "S(0)"), ("A_log", "S(0)")):
            got = plan.params[f"{m}.mixer.{w}"]
            assert str(parse_spec(got)[tp]) == spec, f"{m}.mixer.{w}: {got} on tp, want {spec}"
    if name == "hybrid":  # the attention block is Megatron too: q/k/v split by heads, o row-parallel
        for w, spec in (("attn.q.weight", "S(0)"), ("attn.k.weight", "S(0)"), ("attn.v.weight", "S(0)"),
                        ("attn.o.weight", "S(1)")):
            got = plan.params[f"blocks.1.{w}"]
            assert str(parse_spec(got)[tp]) == spec, f"blocks.1.{w}: {got} on tp, want {spec}"
    if "dp" in names:
        assert plan.reduced, "a data-parallel plan reduces gradients"
    return plan


def _check_context_parallel(plan, name: str, used: list[tuple[dict, dict | None]],
                            checkpoint: str | None = None) -> None:
    """Every scan and convolution split on the sequence with its strategy; inside a block no activation (a value
    with a dim of the sequence length) crosses ``cp`` but through their own exchanges (and the attention's ring);
    per Mamba block and training step one state all-gather and two neighbour messages (the convolution's halo
    forward, its gradient backward), the forward ones again under full recompute; the hybrid's attention 3n − 2
    ring hops, n − 1 more when recomputed. (The solver may keep a per-head parameter such as ``A_log`` sharded on
    ``cp`` and gather it: a handful of values, a tie with all-reducing its gradient.)"""
    from autopart.trace import trace

    ops = {"autopart.ssd_scan.default": "cp_state", "autopart.causal_conv1d.default": "cp_halo"}
    seq_ops = [r for r in plan.nodes.values() if r["op"] in ops]
    mamba_blocks = 2
    assert len(seq_ops) == 2 * mamba_blocks, [r["op"] for r in plan.nodes.values()]
    assert all(r["tag"] == ops[r["op"]] for r in seq_ops), seq_ops
    ids = batches()[0]
    vals = {n.name: n.meta.get("val") for n in trace(make(name), (ids,), {"labels": ids}).graph.nodes}
    cp = plan.axis_names.index("cp")
    for rec in plan.collectives:
        val = vals.get(rec["value"])
        if not str(rec.get("layer", "")).startswith("blocks.") or val is None:
            continue
        crosses = any(ax == cp for ax, _, _ in rec["steps"])
        assert not (crosses and ids.shape[1] in val.shape), rec
    steps = 3
    if plan.pipeline:  # each rank runs its stage's blocks, once per micro-batch
        mamba_blocks = mamba_blocks * plan.pipeline["micro_batches"] // plan.pipeline["degree"]
    again = checkpoint == "full"  # the Mamba blocks' forward exchanges run a second time, in backward
    attention_again = checkpoint is not None  # both policies recompute the hybrid's attention
    for u, layout in used:
        assert layout is None, layout
        assert u["state_gathers"] == (1 + again) * steps * mamba_blocks, u
        assert u["halo_hops"] == (2 + again) * steps * mamba_blocks, u
        if name == "hybrid":  # one attention, cp=2: one K/V hop forward (again when recomputed); backward one K/V
            assert u["ring_hops"] == (1 + attention_again + 3) * steps, u  # hop and two of the dK/dV accumulators
