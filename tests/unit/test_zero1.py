"""ZeRO-1/2's bucketed parameter all-gather after the step (runtime/zero1.py), in one process: every rank's
slices (``zero1_slice``) packed into a bucket, the all-gathers simulated with ``torch.cat`` over the ranks of the
axis, and each parameter must come back whole, as the per-parameter gather (and the reduce-scatter side) lay it
out."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from autopart.runtime.zero1 import gather_bucket, unpack_into, zero1_slice


def _gather(parts: list[torch.Tensor], ways: list[int], all_gather) -> list[torch.Tensor]:
    """``gather_bucket`` on the packed ``parts``, each returned block read row by row (the padded parameter)."""
    return [b.reshape(-1) for b in gather_bucket(torch.cat(parts), [p.numel() for p in parts], ways, all_gather)]


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

        _gather(parts(coords), [sizes[a] for a in inner[: i + 1]], capture)
        return box[0]

    def all_gather(coords, flat: torch.Tensor, i: int) -> torch.Tensor:
        """The ranks of axis ``inner[i]`` through ``coords`` (equal elsewhere), in rank order, each what it sends."""
        a = inner[i]
        peers = [tuple(j if d == a else c for d, c in enumerate(coords)) for j in range(sizes[a])]
        got = [flat if q == tuple(coords) else sent(q, i) for q in peers]
        assert all(g.numel() == flat.numel() for g in got)
        return torch.cat(got)

    def run(coords) -> list[torch.Tensor]:
        return _gather(parts(coords), [sizes[a] for a in inner], lambda f, i: all_gather(coords, f, i))

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

    out = gather_bucket(torch.ones(9), [4, 2, 3], [2, 3], all_gather)
    assert calls == [(0, 9), (1, 18)]
    assert [tuple(o.shape) for o in out] == [(3, 8), (3, 4), (3, 6)]


@pytest.mark.parametrize("numel,width", [(12, 4), (10, 4), (3, 4), (7, 7)])
def test_unpack_into_drops_only_the_padding(numel, width):
    rows = -(-numel // width)
    padded = torch.cat([torch.arange(numel, dtype=torch.float32), torch.full((rows * width - numel,), float("nan"))])
    gathered = torch.cat([padded.view(rows, width), torch.zeros(rows, 3)], dim=1)  # a block of a wider bucket
    flat = torch.empty(numel)
    unpack_into(flat, gathered[:, :width])
    torch.testing.assert_close(flat, torch.arange(numel, dtype=torch.float32), rtol=0, atol=0)


def test_gather_latency_once_per_bucket():
    """The record's latency term fills buckets as the runtime does: per set of axes and dtype, in order, at most
    BUCKET_BYTES gathered bytes (a larger parameter alone), each bucket one all-gather per axis. (The plan's sizes
    ``{}``: the runtime's default everywhere; ``tests/unit/test_buckets.py`` has the links' larger ones.)"""
    import autopart
    from autopart.planner import BUCKET_BYTES, zero1_gather_latency

    cluster = autopart.preset("h100-80gb", (2, 8))
    alpha = [cluster.link(i).for_collective("all_gather").alpha for i in (0, 1)]
    mib = 2**20
    assert BUCKET_BYTES == 25 * mib
    entries = [((1,), torch.bfloat16, 10 * mib)] * 5 + [((0, 1), torch.bfloat16, 30 * mib)] + \
        [((1,), torch.float32, mib)]
    # (1,) bf16: 10+10 | 10+10 | 10: 3 buckets over 8 ranks; (0, 1): one bucket, over both axes; (1,) fp32: one
    expected = 3 * 7 * alpha[1] + (1 * alpha[0] + 7 * alpha[1]) + 7 * alpha[1]
    assert zero1_gather_latency(entries, cluster, {}) == pytest.approx(expected, rel=1e-12)
    assert zero1_gather_latency([], cluster, {}) == 0.0


def test_gather_latency_shares_follow_the_buckets():
    """What a pipeline stage's units charge per parameter (``zero1_latency_shares``): its bucket's latency split by
    bytes. Two 16 MiB blocks do not share a 25 MiB bucket: each pays a whole bucket (the 70B row's q, k, v and
    projection weights, priced 0.64 of one each before); small ones split one; the shares sum to the record's."""
    import autopart
    from autopart.planner import zero1_bucket_latency, zero1_gather_latency, zero1_latency_shares

    cluster = autopart.preset("h100-80gb", (48, 8))
    mib = 2**20
    entries = [((0,), torch.bfloat16, 16 * mib)] * 3 + [((0,), torch.bfloat16, 5 * mib)] * 2 + \
        [((0,), torch.bfloat16, 64 * mib)]
    one = zero1_bucket_latency((0,), cluster)
    assert one == pytest.approx(47 * cluster.link(0).for_collective("all_gather").alpha, rel=1e-12)
    shares = zero1_latency_shares(entries, cluster, {})  # the default 25 MiB buckets
    # 16 | 16 | 16 + 5 | 5 | 64: the first 5 MiB joins the third 16 MiB bucket, the second opens a fourth
    assert shares == pytest.approx([one, one, one * 16 / 21, one * 5 / 21, one, one], rel=1e-12)
    assert sum(shares) == pytest.approx(zero1_gather_latency(entries, cluster, {}), rel=1e-12)


def _zero1_plan():
    """(model, plan, cluster): a tiny GPT planned with ZeRO-1 on 4 data-parallel H100s."""
    import autopart
    from autopart.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=4, d_model=32))
    ids = torch.randint(0, 64, (8, 16))
    cluster = autopart.preset("h100-80gb", (4,))
    return model, autopart.plan(model, autopart.mesh((4,), ("dp",)), (ids,), {"labels": ids}, cluster=cluster,
                                roles={"dp": "dp"}, zero=1, pipeline="off"), cluster


def test_plan_prices_gather_bandwidth_per_parameter_latency_per_bucket():
    """ZeRO-1 on 4 data-parallel H100s: each parameter's node holds its all-gather's bandwidth only; the plan's
    step adds one bucket's latency (the tiny model's parameters fill one bucket), and the record reports both."""
    from autopart.cost import roofline_time

    model, p, cluster = _zero1_plan()
    assert p.zero and set(p.zero.values()) == {1}
    link = cluster.link(0).for_collective("all_gather")
    gathered = [r for r in p.nodes.values() if r["op"] == "param" and "gather_latency_s" in r]
    assert len(gathered) == len(p.zero) == sum(1 for _ in model.parameters())
    bandwidth = 0.0
    for rec in gathered:  # fp32, replicated: ZeRO-1 keeps the whole gradient, the parameter's size
        padded = -(-rec["grad_bytes"] // 16) * 16  # 4 slices of whole fp32 elements
        t = rec["gather_s"]
        copies = roofline_time(0.0, 2 * padded / 4 * (4 + 1), cluster.device)  # slice packed, block unpacked
        assert t == pytest.approx(3 / 4 * padded * link.beta + copies, rel=1e-9)  # no latency per parameter
        # the ILP prices the share of it forward does not hide (zero1_gather_shares), at most all of it and its
        # share of the bucket's latency
        assert 0.0 <= rec["time_s"] - rec["compute_s"] <= t * (1 + 1e-9) + 3 * link.alpha
        bandwidth += t
    latency = 3 * link.alpha  # one bucket, one ring all-gather over 4 ranks
    assert p.predicted["param_gather_latency_s"] == pytest.approx(latency, rel=1e-9)
    pr = p.predicted
    assert pr["param_gather_total_s"] == pytest.approx(bandwidth + latency, rel=1e-9)
    assert "ZeRO-1/2 all-gather after the step" in p.explain(next(iter(p.zero)))  # the whole one visible there
    # one bucket, waited for by the first op that uses a parameter: at most the forward compute before it hides it
    fwd = sum(r["fwd_s"] for r in p.nodes.values() if r["op"] not in ("param", "buffer", "constant", "input"))
    assert pr["param_gather_total_s"] - fwd < pr["param_gather_s"] <= pr["param_gather_total_s"]
    # the step's communication: conversions, node-internal collectives (the ILP's price of the gathers among them,
    # replaced by the exposed gather), the exposed gradient reduction
    edges = sum(c["time_s"] + c.get("regather_s", 0.0) for c in p.collectives)
    priced = sum(r["time_s"] - r["compute_s"] for r in gathered)
    assert pr["param_gather_priced_s"] == pytest.approx(priced, rel=1e-9)
    assert pr["comm_s"] == pytest.approx(edges + pr["internal_comm_s"] - priced + pr["param_gather_s"] +
                                         pr["grad_reduction_s"] - pr["hidden_comm_s"], rel=1e-9)
    assert pr["internal_comm_s"] >= priced


def test_exposed_before_waits_in_order_with_buckets_in_flight():
    """The next forward's stall on the after-step gather: the first bucket needed at once is exposed; a later one
    hides behind the forward compute before its first use; buckets complete in order; with fewer in flight a
    bucket launches only when forward has waited for the one ``in_flight`` before it."""
    from autopart.cost.comm import exposed_after, exposed_before

    assert exposed_before([], [], 2) == 0.0
    assert exposed_before([0.0, 1.0, 2.0], [0.3, 0.3, 0.3], 2) == pytest.approx(0.3)  # the first only
    assert exposed_before([0.5, 1.0, 2.0], [0.3, 0.3, 0.3], 2) == 0.0  # all hidden
    # the link is the bottleneck: 0.3 (first) then 0.9 due at 0.5 + 0.3 stalled -> 0.1 more
    assert exposed_before([0.0, 0.5], [0.3, 0.6], 2) == pytest.approx(0.4)
    # bucket 1 used first (before bucket 0's first use): both are due then
    assert exposed_before([1.0, 0.2], [0.3, 0.3], 2) == pytest.approx(0.4)
    # one in flight: bucket 1 launches when forward waits for bucket 0 (at 0.5), not when bucket 0 ends (0.1)
    assert exposed_before([0.5, 0.6], [0.1, 0.3], 1) == pytest.approx(0.2)
    assert exposed_before([0.5, 0.6], [0.1, 0.3], 2) == 0.0
    deadline, cost = [0.0, 0.1, 0.15, 0.6, 0.7], [0.2, 0.1, 0.2, 0.05, 0.3]
    worst = max(exposed_after([0.0] * (k + 1), cost[:k + 1], deadline[k]) for k in range(len(cost)))
    assert exposed_before(deadline, cost, len(cost)) == pytest.approx(worst)
    with pytest.raises(ValueError, match="in_flight"):
        exposed_before([0.0], [0.1], 0)


def test_pipeline_gather_hides_behind_the_first_micro_batch():
    """Pipelined, with overlap: rank 0's first layer's gather is exposed, rank 1's hides behind rank 0's forward of
    the first micro-batch; without overlap the slowest rank's whole gather; the reduction tail adds it."""
    from autopart.solver.pipeline import LayerCost, PipelineOptions, PipelinePlan, gather_exposed, reduction_tail

    layers = [LayerCost(fwd_s=1.0, bwd_s=2.0, act_bytes=0.0, state_bytes=0.0) for _ in range(4)]
    opts = PipelineOptions(stages=2, micro_batches=4, schedule="1f1b", p2p_s=0.0)
    pl = PipelinePlan(boundaries=(0, 2), checkpointed=(False,) * 4, step_s=0.0, bubble_fraction=0.0,
                      stage_time_s=(3.0, 3.0), stage_memory=(0.0, 0.0), options=opts)
    assert gather_exposed(pl, layers, [0.5, 0.5, 0.5, 0.5], True) == pytest.approx(0.5)
    assert gather_exposed(pl, layers, [0.5, 0.5, 0.5, 0.5], False) == pytest.approx(1.0)
    # rank 0's second layer needs 3.0 of gathers by 1.0 + 0.5 of forward: 1.5 more
    assert gather_exposed(pl, layers, [0.5, 2.5, 0.0, 0.0], True) == pytest.approx(2.0)
    # rank 1's gathers (3.0) run while rank 0 computes its 2 layers (2.0): 1.0 exposed
    assert gather_exposed(pl, layers, [0.0, 0.0, 3.0, 0.0], True) == pytest.approx(1.0)
    # the step: every rank gathers from the schedule's end, 1.0 exposed as above, whether it reduced after the
    # schedule or from backward: rank 1 is done with its backward 4 s before rank 0, but steps (and gathers) only
    # once the loss broadcast after the schedule has joined it to rank 0's end
    assert reduction_tail(pl, layers, [0.0] * 4, True, [0.0, 0.0, 3.0, 0.0], after_schedule=True) == pytest.approx(1.0)
    assert reduction_tail(pl, layers, [0.0] * 4, True, [0.0, 0.0, 3.0, 0.0]) == pytest.approx(1.0)


def test_ilp_gather_share():
    """On a device that overlaps communication, the ILP prices each ZeRO-1 parameter's gather at its share of the
    exposed time: the embedding, used at once, all of it; a parameter first used after enough forward compute
    (the last MLP, on a model whose layers compute for longer than their weights take to gather) nothing; on the tiny
    model little hides and the plan's record charges about what the ILP priced and the bucket's latency (the ILP
    estimates forward at its floor, the record at the chosen shardings). On the cpu
    preset (no overlap) the ILP prices all of it."""
    import autopart
    from autopart.models import GPT, GPTConfig
    from autopart.planner import _analyzed, zero1_gather_shares
    from autopart.trace import trace

    model, p, cluster = _zero1_plan()
    pr = p.predicted
    assert pr["param_gather_s"] == pytest.approx(pr["param_gather_priced_s"] + pr["param_gather_latency_s"],
                                                 rel=0.02)
    with torch.device("meta"):
        big = GPT(GPTConfig(vocab_size=4096, max_seq_len=1024, n_layer=2, n_head=8, d_model=512, bias=False))
        big_ids = torch.randint(0, 4096, (32, 1024))
    traced = trace(big, (big_ids,), {"labels": big_ids})
    shares = zero1_gather_shares(_analyzed(traced, (4,)), cluster)
    fqn = traced.params
    assert {axes for _, axes in shares} == {(0,)}  # one layout family on a 1-D mesh: gathered over it
    by_fqn = {fqn[n]: v for (n, _), v in shares.items()}
    # at most all of a parameter's bandwidth and its share of its bucket's latency (the chain's latency is exposed
    # where the bandwidth is: a share above 1 prices it through the bandwidth term the ILP has)
    assert all(v >= -1e-9 for v in shares.values()), shares
    emb = "wte.weight" if "wte.weight" in by_fqn else "lm_head.weight"  # tied: the export names it either way
    assert by_fqn[emb] >= 1.0 - 1e-9
    assert by_fqn["blocks.1.mlp.proj.weight"] == 0.0, by_fqn
    assert zero1_gather_shares(_analyzed(traced, (4,)), autopart.preset("cpu", (4,))) == {}
