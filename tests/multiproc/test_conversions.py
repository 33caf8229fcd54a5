"""Every conversion between layouts of a 2-D tensor on a 2x2 mesh, run as the collectives pass runs it
(``conversion_steps``, one collective per step, in the steps' order) on 4 gloo ranks. Sources: each axis
Replicate, Shard(0) or Shard(1) (no dim split on both axes), or a partial sum on an axis; destinations: the first
kind. The rank's result is its piece of the full tensor under the destination layout, and backward hands each rank
its piece of the full gradient. Conversions that move a dim from one axis to another ((R, S(0)) -> (S(0), R),
(P, S(0)) -> (S(0), R), swaps) once assembled pieces of different rows (12 of the 98): their steps ran in axis
order through a layout splitting one dim on both axes, nested the wrong way round."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.multiproc.harness import run_ranks

pytestmark = pytest.mark.multiproc


def _all_conversions():
    import torch.distributed as dist

    from autopart.placement import Partial, Replicate, Shard
    from autopart.planner import conversion_steps
    from autopart.runtime import collectives as C
    from autopart.runtime.module import _local_chunk

    rank = dist.get_rank()
    coords = [rank // 2, rank % 2]
    groups0 = [dist.new_group([j, 2 + j]) for j in range(2)]
    groups1 = [dist.new_group([2 * i, 2 * i + 1]) for i in range(2)]
    full, grad = torch.arange(64.0).reshape(8, 8), torch.sin(torch.arange(64.0)).reshape(8, 8)
    specs = [s for s in itertools.product([Replicate(), Shard(0), Shard(1)], repeat=2)
             if not (isinstance(s[0], Shard) and s[0] == s[1])]
    # sources with a partial sum on an axis (its ranks hold summands weighted (c + 1) / 3, adding up to the whole)
    partial = [s for s in itertools.product([Replicate(), Shard(0), Shard(1), Partial()], repeat=2)
               if Partial() in s and not (isinstance(s[0], Shard) and s[0] == s[1])]
    wrong, checked = [], 0
    with C.axis_groups([groups0[coords[1]], groups1[coords[0]]], coords, [2, 2]):
        for src, dst in itertools.product(specs + partial, specs):
            steps = conversion_steps(src, dst, (False, False), True, (2, 2))
            plain = tuple(Replicate() if isinstance(p, Partial) else p for p in src)
            weight = 1.0
            for p, c in zip(src, coords):
                weight *= (c + 1) / 3 if isinstance(p, Partial) else 1.0
            x0 = (_local_chunk(full, plain, coords, [2, 2]) * weight).requires_grad_(True)
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
            x.backward(_local_chunk(grad, dst, coords, [2, 2]).contiguous())
            checked += 1
            if not torch.allclose(x.detach(), _local_chunk(full, dst, coords, [2, 2])) or \
                    not torch.allclose(x0.grad, _local_chunk(grad, plain, coords, [2, 2])):
                wrong.append(f"{src} -> {dst} by {[(st.axis, st.fwd) for st in steps]}")
    return checked, wrong


def test_every_conversion_keeps_every_piece_in_place() -> None:
    for checked, wrong in run_ranks(4, _all_conversions):
        assert checked == 98 and not wrong, wrong
