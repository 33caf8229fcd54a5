"""The data-parallel gradient reduction in another dtype (``PlanOptions.reduce_dtype``) on real gloo processes:
bf16 gradients summed in fp32, as Megatron-LM (``accumulate_allreduce_grads_in_fp32``) and FSDP2's ``reduce_dtype``."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.harness import run_ranks

pytestmark = pytest.mark.multiproc

WORLD = 4
SHAPES = [(3, 257), (1000,), (17, 9)]


def _grad(rank: int, i: int) -> torch.Tensor:
    """Rank ``rank``'s bf16 gradient of parameter ``i``: spread over 2^-12 .. 2^4, where bf16's 8-bit mantissa
    rounds the partial sums of a bf16 ring."""
    g = torch.Generator().manual_seed(1000 * i + rank)
    x = torch.randn(SHAPES[i], generator=g) * torch.exp2(torch.randint(-12, 5, SHAPES[i], generator=g).float())
    return x.to(torch.bfloat16)


def _reduce_run(reduce_dtype, zero: int):
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh

    from autopart.runtime.grads import GradReducer
    from autopart.runtime.zero1 import _Slice, zero1_slice

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))

    def dt(t):  # the runtime's parameters and gradients are DTensors, replicated on the data-parallel axis
        return DTensor.from_local(t, mesh, [Replicate()], run_check=False)

    params = {f"p{i}": nn.Parameter(dt(torch.zeros(s, dtype=torch.bfloat16))) for i, s in enumerate(SHAPES)}
    keys = list(params)
    red = GradReducer(params, {k: (0,) for k in keys}, {k: zero for k in keys} if zero else {}, keys,
                      [dist.group.WORLD], [rank], [WORLD], dm=None, overlap=False, reduce_dtype=reduce_dtype)
    slices = {}
    if zero:
        for k, p in params.items():
            start, end, size = zero1_slice(p.numel(), [rank], [WORLD], [0])
            leaf = nn.Parameter(p.to_local().detach().view(-1)[start:end])
            slices[k] = _Slice(p, leaf, start, end, size, [0])
        red.attach(slices)
    for i, k in enumerate(keys):
        params[k].grad = dt(_grad(rank, i))
    red.post_backward()
    if zero == 2:  # only this rank's slice of the sum stays
        return {k: (s.start, s.end, s.leaf.grad.clone()) for k, s in slices.items()}
    if zero == 1:  # the reduced slice in the whole gradient buffer
        return {k: (s.start, s.end, params[k].grad.to_local().view(-1)[s.start:s.end].clone())
                for k, s in slices.items()}
    return {k: (0, p.numel(), p.grad.to_local().view(-1).clone()) for k, p in params.items()}


def _zero3_run(reduce_dtype):
    """Each rank's bf16 gradient of a ZeRO-3 parameter gathered by ``all_gather_param`` (its shard on this rank),
    after backward's reduce-scatter, and the dtypes the reduce-scatters ran in."""
    import torch.distributed as dist

    import autopart.runtime.collectives as C

    rank = dist.get_rank()
    ran, inner = [], C.reduce_scatter_single

    def recording(out, x, **kw):
        ran.append(x.dtype)
        return inner(out, x, **kw)

    C.reduce_scatter_single = recording
    try:
        got = {}
        with C.axis_groups([dist.group.WORLD], [rank], [WORLD]):
            for i, shape in enumerate(SHAPES):
                if shape[0] % WORLD:  # sharded on dim 0: a shape it splits evenly
                    shape = (WORLD * shape[0], *shape[1:])
                full_grad = torch.cat([_grad(rank, i).view(-1)] * 4)[: torch.Size(shape).numel()].view(shape)
                shard = torch.zeros((shape[0] // WORLD, *shape[1:]), dtype=torch.bfloat16, requires_grad=True)
                C.all_gather_param(shard, 0, 0, "reduce_scatter", reduce_dtype).backward(full_grad)
                got[i] = (shape, shard.grad.clone())
    finally:
        C.reduce_scatter_single = inner
    return got, sorted({str(d) for d in ran})


def _all_runs(reduce_dtype):
    """Every reduction of one world: the reducer's all-reduce and ZeRO-1/2 reduce-scatters, ZeRO-3's backward."""
    return {zero: _reduce_run(reduce_dtype, zero) for zero in (0, 1, 2)}, _zero3_run(reduce_dtype)


def test_bf16_gradients_summed_in_fp32():
    """With ``reduce_dtype="float32"`` every rank's reduced bf16 gradient is the fp32 sum of the 4 ranks' bf16
    gradients rounded once to bf16, exactly, element for element: all-reduced, its ZeRO-1/2 slice of the bucket's
    reduce-scatter, and a ZeRO-3 parameter's shard from ``all_gather_param``'s backward reduce-scatter (which runs
    in fp32). Summed in bf16 (no reduce dtype) the ring's partial sums round, and some elements differ in each."""
    exact = [sum(_grad(r, i).float() for r in range(WORLD)).to(torch.bfloat16).view(-1) for i in range(len(SHAPES))]
    for reduce_dtype, want_exact in (("float32", True), (None, False)):
        results = run_ranks(WORLD, _all_runs, reduce_dtype)
        for zero in (0, 1, 2):
            mismatched = 0
            for res in results:
                for i, (start, end, got) in enumerate(res[0][zero].values()):
                    assert got.dtype == torch.bfloat16
                    ref = exact[i][start:end]
                    if want_exact:
                        torch.testing.assert_close(got, ref, rtol=0, atol=0)
                    else:
                        mismatched += int((got != ref).sum())
            assert want_exact or mismatched > 0, f"zero={zero}: a bf16 ring summed these exactly"
        mismatched = 0
        for rank, (_, (got, ran)) in enumerate(results):
            assert ran == (["torch.float32"] if want_exact else ["torch.bfloat16"]), (reduce_dtype, ran)
            for i, (shape, grad) in got.items():
                n = torch.Size(shape).numel()
                full = [torch.cat([_grad(r, i).view(-1)] * 4)[:n].view(shape).float() for r in range(WORLD)]
                want = sum(full).to(torch.bfloat16).chunk(WORLD)[rank]
                assert grad.dtype == torch.bfloat16
                if want_exact:
                    torch.testing.assert_close(grad, want, rtol=0, atol=0)
                else:
                    mismatched += int((grad != want).sum())
        assert want_exact or mismatched > 0, "zero=3: a bf16 ring summed these exactly"


def _parallelize_run(zero: int):
    import autopart
    import autopart.runtime.collectives as C
    from tests.multiproc.parity import OPT, batches, make_model, train

    ran, inner = set(), C.reduce_scatter_single

    def recording(out, x, **kw):  # the reduce-scatters of the graph's collectives (ZeRO-3's gradients)
        ran.add(str(x.dtype))
        return inner(out, x, **kw)

    C.reduce_scatter_single = recording
    model = make_model("gpt")
    mesh = autopart.mesh((2,), ("dp",))
    ids0 = batches()[0]
    pm = autopart.parallelize(model, mesh, (ids0,), {"labels": ids0}, roles={"dp": "dp"}, zero=zero,
                              reduce_dtype=torch.float64)
    losses, full = train(pm, pm.optimizer(torch.optim.AdamW, **OPT))
    C.reduce_scatter_single = inner
    return losses, full, str(pm.plan), pm.plan.to_json(), pm(batches()[0]).detach(), pm._grads._reduce_dtype, \
        sorted(ran)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_parallelize_reduces_in_the_plans_dtype(zero):
    """``parallelize(..., reduce_dtype=torch.float64)`` on dp2 (all-reduce; ZeRO-1's reduce-scatter; ZeRO-3's
    reduce-scatters in backward): the plan records it, the module's reducer and ZeRO-3's backward sum in it, and
    training matches one process over 3 AdamW steps (fp32 model: the sums cast back)."""
    from autopart.plan import Plan
    from tests.multiproc.parity import check, reference

    results = run_ranks(2, _parallelize_run, zero)
    check("gpt", [r[:5] for r in results], reference("gpt"))
    for r in results:
        plan = Plan.from_json(r[3])
        assert plan.options["reduce_dtype"] == "float64"
        assert r[5] == torch.float64
        if zero == 3:
            assert set(plan.zero.values()) == {3}, plan.zero
            assert r[6] == ["torch.float64"], r[6]
