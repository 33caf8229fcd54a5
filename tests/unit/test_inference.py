"""Inference plans: a frozen model is planned forward-only (no gradients, no optimizer states), with the K/V cache
of a decoding context at every attention, in the layout tensor parallelism gives it."""

from __future__ import annotations

import pytest
import torch

import autopart
from autopart.models import Llama, LlamaConfig

CFG = dict(vocab_size=256, max_seq_len=64, n_layer=2, n_head=8, n_kv_head=4, d_model=64, d_ff=128)


def _llama(frozen: bool = True):
    torch.manual_seed(0)
    m = Llama(LlamaConfig(**CFG)).eval()
    if frozen:
        m.requires_grad_(False)
    return m


def test_frozen_model_plans_forward_only_with_a_kv_cache():
    ids = torch.randint(0, 256, (2, 64))
    ctx, tp = 4096, 4
    p = autopart.plan(_llama(), autopart.mesh((tp,), ("tp",)), (ids,), roles={"tp": "tp"}, kv_cache_tokens=ctx)
    mem = p.predicted["memory_bytes"]
    assert mem["gradients"] == 0 and mem["optimizer_states"] == 0
    assert not p.reduced  # nothing to reduce without gradients
    # K and V per layer: batch x kv heads x ctx x head dim, fp32, the kv heads split over tp by the attention
    hd = CFG["d_model"] // CFG["n_head"]
    expect = CFG["n_layer"] * 2 * 2 * CFG["n_kv_head"] * ctx * hd * 4 / tp
    assert mem["kv_cache"] == pytest.approx(expect, rel=0.01)
    assert mem["total"] >= mem["parameters"] + mem["kv_cache"]
    # decoding reads the cache once per step: a longer context costs time as well as memory
    short = autopart.plan(_llama(), autopart.mesh((tp,), ("tp",)), (ids,), roles={"tp": "tp"}, kv_cache_tokens=64)
    assert short.predicted["step_time_s"] < p.predicted["step_time_s"]
    assert short.predicted["memory_bytes"]["kv_cache"] == pytest.approx(expect * 64 / ctx, rel=0.01)


def test_inference_is_cheaper_than_training_and_partly_frozen_models_train_the_rest():
    ids = torch.randint(0, 256, (2, 64))
    mesh = autopart.mesh((2,), ("dp",))
    inf = autopart.plan(_llama(), mesh, (ids,), roles={"dp": "dp"})
    train = autopart.plan(_llama(frozen=False), mesh, (ids,), {"labels": ids}, roles={"dp": "dp"}, zero=0)
    assert inf.predicted["step_time_s"] < train.predicted["step_time_s"]
    assert inf.predicted["memory_bytes"]["total"] < train.predicted["memory_bytes"]["total"]
    ft = _llama(frozen=False)
    ft.embed.requires_grad_(False)  # fine-tuning with a frozen embedding: its gradient and states vanish
    part = autopart.plan(ft, mesh, (ids,), {"labels": ids}, roles={"dp": "dp"}, zero=0)
    emb = ft.embed.weight.numel() * 4
    mt, mp = train.predicted["memory_bytes"], part.predicted["memory_bytes"]
    assert mt["gradients"] - mp["gradients"] == pytest.approx(emb, rel=1e-6)
    assert mt["optimizer_states"] - mp["optimizer_states"] == pytest.approx(2 * emb, rel=1e-6)
    # nor an optimizer step: Adam's moves 7x an fp32 parameter's bytes (weight and states read and written,
    # gradient read); inference has none at all
    bw = autopart.preset("cpu", (2,)).device.mem_bandwidth
    steps = train.predicted["optimizer_step_s"] - part.predicted["optimizer_step_s"]
    assert steps == pytest.approx(7 * emb / bw, rel=1e-6) and inf.predicted["optimizer_step_s"] == 0
    assert "embed.weight" not in part.reduced
