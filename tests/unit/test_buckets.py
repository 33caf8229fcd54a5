"""Gradient-reduction and ZeRO gather buckets sized to their links (``planner.bucket_bytes``)."""

from __future__ import annotations

import pytest
import torch

from autopart.cost import hierarchical_time, preset
from autopart.planner import (
    BUCKET_BYTES,
    BUCKET_CAP,
    BUCKET_LATENCY_SHARE,
    MIN_BUCKETS,
    bucket_bytes,
    gradient_reduction,
    largest_bucket_bytes,
    plan_bucket_bytes,
)

MIB = 2**20


def _split(axes, cluster, nbytes):
    """(latency, bandwidth seconds) of one reduce-scatter bucket of ``nbytes`` over ``axes``."""
    mesh = cluster.mesh_shape
    levels = sorted(axes, reverse=True)
    lat = hierarchical_time("reduce_scatter", 0.0, [(mesh[a], cluster.link(a).default_protocol()) for a in levels])
    bw = hierarchical_time("reduce_scatter", nbytes, [(mesh[a], cluster.link(a).without_latency()) for a in levels])
    return lat, bw


def test_bucket_keeps_latency_to_its_share_megatron_size_at_48_ranks():
    """48 data-parallel ranks across nodes (tensor parallel 8 inside each, Megatron's 32B row): DDP's 25 MiB bucket
    spends about as long on the ring's 47 hops of latency as on its bytes; the sized bucket is the smallest whole
    MiB whose latency is at most ``BUCKET_LATENCY_SHARE`` of its transfer, 192 MB: Megatron-Core's default for
    dp 48 (max(40M, 1M x dp) parameters, 48M fp32 gradients)."""
    cl = preset("h100-80gb", (48, 8))
    lat, bw = _split((0,), cl, BUCKET_BYTES)
    assert lat > 0.8 * bw, (lat, bw)  # the default is latency-bound here
    b = bucket_bytes((0,), cl)
    lat, bw = _split((0,), cl, b)
    assert lat <= BUCKET_LATENCY_SHARE * bw * (1 + 1e-9)
    lat, bw = _split((0,), cl, b - MIB)
    assert lat > BUCKET_LATENCY_SHARE * bw
    assert b == pytest.approx(48e6 * 4, rel=0.02), b
    # more ranks, larger buckets; capped
    assert bucket_bytes((0,), preset("h100-80gb", (96, 8))) > b
    assert bucket_bytes((0,), preset("h100-80gb", (4096, 8))) == BUCKET_CAP


def test_bucket_default_where_latency_is_small():
    """gloo on the cpu preset, and axes of one rank: the default, and the plan records nothing for them; a bucket
    holds at most 1/MIN_BUCKETS of the bytes reduced over its axes."""
    assert MIN_BUCKETS == 8
    cl = preset("cpu", (2, 2))
    assert bucket_bytes((0,), cl) == bucket_bytes((0, 1), cl) == BUCKET_BYTES
    assert bucket_bytes((0,), preset("h100-80gb", (1, 8))) == BUCKET_BYTES  # an axis of one rank
    assert plan_bucket_bytes({(0,): 1e12, (0, 1): 1e12}, cl) == {}
    assert largest_bucket_bytes(cl) == BUCKET_BYTES
    cl = preset("h100-80gb", (48, 8))
    rec = plan_bucket_bytes({(0,): 1e12, (): 1e12}, cl)
    assert rec == {"0": bucket_bytes((0,), cl)}
    # a model whose gradients make few such buckets gets at least MIN_BUCKETS of them (never below the default)
    assert plan_bucket_bytes({(0,): 8 * 64 * MIB}, cl) == {"0": 64 * MIB}
    assert plan_bucket_bytes({(0,): 8 * 20 * MIB}, cl) == {}
    assert largest_bucket_bytes(cl) >= bucket_bytes((0, 1), cl) >= bucket_bytes((1,), cl)


def _graph(n: int, per: int):
    """A graph summing ``n`` parameters of ``per`` bytes, its records (no compute), each reduce-scattered over axis 0
    (ZeRO-1, Megatron's distributed optimizer: a ring)."""
    from types import SimpleNamespace

    graph = torch.fx.Graph()
    phs = [graph.placeholder(f"p{i}") for i in range(n)]
    for ph in phs:
        ph.meta["val"] = torch.empty(per // 4, dtype=torch.float32, device="meta")
    out = graph.call_function(torch.ops.aten.add.Tensor, (phs[0], phs[1]))
    for ph in phs[2:]:
        out = graph.call_function(torch.ops.aten.add.Tensor, (out, ph))
    graph.output(out)
    nodes = {ph.name: {"op": "param", "compute_s": 0.0, "fwd_s": 0.0, "output": "RR"} for ph in phs}
    nodes |= {n.name: {"op": "op", "compute_s": 0.0, "fwd_s": 0.0, "output": "RR"} for n in graph.nodes
              if n.op == "call_function"}
    traced = SimpleNamespace(graph=graph, params={ph.name: ph.name for ph in phs})
    return traced, nodes, {ph.name: [0] for ph in phs}, {ph.name: 1 for ph in phs}


def test_gradient_reduction_prices_the_sized_buckets():
    """``gradient_reduction`` fills buckets to ``bucket_bytes``: 40 reduce-scattered gradients of 24 MiB over 48
    ranks across nodes launch in 6 buckets of 7 (183 MiB), not 40, and the reduction is priced as those 6."""
    cl = preset("h100-80gb", (48, 8))
    b = bucket_bytes((0,), cl)
    per = 24 * MIB
    traced, nodes, reduced, zero = _graph(40, per)
    total, _ = gradient_reduction(traced, nodes, reduced, zero, cl)
    lat, bw = _split((0,), cl, 40 * per)
    n_buckets = -(-40 // (b // per))
    assert n_buckets == 6
    from autopart.planner import grad_reduction_time

    assert total == pytest.approx(sum(grad_reduction_time(k * per, (0,), True, cl)
                                      for k in [b // per] * (40 // (b // per)) + [40 % (b // per)] if k))
    assert total < sum(grad_reduction_time(per, (0,), True, cl) for _ in range(40)) - 30 * lat


def test_plan_records_its_bucket_sizes():
    """A data-parallel plan on 48 H100 ranks across nodes records its bucket size (``plan.options["bucket_bytes"]``,
    printed with the plan): of 25 MiB doubled up to the links' size, the one whose step exposes least of the reduction
    and ZeRO-1's gather; its record prices the reduction with it, for less than DDP's 25 MiB buckets would."""
    import autopart
    from autopart.models.gpt import GPT, GPTConfig
    from autopart.trace import trace

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=32768, max_seq_len=256, n_layer=4, n_head=16, d_model=1024, bias=False))
        ids = torch.randint(0, 32768, (48, 256))
    traced = trace(model, (ids,), {"labels": ids})
    cl = preset("h100-80gb", (48,))
    p = autopart.plan(model, autopart.Mesh((48,), ("dp",)), (ids,), {"labels": ids}, cluster=cl, traced=traced,
                      roles={"dp": "dp"}, zero=1, pipeline="off")
    total = sum(v.numel() * v.element_size() for v in model.parameters())
    assert all(v == [0] for v in p.reduced.values()) and set(p.zero.values()) == {1}
    top = bucket_bytes((0,), cl, total)
    assert top > BUCKET_BYTES
    ladder = [BUCKET_BYTES * 2**k for k in range(8) if BUCKET_BYTES * 2**k < top] + [top]
    assert list(p.options["bucket_bytes"]) == ["0"] and p.options["bucket_bytes"]["0"] in ladder[1:]
    assert "buckets" in str(p) and "over dp" in str(p)
    sized, default = (gradient_reduction(traced, p.nodes, p.reduced, p.zero, cl, 1, sizes)
                      for sizes in (p.options["bucket_bytes"], {}))
    assert sized[0] == pytest.approx(p.predicted["grad_reduction_s"], rel=1e-9) and sized[0] < default[0]


def test_chosen_bucket_trades_latency_against_the_last_bucket():
    """``choose_bucket_bytes``: with no backward to hide behind, the reduction is exposed whole and the links' size
    (fewest latencies) wins; behind a long backward only what the end of backward launches shows: the first op's two
    gradients (2 x 24 MiB, ready together), one bucket at 50 MiB, two at 25 MiB (two latencies): 50 MiB wins, not
    the links' size."""
    from autopart.planner import choose_bucket_bytes

    cl = preset("h100-80gb", (48, 8))
    traced, nodes, reduced, zero = _graph(40, 24 * MIB)
    totals = {(0,): 40 * 24 * MIB}
    top = bucket_bytes((0,), cl, totals[(0,)])
    assert choose_bucket_bytes(traced, nodes, reduced, zero, [], totals, cl) == {"0": top}
    for rec in nodes.values():
        if rec["op"] == "op":
            rec["compute_s"] = 1.0  # backward seconds per op: every bucket but the last hides
    assert choose_bucket_bytes(traced, nodes, reduced, zero, [], totals, cl) == {"0": 2 * BUCKET_BYTES} and \
        top > 2 * BUCKET_BYTES
