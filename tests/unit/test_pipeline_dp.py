import itertools
import math

import numpy as np
import pytest

from autopart.solver.pipeline import (
    LayerCost,
    PipelineOptions,
    best_pipeline,
    bubble_fraction,
    bubble_over_ideal,
    partition,
    schedule_step_time,
)


def _brute(layers, opts, limit):
    """Least bottleneck over all contiguous partitions x all checkpoint subsets per stage."""
    n, K = len(layers), opts.chunks
    p2p = opts.p2p_s if K > 1 else 0.0
    best = math.inf
    for cuts in itertools.combinations(range(1, n), K - 1):
        bounds = (0, *cuts, n)
        worst = 0.0
        for k in range(K):
            seg = layers[bounds[k]:bounds[k + 1]]
            f = opts.in_flight(k)
            stage = math.inf
            for mask in itertools.product((False, True), repeat=len(seg)):
                if any(c and (x.recompute_act_bytes is None or x.recompute_act_bytes >= x.act_bytes)
                       for c, x in zip(mask, seg)):
                    continue
                act = sum(x.recompute_act_bytes if c else x.act_bytes for c, x in zip(mask, seg))
                grads = sum(x.grad_bytes for x in seg)
                # GPipe: all m held as backward starts, before gradients; after the first backward, m - 1 and them
                held = max(f * act - grads, (f - 1) * act) if opts.schedule == "gpipe" else f * act
                mem = sum(x.state_bytes for x in seg) + held
                if mem <= limit / opts.virtual * (1 + 1e-9):
                    stage = min(stage, sum(x.fwd_s + x.bwd_s + (x.fwd_s if c else 0) for c, x in zip(mask, seg)) + p2p)
            worst = max(worst, stage)
        best = min(best, worst)
    return best


def _random_layers(rng, n, ckpt):
    out = []
    for _ in range(n):
        state = float(rng.uniform(0, 5))
        out.append(LayerCost(float(rng.uniform(0.1, 2)), float(rng.uniform(0.2, 4)), float(rng.uniform(1, 10)),
                             state, float(rng.uniform(0, 2)) if ckpt and rng.random() < 0.8 else None,
                             grad_bytes=state * float(rng.uniform(0, 0.5))))
    return out


@pytest.mark.parametrize("repeated", [False, True])
@pytest.mark.parametrize("seed", range(30))
def test_dp_matches_brute_force(seed, repeated):
    """``repeated``: the layers drawn from two (a model's identical blocks), whose segments share their fronts."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    ckpt = bool(seed % 2) or repeated
    layers = _random_layers(rng, n, ckpt)
    if repeated:
        layers = [layers[0]] + [layers[int(rng.integers(1, min(3, n)))] for _ in range(n - 2)] + [layers[-1]]
    sched = ["gpipe", "1f1b", "interleaved"][seed % 3]
    v = 2 if sched == "interleaved" else 1
    p = int(rng.integers(1, min(4, n // v) + 1))
    opts = PipelineOptions(p, int(rng.integers(1, 5)), sched, v, p2p_s=float(rng.uniform(0, 0.5)))
    total = sum(x.state_bytes + x.act_bytes for x in layers) * opts.micro_batches
    for limit in (math.inf, total * rng.uniform(0.1, 0.6), total * 0.05):
        want = _brute(layers, opts, limit)
        if math.isinf(want):
            with pytest.raises(ValueError, match="memory_limit"):
                partition(layers, opts, limit)
            continue
        plan = partition(layers, opts, limit)
        assert max(plan.stage_time_s) == pytest.approx(want, rel=1e-9)
        assert plan.step_s == pytest.approx(schedule_step_time(plan.stage_time_s, opts))
        assert max(plan.stage_memory) <= limit * (1 + 1e-9)
        assert len(plan.boundaries) == opts.chunks and plan.boundaries[0] == 0
        assert list(plan.boundaries) == sorted(set(plan.boundaries))


def test_bubble_formulas_match_reference():
    for p, m, v in [(2, 4, 1), (4, 8, 1), (8, 32, 1), (4, 8, 2), (8, 16, 4)]:
        if v == 1:
            for s in ("gpipe", "1f1b"):
                o = PipelineOptions(p, m, s)
                assert bubble_fraction(o) == pytest.approx((p - 1) / (m + p - 1))
                assert bubble_over_ideal(o) == pytest.approx((p - 1) / m)
                assert schedule_step_time([1.0] * p, o) == pytest.approx(m * (1 + (p - 1) / m))
        else:
            o = PipelineOptions(p, m, "interleaved", v)
            assert bubble_over_ideal(o) == pytest.approx((p - 1) / (v * m))
            t = 1.0
            step = schedule_step_time([t / v] * (p * v), o)
            assert step == pytest.approx(m * t * (1 + (p - 1) / (v * m)))
            assert (step - m * t) / step == pytest.approx(bubble_fraction(o))


def _critical_path(opts, forward_share):
    """The schedule's length by event simulation: each rank runs its actions in order (``_actions``), each once the
    action it depends on has finished; a forward takes ``forward_share`` of a chunk time, a backward the rest."""
    from autopart.solver.pipeline import _actions, _dependency

    p = opts.stages
    queues = [_actions(opts, r) for r in range(p)]
    finish, free, at = {}, [0.0] * p, [0] * p
    while any(at[r] < len(queues[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while at[r] < len(queues[r]):
                kind, i, c = queues[r][at[r]]
                d = _dependency(kind, i, c, r, p, opts.virtual)
                if d is not None and d not in finish:
                    break
                start = max(free[r], finish[d] if d is not None else 0.0)
                free[r] = finish[kind, i, c, r] = start + (forward_share if kind == "F" else 1 - forward_share)
                at[r] += 1
                moved = True
        assert moved, f"{opts} deadlocked"
    return max(free)


def test_schedule_length_is_the_critical_path_of_its_actions():
    """``schedule_units`` (N21's m v + p - 1 for m >= p; v p + m - 1 for fewer micro-batches than stages, which
    torch's interleaved schedule runs in one round) is the event-simulated critical path of every schedule, with a
    forward of any share of the chunk time (1: forward-only). The bottleneck formula alone priced one micro-batch
    on p = 2, v = 2 at 3 chunk times, while its 4 chunks run one after the other."""
    from autopart.solver.pipeline import _simulate, schedule_units

    for p, m in itertools.product((2, 3, 4, 8), range(1, 18)):
        for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)):
            if name == "interleaved" and m % max(1, m // p):
                continue  # torch's ScheduleInterleaved1F1B refuses these
            o = PipelineOptions(p, m, name, v)
            units = schedule_units(o)
            for share in (0.2, 1 / 3, 0.5, 1.0):
                assert units == pytest.approx(_critical_path(o, share)), (o, share)
            assert len(_simulate(o)[0]) == 2 * units  # the drawn grid: forward and backward one slot each
            assert bubble_fraction(o) == pytest.approx(1 - m * v / units)
    one = PipelineOptions(2, 1, "interleaved", 2)
    plan = partition([LayerCost(1.0, 2.0, 1.0, 1.0)] * 4, one, math.inf)
    assert plan.step_s == pytest.approx(4 * 3.0) and plan.bubble_fraction == pytest.approx(0.5)


def test_interleaved_actions_in_torchs_order_when_fewer_micro_batches_than_stages():
    """With m < p torch's ScheduleInterleaved1F1B runs one round of m micro-batches through each chunk (m multiple
    of p: rounds of p, Megatron's order); its warm-up is (v - 1) m + 2 (p - 1 - r) forwards. The order below is
    ``_calculate_single_rank_operations`` of torch 2.13 for p = 2, m = 3, v = 2 (the Nones dropped). A rank holds
    at most its warm-up plus one chunk-micro-batches (``in_flight``)."""
    from autopart.solver.pipeline import _actions

    o = PipelineOptions(2, 3, "interleaved", 2)
    f = [("F", i, c) for c in (0, 1) for i in range(3)]
    b = [("B", i, c) for c in (1, 0) for i in range(3)]
    assert _actions(o, 0) == f + b
    assert _actions(o, 1) == f[:4] + [b[0], f[4], b[1], f[5]] + b[2:]
    # p = 8, m = 4: the last rank warms up with m (v - 1) = 4 forwards, then holds 5 chunk-micro-batches at most
    # (3 a chunk, spread evenly), not Megatron's p (v - 1) + 1 = 9 (capped at m v = 8: 4 a chunk); rank 0 all 8
    eight = PipelineOptions(8, 4, "interleaved", 2)
    assert (eight.in_flight(7), eight.in_flight(15), eight.in_flight(0), eight.in_flight(8)) == (3, 3, 4, 4)


def test_1f1b_first_stage_holds_p_micro_batches():
    p, m = 4, 8
    layers = [LayerCost(1, 2, 10, 3) for _ in range(8)]
    plan = partition(layers, PipelineOptions(p, m, "1f1b"), math.inf)
    assert plan.boundaries == (0, 2, 4, 6)
    assert plan.stage_memory == (2 * 3 + p * 2 * 10, 2 * 3 + 3 * 20, 2 * 3 + 2 * 20, 2 * 3 + 1 * 20)
    gp = partition(layers, PipelineOptions(p, m, "gpipe"), math.inf)
    assert gp.stage_memory == (2 * 3 + m * 20,) * p
    assert gp.step_s == plan.step_s


def test_gpipe_peak_comes_before_gradients():
    # states 3 of which gradients 1 per layer, activations 10: GPipe holds all m = 4 micro-batches as backward starts
    # (gradients not yet allocated: 2*2 + 4*20 = 84), then gradients and 3 micro-batches (2*3 + 3*20 = 66)
    layers = [LayerCost(1, 2, 10, 3, grad_bytes=1) for _ in range(4)]
    gp = partition(layers, PipelineOptions(2, 4, "gpipe"), math.inf)
    assert gp.stage_memory == (2 * 3 - 2 * 1 + 4 * 20,) * 2
    # large gradients: the peak is after the first backward
    layers = [LayerCost(1, 2, 10, 30, grad_bytes=25) for _ in range(4)]
    gp = partition(layers, PipelineOptions(2, 4, "gpipe"), math.inf)
    assert gp.stage_memory == (2 * 30 + 3 * 20,) * 2
    # and the limit is checked against that peak: 84 fits exactly where the gradient-blind model (86) would not
    layers = [LayerCost(1, 2, 10, 3, grad_bytes=1) for _ in range(4)]
    assert partition(layers, PipelineOptions(2, 4, "gpipe"), 84).stage_memory == (84, 84)
    with pytest.raises(ValueError):
        LayerCost(1, 2, 10, 3, grad_bytes=4)


def test_unequal_costs_give_unequal_counts():
    layers = [LayerCost(1, 2, 1, 1)] * 6 + [LayerCost(3, 6, 1, 1)] * 6
    plan = partition(layers, PipelineOptions(2, 4, "1f1b"), math.inf)
    assert plan.boundaries == (0, 8)  # 6 light + 2 heavy | 4 heavy: 36 s each
    assert plan.stage_time_s == (pytest.approx(36), pytest.approx(36))


def test_heavy_embedding_and_head_shift_boundaries():
    block = LayerCost(1, 2, 1, 1)
    plain = partition([block] * 16, PipelineOptions(4, 8, "1f1b"), math.inf).boundaries
    assert plain == (0, 4, 8, 12)
    heavy = [LayerCost(4, 8, 1, 1)] + [block] * 14 + [LayerCost(4, 8, 1, 1)]
    b = partition(heavy, PipelineOptions(4, 8, "1f1b"), math.inf).boundaries
    assert b[1] < 4 and 16 - b[3] < 4


def test_checkpoints_only_when_needed_and_cheapest():
    layers = [LayerCost(1, 2, 10, 0, 1), LayerCost(5, 2, 10, 0, 1), LayerCost(1, 2, 10, 0, 1)]
    opts = PipelineOptions(1, 1, "gpipe")
    assert not any(partition(layers, opts, 30).checkpointed)
    assert partition(layers, opts, 25).checkpointed == (True, False, False)
    assert partition(layers, opts, 15).checkpointed == (True, False, True)
    plan = partition(layers, opts, 3)
    assert all(plan.checkpointed) and plan.stage_time_s == (pytest.approx(13 + 7),)


def test_large_instance():
    """384 layers into 16 stages (the DP's speed is measured by benchmarks/bench_pipeline.py, not by a timed test):
    a time per stage, a recompute flag per layer, and a memory limit that forces recompute on some layers only."""
    rng = np.random.default_rng(0)
    kinds = [LayerCost(float(a), float(2 * a), 100.0, 50.0, 10.0) for a in rng.uniform(0.5, 1.5, 4)]
    layers = [kinds[i % 4] for i in range(384)]
    opts = PipelineOptions(16, 32, "1f1b")
    plan = partition(layers, opts, math.inf)
    tight = partition(layers, opts, 24 * 50 + 16 * 24 * 100 * 0.7)
    for p in (plan, tight):
        assert len(p.stage_time_s) == 16
        assert len(p.checkpointed) == 384
    assert not any(plan.checkpointed) and any(tight.checkpointed) and not all(tight.checkpointed)
    assert max(tight.stage_time_s) >= max(plan.stage_time_s)


def _rows(grid):
    return [line.split(":", 1)[1].split() for line in grid.splitlines()]


def test_grid_gpipe_and_1f1b():
    layers = [LayerCost(1, 1, 1, 1)] * 2
    g = _rows(partition(layers, PipelineOptions(2, 4, "gpipe"), math.inf).grid())
    assert g[0] == ["F0", "F1", "F2", "F3", ".", ".", "B0", "B1", "B2", "B3"]
    assert g[1] == [".", "F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3", "."]
    o = _rows(partition(layers, PipelineOptions(2, 4, "1f1b"), math.inf).grid())
    assert [a for a in o[0] if a != "."] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert [a for a in o[1] if a != "."] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert len(o[0]) == len(g[0])


def test_interleaved_grid_completes():
    opts = PipelineOptions(2, 4, "interleaved", 2)
    rows = _rows(partition([LayerCost(1, 1, 1, 1)] * 4, opts, math.inf).grid())
    for r in rows:
        acts = [a for a in r if a != "."]
        assert len(acts) == 2 * 4 * 2 and len(set(acts)) == len(acts)


def test_infeasible_names_stage_and_limit():
    layers = [LayerCost(1, 2, 10, 5, 2)] * 8
    opts = PipelineOptions(2, 4, "1f1b")
    with pytest.raises(ValueError, match=r"needs 35 bytes on stage 1 .*memory_limit to >= 35"):
        partition(layers, opts, 20)
    assert max(partition(layers, opts, 35).stage_memory) <= 35


def test_best_pipeline_prefers_throughput_and_skips_infeasible():
    from autopart.solver.pipeline import StageMemoryError

    layers = [LayerCost(1, 2, 10, 5, 2)] * 8
    plan = best_pipeline(layers, 200, [1, 2, 4], [1, 4, 8], ["gpipe", "1f1b", ("interleaved", 2)])
    assert max(plan.stage_memory) <= 200
    with pytest.raises(ValueError, match="no pipeline configuration fits"):
        best_pipeline(layers, 1, [2], [4], ["1f1b"])
    # the figures of the configuration closest to fitting (4 stages of 2 layers: 22 bytes, states 10; 2 stages
    # need 35, the test above), its line last in the message
    with pytest.raises(StageMemoryError) as err:
        best_pipeline(layers, 1, [2, 4], [4], ["1f1b"])
    e = err.value
    assert (e.need, e.limit, e.states) == (min(partition_need(layers, p) for p in (2, 4)), 1, 10)
    assert e.need == e.states + e.activations and e.where.startswith("stage ") and e.layers[1] - e.layers[0] == 1
    assert str(e).splitlines()[-1].startswith("  closest: 1f1b(p=4, m=4)") and "needs 22 bytes" in str(e)


def partition_need(layers, p: int) -> float:
    """The least per-device peak ``partition`` reports for ``p`` stages of 1F1B with 4 micro-batches."""
    from autopart.solver.pipeline import StageMemoryError

    try:
        partition(layers, PipelineOptions(p, 4, "1f1b"), 1)
    except StageMemoryError as e:
        return e.need
    raise AssertionError("fits")


def test_reduction_tail_overlaps_the_last_backward():
    from autopart.solver.pipeline import PipelinePlan, reduction_tail

    layers = [LayerCost(fwd_s=1.0, bwd_s=2.0, act_bytes=0.0, state_bytes=0.0)] * 4
    opts = PipelineOptions(2, 4, "1f1b", p2p_s=0.2)
    pl = PipelinePlan((0, 2), (False,) * 4, 0.0, 0.0, (0.0, 0.0), (0.0, 0.0), opts)
    red = [1.5, 1.5, 1.0, 1.0]
    # no overlap: the slowest rank's sum
    assert reduction_tail(pl, layers, red, overlap=False) == pytest.approx(3.0)
    # the last micro-batch's backward: layer 3 done at 2, layer 2 at 4, a 0.1 s send, layer 1 at 6.1, layer 0 at 8.1.
    # rank 1 (layers 2, 3): 2 -> 3, then 4 -> 5, hidden by 8.1; rank 0: 6.1 -> 7.6, then 8.1 -> 9.6: 1.5 s exposed
    assert reduction_tail(pl, layers, red, overlap=True) == pytest.approx(1.5)
    # a reduction slower than the backward left: rank 1's from t = 2 ends at 7, the next at 12: 3.9 s after 8.1; but
    # rank 1 is needed again only when the next step's first micro-batch has passed rank 0 (2 s and a 0.1 s send):
    # 1.8 s late (the sum of the two, 3.9 s, priced the slowest rank's tail as if it held up rank 0 too)
    assert reduction_tail(pl, layers, [0.0, 0.0, 5.0, 5.0], overlap=True) == pytest.approx(12 - 8.1 - 2.1)
    # a checkpointed layer recomputes its forward inside that backward: rank 0's layers end 1 s later, still the last
    ck = PipelinePlan((0, 2), (True, False, False, False), 0.0, 0.0, (0.0, 0.0), (0.0, 0.0), opts)
    assert reduction_tail(ck, layers, red, overlap=True) == pytest.approx(1.5)
    # ZeRO-1's parameter all-gather after the step, behind the next first micro-batch's forward: rank 1's reduction
    # ended 3.1 s before rank 0's backward (at 5), so its gathers (2 + 2 s) are done before rank 0, which reduces
    # until 1.5 and then computes 2 s, sends it the micro-batch: the stall is rank 0's reduction alone (it was priced
    # 1.5 + 0.9: every rank's gathers started after the slowest rank's reduction)
    assert reduction_tail(pl, layers, red, True, [0.0, 0.0, 2.0, 2.0]) == pytest.approx(1.5)
    assert reduction_tail(pl, layers, red, False, [0.5, 0.5, 0.0, 0.0]) == pytest.approx(4.0)


def test_reduction_tail_in_the_schedule():
    """The runtime's pipelines launch each bucket from the last micro-batch's backward
    (``runtime.grads.OVERLAP_IN_PIPELINE``): a rank's reduction hides behind the backward left after its gradients
    are final (its earlier layers, the stages before it), and what runs past the schedule's end is exposed, since
    every rank steps after the loss broadcast that follows the schedule. A parameter several stages hold (a tied
    embedding and head, ``late_s``) is reduced after the rest, once the stages summed it."""
    from autopart.runtime.grads import OVERLAP_IN_PIPELINE
    from autopart.solver.pipeline import PipelinePlan, reduction_tail

    assert OVERLAP_IN_PIPELINE  # pipelining.py prices what the runtime does: a change there must change both
    layers = [LayerCost(fwd_s=1.0, bwd_s=2.0, act_bytes=0.0, state_bytes=0.0)] * 4
    opts = PipelineOptions(2, 4, "1f1b", p2p_s=0.2)
    pl = PipelinePlan((0, 2), (False,) * 4, 0.0, 0.0, (0.0, 0.0), (0.0, 0.0), opts)
    red = [1.5, 1.5, 1.0, 1.0]
    # the last backward ends at 8.1 (layer 1 final at 6.1, layer 0 at 8.1): rank 0's 1.5 s run past it, rank 1's
    # (done at 5) hide in its cool-down: 1.5 s; after the schedule, rank 0's 3 s
    assert reduction_tail(pl, layers, red, True) == pytest.approx(1.5)
    assert reduction_tail(pl, layers, red, True, after_schedule=True) == pytest.approx(3.0)
    # the tied embedding/head's 0.5 s on ranks 0 and 1 after their launched buckets: rank 0 done at 2.0, rank 1 at
    # 0.5, long before the next step's first micro-batch reaches it (4.1): 2.0
    late = [0.5, 0.0, 0.0, 0.5]
    assert reduction_tail(pl, layers, red, True, late_s=late) == pytest.approx(2.0)
    assert reduction_tail(pl, layers, red, True, after_schedule=True, late_s=late) == pytest.approx(3.5)
    assert reduction_tail(pl, layers, red, False, late_s=late) == pytest.approx(3.5)
    # each rank's optimizer step follows its reduction: rank 0's 0.25 + 0.25 s add to its 1.5 s past the schedule
    # (2.0); rank 1's 3 s, from the schedule's end (its reduction ended in the cool-down), end at 3.0, before the
    # next step's first micro-batch reaches it (rank 0's 2.0 s, 2 s of forward, a 0.1 s send: 4.1)
    step = [0.25, 0.25, 1.5, 1.5]
    assert reduction_tail(pl, layers, red, True, step_s=step) == pytest.approx(2.0)
    assert reduction_tail(pl, layers, red, False, step_s=step) == pytest.approx(2.0 + 3.0)  # rank 1's 2 + 3 s
    # a step long enough on rank 1 to delay it: 8 s from the schedule's end, where without any of this the first
    # micro-batch reaches it at 2.1: 5.9 s late
    assert reduction_tail(pl, layers, red, True, step_s=[0.0, 0.0, 4.0, 4.0]) == pytest.approx(8.0 - 2.1)


def test_reduction_tail_after_the_schedule():
    """Reduced after the schedule (``after_schedule``: how ``gather_exposed`` starts the gathers), once the loss
    broadcast has joined every rank to rank 0's last backward: the reduction hides nowhere; the gathers follow each
    rank's own reduction, and a later stage's hide behind rank 0's reduction and first forward."""
    from autopart.solver.pipeline import PipelinePlan, reduction_tail

    layers = [LayerCost(fwd_s=1.0, bwd_s=2.0, act_bytes=0.0, state_bytes=0.0)] * 4
    opts = PipelineOptions(2, 4, "1f1b", p2p_s=0.2)
    pl = PipelinePlan((0, 2), (False,) * 4, 0.0, 0.0, (0.0, 0.0), (0.0, 0.0), opts)
    red = [1.5, 1.5, 1.0, 1.0]
    # rank 0 reduces 3 s from the end (rank 1: 2 s), then forward: all of rank 0's exposed
    assert reduction_tail(pl, layers, red, True, after_schedule=True) == pytest.approx(3.0)
    # rank 1 gathers 2 + 2 s from 2: done at 4 and 6; rank 0's forward (from 3) reaches layer 2 at 5.1, layer 3 at 6.1
    assert reduction_tail(pl, layers, red, True, [0.0, 0.0, 2.0, 2.0], after_schedule=True) == pytest.approx(3.0)
    # rank 0's own gathers (1 + 1.5 s from 3) are waited for before layers 0 and 1: layer 0 at 4, layer 1 at 5.5 (it
    # would start at 5): 1 + 0.5 s more
    assert reduction_tail(pl, layers, red, True, [1.0, 1.5, 0.0, 0.0], after_schedule=True) == pytest.approx(4.5)
    # a reduction on rank 1 longer than rank 0's reduction and forward together: the rest of it is exposed
    assert reduction_tail(pl, layers, [0.5, 0.5, 4.0, 4.0], True, after_schedule=True) == pytest.approx(
        8.0 - 2.1)


def test_reduction_tail_interleaved_chunks_share_their_rank_clock():
    """Interleaved (p = 2, v = 2, one layer per chunk, ranks 0 1 0 1): a rank's gathers for its second chunk follow
    those of its first, from its own reduction's end; its second chunk waits for them, not for the other rank's."""
    from autopart.solver.pipeline import PipelinePlan, reduction_tail

    layers = [LayerCost(fwd_s=1.0, bwd_s=2.0, act_bytes=0.0, state_bytes=0.0)] * 4
    opts = PipelineOptions(2, 4, "interleaved", virtual=2)
    pl = PipelinePlan((0, 1, 2, 3), (False,) * 4, 0.0, 0.0, (0.0,) * 4, (0.0, 0.0), opts)
    red = [1.0, 0.0, 1.0, 0.0]  # rank 0 reduces 2 s after the schedule, rank 1 nothing
    # rank 1's gather (3 s, chunk 3) from 0, done long before the first micro-batch reaches chunk 3 at 5: rank 0's 2 s
    assert reduction_tail(pl, layers, red, True, [0.0, 0.0, 0.0, 3.0], after_schedule=True) == pytest.approx(2.0)
    # rank 0's gather for chunk 2 (4 s) from its reduction's end (2): done at 6, chunk 2 reached at 4: 2 s more
    assert reduction_tail(pl, layers, red, True, [0.0, 0.0, 4.0, 0.0], after_schedule=True) == pytest.approx(4.0)
    # and behind chunk 0's gather (1 s) first: chunk 0 from 3, chunk 2 reached at 5, its gather done at 7
    assert reduction_tail(pl, layers, red, True, [1.0, 0.0, 4.0, 0.0], after_schedule=True) == pytest.approx(5.0)


@pytest.mark.parametrize("pattern", ["uniform", "alternating"])
def test_shared_fronts_give_each_segment_its_exact_cost(pattern):
    """Segments of repeated layers share their checkpoint fronts (``partition``); the least bottleneck is still the
    one of every segment priced on its own by the exact knapsack: 40 layers, an embedding and a head apart, blocks
    all alike or alternating two kinds (a hybrid Mamba/attention model), memory tight enough that most stages
    recompute."""
    from autopart.solver import pipeline as pl

    rng = np.random.default_rng(7)
    kinds = _random_layers(rng, 4, True)
    blocks = [kinds[1] if pattern == "uniform" or i % 2 == 0 else kinds[2] for i in range(38)]
    layers = [kinds[0], *blocks, kinds[3]]
    opts = PipelineOptions(4, 8, "1f1b", p2p_s=0.05)
    ar = pl._Arrays(layers)
    flights = [opts.in_flight(k) for k in range(opts.chunks)]
    checked = 0
    for share in (0.1, 0.15, 0.2, 0.25):
        limit = sum(x.state_bytes + x.act_bytes for x in layers) * opts.micro_batches * share / opts.stages
        lim = limit / opts.virtual * (1 + pl._RTOL)
        costs = []
        for f in flights:
            need = ar.A - ar.allowed_act(f, lim, False)
            c = np.full(ar.T.shape, np.inf)
            for i, j in zip(*np.nonzero(ar.valid)):
                extra = 0.0 if need[i, j] <= 0 else pl._knapsack(ar.fwd[i:j], ar.save[i:j], need[i, j])[0]
                c[i, j] = ar.T[i, j] + extra + opts.p2p_s
            costs.append(c)
        want, _ = pl._bottleneck_dp(costs)
        if not math.isfinite(want):
            continue
        plan = partition(layers, opts, limit)
        assert max(plan.stage_time_s) == pytest.approx(want, rel=1e-12)
        checked += any(plan.checkpointed)
    assert checked >= 3
