"""The checkpoint pass: which nodes each region holds, that the outer program keeps its placeholders, and on a
one-rank gloo world that checkpointed programs give the model's loss and gradients while saving less for backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

import autopart
from autopart.models import GPT, GPTConfig, Llama, LlamaConfig
from autopart.passes import run_passes
from autopart.planner import needs_grad_map
from autopart.runtime import collectives as C
from autopart.runtime.memtrack import MemoryTracker
from autopart.trace import trace

IDS = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, max_seq_len=32, n_layer=2, n_head=4, d_model=32))


def _program(model, mesh: tuple, checkpoint, roles=None) -> fx.GraphModule:
    t = trace(model, (IDS,), {"labels": IDS})
    names = ("dp", "tp")[: len(mesh)]
    p = autopart.plan(model, autopart.Mesh(mesh, names), traced=t, checkpoint=checkpoint, roles=roles)
    return run_passes(t, p, needs_grad_map(t))


def _region_ops(gm: fx.GraphModule, name: str) -> list[str]:
    sub = getattr(gm, name)
    return [getattr(n.target, "__name__", str(n.target)) for n in sub.graph.nodes if n.op == "call_function"]


def _placeholders(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.find_nodes(op="placeholder")]


def test_regions_full_and_selective():
    model = _gpt()
    plain = _program(model, (1,), None)
    gm = _program(model, (1,), {"blocks.0": "full", "blocks.1": "selective"})
    gm.graph.lint()
    assert _placeholders(gm) == _placeholders(plain)
    assert "checkpointed(ckpt_blocks_0," in gm.code and "checkpointed(ckpt_blocks_1," in gm.code
    full, sel = _region_ops(gm, "ckpt_blocks_0"), _region_ops(gm, "ckpt_blocks_1")
    assert full[0].startswith("layer_norm") and "gelu.default" in full and "scaled_dot_product_attention.default" \
        in full  # the whole block: both norms, attention, MLP, residuals
    assert sel[0] == sel[-1] == "linear.default" and "scaled_dot_product_attention.default" in sel  # q .. proj
    assert not any(op.startswith(("layer_norm", "gelu", "add")) for op in sel), sel
    assert not any(n.op == "get_attr" for n in plain.graph.nodes)


def test_selective_llama_excludes_attn_norm():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=128, max_seq_len=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64))
    gm = _program(model, (1,), "selective")
    for name in ("ckpt_blocks_0", "ckpt_blocks_1"):
        sub = getattr(gm, name)
        paths = [list(n.meta["nn_module_stack"].values())[-1][0] for n in sub.graph.nodes if n.op == "call_function"]
        assert "attn" in paths[0].split(".")[-2:] and "attn" in paths[-1].split(".")[-2:], paths
        assert not any("attn_norm" in p or "mlp" in p for p in paths), paths


def test_full_region_holds_its_collectives():
    """On a dp x tp mesh the layer's conversions (tp copy before the projections, all-reduce after) are inside."""
    gm = _program(_gpt(), (2, 2), "full", roles={"dp": "dp", "tp": "tp"})
    plain = _program(_gpt(), (2, 2), None, roles={"dp": "dp", "tp": "tp"})
    assert _placeholders(gm) == _placeholders(plain)
    for name in ("ckpt_blocks_0", "ckpt_blocks_1"):
        ops = [n.target for n in getattr(gm, name).graph.nodes if n.op == "call_function"]
        assert ops.count(C.all_reduce) == 2 and C.grad_all_reduce in ops, ops


# ---- one-rank world: numbers and memory -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _parallel(checkpoint):
    model = _gpt()
    pm = autopart.parallelize(model, autopart.mesh((1,), ("dp",)), (IDS,), {"labels": IDS}, checkpoint=checkpoint)
    return model, pm


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_one_rank_matches_model(world1, mode):
    model, pm = _parallel(mode)
    assert f"checkpointed(ckpt_blocks_{1}," in pm.program()
    loss = pm.forward_backward(IDS, labels=IDS)
    ref = model(IDS, labels=IDS)
    ref.backward()
    assert loss.item() == ref.item()
    for k, p in model.named_parameters():
        torch.testing.assert_close(pm.param(k).grad.full_tensor(), p.grad, rtol=0, atol=1e-6, msg=k)


def _held_bytes(pm) -> int:
    """Bytes of activations alive between forward and backward: what autograd keeps (plus the loss)."""
    with MemoryTracker() as mt:
        loss = pm(IDS, labels=IDS)
        held = mt.current["activations"]
        loss.backward()
    return held


def test_checkpoint_saves_memory(world1):
    none, sel, full = (_held_bytes(_parallel(m)[1]) for m in (None, "selective", "full"))
    assert full < sel < none, (none, sel, full)
    assert full < none / 2, (none, full)
