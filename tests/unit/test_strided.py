"""Fused projections split in blocks (``placement.Strided``): the layout, where the rules offer it, and what the
planner and the runtime do with it (parity on gloo: ``tests/multiproc/test_parity.py``, hf-gpt2 and hf-phi3)."""

from __future__ import annotations

import pytest
import torch

from autopart.placement import R, Shard, Strided, local_shape, parse_spec, spec_str
from autopart.planner import conversion_steps
from autopart.runtime.module import _local_chunk
from autopart.strategy import options_for
from autopart.strategy.registry import _divisible
from autopart.strategy.views import fused_blocks
from autopart.trace import trace
from tests.multiproc.parity import batches, make_model

aten = torch.ops.aten


def test_layout_pieces_and_text() -> None:
    full = torch.arange(12.0)
    # [q | k | v] of 4 each over 2 ranks: rank 0 holds q0 q1 k0 k1 v0 v1, rank 1 the other halves
    assert _local_chunk(full, (Strided(0, 3),), [0], [2]).tolist() == [0, 1, 4, 5, 8, 9]
    assert _local_chunk(full, (Strided(0, 3),), [1], [2]).tolist() == [2, 3, 6, 7, 10, 11]
    spec = parse_spec("RS(1)/3")
    assert spec == (R, Strided(1, 3)) and spec_str(spec) == "RS(1)/3"
    assert local_shape((4, 12), spec, (2, 2)) == (4, 6)
    # each block splits evenly, and a strided dim is split on one axis only
    assert _divisible((4, 12), [Strided(1, 3)], [2]) and not _divisible((4, 12), [Strided(1, 3)], [8])
    assert not _divisible((4, 12), [Strided(1, 2), Shard(1)], [2, 2], nested=True)


def test_no_step_converts_a_strided_layout() -> None:
    assert conversion_steps((Strided(0, 3),), (Shard(0),), (True,), True, (2,)) is None
    assert conversion_steps((Strided(0, 3),), (R,), (True,), True, (2,)) is None
    assert conversion_steps((R,), (Strided(0, 3),), (True,), True, (2,)) is None
    # another axis converts while the strided one stays
    steps = conversion_steps((Shard(1), Strided(0, 3)), (R, Strided(0, 3)), (True, True), True, (2, 2))
    assert [(s.axis, s.fwd) for s in steps] == [(0, "all_gather")]


def _node(traced, name: str):
    return next(n for n in traced.gm.graph.nodes if n.name == name)


def test_gpt2_c_attn_offers_its_blocks() -> None:
    pytest.importorskip("transformers")
    ids = batches()[0]
    traced = trace(make_model("hf-gpt2", layers=1), (ids,), {"labels": ids})
    addmm, view, split = (_node(traced, n) for n in ("addmm", "view_2", "split"))
    assert fused_blocks(addmm, -1) == 3 and fused_blocks(view, 2) == 3
    assert fused_blocks(addmm, 0) is None  # the rows are not cut in blocks
    out = [o for o in options_for(addmm, (2,))[0] if o.output == (Strided(1, 3),)]
    # addmm(bias, x, weight): weight and bias in blocks, the input whole
    assert [o.inputs for o in out] == [((Strided(0, 3),), (R,), (Strided(1, 3),))]
    assert any(o.inputs == ((Strided(1, 3),),) and o.output == (Strided(2, 3),) for o in options_for(view, (2,))[0])
    assert any(o.inputs == ((Strided(2, 3),),) and o.output == ((Shard(2),),) * 3 for o in options_for(split, (2,))[0])
    # 32 columns per block do not split 64 ways
    assert not any(o.output == (Strided(1, 3),) for o in options_for(addmm, (64,))[0])


def test_phi3_slices_are_blocks() -> None:
    pytest.importorskip("transformers")
    ids = batches()[0]
    traced = trace(make_model("hf-phi3", layers=1), (ids,), {"labels": ids})
    linear = next(n for n in traced.gm.graph.nodes if n.target == aten.linear.default and
                  n.meta["val"].shape[-1] == 96)  # qkv_proj: 3 x 32
    assert fused_blocks(linear, -1) == 3
    sl = [u for u in linear.users if u.target == aten.slice.Tensor]
    assert len(sl) == 3
    for u in sl:
        assert any(o.inputs == ((Strided(2, 3),),) and o.output == (Shard(2),) for o in options_for(u, (2,))[0])


def test_a_projection_used_whole_is_not_offered_blocks() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 24)

        def forward(self, x):
            y = self.proj(x)
            a, b, c = y.split(8, dim=-1)
            return (a * b + c).sum() + y.mean()  # y has another user: its columns must stay in order

    traced = trace(Net(), (torch.randn(4, 8),))
    linear = next(n for n in traced.gm.graph.nodes if n.target == aten.linear.default)
    assert fused_blocks(linear, -1) is None
    assert not any(isinstance(p, Strided) for o in options_for(linear, (2,))[0] for p in o.output)
