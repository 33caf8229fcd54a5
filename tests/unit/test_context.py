"""Context parallelism without a process group: the ring's block arithmetic simulated over c ranks in one process
(outputs and gradients equal SDPA's), the balanced layout's positions and permutation, the strategy's options and
tags, the cost terms, and the lowering pass on a planned Llama."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import autopart
from autopart.runtime import context as RC
from autopart.strategy import context as SC

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def test_balanced_positions_pair_chunks() -> None:
    n, s = 4, 32
    perm = RC.balanced_permutation(s, n)
    assert sorted(perm.tolist()) == list(range(s))
    chunks = perm.view(2 * n, s // (2 * n))[:, 0] // (s // (2 * n))  # chunk index of each 2n-th of the order
    assert chunks.tolist() == [0, 7, 1, 6, 2, 5, 3, 4]
    work = [sum(int(p) + 1 for p in RC.positions("balanced", r, n, s // n)) for r in range(n)]
    assert len(set(work)) == 1  # causal work (keys seen) equal on every rank
    contiguous = [sum(int(p) + 1 for p in RC.positions("contiguous", r, n, s // n)) for r in range(n)]
    assert contiguous[-1] / (sum(contiguous) / n) == pytest.approx((2 * n - 1) / n, rel=0.05)
    x = torch.randn(3, s, 5)
    ctx = {"axis": 0, "n": n, "s": s, "layout": "balanced"}
    assert torch.equal(RC.to_layout(x, ctx)[:, : s // n], x[:, perm[: s // n]])
    assert torch.equal(RC.from_layout(RC.to_layout(x, ctx), ctx), x)
    with pytest.raises(ValueError, match="divisible by 8"):
        RC.balanced_permutation(12, 4)
    with pytest.raises(ValueError, match="several dims"):
        RC.to_layout(torch.zeros(s, s), ctx)


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@pytest.mark.parametrize("h,hk,causal", [(4, 2, True), (4, 4, False)])
def test_ring_blocks_match_sdpa(layout: str, h: int, hk: int, causal: bool) -> None:
    """Every rank's ring, simulated: merged block outputs and summed block gradients equal SDPA's."""
    torch.manual_seed(0)
    n, b, s, d = 4, 2, 16, 8
    q, w = torch.randn(b, h, s, d), torch.randn(b, h, s, d)
    k, v = torch.randn(b, hk, s, d), torch.randn(b, hk, s, d)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=h != hk)
    (ref * w).sum().backward()
    sl, scale = s // n, d ** -0.5
    pos = [RC.positions(layout, r, n, sl) for r in range(n)]
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for r in range(n):
        qr = q[:, :, pos[r]]
        out, lse = torch.zeros_like(qr), torch.full(qr.shape[:3], float("-inf"))
        blocks = []
        for t in range(n):  # the order the ring delivers them: own block first
            src = (r - t) % n
            seen, mask = RC._block_mask(pos[r], pos[src], causal)
            if seen:
                kb, vb = (RC._expand(x[:, :, pos[src]], h) for x in (k, v))
                blocks.append((src, kb, vb, mask))
                out, lse = RC.merge(out, lse, *RC.block_forward(qr, kb, vb, mask, scale))
        torch.testing.assert_close(out, ref[:, :, pos[r]], atol=1e-5, rtol=1e-5)
        do = w[:, :, pos[r]]
        dq = torch.zeros_like(qr)
        for src, kb, vb, mask in blocks:
            bq, bk, bv = RC.block_backward(qr, kb, vb, mask, scale, out, lse, do)
            dq += bq
            dk[:, :, pos[src]] += RC._fold(bk, hk)
            dv[:, :, pos[src]] += RC._fold(bv, hk)
        torch.testing.assert_close(dq, full[0].grad[:, :, pos[r]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dk, full[1].grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dv, full[2].grad, atol=1e-5, rtol=1e-5)


def _sdpa_graph(s: int, mask: bool | str = False, causal: bool = True, h: int = 8, hk: int = 2, d: int = 64,
                ordered: bool = False) -> fx.GraphModule:
    class M(torch.nn.Module):
        def forward(self, q, k, v):
            if ordered:
                q = q.cumsum(2)
            m = torch.ones(s, s, dtype=torch.float if mask == "float" else torch.bool, device=q.device) if mask \
                else None
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal and not mask,
                                                  enable_gqa=h != hk)

    with torch.device("meta"):
        args = (torch.randn(1, h, s, d), torch.randn(1, hk, s, d), torch.randn(1, hk, s, d))
    return torch.export.export(M(), args, strict=False).module()


def _sdpa_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.target == SDPA)


def test_options_and_tags() -> None:
    from autopart.planner import _pin_filter
    from autopart.strategy import options_for

    node = _sdpa_node(_sdpa_graph(64))
    opts = SC.cp_variants(node, options_for(node, (4,))[0])
    seq = [o for o in opts if SC.cp_axis(o) == 0]
    assert sorted(o.tag for o in seq) == ["cp_allgather", "cp_ring"]
    assert all(o.inputs == ((SC.Shard(2),),) * 3 for o in seq)
    assert [o.tag for o in _pin_filter("sdpa", opts, "S(2) [cp_ring]")] == ["cp_ring"]
    assert len(_pin_filter("sdpa", opts, "S(2)")) == 2
    with pytest.raises(ValueError, match="not a legal placement"):
        _pin_filter("sdpa", opts, "S(2) [zero3]")
    masked = _sdpa_node(_sdpa_graph(64, mask=True))  # a boolean [s, s] mask: split on its query rows
    assert [o.inputs for o in options_for(masked, (4,))[0] if SC.cp_axis(o) is not None] == \
        [((SC.Shard(2),),) * 3 + ((SC.Shard(0),),)]
    additive = _sdpa_node(_sdpa_graph(64, mask="float"))  # an additive float mask: no split
    assert not any(SC.cp_axis(o) is not None for o in options_for(additive, (4,))[0])


def test_cost_terms() -> None:
    from autopart.cost import collective_time, preset
    from autopart.cost.compute import dtype_peak_flops

    cluster = preset("h100-80gb", (8,))
    link, c = cluster.link(0), 8

    def cost(gm, tag):
        node = _sdpa_node(gm)
        opt = SC.OpOption(((SC.Shard(2),),) * 3, (SC.Shard(2),), tag=tag)
        return SC.cp_comm_time(node, opt, cluster)

    for s in (8192, 131072):
        gm = _sdpa_graph(s)
        local = 2 * (s // c) * 2 * 64 * 4  # this rank's K and V blocks, fp32
        ag = 2 * collective_time("all_gather", c * local, c, link) + collective_time("reduce_scatter", c * local, c,
                                                                                     link)
        assert cost(gm, "cp_allgather") == pytest.approx(ag)  # balanced: no imbalance priced
        hop = autopart.cost.send_recv_time(local, link)
        ring = cost(gm, "cp_ring")
        # the ring's passes outside its kernels, fp32 (e = 4) elements of this rank's q (8 heads) and K+V (2 + 2
        # heads): per step after the first 32 B per q element (forward merge 8 + e, backward rowsum 2e and dq add
        # 8 + e) and 12 per K/V one (8 + e), then the casts of out, dq and dK/dV (4 + e each). Balanced causal
        # layout: the last rank's steps attend all its queries to half of each block's keys
        nq, nkv = 8 * (s // c) * 64, 4 * (s // c) * 64
        merge = ((c - 1) * (32 * nq + 12 * nkv / 2) + 8 * (2 * nq + nkv)) / cluster.device.mem_bandwidth
        assert ring >= hop + merge
        if s == 131072:  # blocks of 16K tokens: every hop hidden but the dK/dV return
            assert ring == pytest.approx(hop + merge)
    small = _sdpa_graph(256)  # 32-token blocks: the ring's hops are exposed, the all-gather is cheaper
    assert cost(small, "cp_ring") > 2 * (c - 1) * autopart.cost.send_recv_time(2 * 32 * 2 * 64 * 4, link) * 0.9
    assert cost(small, "cp_allgather") < cost(small, "cp_ring")
    ordered = _sdpa_graph(8192, ordered=True)  # a cumsum along the sequence: contiguous rows, imbalance priced
    assert SC.balance_blockers(ordered.graph, 8192) and not SC.balance_blockers(_sdpa_graph(8192).graph, 8192)
    rank_flops = 4 * 8 * 8192 * 8192 * 64 / c  # this rank's queries against every key, no causal halving
    # the last rank's extra, at the rate the attention op itself is priced at (the preset's fused attention)
    fp32 = dtype_peak_flops(cluster.device, torch.float32) / cluster.device.peak_flops  # an fp32 graph
    imbalance = (c - 1) / c * 3.5 * rank_flops / 2 / (cluster.device.attention_flops * fp32)
    assert cost(ordered, "cp_allgather") - cost(_sdpa_graph(8192), "cp_allgather") == pytest.approx(imbalance)
    assert cost(_sdpa_graph(8192), "") == 0.0


def _llama_program(tag: str, s: int = 16):
    from autopart.models.llama import Llama, LlamaConfig
    from autopart.passes import run_passes
    from autopart.planner import needs_grad_map
    from autopart.trace import trace

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, n_layer=1, n_head=4, n_kv_head=2, d_model=32, d_ff=64))
    ids = torch.randint(0, 64, (2, s))
    t = trace(model, (ids,), {"labels": ids})
    sdpa = next(n.name for n in t.graph.nodes if n.target == SDPA)
    plan = autopart.plan(model, autopart.mesh((2,), ("cp",)), (ids,), {"labels": ids}, traced=t, pipeline="off",
                         pins={"ids": "S(1)", sdpa: f"S(2) [{tag}]"})
    return t, plan, sdpa, lambda p: run_passes(t, p, needs_grad_map(t))


def test_pass_lowers_and_balances() -> None:
    t, plan, sdpa, passes = _llama_program("cp_allgather")
    assert plan.nodes[sdpa]["tag"] == "cp_allgather"
    assert plan.nodes[sdpa]["cp_axis"] == 0 and plan.axis_role(0) == "context"  # the sequence split, not the batch
    gm = passes(plan)
    assert gm.meta["autopart.context"] == {"axis": 0, "n": 2, "s": 16, "layout": "balanced"}
    assert gm.code.count("context_attention(") == 1 and "'cp_allgather', True, None, 'balanced'" in gm.code
    assert gm.code.count("sequence_positions(16, 2") == 1  # the RoPE positions, permuted
    del plan.nodes[sdpa]["tag"]
    with pytest.raises(ValueError, match="names no context-parallel strategy"):
        passes(plan)
    t, plan, sdpa, passes = _llama_program("cp_ring", s=18)  # 18 tokens cannot be cut in 4 chunks: contiguous
    gm = passes(plan)
    assert "autopart.context" not in gm.meta and "'cp_ring', True, None, 'contiguous'" in gm.code
    assert "sequence_positions" not in gm.code


def test_saved_activations_shrink_by_c() -> None:
    """Under either strategy the attention saves its local q, k, v and output: 1/c of the unsplit node's bytes."""
    t, plan, sdpa, _ = _llama_program("cp_ring")
    _, plan_ag, _, _ = _llama_program("cp_allgather")
    from autopart.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, n_layer=1, n_head=4, n_kv_head=2, d_model=32, d_ff=64))
    ids = torch.randint(0, 64, (2, 16))
    whole = autopart.plan(model, autopart.mesh((2,), ("cp",)), (ids,), {"labels": ids}, traced=t, pipeline="off",
                          pins={"ids": "R", sdpa: "R"})
    assert whole.nodes[sdpa]["memory_bytes"] > 0
    for p in (plan, plan_ag):
        assert p.nodes[sdpa]["memory_bytes"] == pytest.approx(whole.nodes[sdpa]["memory_bytes"] / 2)


def test_cpu_flash_kernel_takes_a_strided_last_dim() -> None:
    """The CPU flash kernel read a query whose last dim is strided as if it were contiguous (a query after a
    reduce-scatter along the features: stride 32 there), garbage out; ``_torch_private`` hands it contiguous
    copies, forward and backward, as the public ``scaled_dot_product_attention`` does."""
    from autopart import _torch_private as P

    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, 4, 1, 4, generator=g).permute(1, 2, 3, 0)  # [4, 1, 4, 8], stride(-1) = 16
    k, v = (torch.randn(4, 1, 4, 8, generator=g) for _ in range(2))
    assert q.stride(-1) != 1
    out, lse = P.flash_attention_cpu(q, k, v, True, None, 8 ** -0.5)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    do = torch.randn(out.shape, generator=g).transpose(-1, -2).contiguous().transpose(-1, -2)
    dq, dk, dv = P.flash_attention_cpu_backward(do, q, k, v, out, lse, True, None, 8 ** -0.5)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(qr, kr, vr, is_causal=True).backward(do)
    for a, b in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(a, b)
