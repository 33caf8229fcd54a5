"""Every conversion between layouts of a 2-D tensor on a 2x2 and a 2x2x2 mesh, run as the collectives pass runs it
(``conversion_steps``, one collective per step, in the steps' order) on 4 and 8 gloo ranks. Sources: each axis
Replicate, Shard(0), Shard(1) or a partial sum; destinations: each axis Replicate, Shard(0) or Shard(1). A dim may
be split on several axes (its pieces nest in mesh order, as ``runtime.module._local_chunk`` and DTensor cut them).
The rank's result is its piece of the full tensor under the destination layout, and backward hands each rank its
piece of the full gradient.

Two orderings were wrong before: conversions that move a dim from one axis to another ((R, S(0)) -> (S(0), R),
(P, S(0)) -> (S(0), R), swaps; 12 of the 98 non-nested 2x2 pairs) ran their steps in axis order through a layout
nesting the dim the wrong way round; and conversions from or to a dim split on two axes (18 of the 144 2x2 pairs,
e.g. (S(0), S(0)) -> (R, R) gathered the outer axis first) joined pieces of different rows."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.multiproc.harness import run_ranks

pytestmark = pytest.mark.multiproc


def _axis_groups(shape: tuple[int, ...]):
    """This rank's process group per mesh axis (row-major ranks) and its coordinates."""
    import torch.distributed as dist

    rank = dist.get_rank()
    coords = [(rank // (torch.Size(shape[i + 1:]).numel())) % n for i, n in enumerate(shape)]
    groups = []
    for a, n in enumerate(shape):
        for rest in itertools.product(*[range(m) for i, m in enumerate(shape) if i != a]):
            ranks = [sum(c * torch.Size(shape[i + 1:]).numel()
                         for i, c in enumerate(rest[:a] + (k,) + rest[a:])) for k in range(n)]
            g = dist.new_group(ranks)  # every rank creates every group, in the same order
            if rank in ranks:
                groups.append(g)
    return groups, coords


def _all_conversions(shape: tuple[int, ...]):
    from autopart.placement import Partial, Replicate, Shard
    from autopart.planner import conversion_steps
    from autopart.runtime import collectives as C
    from autopart.runtime.module import _local_chunk

    groups, coords = _axis_groups(shape)
    sizes = list(shape)
    full, grad = torch.arange(576.0).reshape(24, 24), torch.sin(torch.arange(576.0)).reshape(24, 24)
    plain = [Replicate(), Shard(0), Shard(1)]
    dsts = list(itertools.product(plain, repeat=len(shape)))
    srcs = list(itertools.product(plain + [Partial()], repeat=len(shape)))
    wrong, checked = [], 0
    with C.axis_groups(groups, coords, sizes):
        for src, dst in itertools.product(srcs, dsts):
            steps = conversion_steps(src, dst, (False,) * len(shape), True, shape)
            held = tuple(Replicate() if isinstance(p, Partial) else p for p in src)
            weight = 1.0  # a partial sum's ranks hold summands weighted (c + 1) / 3, adding up to the whole
            for p, c in zip(src, coords):
                weight *= (c + 1) / 3 if isinstance(p, Partial) else 1.0
            x0 = (_local_chunk(full, held, coords, sizes) * weight).requires_grad_(True)
            x = x0
            for st in steps:
                if st.fwd == "all_gather":
                    x = C.all_gather(x, st.axis, st.src.dim, st.bwd)
                elif st.fwd == "shard":
                    x = C.shard(x, st.axis, st.dst.dim)
                elif st.fwd == "all_to_all":
                    x = C.all_to_all(x, st.axis, st.src.dim, st.dst.dim)
                elif st.fwd == "all_reduce":
                    x = C.all_reduce(x, st.axis, st.bwd)
                elif st.fwd == "reduce_scatter":
                    x = C.reduce_scatter(x, st.axis, st.dst.dim)
                else:
                    raise AssertionError(f"unexpected step {st}")
            want = _local_chunk(full, dst, coords, sizes)
            x.backward(_local_chunk(grad, dst, coords, sizes).contiguous())
            checked += 1
            if x.shape != want.shape or not torch.allclose(x.detach(), want) or \
                    not torch.allclose(x0.grad, _local_chunk(grad, held, coords, sizes)):
                wrong.append(f"{src} -> {dst} by {[(st.axis, st.fwd) for st in steps]}")
    return checked, wrong


@pytest.mark.parametrize("shape", [(2, 2), (2, 2, 2)], ids=["2x2", "2x2x2"])
def test_every_conversion_keeps_every_piece_in_place(shape) -> None:
    for checked, wrong in run_ranks(torch.Size(shape).numel(), _all_conversions, shape):
        assert checked == 4 ** len(shape) * 3 ** len(shape) and not wrong, wrong
