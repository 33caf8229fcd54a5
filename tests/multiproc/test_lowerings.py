"""Lowered ops against their single-process definitions on 2 real gloo ranks: vocab-parallel cross-entropy
(Megatron), vocab-parallel embedding, and each autograd-aware conversion's forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.multiproc.harness import run_ranks

pytestmark = pytest.mark.multiproc


def _lowerings() -> dict:
    from autopart.runtime import collectives as C

    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 16, generator=g, dtype=torch.float64)
    target = torch.randint(0, 16, (12,), generator=g)
    target[3] = -100
    with C.axis_groups([dist.group.WORLD], [rank], [n]):
        for reduction in (0, 1, 2):
            local = logits.chunk(n, dim=1)[rank].clone().requires_grad_(True)
            loss = C.sharded_cross_entropy(local, target, (), 0, reduction, -100)
            loss.sum().backward() if reduction == 0 else loss.backward()
            out[f"ce{reduction}"] = (loss.detach(), local.grad)
        # batch-sharded mean with an uneven number of ignored targets per rank: exact global mean
        local = logits.chunk(n, dim=0)[rank].clone().requires_grad_(True)
        part = C.sharded_cross_entropy(local, target.chunk(n)[rank], (0,), None, 1, -100)
        full = C.all_reduce(part, 0, "none")
        full.backward()
        out["ce_batch"] = (full.detach(), local.grad)
        w = torch.randn(16, 4, generator=g, dtype=torch.float64)
        wl = w.chunk(n, dim=0)[rank].clone().requires_grad_(True)
        ids = torch.randint(0, 16, (3, 5), generator=g)
        emb = C.all_reduce(C.vocab_parallel_embedding(wl, ids, 0), 0, "none")
        (emb * torch.arange(4, dtype=torch.float64)).sum().backward()
        out["emb"] = (emb.detach(), wl.grad)
        for pad in (0, 13):  # a padding row on rank 0's rows, and on rank 1's: it gets no gradient
            wl = w.chunk(n, dim=0)[rank].clone().requires_grad_(True)
            emb = C.all_reduce(C.vocab_parallel_embedding(wl, ids, 0, pad), 0, "none")
            (emb * torch.arange(4, dtype=torch.float64)).sum().backward()
            out[f"emb_pad{pad}"] = (emb.detach(), wl.grad)
        x = torch.randn(4, 6, generator=g, dtype=torch.float64)
        xl = x.chunk(n, dim=1)[rank].clone().requires_grad_(True)
        y = C.all_to_all(xl, 0, 1, 0)  # S(1) -> S(0)
        (y * (rank + 1)).sum().backward()
        out["a2a"] = (y.detach(), xl.grad)
    return out


def test_lowerings_match_single_process():
    results = run_ranks(2, _lowerings)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 16, generator=g, dtype=torch.float64)
    target = torch.randint(0, 16, (12,), generator=g)
    target[3] = -100
    for reduction, name in ((0, "none"), (1, "mean"), (2, "sum")):
        ref_logits = logits.clone().requires_grad_(True)
        ref = torch.nn.functional.cross_entropy(ref_logits, target, reduction=name, ignore_index=-100)
        ref.sum().backward() if reduction == 0 else ref.backward()
        for rank, res in enumerate(results):
            loss, grad = res[f"ce{reduction}"]
            torch.testing.assert_close(loss, ref.detach())
            torch.testing.assert_close(grad, ref_logits.grad.chunk(2, dim=1)[rank])
    ref_logits = logits.clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(ref_logits, target, ignore_index=-100)
    ref.backward()
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["ce_batch"][0], ref.detach())
        torch.testing.assert_close(res["ce_batch"][1], ref_logits.grad.chunk(2, dim=0)[rank])
    w = torch.randn(16, 4, generator=g, dtype=torch.float64).requires_grad_(True)
    ids = torch.randint(0, 16, (3, 5), generator=g)
    emb = torch.nn.functional.embedding(ids, w)
    (emb * torch.arange(4, dtype=torch.float64)).sum().backward()
    for pad in (0, 13):
        assert (ids == pad).any(), "the padding row must be looked up for the test to see its gradient"
        wp = w.detach().clone().requires_grad_(True)
        ref = torch.nn.functional.embedding(ids, wp, padding_idx=pad)
        (ref * torch.arange(4, dtype=torch.float64)).sum().backward()
        assert not wp.grad[pad].any()
        for rank, res in enumerate(results):
            torch.testing.assert_close(res[f"emb_pad{pad}"][0], ref.detach())
            torch.testing.assert_close(res[f"emb_pad{pad}"][1], wp.grad.chunk(2, dim=0)[rank])
    x = torch.randn(4, 6, generator=g, dtype=torch.float64)
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["emb"][0], emb.detach())
        torch.testing.assert_close(res["emb"][1], w.grad.chunk(2, dim=0)[rank])
        torch.testing.assert_close(res["a2a"][0], x.chunk(2, dim=0)[rank])
        # d/dx of sum_r (r+1) * y_r where y_r is row-block r of x: column block of the per-row-block weights
        weights = torch.cat([torch.full((2, 6), float(r + 1), dtype=torch.float64) for r in range(2)])
        torch.testing.assert_close(res["a2a"][1], weights.chunk(2, dim=1)[rank])
