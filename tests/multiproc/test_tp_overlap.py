"""Tensor-parallel communication overlap on real gloo ranks: the collective matmuls (``runtime.collectives``
``all_gather_linear`` / ``linear_reduce_scatter``) give the unfused collective-then-linear results forward and
backward on a 3-rank ring (next and previous neighbours differ), and a sequence-parallel GPT trained with them
(``tp_comm_overlap=True``) matches one process (loss every step, parameters after 3 AdamW steps, 1e-5)."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import OPT, batches, check, make_model, reference, train

pytestmark = pytest.mark.multiproc


def _ring_vs_unfused(bwd: str):
    """Per rank: the largest difference of the fused collective matmuls from the unfused collectives and linears,
    over outputs and the gradients of the shard, weights and biases (10 tensors)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from autopart.runtime import collectives as C

    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 4 * n, 6, generator=g)  # (batch, sequence, hidden), the sequence split over the ranks
    ws = [torch.randn(5, 6, generator=g), torch.randn(3, 6, generator=g)]
    bs = [torch.randn(5, generator=g), None]
    up = [torch.randn(2, 4 * n, 5, generator=g) * (rank + 1), torch.randn(2, 4 * n, 3, generator=g)]
    w2, b2 = torch.randn(7, 6, generator=g), torch.randn(7, generator=g)
    up2 = torch.randn(2, 4, 7, generator=g) * (rank + 1)
    errs = []
    with C.axis_groups([dist.group.WORLD], [rank], [n]):
        results = []
        for fused in (True, False):
            x = full.chunk(n, 1)[rank].clone().requires_grad_()
            w = [t.clone().requires_grad_() for t in ws]
            b = [bs[0].clone().requires_grad_(), None]
            x2 = (full * (rank + 1)).clone().requires_grad_()  # partial sums: different on every rank
            w2_, b2_ = w2.clone().requires_grad_(), b2.clone().requires_grad_()
            if fused:
                outs = C.all_gather_linear(x, 0, 1, bwd, tuple(w), tuple(b))
                out2 = C.linear_reduce_scatter(x2, w2_, b2_, 0, 1)
            else:
                gathered = C.all_gather(x, 0, 1, bwd)
                outs = [F.linear(gathered, wi, bi) for wi, bi in zip(w, b)]
                out2 = C.reduce_scatter(F.linear(x2, w2_, b2_), 0, 1)
            loss = sum((o * u).sum() for o, u in zip(outs, up)) + (out2 * up2).sum()
            loss.backward()
            results.append([*outs, out2, x.grad, *(t.grad for t in w), b[0].grad, x2.grad, w2_.grad, b2_.grad])
        for a, r in zip(*results):
            errs.append((a - r).abs().max().item())
    return errs


def _both_backwards():
    return {bwd: _ring_vs_unfused(bwd) for bwd in ("reduce_scatter", "shard")}


def test_collective_matmul_matches_unfused() -> None:
    # the gathered value's gradient reduce-scattered (its users split on the axis) or taken as this rank's piece
    for rank, res in enumerate(run_ranks(3, _both_backwards)):
        for bwd, errs in res.items():
            assert len(errs) == 10 and max(errs) <= 1e-5, (rank, bwd, errs)


def _overlapped(name: str, pins: dict[str, str]):
    """``parity.distributed`` with ``tp_comm_overlap=True`` on a 2-rank tensor-parallel mesh, plus how many
    collective matmuls the rank's program calls."""
    import autopart

    model = make_model(name)
    model.train()
    ids0 = batches()[0]
    pm = autopart.parallelize(model, autopart.mesh((2,), ("tp",)), (ids0,), {"labels": ids0}, roles={"tp": "tp"},
                              pins=pins, tp_comm_overlap=True)
    code = pm.program()
    losses, full = train(pm, torch.optim.AdamW(pm.parameters(), **OPT))
    logits = pm(batches()[0])
    counts = (code.count("all_gather_linear("), code.count("linear_reduce_scatter("))
    return losses, full, str(pm.plan), pm.plan.to_json(), logits.detach(), counts


def test_tp_overlap_parity() -> None:
    from autopart.plan import Plan
    from tests.multiproc.test_sequence_parallel import sp_pins

    results = run_ranks(2, _overlapped, "gpt", sp_pins("gpt"))
    check("gpt", [r[:-1] for r in results], reference("gpt"))
    assert Plan.from_json(results[0][3]).options["tp_comm_overlap"] is True
    # per block the gathers into Q/K/V and into fc, the head's gather; the two row-parallel matmuls' scatters
    assert all(r[-1] == (5, 4) for r in results), [r[-1] for r in results]
