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


def test_unequal_blocks_layout() -> None:
    from autopart.placement import permuted

    full = torch.arange(8.0)
    # [q | k | v] of 4, 2 and 2 over 2 ranks: rank 0 holds q0 q1 k0 v0, rank 1 q2 q3 k1 v1
    p = Strided(0, 3, (4, 2, 2))
    assert _local_chunk(full, (p,), [0], [2]).tolist() == [0, 1, 4, 6]
    assert _local_chunk(full, (p,), [1], [2]).tolist() == [2, 3, 5, 7]
    # an empty block (HF Mamba-2 splits off a gated MLP of width 0) holds nothing on any rank
    assert _local_chunk(full, (Strided(0, 4, (0, 4, 2, 2)),), [1], [2]).tolist() == [2, 3, 5, 7]
    assert str(p) == "S(0)/4+2+2" and parse_spec("RS(0)/4+2+2") == (R, p) and spec_str((p, R)) == "S(0)/4+2+2R"
    assert Strided.of(0, (2, 2, 2)) == Strided(0, 3) and Strided.of(0, [4, 2, 2]) == p and Strided.of(1, 3) == \
        Strided(1, 3)
    assert p.parts(8) == [4, 2, 2] and Strided(0, 2).parts(8) == [4, 4]
    # each block splits evenly: 2 ranks yes, 4 no (k's 2 rows)
    assert _divisible((8, 4), [p], [2]) and not _divisible((8, 4), [p], [4])
    # DTensor has no such placement: stored as a plain split of the permuted tensor, ParallelModule told which
    assert permuted((R, p)) == [(1, p)] and permuted((Strided(0, 3), R)) == []


def test_grouped_query_slices_are_unequal_blocks() -> None:
    pytest.importorskip("transformers")
    ids = batches()[0]
    traced = trace(make_model("hf-phi3-gqa", layers=1), (ids,), {"labels": ids})
    linear = next(n for n in traced.gm.graph.nodes if n.target == aten.linear.default and
                  n.meta["val"].shape[-1] == 64)  # qkv_proj: q 32, k 16, v 16
    assert fused_blocks(linear, -1) == (32, 16, 16)
    blocks = Strided(2, 3, (32, 16, 16))
    assert any(o.output == (blocks,) and o.inputs == ((R,), (Strided(0, 3, (32, 16, 16)),))
               for o in options_for(linear, (2,))[0])
    sl = [u for u in linear.users if u.target == aten.slice.Tensor]
    assert len(sl) == 3
    for u in sl:
        assert any(o.inputs == ((blocks,),) and o.output == (Shard(2),) for o in options_for(u, (2,))[0])
    # k and v hold 16 columns (2 heads of 8): not 32 ways
    assert not any(o.output == (Strided(2, 3, (32, 16, 16)),) for o in options_for(linear, (32,))[0])


class _SplitSizes(torch.nn.Module):
    """A fused projection cut by ``split`` into parts of unequal lengths (a grouped-query [q | k | v])."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 16)

    def forward(self, x):
        q, k, v = self.proj(x).split([8, 4, 4], dim=-1)
        return (q[..., :4] * k + v).sum()


def test_split_with_sizes_cuts_unequal_blocks() -> None:
    traced = trace(_SplitSizes(), (torch.randn(4, 8),))
    linear = next(n for n in traced.gm.graph.nodes if n.target == aten.linear.default)
    split = next(iter(linear.users))
    assert fused_blocks(linear, -1) == (8, 4, 4)
    assert any(o.inputs == ((Strided(1, 3, (8, 4, 4)),),) and o.output == ((Shard(1),),) * 3
               for o in options_for(split, (2,))[0])
    assert any(o.output == (Strided(1, 3, (8, 4, 4)),) for o in options_for(linear, (4,))[0])
    assert not any(isinstance(p, Strided) for o in options_for(linear, (8,))[0] for p in o.output)  # 4 rows of k


class _MambaLike(torch.nn.Module):
    """HF Mamba's mixer head: ``in_proj(u).transpose(1, 2).chunk(2, dim=1)``, then a depthwise convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = torch.nn.Linear(8, 32)
        self.conv = torch.nn.Conv1d(16, 16, 3, groups=16, padding=2)

    def forward(self, u):
        x, z = self.in_proj(u).transpose(1, 2).chunk(2, dim=1)
        return (self.conv(x)[..., :u.shape[1]] * torch.sigmoid(z)).sum()


def test_blocks_ride_through_a_transpose_and_a_depthwise_convolution_splits_by_groups() -> None:
    traced = trace(_MambaLike(), (torch.randn(2, 6, 8),))
    nodes = {n.target: n for n in traced.gm.graph.nodes if n.op == "call_function"}
    linear, transpose, conv = nodes[aten.linear.default], nodes[aten.transpose.int], nodes[aten.conv1d.default]
    assert fused_blocks(linear, -1) == 2 and fused_blocks(transpose, 1) == 2
    assert any(o.inputs == ((Strided(2, 2),),) and o.output == (Strided(1, 2),)
               for o in options_for(transpose, (2,))[0])
    # x's channels, the weight's rows and the bias split by whole groups; lower runs groups / n on each rank
    assert any(o.inputs == ((Shard(1),), (Shard(0),), (Shard(0),)) and o.output == (Shard(1),)
               for o in options_for(conv, (2,))[0])
    assert not any(o.inputs[0] == (Shard(1),) for o in options_for(conv, (32,))[0])  # 16 groups: not 32 ways


class _Mamba2Like(torch.nn.Module):
    """Mamba-2's mixer head: ``in_proj`` -> [z | xBC | dt]; xBC through a depthwise convolution, its activation and
    casts, then cut into [x | B | C]; and a value nothing reads (HF computes a fused kernel's weight view)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = torch.nn.Linear(8, 48)
        self.conv = torch.nn.Conv1d(24, 24, 3, groups=24, padding=2)

    def forward(self, u):
        unused = self.conv.weight.squeeze(1)  # noqa: F841
        z, xbc, dt = self.in_proj(u).split([16, 24, 8], dim=-1)
        xbc = torch.nn.functional.silu(self.conv(xbc.transpose(1, 2))[..., :u.shape[1]]).transpose(1, 2)
        x, b, c = xbc.split([16, 4, 4], dim=-1)
        return (x * z).sum() + (b * c).sum() + dt.sum()


def test_blocks_cut_again_after_a_convolution_nest() -> None:
    traced = trace(_Mamba2Like(), (torch.randn(2, 6, 8),))
    nodes = list(traced.gm.graph.nodes)
    # the unused weight view is dropped at trace time: it would pin the weight to a layout no user needs
    assert not any(n.target == aten.squeeze.dim for n in nodes)
    linear = next(n for n in nodes if n.target == aten.linear.default)
    split, conv = next(iter(linear.users)), next(n for n in nodes if n.target == aten.conv1d.default)
    blocks = (16, 16, 4, 4, 8)
    assert fused_blocks(linear, -1) == blocks
    # the outer split hands xBC on in its blocks; z and dt are one block each
    assert any(o.inputs == ((Strided(2, 5, blocks),),) and
               o.output == ((Shard(2),), (Strided(2, 3, (16, 4, 4)),), (Shard(2),))
               for o in options_for(split, (2,))[0])
    inner = Strided(1, 3, (16, 4, 4))
    assert any(o.inputs == ((inner,), (Strided(0, 3, (16, 4, 4)),), (Strided(0, 3, (16, 4, 4)),)) and
               o.output == (inner,) for o in options_for(conv, (2,))[0])
    silu = next(n for n in nodes if n.target == aten.silu.default)
    assert any(o.inputs == ((inner,),) and o.output == (inner,) for o in options_for(silu, (2,))[0])
    # 4 rows of B do not split 8 ways: no blocks there
    assert not any(isinstance(p, Strided) for o in options_for(conv, (8,))[0] for p in o.output)


class _TensorSplit(torch.nn.Module):
    """A fused projection cut by ``tensor_split`` at indices (unequal parts), one part then cut along its rows."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 16)

    def forward(self, x):
        q, k, v = torch.tensor_split(self.proj(x), [8, 12], dim=-1)
        head, _ = torch.tensor_split(q, [3], dim=0)  # HF Mamba-2 (transformers 5.2x) cuts x, B, C along the sequence
        return head.sum() + (q[..., :4] * k + v).sum()


def test_tensor_split_cuts_blocks_and_lowers_to_the_ranks_piece() -> None:
    from autopart.passes.lower import lower

    traced = trace(_TensorSplit(), (torch.randn(4, 8),))
    nodes = [n for n in traced.gm.graph.nodes if n.target == aten.tensor_split.indices]
    linear = next(n for n in traced.gm.graph.nodes if n.target == aten.linear.default)
    cut, rows = nodes
    assert fused_blocks(linear, -1) == (8, 4, 4)
    blocks = Strided(1, 3, (8, 4, 4))
    assert any(o.inputs == ((blocks,),) and o.output == ((Shard(1),),) * 3 for o in options_for(cut, (2,))[0])
    # along another dim than the one split: the columns stay split, the cut along the rows is the same on each rank
    assert any(o.inputs == ((Shard(1),),) and o.output == ((Shard(1),),) * 2 for o in options_for(rows, (2,))[0])
    assert not any(o.inputs[0][0] == Shard(0) for o in options_for(rows, (2,))[0])
    cut.meta["autopart.inputs"], cut.meta["autopart.output"] = ((blocks,),), ((Shard(1),),) * 3
    lower(traced.gm, (2,))
    assert cut.args[1] == [4, 6]  # the rank's piece of every block: 4 of q, 2 of k, 2 of v
    full = torch.arange(32.0).view(2, 16)
    for rank in range(2):
        local = _local_chunk(full, (blocks,), [rank], [2])
        parts = torch.tensor_split(local, cut.args[1], dim=-1)
        for part, ref in zip(parts, torch.tensor_split(full, [8, 12], dim=-1)):
            assert torch.equal(part, ref.chunk(2, dim=-1)[rank])
