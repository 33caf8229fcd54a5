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
    assert p.axis_role(0) == "tensor"  # the weights' bytes split there (the norms, whole, are a sliver)
    # decoding reads the cache once per step: a longer context costs time as well as memory
    short = autopart.plan(_llama(), autopart.mesh((tp,), ("tp",)), (ids,), roles={"tp": "tp"}, kv_cache_tokens=64)
    assert short.predicted["step_time_s"] < p.predicted["step_time_s"]
    assert short.predicted["memory_bytes"]["kv_cache"] == pytest.approx(expect * 64 / ctx, rel=0.01)


def test_decoding_with_fewer_kv_heads_than_devices_reads_one_kv_head_each():
    """8 query heads on 8 devices, decoding one token over a 4096-token cache. With 8 K/V heads each device holds
    and reads one. With 2, the heads cannot split alike: each device holds both K/V heads (replicated, as vLLM
    keeps them) but attends with the one its query head uses, so the attention reads what the 8-head model's does
    and holds twice its cache (``strategy.context.gqa_split``)."""
    ids = torch.randint(0, 256, (1, 1))

    def attention(kv: int):
        torch.manual_seed(0)
        m = Llama(LlamaConfig(**{**CFG, "n_kv_head": kv})).eval().requires_grad_(False)
        p = autopart.plan(m, autopart.mesh((8,), ("tp",)), (ids,), roles={"tp": "tp"}, kv_cache_tokens=4096)
        rec = next(r for r in p.nodes.values() if r["op"] == "aten.scaled_dot_product_attention.default")
        return p, rec

    p8, a8 = attention(8)
    p2, a2 = attention(2)
    assert a8["inputs"] == ["S(1)"] * 3 and a2["inputs"] == ["S(1)", "R", "R"], (a8, a2)
    assert a2["compute_s"] == pytest.approx(a8["compute_s"], rel=1e-9)
    assert p2.predicted["memory_bytes"]["kv_cache"] == pytest.approx(2 * p8.predicted["memory_bytes"]["kv_cache"])


def test_inference_is_cheaper_than_training_and_partly_frozen_models_train_the_rest():
    ids = torch.randint(0, 256, (2, 64))
    mesh = autopart.mesh((2,), ("dp",))
    inf = autopart.plan(_llama(), mesh, (ids,), roles={"dp": "dp"})
    train = autopart.plan(_llama(frozen=False), mesh, (ids,), {"labels": ids}, roles={"dp": "dp"}, zero=0)
    assert inf.predicted["step_time_s"] < train.predicted["step_time_s"]
    # forward only, no gradient says the axis is data parallel: the weights whole and the batch split there do
    assert inf.axis_role(0) == train.axis_role(0) == "data" and not inf.reduced
    solo = autopart.plan(_llama(), autopart.mesh((1,), ("dp",)), (ids,))
    assert solo.axis_role(0) == "replicated"
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


def _decode_plan(axis: str, pipeline=None, batch: int = 4, ranks: int = 4):
    ids = torch.randint(0, 256, (batch, 1))
    return autopart.plan(_llama(), autopart.mesh((ranks,), (axis,)), (ids,), roles={axis: axis}, cluster="h100-80gb",
                         kv_cache_tokens=64, pipeline=pipeline, recipes=False)


def test_a_replicated_weight_is_read_whole_by_every_device():
    """A decoding step (one token a sequence) reads every weight: under data parallelism each device reads the
    whole of each (the op's FLOPs split 4 ways, its weight's bytes not), under tensor parallelism its shard.
    Before, an op's bytes were split like its FLOPs, and data-parallel decoding was priced up to 4x too fast."""
    bw = autopart.preset("h100-80gb", (4,)).device.mem_bandwidth
    # every weight but the embedding's table, of which a lookup reads the rows it gathers
    weights = sum(p.numel() * p.element_size() for n, p in _llama().named_parameters() if n != "embed.weight")
    dp, tp = _decode_plan("dp"), _decode_plan("tp")
    read = {k: sum(r.get("param_read_s", 0.0) for r in p.nodes.values()) for k, p in (("dp", dp), ("tp", tp))}
    assert read["dp"] == pytest.approx(weights / bw, rel=1e-9)  # every weight read once, whole, on every device
    assert read["tp"] < read["dp"] / 2  # the shards
    for k, p in (("dp", dp), ("tp", tp)):
        assert p.predicted["compute_s"] >= read[k]


def test_every_micro_batch_of_a_pipeline_reads_its_stage_weights():
    """Layer costs scale with the micro-batch, except what each micro-batch pays whatever its size: its ops'
    weights read (``Unit.floor_s``). A decoding pipeline of m micro-batches reads each stage's weights m times."""
    from autopart.pipelining import Unit

    u = Unit("b", time_s=10.0, floor_s=4.0)
    assert u.cost(1).fwd_s + u.cost(1).bwd_s == pytest.approx(10.0)
    assert u.cost(4).fwd_s + u.cost(4).bwd_s == pytest.approx(4.0)  # not 10 / 4
    one = Unit("b", time_s=10.0, floor_s=40.0).cost(1)
    assert one.fwd_s + one.bwd_s == pytest.approx(10.0)  # never above one pass's time
    # only the ops that read the weights keep the floor: the rest (attention reading its sequences' K/V cache)
    # takes its share. 6 of the 10 s read 4 s of weights: a quarter of the batch takes 4 + 4 / 4, not max(2.5, 4)
    part = Unit("b", time_s=10.0, floor_s=4.0, floored_s=6.0).cost(4)
    assert part.fwd_s + part.bwd_s == pytest.approx(5.0)
    stage_time = {}
    for m in (1, 4):
        p = _decode_plan("pp", {"stages": 2, "micro_batches": m, "schedule": "gpipe"}, ranks=2)
        assert p.pipeline["micro_batches"] == m
        stage_time[m] = max(st["time_s"] for st in p.pipeline["stages"])
        for st in p.pipeline["stages"]:
            floor = sum(r.get("param_read_s", 0.0) for r in p.nodes.values() if r["layer"] in st["layers"])
            assert floor > 0 and st["time_s"] >= floor * (1 - 1e-9)  # each micro-batch reads its stage's weights
    assert stage_time[4] > 1.5 * stage_time[1] / 4  # a quarter of the batch is not a quarter of the time


def test_forward_only_working_set_is_sharded_and_holds_no_weights():
    """Forward-only plans save nothing for backward: their activations are the largest op's inputs and outputs
    while it runs, in the layout the plan gives them (it was the unsharded set with the op's weights, the same on
    1 and on 4 devices: the embedding table counted twice at batch 1). A batch split over 4 devices holds a
    quarter of one device's working set; a pipeline's stages hold their largest op's (they held none), and the
    last stage every micro-batch's outputs."""
    ids = torch.randint(0, 256, (8, 64))
    one = autopart.plan(_llama(), autopart.mesh((1,), ("dp",)), (ids,), roles={"dp": "dp"}, recipes=False)
    four = autopart.plan(_llama(), autopart.mesh((4,), ("dp",)), (ids,), roles={"dp": "dp"}, recipes=False)
    a1, a4 = (p.predicted["memory_bytes"]["activations"] for p in (one, four))
    logits = 8 * 64 * CFG["vocab_size"] * 4  # the lm head's output, fp32: its largest op's output
    assert logits <= a1 < logits + 8 * 64 * CFG["d_model"] * 4 * 4  # its inputs and output, no weight
    assert a4 == pytest.approx(a1 / 4, rel=1e-6)
    pipe = autopart.plan(_llama(), autopart.mesh((2,), ("pp",)), (ids,), roles={"pp": "pp"}, recipes=False,
                         pipeline={"stages": 2, "micro_batches": 4, "schedule": "gpipe"})
    first, last = pipe.pipeline["stages"]
    assert first["memory_bytes"]["activations"] > 0 and last["memory_bytes"]["activations"] > 0
    assert last["memory_bytes"]["activations"] == pytest.approx(a1 / 4, rel=1e-6)  # one micro-batch's lm head
    weights = sum(p.numel() * 4 for p in _llama().parameters())
    assert last["memory_bytes"]["states"] >= logits  # the 4 micro-batches' logits, held until the call returns
    assert first["memory_bytes"]["states"] + last["memory_bytes"]["states"] >= weights + logits


@pytest.mark.parametrize("m", [1, 2, 4])
def test_decoding_pipeline_is_priced_kept_full(m):
    """Served decoding never drains its pipeline: as a micro-batch's token leaves the last stage its next step enters
    the first. A step of every micro-batch is max(m, p) stage times, not GPipe's one-batch m + p - 1 (the fill and
    drain), and that is the time between a sequence's tokens. A forward of one batch (no K/V cache: not decoding)
    still pays the fill and drain, as the runtime runs one call."""
    forced = {"stages": 2, "micro_batches": m, "schedule": "gpipe"}
    dec = _decode_plan("pp", forced, ranks=2)
    pp = dec.pipeline
    assert pp["steady"] and "decoding served continuously" in dec.pipeline_text()
    t = max(st["time_s"] for st in pp["stages"])
    assert pp["pipeline_s"] == pytest.approx(max(m, 2) * t, rel=1e-9)
    assert pp["drained_step_time_s"] == pytest.approx((m + 1) * t, rel=1e-9)
    assert pp["bubble_fraction"] == pytest.approx(1 - m / max(m, 2))
    assert dec.predicted["step_time_s"] == pytest.approx(pp["step_time_s"]) and pp["step_time_s"] >= pp["pipeline_s"]
    ids = torch.randint(0, 256, (4, 1))
    one = autopart.plan(_llama(), autopart.mesh((2,), ("pp",)), (ids,), roles={"pp": "pp"}, cluster="h100-80gb",
                        pipeline=forced, recipes=False)
    assert not one.pipeline["steady"] and one.pipeline["drained_step_time_s"] == one.pipeline["step_time_s"]
    t1 = max(st["time_s"] for st in one.pipeline["stages"])
    assert one.pipeline["pipeline_s"] == pytest.approx((m + 1) * t1, rel=1e-9)
