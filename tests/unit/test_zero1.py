"""ZeRO-1/2's bucketed parameter all-gather after the step (runtime/zero1.py), in one process: every rank's
slices (``zero1_slice``) packed into a bucket, the all-gathers simulated with ``torch.cat`` over the ranks of the
axis, and each parameter must come back whole, as the per-parameter gather (and the reduce-scatter side) lay it
out."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from autopart.runtime.zero1 import gather_bucket, zero1_slice


def _gathered(numels: list[int], sizes: list[int], axes: list[int]) -> dict[tuple, list[torch.Tensor]]:
    """Every rank's (mesh coordinates) result of ``gather_bucket`` for a bucket of parameters of ``numels``
    elements, replicated over mesh ``axes`` (outer first) of a mesh of ``sizes``."""
    params = [torch.arange(n, dtype=torch.float32) + 1000 * i for i, n in enumerate(numels)]
    inner = list(reversed(axes))
    coords_all = list(itertools.product(*(range(n) for n in sizes)))

    def parts(coords) -> list[torch.Tensor]:
        out = []
        for p in params:
            start, end, size = zero1_slice(p.numel(), list(coords), sizes, axes)
            part = torch.full((size,), float("nan"))  # padding must never reach a parameter
            part[: end - start] = p[start:end]
            out.append(part)
        return out

    def sent(coords, i: int) -> torch.Tensor:
        """What rank ``coords`` passes to its all-gather over axis ``inner[i]``."""
        box = []

        def capture(flat: torch.Tensor, j: int) -> torch.Tensor:
            if j < i:
                return all_gather(coords, flat, j)
            box.append(flat.clone())
            return torch.zeros(flat.numel() * sizes[inner[j]])

        gather_bucket(parts(coords), [sizes[a] for a in inner[: i + 1]], capture)
        return box[0]

    def all_gather(coords, flat: torch.Tensor, i: int) -> torch.Tensor:
        """The ranks of axis ``inner[i]`` through ``coords`` (equal elsewhere), in rank order, each what it sends."""
        a = inner[i]
        peers = [tuple(j if d == a else c for d, c in enumerate(coords)) for j in range(sizes[a])]
        got = [flat if q == tuple(coords) else sent(q, i) for q in peers]
        assert all(g.numel() == flat.numel() for g in got)
        return torch.cat(got)

    def run(coords) -> list[torch.Tensor]:
        return gather_bucket(parts(coords), [sizes[a] for a in inner], lambda f, i: all_gather(coords, f, i))

    return {c: run(c) for c in coords_all}, params


@pytest.mark.parametrize("numels,sizes,axes", [
    ([10, 7, 1, 33], [4], [0]),  # one axis, uneven sizes (padded slices, a parameter smaller than the ranks)
    ([10, 7, 1, 33], [2, 3], [0, 1]),  # two axes, outer first: mixed-radix order
    ([12, 5, 9], [3, 2], [1]),  # replicated on the inner axis only, the other axis left alone
    ([5, 64], [2, 2, 3], [0, 2]),  # two axes of three
])
def test_gather_bucket_restores_every_parameter(numels, sizes, axes):
    results, params = _gathered(numels, sizes, axes)
    ways = math.prod(sizes[a] for a in axes)
    for coords, whole in results.items():
        assert len(whole) == len(params)
        for p, w in zip(params, whole):
            assert w.numel() == -(-p.numel() // ways) * ways, (coords, w.numel())
            torch.testing.assert_close(w[: p.numel()], p, rtol=0, atol=0)


def test_gather_bucket_one_collective_per_axis():
    calls = []

    def all_gather(flat, i):
        calls.append((i, flat.numel()))
        return torch.cat([flat] * [2, 3][i])

    out = gather_bucket([torch.ones(4), torch.ones(2), torch.ones(3)], [2, 3], all_gather)
    assert calls == [(0, 9), (1, 18)]
    assert [o.numel() for o in out] == [24, 12, 18]
