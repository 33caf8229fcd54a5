"""Expert parallelism of a Hugging Face experts layer (``autopart.regions._ep_experts``) on 4 gloo ranks as a 2x2
mesh: each rank holds its own tokens and a slice of the experts; the output rows and the gradients of the hidden
states, routing weights and the rank's expert weights equal one process running the whole layer on all tokens
(fp32, atol 1e-5). Experts split over both axes (nested dispatch), over one axis (the other replicates them: their
gradients are summed over it), and routings that leave a rank without any row."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.multiproc.harness import run_ranks

pytestmark = pytest.mark.multiproc

E, K, H, TOKENS = 4, 2, 8, 6


def _layer(implementation: str):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(num_local_experts=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=12,
                        experts_implementation=implementation)
    torch.manual_seed(0)
    layer = MixtralExperts(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def _tokens(routing: str):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * TOKENS, H, generator=g)
    if routing == "one-expert-rank":  # every pair goes to experts 0 and 1: on a 4-way split, 3 ranks get no row
        ids = torch.tensor([[0, 1]] * (4 * TOKENS))
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(4 * TOKENS)])
    w = torch.rand(4 * TOKENS, K, generator=g)
    return x, ids, w


def _reference(implementation: str, routing: str):
    layer = _layer(implementation)
    x, ids, w = _tokens(routing)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = layer(x, ids, w)
    out.backward(torch.cos(out))  # a gradient that differs per row
    return out.detach(), x.grad, w.grad, {n: p.grad for n, p in layer.named_parameters()}


@functools.cache
def _groups(coords: tuple[int, int]) -> list:
    import torch.distributed as dist

    groups0 = [dist.new_group([j, 2 + j]) for j in range(2)]
    groups1 = [dist.new_group([2 * i, 2 * i + 1]) for i in range(2)]
    return [groups0[coords[1]], groups1[coords[0]]]


def _ranks(implementation: str, routing: str, axes: tuple[int, ...]):
    import torch.distributed as dist

    from autopart import regions
    from autopart.runtime import collectives as C

    rank = dist.get_rank()
    coords = (rank // 2, rank % 2)
    # axis 0: ranks differing in the first coordinate ({0, 2}, {1, 3}); axis 1: in the second ({0, 1}, {2, 3})
    groups = _groups(coords)
    layer = _layer(implementation)
    with torch.no_grad():  # this rank's experts: dim 0 chunked by axis 0, then by axis 1 within (mesh order)
        for name, p in list(layer.named_parameters()):
            local = p
            for a in axes:
                local = local.chunk(2, dim=0)[coords[a]]
            setattr(layer, name, torch.nn.Parameter(local.clone()))
    x, ids, w = _tokens(routing)
    rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
    x, ids, w = x[rows].clone().requires_grad_(True), ids[rows], w[rows].clone().requires_grad_(True)
    with C.axis_groups(groups, list(coords), [2, 2]):
        out = regions._ep_experts(layer, type(layer).forward, x, ids, w, axes, E)
        out.backward(torch.cos(out))
        grads = {}
        for n, p in layer.named_parameters():
            g = p.grad.clone()
            for a in range(2):
                if a not in axes:  # experts replicated on this axis: its ranks' tokens each gave a part
                    dist.all_reduce(g, group=groups[a])
            grads[n] = g
    return rank, out.detach(), x.grad, w.grad, grads, coords


CASES = [("grouped_mm", "random", (0, 1)), ("grouped_mm", "random", (1,)), ("eager", "random", (0,)),
         ("grouped_mm", "one-expert-rank", (0, 1)), ("eager", "one-expert-rank", (0, 1))]


def _all_cases():
    return [_ranks(*case) for case in CASES]


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m: f"{what}: {m}")


def test_expert_parallel_matches_one_process() -> None:
    """Every case of ``CASES`` (experts implementation, routing, axes the experts are split over) in one world."""
    pytest.importorskip("transformers")
    results = run_ranks(4, _all_cases)
    for i, case in enumerate(CASES):
        out, gx, gw, gparams = _reference(*case[:2])
        for rank, o, x_grad, w_grad, grads, coords in (r[i] for r in results):
            rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
            where = f"{case} rank {rank}"
            _close(o, out[rows], f"{where} output")
            _close(x_grad, gx[rows], f"{where} d hidden")
            _close(w_grad, gw[rows], f"{where} d routing weights")
            for n, g in grads.items():
                ref = gparams[n]
                for a in case[2]:
                    ref = ref.chunk(2, dim=0)[coords[a]]
                _close(g, ref, f"{where} d {n}")
