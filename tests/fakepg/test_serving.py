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


def test_decoding_batch_8_stays_tensor_parallel_its_pipelines_priced_as_served():
    """Llama-3-8B decoding 8 sequences over an 8192-token K/V cache on one H100 node: tensor parallel 8, as served
    in practice. Its pipelined candidates are priced as a server runs them, kept full (a step of m micro-batches is
    max(m, p) stage times, no fill or drain), and each micro-batch reads its stage's weights *and* its sequences'
    K/V cache. When a block's floor was the larger of the two (the weights' read hiding the cache's), tensor 4 x 2
    pipeline stages looked 11% faster (1.719 ms against 1.937) and won."""
    a = autopart.advise("llama", "8b", cluster="h100-80gb", nodes=1, batch=8, seq=1, inference=True,
                        kv_cache_tokens=8192)
    assert a.fits and (a.strategy["tp"], a.strategy["pp"]) == (8, 1), a.strategy
    cands = a.plan.solver["pipeline_candidates"]
    assert cands and all("steady" in c["schedule"] for c in cands)
    assert min(c["step_time_s"] for c in cands) > a.step_time_s
    kv = a.memory["by_kind"]["kv_cache"]
    assert kv == pytest.approx(8 * 32 * 8192 * 2 * 8 * 128 * 2 / 8, rel=0.01)  # the cache split 8 ways by heads
