"""Data parallelism over both axes of a (nodes, gpus) mesh at scale: Llama-8B on 4 x 8 H100s, planned on the meta
device (no memory, no process group). Before the batch could split over several axes at once, this mesh's plan
was tensor parallel inside a node and data parallel across (0.783 s a step); now it is ZeRO over all 32 GPUs, the
layout ``autopart advise`` found only on its flat 32-GPU view (benchmarks/README.md)."""

from __future__ import annotations

import functools
import importlib

import pytest

import autopart
from autopart.placement import Replicate, parse_spec
from autopart.trace import trace

pytestmark = pytest.mark.slow

SHAPE, NAMES = (4, 8), ("node", "gpu")


@functools.cache
def _traced():
    _, model, inputs, kwargs, _ = importlib.import_module("autopart.advise").build(model="llama:8b", batch=64,
                                                                                   seq=4096)
    return model, inputs, kwargs, trace(model, inputs, kwargs)


def _plan(**kw) -> autopart.Plan:
    model, inputs, kwargs, t = _traced()
    return autopart.plan(model, autopart.mesh(SHAPE, NAMES), inputs, kwargs,
                         cluster=autopart.preset("h100-80gb", SHAPE), traced=t, optimizer_bytes_per_param=12.0,
                         pipeline="off", **kw)


def test_llama8b_on_4x8_is_data_parallel_over_all_gpus():
    p = _plan()
    # inside the blocks the batch is split over both axes: every projection's output S(0)S(0), every weight whole
    # on both axes (ZeRO slices their states and gradients), every gradient summed over both, and no activation
    # collective (nothing tensor parallel). The embedding and head may differ (a 128K-row table)
    blocks = [k for k in p.params if k.startswith("blocks.")]
    assert all(all(isinstance(x, Replicate) for x in parse_spec(p.params[k])) for k in blocks), p.params
    assert all(sorted(p.reduced[k]) == [0, 1] for k in blocks)
    assert {p.zero.get(k, 0) for k in blocks} <= {1, 2} and p.zero
    ops = [r for r in p.nodes.values() if r["layer"] == "blocks.0" and r["op"] != "param"]
    assert sum(r["op"] == "aten.linear.default" for r in ops) == 7
    assert all(r["output"] in ("S(0)S(0)", ["S(0)S(0)"] * len(r["output"])) for r in ops), ops
    # (block 0 converts its input from the embedding's layout, the table's hidden dim split on gpu: one all-to-all)
    assert sum(p.collective_counts("blocks.0", "fwd").values()) <= 1
    for layer in (f"blocks.{i}" for i in range(1, 32)):
        assert not p.collective_counts(layer, "fwd"), p.collective_counts(layer, "fwd")
    assert p.predicted["memory_bytes"]["total"] <= autopart.preset("h100-80gb", SHAPE).memory_budget
    # the plan's "axes:" line says so, by the parameters' bytes (not by the token ids, kept whole and sliced at the
    # embedding); Megatron's layout reads data across nodes, tensor inside
    assert [p.axis_role(i) for i in range(2)] == ["data", "data"], str(p).splitlines()[1]
    assert "axes: node: data, gpu: data" in str(p)
    # faster than Megatron's layout on the same mesh, which was the best this mesh could plan before
    meg = _plan(roles={"node": "dp", "gpu": "tp"})
    assert p.predicted["step_time_s"] < meg.predicted["step_time_s"], (p.predicted["step_time_s"],
                                                                        meg.predicted["step_time_s"])
    assert [meg.axis_role(i) for i in range(2)] == ["data", "tensor"]
