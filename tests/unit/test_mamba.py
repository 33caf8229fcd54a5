"""The Mamba reference model: the loop-free scan equals the token-by-token recurrence, the traced graph does not
grow with the sequence, and a tensor-parallel plan is Megatron-style over the inner dimension with Mamba-1's two
reductions per block forward."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import autopart
from autopart.models.mamba import Hybrid, HybridConfig, Mamba, MambaConfig, selective_scan, selective_scan_reference
from autopart.trace import trace


def _scan_inputs(seq: int, bsz: int = 2, heads: int = 4, hd: int = 8, d_state: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bsz, seq, heads, hd, generator=g)
    dt = F.softplus(torch.randn(bsz, seq, heads, generator=g) - 1)
    a = -torch.rand(heads, generator=g) * 15 - 1  # A in [-16, -1], as Mamba initialises it
    b = torch.randn(bsz, seq, d_state, generator=g)
    c = torch.randn(bsz, seq, d_state, generator=g)
    return x, dt, a, b, c


@pytest.mark.parametrize(("seq", "chunk"), [(16, 4), (64, 16), (64, 64), (10, 4), (3, 8), (40, 1)])
def test_scan_matches_the_sequential_recurrence(seq: int, chunk: int) -> None:
    inputs = _scan_inputs(seq)
    ref = selective_scan_reference(*inputs)
    out = selective_scan(*inputs, chunk_size=chunk)
    assert out.shape == ref.shape
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-5, f"seq {seq}, chunk {chunk}: relative error {rel:.2e}"


def test_scan_gradients_match_the_sequential_recurrence() -> None:
    inputs = [t.requires_grad_() for t in _scan_inputs(24, seed=1)]
    w = torch.randn(2, 24, 4, 8)
    grads = []
    for fn in (selective_scan_reference, functools.partial(selective_scan, chunk_size=8)):
        grads.append(torch.autograd.grad((fn(*inputs) * w).sum(), inputs))
    for name, g_ref, g in zip(("x", "dt", "a", "b", "c"), *grads):
        assert torch.isfinite(g).all(), name
        rel = ((g - g_ref).abs().max() / g_ref.abs().max()).item()
        assert rel <= 1e-5, f"d/d{name}: relative error {rel:.2e}"


def test_long_sequences_stay_finite() -> None:
    """Strong decay over many chunks: the segment-sums only exponentiate non-positive numbers."""
    x, dt, a, b, c = _scan_inputs(2048, bsz=1, heads=2, seed=2)
    y = selective_scan(x, dt * 10, a, b, c, chunk_size=64)
    assert torch.isfinite(y).all()


def _mixer_with_reference_scan(monkeypatch) -> None:
    import autopart.models.mamba as mamba

    monkeypatch.setattr(mamba, "selective_scan", lambda x, dt, a, b, c, chunk_size: selective_scan_reference(
        x, dt, a, b, c))


def test_model_equals_the_model_with_a_sequential_scan(monkeypatch) -> None:
    torch.manual_seed(0)
    model = Mamba(MambaConfig(vocab_size=64, d_model=32, chunk_size=4))
    ids = torch.randint(0, 64, (2, 13))
    out = model(ids)
    _mixer_with_reference_scan(monkeypatch)
    torch.testing.assert_close(out, model(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_cls", ["mamba", "hybrid"])
def test_causal(model_cls: str) -> None:
    """Changing token t changes no output before t (the convolution and the scan look only backwards)."""
    torch.manual_seed(0)
    cfg = MambaConfig(vocab_size=64, d_model=32, n_layer=3, chunk_size=4)
    model = Mamba(cfg) if model_cls == "mamba" else Hybrid(HybridConfig(mamba=cfg, attn_layers=(1,), d_ff=64))
    ids = torch.randint(0, 64, (1, 16))
    other = ids.clone()
    other[0, 9] = (ids[0, 9] + 1) % 64
    a, b = model(ids), model(other)
    torch.testing.assert_close(a[:, :9], b[:, :9])
    assert (a[:, 9] - b[:, 9]).abs().max() > 1e-4


def test_loss_and_tied_head() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8))
    tied = Mamba(MambaConfig(vocab_size=64, d_model=32))
    assert tied.lm_head.weight is tied.embed.weight
    untied = Mamba(MambaConfig(vocab_size=64, d_model=32, tie_embeddings=False))
    assert untied.lm_head.weight is not untied.embed.weight
    logits = tied(ids)
    torch.testing.assert_close(tied(ids, labels=ids), F.cross_entropy(logits.view(-1, 64), ids.view(-1)))


@pytest.mark.parametrize("model_cls", ["mamba", "hybrid"])
def test_bf16_model_runs_in_bf16(model_cls: str) -> None:
    torch.manual_seed(0)
    cfg = MambaConfig(vocab_size=64, d_model=32, n_layer=3, chunk_size=4)
    model = Mamba(cfg) if model_cls == "mamba" else Hybrid(HybridConfig(mamba=cfg, attn_layers=(1,), d_ff=64))
    ids = torch.randint(0, 64, (2, 16))
    loss = model.to(torch.bfloat16)(ids, labels=ids)
    assert loss.dtype == torch.bfloat16 and torch.isfinite(loss)


def test_bad_configs_raise() -> None:
    with pytest.raises(ValueError, match="headdim"):
        MambaConfig(d_model=32, expand=2, headdim=24)
    with pytest.raises(ValueError, match="chunk_size"):
        MambaConfig(chunk_size=0)
    with pytest.raises(ValueError, match="attn_layers"):
        HybridConfig(mamba=MambaConfig(n_layer=2), attn_layers=(2,))
    with pytest.raises(ValueError, match="n_head"):
        HybridConfig(mamba=MambaConfig(d_model=32), n_head=5)
    with pytest.raises(ValueError, match="unknown Mamba preset"):
        MambaConfig.preset("mamba-7t")


def _meta_model(seq: int, d_model: int = 256, batch: int = 1):
    with torch.device("meta"):
        model = Mamba(MambaConfig(vocab_size=32000, n_layer=2, d_model=d_model, headdim=64, chunk_size=64))
        ids = torch.randint(0, 32000, (batch, seq))
    return model, ids


def test_graph_does_not_grow_with_the_sequence() -> None:
    sizes = {}
    for seq in (64, 4096):
        model, ids = _meta_model(seq)
        graph = trace(model, (ids,), {"labels": ids}).graph
        sizes[seq] = len(graph.nodes)
    assert sizes[4096] == sizes[64], sizes


def _forward_reductions(plan: autopart.Plan, layer: str) -> int:
    """Partial sums of the layer's own values reduced in forward (an all-reduce, or a reduce-scatter when the
    solver keeps the result sequence-parallel, as Megatron's sequence parallelism does)."""
    n = 0
    for rec in plan.collectives:
        if plan.nodes.get(rec["value"], {}).get("layer") != layer:
            continue
        n += sum(1 for _, fwd, _ in rec["steps"] if fwd in ("all_reduce", "reduce_scatter"))
    return n


def test_tensor_parallel_plan_is_megatron_over_the_inner_dimension() -> None:
    """tp=8 on one H100 node: in_proj column-parallel, x_proj and out_proj row-parallel, conv/dt/A/D split by
    channel or head; per block forward exactly two reductions (REFERENCE.md: Mamba-1 needs 2 all-reduces per block),
    none inside the scan."""
    model, ids = _meta_model(2048, d_model=1024, batch=8)
    plan = autopart.plan(model, autopart.mesh((8,), ("tp",)), (ids,), {"labels": ids}, roles={"tp": "tp"},
                         cluster=autopart.preset("h100-80gb", (8,)), pipeline="off")
    assert not plan.unsupported_ops, plan.unsupported_ops
    want = {"in_proj.weight": "S(0)", "x_proj.weight": "S(1)", "out_proj.weight": "S(1)", "conv_weight": "S(0)",
            "conv_bias": "S(0)", "dt_proj.weight": "S(0)", "dt_proj.bias": "S(0)", "A_log": "S(0)", "D": "S(0)"}
    for i in range(2):
        got = {k: plan.params[f"blocks.{i}.mixer.{k}"] for k in want}
        assert got == want, f"blocks.{i}"
        assert _forward_reductions(plan, f"blocks.{i}") == 2, plan.collective_counts(f"blocks.{i}")
