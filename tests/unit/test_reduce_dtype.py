"""Pricing the data-parallel gradient reduction in another dtype (``PlanOptions.reduce_dtype``)."""

from __future__ import annotations

import pytest
import torch

import autopart
from autopart.models.gpt import GPT, GPTConfig
from autopart.planner import PlanOptions, reduce_scale
from autopart.trace import trace


def _model(dtype):
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=8192, max_seq_len=512, n_layer=2, n_head=8, d_model=1024, bias=False))
        ids = torch.randint(0, 8192, (32, 512))
    return model.to(dtype), ids


def test_fp32_reduction_of_bf16_gradients_moves_twice_the_bytes():
    """bf16 gradients summed in fp32 (Megatron-LM's default with bf16): the plan records the dtype, its reduction
    moves twice the bytes (priced between 1.6x and 2x: the buckets' latency does not double); an fp32 model's plan
    does not change."""
    model, ids = _model(torch.bfloat16)
    traced = trace(model, (ids,), {"labels": ids})
    kw = dict(cluster="h100-80gb", traced=traced, zero=1, gpus_per_node=8)
    base = autopart.evaluate(model, 32, (ids,), {"labels": ids}, **kw)
    fp32 = autopart.evaluate(model, 32, (ids,), {"labels": ids}, reduce_dtype=torch.float32, **kw)
    assert base.options["reduce_dtype"] is None and fp32.options["reduce_dtype"] == "float32"
    ratio = fp32.predicted["grad_reduction_s"] / base.predicted["grad_reduction_s"]
    assert 1.6 < ratio <= 2.0, ratio
    assert fp32.predicted["step_time_s"] >= base.predicted["step_time_s"]
    model32, ids = _model(torch.float32)
    traced = trace(model32, (ids,), {"labels": ids})
    a, b = (autopart.evaluate(model32, 32, (ids,), {"labels": ids}, cluster="h100-80gb", traced=traced, zero=1,
                              reduce_dtype=rd) for rd in (None, "float32"))
    assert a.predicted["grad_reduction_s"] == pytest.approx(b.predicted["grad_reduction_s"], rel=1e-12)
    assert reduce_scale(torch.bfloat16, "float32") == 2.0 and reduce_scale(torch.float32, None) == 1.0
    assert reduce_scale(torch.int64, "float32") == 1.0


def test_reduce_dtype_must_be_a_floating_dtype():
    for bad in ("int32", "fp33", torch.int8):
        with pytest.raises(ValueError, match="reduce_dtype"):
            PlanOptions(reduce_dtype=bad)
    assert PlanOptions(reduce_dtype=torch.float32).reduce_dtype == "float32"
