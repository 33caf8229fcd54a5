"""Inference on real gloo ranks: a frozen Llama, planned forward-only, gives one process's logits."""

from __future__ import annotations

import math

import pytest
import torch

from tests.multiproc.harness import run_ranks

pytestmark = pytest.mark.multiproc

CFG = dict(vocab_size=128, max_seq_len=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64)


def _model():
    from autopart.models import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(**CFG)).eval().requires_grad_(False)


def _ids():
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))


def _run(shape, names, roles):
    import autopart

    pm = autopart.parallelize(_model(), autopart.mesh(shape, names), (_ids(),), roles=roles, kv_cache_tokens=256)
    with torch.no_grad():
        out = pm(_ids())
    mem = pm.plan.predicted["memory_bytes"]
    return out.detach().clone(), mem["gradients"], mem["optimizer_states"], mem["kv_cache"]


@pytest.mark.parametrize("shape,names,roles", [((2,), ("tp",), {"tp": "tp"}),
                                               ((2, 2), ("dp", "tp"), {"dp": "dp", "tp": "tp"})],
                         ids=["tp2", "dp2xtp2"])
def test_inference_logits_match_one_process(shape, names, roles):
    with torch.no_grad():
        ref = _model()(_ids())
    for out, grads, states, kv in run_ranks(math.prod(shape), _run, shape, names, roles):
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        assert grads == 0 and states == 0 and kv > 0
