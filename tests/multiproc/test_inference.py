"""Inference on real gloo ranks: a frozen Llama, planned forward-only, gives one process's logits."""

from __future__ import annotations

import math

import pytest
import torch

from tests.multiproc.harness import run_ranks

pytestmark = pytest.mark.multiproc

CFG = dict(vocab_size=128, max_seq_len=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64)


def _model(layers: int = 2):
    from autopart.models import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(**{**CFG, "n_layer": layers})).eval().requires_grad_(False)


def _ids():
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))


def _run(shape, names, roles, layers=2, pipeline=None):
    import autopart

    pm = autopart.parallelize(_model(layers), autopart.mesh(shape, names), (_ids(),), roles=roles,
                              kv_cache_tokens=256, pipeline=pipeline)
    with torch.no_grad():
        out = pm(_ids())
    mem = pm.plan.predicted["memory_bytes"]
    grid = (pm.plan.pipeline or {}).get("grid", "")
    # a pipelined plan's memory is its largest rank's: states (parameters, with the optimizer's when training)
    return out.detach().clone(), mem["gradients"], mem.get("optimizer_states", 0.0), mem["kv_cache"], grid


@pytest.mark.parametrize("shape,names,roles", [((2,), ("tp",), {"tp": "tp"}),
                                               ((2, 2), ("dp", "tp"), {"dp": "dp", "tp": "tp"})],
                         ids=["tp2", "dp2xtp2"])
def test_inference_logits_match_one_process(shape, names, roles):
    with torch.no_grad():
        ref = _model()(_ids())
    for out, grads, states, kv, _ in run_ranks(math.prod(shape), _run, shape, names, roles):
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        assert grads == 0 and states == 0 and kv > 0


def test_pipelined_inference_with_one_micro_batch_matches_one_process():
    """Two stages of two chunks each (interleaved, one micro-batch: fewer than the stages), run forward-only as the
    runtime runs a frozen model's pipeline (breadth-first over a rank's chunks); the plan draws that order."""
    with torch.no_grad():
        ref = _model(4)(_ids())
    pipe = {"stages": 2, "micro_batches": 1, "schedule": "interleaved"}
    # K and V of 256 positions per layer: 4 sequences x 2 kv heads x head dim 8 x fp32, 2 of the 4 layers a rank
    kv_rank = 2 * 2 * 4 * CFG["n_kv_head"] * 256 * (CFG["d_model"] // CFG["n_head"]) * 4
    for out, grads, states, kv, grid in run_ranks(2, _run, (2,), ("pp",), {"pp": "pp"}, 4, pipe):
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        assert grads == 0 and states == 0 and kv == pytest.approx(kv_rank, rel=1e-6)
        assert grid.splitlines() == ["rank 0: F0c0 .    F0c1 .", "rank 1: .    F0c0 .    F0c1"]
