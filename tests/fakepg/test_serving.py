"""Serving what-if plans on an H100 node (``autopart.advise(..., inference=True)``, the ``meta`` device): decoding one
token of Llama-2-70B's layer (20 layers of it, as tests/fakepg/test_advise.py) at batch 1 is bound by reading the
weights and by the tensor-parallel all-reduces' latency. Published practice serves it tensor parallel over the
node's 8 GPUs (vLLM, TensorRT-LLM), weights sharded; ~4 s of CPU."""

from __future__ import annotations

import functools

import pytest

import autopart
from autopart.cost import all_reduce_time, preset

LAYERS = 20


@functools.cache
def _decode():
    return autopart.advise("llama", "70b", layers=LAYERS, cluster="h100-80gb", nodes=1, batch=1, seq=1,
                           inference=True, kv_cache_tokens=8192)


def test_batch_one_decoding_is_tensor_parallel_over_the_node_with_weights_sharded():
    a = _decode()
    assert a.fits and a.strategy["tp"] == 8 and a.strategy["pp"] == 1, a.strategy
    views = {tuple(v["mesh"]): v["step_time_s"] for v in a.views}
    assert views[(8,)] < views[(4, 2)]  # tensor parallel 8 beats 4 x 2 on latency
    # every weight held as its matmul reads it: the 8th of each, plus at most the embedding table whole (a lookup
    # reads rows; sharding it costs a collective). Before, weights a matmul reads sliced could stay whole in memory
    # at no cost in time (Llama-70B: 47.5 GiB a GPU instead of 16.5)
    h, vocab = 8192, 32000
    assert a.memory["by_kind"]["parameters"] <= (2 * a.params / 8 + 2 * vocab * h) * 1.01
    # the step: the weights read from HBM, plus two all-reduces of a token's activation per layer at NCCL's
    # low-latency protocol (15 us on 8 NVLink GPUs), not the ring's 2 (n - 1) alpha (70 us)
    cl = preset("h100-80gb", (8,))
    read = a.memory["by_kind"]["parameters"] / cl.device.mem_bandwidth
    per = all_reduce_time(2 * h, 8, cl.link(0))
    assert per < 20e-6 < 60e-6 < 14 * cl.link(0).alpha
    comm = a.communication["all_reduce"]["time_s"]
    assert 2 * LAYERS * per <= comm <= (2 * LAYERS + 4) * per
    assert read < a.step_time_s < read + comm + 1e-3


def test_decoding_across_a100_nodes_is_pipelined_and_priced_kept_full():
    """Two A100 nodes serving Llama-2-70B's layer (8 layers) at batch 64: tensor parallel 8 inside each node and
    2 pipeline stages across (vLLM's and TensorRT-LLM's multi-node layout), priced as served: the pipeline never
    drains, a step of both micro-batches is 2 stage times (not GPipe's 3 of one batch), which is also the time
    between a sequence's tokens. Priced as one drained batch, the same pipeline is slower than the plan without
    stages (before, the search turned to the interleaved schedule to cut a bubble served decoding does not have)."""
    a = autopart.advise("llama", "70b", layers=8, cluster="a100-80gb", nodes=2, batch=64, seq=1, inference=True,
                        kv_cache_tokens=8192)
    pp = a.plan.pipeline
    assert a.fits and a.strategy["pp"] == 2 and a.strategy["tp"] == 8, a.strategy
    assert pp["steady"] and pp["axis_name"] == "node" and pp["micro_batches"] >= 2
    t = max(st["time_s"] for st in pp["stages"])
    m = pp["micro_batches"]
    assert pp["pipeline_s"] == pytest.approx(max(m, 2) * t, rel=1e-9)
    assert pp["drained_step_time_s"] == pytest.approx(a.step_time_s + (min(m, 2) - 1) * t, rel=1e-9)
    # the plan without stages on the same mesh is slower than the pipeline served, faster than one drained batch
    assert a.step_time_s < pp["no_pipeline_step_time_s"] < pp["drained_step_time_s"]
    assert a.tokens_per_s == pytest.approx(64 / a.step_time_s)
