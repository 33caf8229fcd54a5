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
    lat = hierarchical_time("reduce_scatter", 0.0, [(mesh[a], cluster.link(a)) for a in levels])
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


def test_gradient_reduction_prices_the_sized_buckets():
    """``gradient_reduction`` fills buckets to ``bucket_bytes``: 40 reduce-scattered gradients of 24 MiB over 48
    ranks across nodes launch in 6 buckets of 7 (183 MiB), not 40, and the reduction is priced as those 6."""
    from types import SimpleNamespace

    cl = preset("h100-80gb", (48, 8))
    b = bucket_bytes((0,), cl)
    per = 24 * MIB
    graph = torch.fx.Graph()
    phs = [graph.placeholder(f"p{i}") for i in range(40)]
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
    zero = {ph.name: 1 for ph in phs}  # reduce-scattered (ZeRO-1, Megatron's distributed optimizer): a ring
    total, _ = gradient_reduction(traced, nodes, {ph.name: [0] for ph in phs}, zero, cl)
    lat, bw = _split((0,), cl, 40 * per)
    n_buckets = -(-40 // (b // per))
    assert n_buckets == 6
    from autopart.planner import grad_reduction_time

    assert total == pytest.approx(sum(grad_reduction_time(k * per, (0,), True, cl)
                                      for k in [b // per] * (40 // (b // per)) + [40 % (b // per)] if k))
    assert total < sum(grad_reduction_time(per, (0,), True, cl) for _ in range(40)) - 30 * lat
