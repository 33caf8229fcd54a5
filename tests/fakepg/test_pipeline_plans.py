"""A 70B-class Llama on 1024 A100-80GB (128 nodes x 8) with the Megatron-LM classic layout pinned: tensor parallel
on the intra-node axis, data parallel across nodes, no ZeRO and no offload; ``pipeline={"axis": "dp"}`` lets stages
split the pinned data-parallel axis (the degree, micro-batches, schedule and boundaries are the solver's). Model
states alone are 70e9 x 16 bytes / 8 = 140 GB per device, so no plan without pipeline stages fits 80 GB; the planner
must split the data-parallel axis into stages, and the stage holding the embedding (where 1F1B's activations in
flight peak) must fit. Built on the ``meta`` device; no process group. Measured (2 cores): export ~25 s, planning
~10 s."""

from __future__ import annotations

import functools

import pytest
import torch

import autopart
from autopart.models.llama import Llama, LlamaConfig
from autopart.trace import trace

pytestmark = pytest.mark.slow

SHAPE = (128, 8)
SEQ = 2048
BATCH = 128  # one 2048-token sequence per data-parallel rank of the unpipelined mesh


@functools.cache
def _plan() -> autopart.Plan:
    with torch.device("meta"):
        model = Llama(LlamaConfig.preset("llama-70b"))
        ids = torch.randint(0, model.cfg.vocab_size, (BATCH, SEQ))
    t = trace(model, (ids,), {"labels": ids})
    return autopart.plan(model, autopart.mesh(SHAPE, ("dp", "tp")), (ids,), {"labels": ids},
                         cluster=autopart.preset("a100-80gb", SHAPE), roles={"dp": "dp", "tp": "tp"}, zero=0,
                         offload="none", pipeline={"axis": "dp"}, traced=t)


def test_70b_needs_and_gets_pipeline() -> None:
    cluster = autopart.preset("a100-80gb", SHAPE)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Llama(LlamaConfig.preset("llama-70b")).parameters())
    assert n_params * 16 / SHAPE[1] > cluster.memory_budget, "the premise: no stage-free plan can hold the states"
    p = _plan()
    pp = p.pipeline
    assert pp and pp["degree"] > 1, p
    assert pp["axis_name"] == "dp" and SHAPE[0] % pp["degree"] == 0
    assert tuple(p.mesh_shape) == (SHAPE[0] // pp["degree"], SHAPE[1])
    # every rank (the sum of its chunks under interleaving) fits, the first stage included
    per_rank = [0.0] * pp["degree"]
    for st in pp["stages"]:
        per_rank[st["rank"]] += st["memory_bytes"]["total"]
    assert max(per_rank) <= cluster.memory_budget * (1 + 1e-9), per_rank
    first = pp["stages"][0]
    assert first["layers"][0] == "blocks.0" and pp["stages"][-1]["layers"][-1] == "blocks.79"
    assert first["in_flight"] == max(st["in_flight"] for st in pp["stages"])
    # stages are contiguous and cover the 80 blocks once
    order = [lay for st in pp["stages"] for lay in st["layers"]]
    assert order == [f"blocks.{i}" for i in range(80)]
    assert 0 < pp["bubble_fraction"] < 0.5
    assert pp["micro_batches"] * pp["micro_batch_size"] == BATCH
    # Megatron layout inside a stage: weights sharded on tp, no ZeRO
    assert not p.zero
    assert p.axis_role(1) in ("tensor", "data+tensor")
    assert "pipeline: " in str(p)
    # the plan without stages cannot fit: not solved, and said so with its ILP's bound, not as its step
    assert pp["no_pipeline_is_lower_bound"]
    assert "without pipeline: not solved, its ILP objective >= " in str(p)
