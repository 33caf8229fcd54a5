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


def test_fp32_gradients_of_bf16_weights_are_priced_as_such():
    """``grad_dtype="float32"`` on a bf16 model (Megatron-LM's fp32 ``main_grad``): the plan keeps 4 bytes of
    gradient per parameter instead of 2 (the memory row "gradients" doubles, ZeRO-1 keeping whole gradients and
    without ZeRO alike), reduces in fp32 unless told otherwise, and the optimizer step reads the wider gradient."""
    model, ids = _model(torch.bfloat16)
    traced = trace(model, (ids,), {"labels": ids})
    for zero in (0, 1):
        kw = dict(cluster="h100-80gb", traced=traced, zero=zero, gpus_per_node=8)
        base = autopart.evaluate(model, 32, (ids,), {"labels": ids}, **kw)
        wide = autopart.evaluate(model, 32, (ids,), {"labels": ids}, grad_dtype=torch.float32, **kw)
        assert wide.options["grad_dtype"] == "float32" and wide.options["reduce_dtype"] == "float32"
        assert base.options["grad_dtype"] is None and base.options["reduce_dtype"] is None
        grads = [p.predicted["memory_bytes"]["gradients"] for p in (base, wide)]
        assert grads[1] == pytest.approx(2 * grads[0], rel=1e-9), grads
        assert wide.predicted["optimizer_step_s"] > base.predicted["optimizer_step_s"]
        assert 1.6 < wide.predicted["grad_reduction_s"] / base.predicted["grad_reduction_s"] <= 2.0
        # a bf16 reduction of the fp32 gradients, asked for: the bytes of bf16 again
        narrow = autopart.evaluate(model, 32, (ids,), {"labels": ids}, grad_dtype="float32",
                                   reduce_dtype="bfloat16", **kw)
        assert narrow.predicted["grad_reduction_s"] == pytest.approx(base.predicted["grad_reduction_s"], rel=1e-9)
    with pytest.raises(ValueError, match="grad_dtype"):
        PlanOptions(grad_dtype="int8")


def test_zero3_reduce_scatter_priced_in_reduce_dtype():
    """ZeRO-3 on a bf16 model with ``reduce_dtype="float32"`` (FSDP2's ``MixedPrecisionPolicy(reduce_dtype=
    torch.float32)``): backward's reduce-scatter of each parameter's gradient moves twice its bf16 bytes, the
    forward all-gathers do not change, and the plan's communication by kind still sums to its ``comm_s``."""
    from autopart.advise import INSIDE_OPS, KINDS, communication

    model, ids = _model(torch.bfloat16)
    traced = trace(model, (ids,), {"labels": ids})
    kw = dict(cluster="h100-80gb", traced=traced, zero=3, gpus_per_node=8)
    plans = [autopart.evaluate(model, 32, (ids,), {"labels": ids}, reduce_dtype=rd, **kw)
             for rd in (None, "float32")]
    assert all(set(p.zero.values()) == {3} for p in plans), [p.zero for p in plans]
    comms = [communication(p, traced) for p in plans]
    assert comms[1]["reduce_scatter"]["bytes"] == pytest.approx(2 * comms[0]["reduce_scatter"]["bytes"], rel=1e-9)
    assert comms[1]["all_gather"]["bytes"] == pytest.approx(comms[0]["all_gather"]["bytes"], rel=1e-9)
    # the extra bytes priced at the links' bandwidth (NVLink 450 GB/s .. InfiniBand 50 GB/s per GPU): latency-bound
    # small parameters make the time grow less than 2x
    extra_s = comms[1]["reduce_scatter"]["time_s"] - comms[0]["reduce_scatter"]["time_s"]
    extra_b = comms[1]["reduce_scatter"]["bytes"] - comms[0]["reduce_scatter"]["bytes"]
    assert extra_b / 450e9 * 0.999 <= extra_s <= extra_b / 50e9 * 1.001, (extra_s, extra_b)
    assert plans[1].predicted["comm_s"] > plans[0].predicted["comm_s"]
    for p, c in zip(plans, comms):
        total = sum(c[k]["time_s"] for k in KINDS) + c[INSIDE_OPS]["time_s"]
        assert total == pytest.approx(p.predicted["comm_s"], rel=1e-6)
