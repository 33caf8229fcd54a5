"""Solver units: hand-made graphs with known optima, brute force on random small problems, DP vs MIP, JSON."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest

from autopart.solver import InfeasibleError, Problem, Solution, SolverOptions, solve

INF = math.inf
EXACT = SolverOptions(relative_gap=0.0, time_limit_s=10.0)
MIP_ONLY = SolverOptions(relative_gap=0.0, time_limit_s=10.0, presolve=False, use_dp=False)
SWITCH = np.array([[0.0, 10.0], [10.0, 0.0]])


def brute_force(p: Problem) -> tuple[float, tuple[int, ...]] | None:
    best = None
    for choice in itertools.product(*(range(len(c)) for c in p.node_cost)):
        cost, peak = p.evaluate(choice)
        if not math.isfinite(cost) or (p.memory_limit is not None and peak > p.memory_limit):
            continue
        if best is None or cost < best[0]:
            best = (cost, choice)
    return best


def random_problem(rng: np.random.Generator, tree: bool = False, memory: bool = False) -> Problem:
    n = int(rng.integers(2, 7))
    ks = rng.integers(1, 5, size=n)
    cost = [np.where(rng.random(k) < 0.1, INF, rng.random(k)) for k in ks]
    for c in cost:
        c[rng.integers(len(c))] = rng.random()
    mem = [rng.integers(1, 100, size=k).astype(float) for k in ks]
    if tree:
        pairs = [(int(rng.integers(0, v)), v) for v in range(1, n)]
    else:
        pairs = [(u, v) for u in range(n) for v in range(n) if u != v and rng.random() < 0.35]
    edges = []
    for u, v in pairs:
        mat = rng.random((ks[u], ks[v])) * rng.choice([0.1, 1.0, 3.0])
        mat[rng.random(mat.shape) < (0.0 if tree else 0.15)] = INF
        edges.append((u, v, mat))
    limit = None
    if memory:
        lo, hi = sum(m.min() for m in mem), sum(m.max() for m in mem)
        limit = float(lo + rng.uniform(0.1, 0.8) * (hi - lo))
    return Problem([f"g{i}" for i in range(n)], cost, mem, edges, memory_limit=limit)


def test_chain_resharding_beats_locally_cheapest():
    # Locally cheapest is option 0, 0, 1 (1 + 1 + 1 = 3, plus a switch of 10); the optimum stays on option 1 (5).
    p = Problem(
        ["a", "b", "c"],
        [np.array([1.0, 2.0]), np.array([1.0, 2.0]), np.array([5.0, 1.0])],
        [np.zeros(2)] * 3,
        [(0, 1, SWITCH), (1, 2, SWITCH)],
    )
    for options in (EXACT, MIP_ONLY, SolverOptions(backend="cp-sat", use_dp=False, presolve=False)):
        sol = solve(p, options)
        assert sol.choice == (1, 1, 1)
        assert sol.objective == pytest.approx(5.0)
        assert sol.status == "optimal" and sol.bound == pytest.approx(5.0, rel=1e-6)


def test_diamond():
    # a -> b, a -> c, b -> d, c -> d: b prefers 1, c prefers 0; a and d must agree with both or pay.
    cheap1, cheap0 = np.array([3.0, 0.0]), np.array([0.0, 3.0])
    p = Problem(
        ["a", "b", "c", "d"],
        [np.zeros(2), cheap1, cheap0, np.array([0.0, 0.5])],
        [np.zeros(2)] * 4,
        [(0, 1, SWITCH * 0.1), (0, 2, SWITCH * 0.1), (1, 3, SWITCH * 0.1), (2, 3, SWITCH * 0.1)],
    )
    sol = solve(p, EXACT)
    assert sol.objective == pytest.approx(brute_force(p)[0])
    assert sol.choice[1:3] == (1, 0)
    assert sol.objective == pytest.approx(2.0)
    assert solve(p, MIP_ONLY).objective == pytest.approx(2.0)


def test_memory_limit_forces_costlier_option():
    p = Problem(
        ["w1", "w2"],
        [np.array([1.0, 3.0]), np.array([1.0, 2.0])],
        [np.array([100.0, 10.0]), np.array([100.0, 50.0])],
        [],
        memory_limit=170.0,
        memory_base=20.0,
    )
    sol = solve(p, EXACT)
    assert sol.choice == (0, 1) and sol.objective == pytest.approx(3.0)
    p.memory_limit = 90.0
    sol = solve(p, EXACT)
    assert sol.choice == (1, 1) and sol.objective == pytest.approx(5.0)


def test_forbidden_pairs_and_options():
    p = Problem(
        ["a", "b"],
        [np.array([0.0, 1.0]), np.array([INF, 0.0, 0.5])],
        [np.zeros(2), np.zeros(3)],
        [(0, 1, np.array([[0.0, INF, INF], [0.0, 0.0, 0.0]]))],
    )
    for options in (EXACT, MIP_ONLY):
        sol = solve(p, options)
        assert sol.choice == (1, 1) and sol.objective == pytest.approx(1.0)


def test_no_usable_option_is_infeasible():
    p = Problem(["a", "b"], [np.zeros(1), np.zeros(2)], [np.zeros(1), np.zeros(2)], [(0, 1, np.array([[INF, INF]]))])
    with pytest.raises(InfeasibleError, match="no usable option"):
        solve(p, EXACT)


def test_infeasible_memory_reports_minimum_and_contributors():
    gib = float(1 << 30)
    p = Problem(
        ["embed", "mlp", "head"],
        [np.array([0.0, 1.0]), np.array([0.0, 1.0, 2.0]), np.array([0.0, 1.0])],
        [np.array([8.0, 2.0]) * gib, np.array([16.0, 4.0, 1.0]) * gib, np.array([6.0, 3.0]) * gib],
        # mlp's smallest option (1 GiB) is forbidden next to head's smallest (3 GiB): min is 2 + 1 + 6 or 2 + 4 + 3.
        [(1, 2, np.array([[0.0, 0.0], [0.0, 0.0], [0.0, INF]]))],
        memory_limit=5.0 * gib,
        memory_base=1.0 * gib,
    )
    for options in (EXACT, MIP_ONLY):
        with pytest.raises(InfeasibleError) as info:
            solve(p, options)
        err = info.value
        assert err.min_memory == pytest.approx(10.0 * gib)
        assert dict(err.contributors) in (
            {"embed": 2 * gib, "mlp": 1 * gib, "head": 6 * gib},
            {"embed": 2 * gib, "mlp": 4 * gib, "head": 3 * gib},
        )
        assert err.contributors[0][1] == max(b for _, b in err.contributors)
        assert "at least 10 GiB" in str(err)


@pytest.mark.parametrize("memory", [False, True])
def test_random_small_problems_match_brute_force(memory):
    rng = np.random.default_rng(1 if memory else 0)
    checked = 0
    for _ in range(30):
        p = random_problem(rng, memory=memory)
        best = brute_force(p)
        for options in (EXACT, MIP_ONLY, SolverOptions(backend="scip", relative_gap=0.0)):
            if best is None:
                with pytest.raises(InfeasibleError):
                    solve(p, options)
                continue
            sol = solve(p, options)
            assert sol.objective == pytest.approx(best[0], rel=1e-9, abs=1e-12), (options, sol, best)
            assert p.evaluate(sol.choice)[0] == sol.objective
            checked += 1
    assert checked > 40


def test_cpsat_matches_brute_force():
    rng = np.random.default_rng(7)
    for _ in range(8):
        p = random_problem(rng, memory=True)
        best = brute_force(p)
        if best is None:
            continue
        sol = solve(p, SolverOptions(backend="cp-sat", relative_gap=0.0, use_dp=False))
        assert sol.objective == pytest.approx(best[0], rel=1e-6)


def test_dp_equals_mip_on_random_trees():
    rng = np.random.default_rng(3)
    for _ in range(20):
        p = random_problem(rng, tree=True)
        dp = solve(p, EXACT)
        mip = solve(p, MIP_ONLY)
        assert dp.backend in ("dp",) and dp.status == "optimal" and dp.gap == 0.0
        assert dp.objective == pytest.approx(mip.objective, rel=1e-9, abs=1e-12)


def test_hint_and_options_are_accepted():
    rng = np.random.default_rng(5)
    p = random_problem(rng, memory=True)
    best = brute_force(p)
    while best is None:
        p = random_problem(rng, memory=True)
        best = brute_force(p)
    p.hint = list(best[1])
    for backend in ("highs", "scip", "cp-sat"):
        sol = solve(p, SolverOptions(backend=backend, seed=3, relative_gap=0.0, presolve=False))
        assert sol.objective == pytest.approx(best[0], rel=1e-6)
    with pytest.raises(ValueError, match="backend"):
        SolverOptions(backend="gurobi")


def test_solution_json_round_trip():
    sol = Solution((0, 2, 1), "feasible", 1.5e-3, 1.2e-3, 0.2, 0.01, "highs", 40, 12)
    assert Solution.from_json(json.loads(json.dumps(sol.to_json()))) == sol


def test_two_memory_rows_admit_what_one_summed_row_refuses():
    # forward row: activations; backward row: gradients. The peak is the larger row, not their sum.
    p = Problem(
        ["act", "grad"],
        [np.array([0.0, 1.0]), np.array([0.0, 1.0])],
        [np.array([[60.0, 0.0], [10.0, 0.0]]), np.array([[0.0, 60.0], [0.0, 10.0]])],
        [],
        memory_limit=70.0,
        memory_base=[5.0, 5.0],
        memory_labels=["end of forward", "end of backward"],
    )
    for options in (EXACT, MIP_ONLY, SolverOptions(backend="cp-sat", relative_gap=0.0)):
        sol = solve(p, options)
        assert sol.choice == (0, 0) and sol.objective == 0.0
    assert p.evaluate((0, 0)) == (0.0, 65.0)
    summed = Problem(p.names, p.node_cost, [m.sum(axis=1) for m in p.node_memory], [], memory_limit=70.0,
                     memory_base=10.0)
    assert solve(summed, EXACT).choice != (0, 0)  # 130 bytes summed: the one-row model refuses it


def test_two_memory_rows_infeasible_names_the_binding_row():
    p = Problem(
        ["a", "b"],
        [np.array([0.0, 1.0]), np.array([0.0, 1.0])],
        [np.array([[50.0, 1.0], [20.0, 30.0]]), np.array([[50.0, 1.0], [20.0, 30.0]])],
        [],
        memory_limit=50.0,
        memory_labels=["end of forward", "end of backward"],
    )
    with pytest.raises(InfeasibleError) as info:
        solve(p, EXACT)
    # best max-row peak: both pick option 1 -> rows (40, 60) -> 60, binding at the end of backward
    assert info.value.min_memory == pytest.approx(60.0)
    assert info.value.binding == "end of backward"
    assert "end of backward" in str(info.value)


@pytest.mark.parametrize("seed", range(3))
def test_random_two_row_problems_match_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    checked = 0
    for _ in range(20):
        p = random_problem(rng)
        p.node_memory = [np.stack([rng.integers(1, 100, size=len(c)), rng.integers(1, 100, size=len(c))], axis=1)
                         .astype(float) for c in p.node_cost]
        p.memory_base = [3.0, 7.0]
        lo = max(p.base_vector() + sum(m.min(axis=0) for m in p.node_memory))
        hi = max(p.base_vector() + sum(m.max(axis=0) for m in p.node_memory))
        p.memory_limit = float(lo + rng.uniform(0.1, 0.8) * (hi - lo))
        best = brute_force(p)
        for options in (EXACT, MIP_ONLY):
            if best is None:
                with pytest.raises(InfeasibleError):
                    solve(p, options)
                continue
            sol = solve(p, options)
            assert sol.objective == pytest.approx(best[0], rel=1e-6, abs=1e-9)
            assert p.evaluate(sol.choice)[1] <= p.memory_limit * (1 + 1e-6)
            checked += 1
    assert checked > 10


def _with_edge_memory(rng: np.random.Generator, p: Problem, rows: int = 1) -> Problem:
    """``p`` with memory on about half its edges: a saved value kept whole (node term) that some option pairs keep
    as a smaller shard (a negative edge term, whole bytes, no larger than what the consumer counts), plus pairs
    that hold extra bytes (positive); node terms made (K, rows)."""
    p.node_memory = [np.stack([np.asarray(m, dtype=float) if r == 0 else rng.integers(1, 100, size=len(m))
                               .astype(float) for r in range(rows)], axis=1) for m in p.node_memory]
    ems = []
    for _, v, mat in p.edges:
        if rng.random() < 0.5:
            ems.append(None)
            continue
        em = np.zeros(mat.shape + (rows,))
        em[..., 0] = -np.floor(rng.random(mat.shape) * p.node_memory[v][None, :, 0]) * (rng.random(mat.shape) < 0.5)
        em[..., rows - 1] += rng.integers(0, 40, size=mat.shape) * (rng.random(mat.shape) < 0.3)
        ems.append(em if rows > 1 else em[..., 0])
    p.edge_memory = ems
    lo = max(p.base_vector() + sum(m.min(axis=0) for m in p.node_memory))
    hi = max(p.base_vector() + sum(m.max(axis=0) for m in p.node_memory))
    p.memory_limit = float(lo + rng.uniform(0.0, 0.8) * (hi - lo))
    return p


@pytest.mark.parametrize("rows", [1, 2])
def test_random_edge_memory_problems_match_brute_force(rows):
    """Edge memory terms (bytes that depend on both ends' options) through presolve (folding, fixing, dominance,
    row dropping) and every backend: the optimum and the peak agree with enumeration."""
    rng = np.random.default_rng(200 + rows)
    checked = infeasible = 0
    for _ in range(40):
        p = _with_edge_memory(rng, random_problem(rng), rows)
        best = brute_force(p)
        for options in (EXACT, MIP_ONLY, SolverOptions(backend="cp-sat", relative_gap=0.0, use_dp=False)):
            if best is None:
                with pytest.raises(InfeasibleError) as info:
                    solve(p, options)
                # the least peak reported is one some choice reaches (none: forbidden pairs everywhere)
                least = min((max(p.peaks(c)) for c in itertools.product(*(range(len(x)) for x in p.node_cost))
                             if math.isfinite(p.evaluate(c)[0])), default=math.inf)
                assert info.value.min_memory >= least - 1e-9
                infeasible += 1
                continue
            sol = solve(p, options)
            assert sol.objective == pytest.approx(best[0], rel=1e-6, abs=1e-9), (options, sol, best)
            assert p.evaluate(sol.choice)[1] <= p.memory_limit * (1 + 1e-6)
            checked += 1
    assert checked > 40 and infeasible > 0


def test_edge_memory_binds_where_node_terms_alone_would_not():
    """A pair that keeps more than its nodes: a zero-cost edge whose memory is not separable must not be folded
    away by presolve, and the cheap pair (0, 0) that holds 50 bytes on it is refused at a 40-byte limit."""
    em = np.array([[50.0, 0.0], [0.0, 0.0]])
    p = Problem(["a", "b"], [np.array([0.0, 1.0]), np.array([0.0, 2.0])], [np.zeros(2), np.zeros(2)],
                [(0, 1, np.zeros((2, 2)))], memory_limit=40.0, edge_memory=[em])
    for options in (EXACT, MIP_ONLY, SolverOptions(backend="cp-sat", relative_gap=0.0)):
        assert solve(p, options).choice == (1, 0)
    assert p.peaks((0, 0)) == pytest.approx([50.0])
    # a pair that keeps less than its nodes (a shard saved instead of the gathered value): (1, 1) fits only thanks
    # to its edge term, and option 0 of b, cheaper but with no saving, does not
    p = Problem(["a", "b"], [np.array([0.0, 1.0]), np.array([0.0, 1.0])], [np.zeros(2), np.array([30.0, 30.0])],
                [(0, 1, np.array([[0.0, 5.0], [5.0, 0.0]]))], memory_limit=20.0,
                edge_memory=[np.array([[0.0, 0.0], [0.0, -15.0]])])
    for options in (EXACT, MIP_ONLY):
        assert solve(p, options).choice == (1, 1)
    with pytest.raises(ValueError, match="edge_memory"):
        Problem(["a", "b"], [np.zeros(2), np.zeros(2)], [np.zeros(2), np.zeros(2)], [(0, 1, np.zeros((2, 2)))],
                edge_memory=[np.zeros((2, 3))]).validate()


def test_repair_to_budget_counts_edge_memory():
    """The greedy warm start sees edge terms: from a choice over the limit only through its edge term, it switches
    to a choice whose peak, edge terms included, fits."""
    from autopart.planner import repair_to_budget

    rng = np.random.default_rng(5)
    repaired = 0
    for _ in range(30):
        p = _with_edge_memory(rng, random_problem(rng), 2)
        start = [int(np.argmin(c)) for c in p.node_cost]
        edges = [(u, v, m) for u, v, m in p.edges]
        ems = [None if e is None else np.asarray(e) for e in p.edge_memory]
        out = repair_to_budget(list(start), p.node_cost, p.node_memory, edges, p.memory_limit - p.base_vector(),
                               edge_memory=ems)
        if out is not None:
            assert max(p.peaks(out)) <= p.memory_limit + 1e-9
            repaired += max(p.peaks(start)) > p.memory_limit
    assert repaired > 3


def test_prefer_smaller_on_ties_keeps_the_cost_and_lowers_memory():
    """The solver breaks exact ties arbitrarily; the polish moves a group to the option of least memory among those
    costing no more with its neighbours as chosen, only where no memory row grows: random problems keep their cost
    and no peak row grows; a hand-made tie (a frozen weight kept whole or as the slice its consumer reads) resolves
    to the slice, and not where the slice would cost more."""
    from autopart.planner import prefer_smaller_on_ties

    rng = np.random.default_rng(11)
    lowered = 0
    for _ in range(60):
        p = _with_edge_memory(rng, random_problem(rng), 2)
        for c in p.node_cost:  # ties: copy an option's cost onto another
            if len(c) > 1 and rng.random() < 0.7:
                c[int(rng.integers(1, len(c)))] = c[0]
        edges = [(u, v, np.asarray(m)) for u, v, m in p.edges]
        ems = [None if e is None else np.asarray(e) for e in p.edge_memory]
        start = [int(rng.integers(len(c))) for c in p.node_cost]
        before = p.evaluate(start)[0]
        if not math.isfinite(before):
            continue
        out = prefer_smaller_on_ties(list(start), p.node_cost, p.node_memory, edges, ems)
        assert p.evaluate(out)[0] <= before * (1 + 1e-9) + 1e-12
        assert (p.peaks(out) <= p.peaks(start) + 1e-9).all()
        lowered += bool((p.peaks(out) < p.peaks(start) - 1e-9).any())
    assert lowered >= 5, lowered
    # weight options: whole (8 bytes), the slice its matmul reads (2), a smaller slice that costs a conversion (1)
    cost = [np.array([0.0, 0.0, 0.5]), np.array([1.0, 3.0])]
    mem = [np.array([8.0, 2.0, 1.0]), np.array([0.0, 0.0])]
    edge = (0, 1, np.array([[0.0, 0.0], [0.0, 5.0], [0.0, 0.0]]))  # the slice feeds option 1 only at a price
    assert prefer_smaller_on_ties([0, 0], cost, mem, [edge]) == [1, 0]
    assert prefer_smaller_on_ties([0, 1], cost, mem, [edge]) == [0, 1]  # there the slice costs 5 more: kept whole
    rows = [np.array([[8.0, 1.0], [2.0, 3.0], [1.0, 1.0]]), np.zeros((2, 2))]  # a row that would grow: refused
    assert prefer_smaller_on_ties([0, 0], cost, rows, [edge]) == [0, 0]


def test_share_solutions_answers_a_problem_solved_before():
    from autopart.solver.ilp import record_solves, share_solutions

    rng = np.random.default_rng(7)
    p = random_problem(rng, memory=True)
    while p.memory_limit is None or brute_force(p) is None:
        p = random_problem(rng, memory=True)
    best = brute_force(p)
    twin = Problem([f"other{i}" for i in range(len(p.names))], [c.copy() for c in p.node_cost], p.node_memory,
                   p.edges, memory_limit=p.memory_limit, hint=list(best[1]))
    with record_solves() as solves, share_solutions() as shared:
        first = solve(p, EXACT)
        again = solve(twin, EXACT)  # other names and a hint: the same problem, answered from the first solve
        assert shared.hits == 1 and len(solves) == 1
        assert again.choice == first.choice and again.hint == "reused" and again.objective == first.objective
        assert math.isclose(first.objective, best[0], rel_tol=1e-9)
        # another memory limit or another cost is another problem: solved
        looser = solve(Problem(p.names, p.node_cost, p.node_memory, p.edges, memory_limit=p.memory_limit * 2), EXACT)
        dearer = [c.copy() for c in p.node_cost]
        dearer[0] = dearer[0] + 1.0
        solve(Problem(p.names, dearer, p.node_memory, p.edges, memory_limit=p.memory_limit), EXACT)
        assert shared.hits == 1 and len(solves) == 3 and looser.hint == "none"
    assert solve(twin, EXACT).hint in ("used", "not needed")  # solved: outside the block nothing is shared


def test_highs_presolve_off_on_large_memoryless_problems_keeps_the_optimum(monkeypatch):
    """Without a memory row and with HIGHS_PRESOLVE_OFF_VARS variables or more, HiGHS runs without its own presolve
    (faster there); the optimum is the one it proves with its presolve on."""
    import autopart.solver.ilp as ilp

    rng = np.random.default_rng(3)
    n, k = 24, 12
    cost = [rng.random(k) for _ in range(n)]
    edges = [(i, i + 1, rng.random((k, k))) for i in range(n - 1)] + [(i, i + 2, rng.random((k, k)))
                                                                    for i in range(0, n - 2, 3)]
    p = Problem([f"g{i}" for i in range(n)], cost, [np.zeros(k)] * n, edges)
    runs = {}
    for threshold in (10**9, 0):  # presolve on / off for this problem
        monkeypatch.setattr(ilp, "HIGHS_PRESOLVE_OFF_VARS", threshold)
        runs[threshold] = solve(p, MIP_ONLY)
    on, off = runs[10**9], runs[0]
    assert on.num_variables >= 3000 and on.status == off.status == "optimal"
    assert math.isclose(on.objective, off.objective, rel_tol=1e-9) and math.isclose(off.objective, off.bound,
                                                                                       rel_tol=1e-9)


def test_unsliced_hint_moves_sliced_choices_to_the_cheapest_allowed_option():
    """The warm start of the solve without ZeRO-1/2: a group on a sliced option takes its cheapest other option,
    its edges priced with the neighbours held; groups on allowed options keep them."""
    from autopart.planner import unsliced_hint

    cost = [np.array([1.0, 0.5, 2.0]), np.array([0.0, 0.0])]
    edge = np.array([[0.0, 9.0], [5.0, 0.0], [0.0, 0.0]])  # group 0's option 1 is dear next to group 1's option 0
    sliced = {0: np.array([True, False, False]), 1: np.array([True, True])}  # group 1: every option sliced
    assert unsliced_hint([0, 0], cost, [(0, 1, edge)], sliced) == [2, 0]  # 1.0 + 5.0 > 2.0 + 0.0
    assert unsliced_hint([0, 1], cost, [(0, 1, edge)], sliced) == [1, 1]  # 0.5 + 0.0 < 2.0 + 0.0
    assert unsliced_hint([1, 0], cost, [(0, 1, edge)], sliced) == [1, 0]  # not on a sliced option: kept


def _forbidden_low_pair(limit: float) -> Problem:
    """Two groups whose small options (cheap in memory, dear in time) may not be paired: each group's least memory is
    1 byte, but any allowed choice holds at least 1 + 10."""
    pair = np.array([[INF, 0.0], [0.0, 0.0]])
    return Problem(["a", "b"], [np.array([1.0, 0.0]), np.array([1.0, 0.0])],
                   [np.array([1.0, 10.0]), np.array([1.0, 10.0])], [(0, 1, pair)], memory_limit=limit)


def test_infeasible_memory_is_proven_by_the_row_minima_without_the_mip(monkeypatch):
    """Presolve's bound (every group's least option, 2 bytes) does not see that the small options exclude each other;
    the exact least memory of the row (a problem without a memory row) does, and no MIP is built for it."""
    import autopart.solver.ilp as ilp

    def no_mip(*args, **kwargs):
        raise AssertionError("the memory-bounded MIP ran for a problem the row minima prove infeasible")

    monkeypatch.setattr(ilp, "_run_mathopt", no_mip)
    monkeypatch.setattr(ilp, "_run_cpsat", no_mip)
    for options in (EXACT, MIP_ONLY, SolverOptions(backend="cp-sat", relative_gap=0.0)):
        with pytest.raises(InfeasibleError) as info:
            solve(_forbidden_low_pair(5.0), options)
        assert info.value.min_memory == pytest.approx(11.0)
        assert "smallest achievable peak is" in str(info.value)


def test_a_row_minimum_that_fits_seeds_the_mip_where_no_hint_does(monkeypatch):
    """Without a hint, a probe's choice that fits is the MIP's start; the optimum is brute force's."""
    import autopart.solver.ilp as ilp

    seen = []
    run = ilp._run_mathopt

    def spy(mip, red, backend, options, time_left, hint):
        seen.append(hint)
        return run(mip, red, backend, options, time_left, hint)

    monkeypatch.setattr(ilp, "_run_mathopt", spy)
    p = _forbidden_low_pair(12.0)  # fits: (0, 1) or (1, 0), 11 bytes, cost 1
    sol = solve(p, MIP_ONLY)
    assert sol.objective == pytest.approx(brute_force(p)[0]) == pytest.approx(1.0)
    assert len(seen) == 1 and seen[0] is not None and seen[0].sum() > 0
    assert sol.hint == "none"  # the caller gave none


def test_forest_bound_is_a_lower_bound_exact_on_trees_and_above_the_floor():
    """``forest_bound`` (the planner's pruning bound): never above the optimum, on graphs with cycles, parallel edges
    both ways, edges from a group to itself and forbidden pairs; exact on trees; never below every node's and every
    edge's cheapest entry taken apart (the bound it replaced)."""
    from autopart.solver.ilp import forest_bound

    rng = np.random.default_rng(11)
    above_floor = 0
    for trial in range(60):
        p = random_problem(rng, tree=trial % 3 == 0)
        edges = list(p.edges)
        if trial % 3 == 1:  # a tied group's self-edge: both ends take one option (its diagonal)
            u = int(rng.integers(len(p.node_cost)))
            k = len(p.node_cost[u])
            edges.append((u, u, rng.random((k, k))))
            p = Problem(p.names, p.node_cost, p.node_memory, edges)
        best = brute_force(p)
        bound = forest_bound(p.node_cost, edges)
        floor = sum(float(np.min(c)) for c in p.node_cost) + sum(float(np.min(m)) for _, _, m in edges)
        assert bound >= floor - 1e-12
        if best is None:
            continue
        assert bound <= best[0] + 1e-9, (trial, bound, best)
        if trial % 3 == 0:  # a tree: the forest is the graph, solved exactly
            assert bound == pytest.approx(best[0], rel=1e-12, abs=1e-12)
        above_floor += bound > floor + 1e-9
    assert above_floor >= 20  # the bound is not the floor in disguise


def test_presolve_leaves_nothing_to_reduce() -> None:
    """Presolve runs to its fixpoint: it re-checks only the edges and groups whose options, costs or memory changed
    (``_presolve``'s dirty sets), so a second presolve of its output (forbidden pairs, separable edges, slack memory
    rows, single options, dominated options) must find nothing left; one that stopped early would. Random problems
    with and without memory limits and forbidden pairs, cycles included."""
    from autopart.solver.ilp import _presolve

    rng = np.random.default_rng(11)
    reduced = 0
    for trial in range(300):
        p = random_problem(rng, tree=trial % 3 == 0, memory=trial % 2 == 0)
        try:
            red = _presolve(p, True)
        except InfeasibleError:
            continue
        if not red.groups:
            continue
        reduced += len(red.groups) < len(p.names) or any(len(o) < len(c) for o, c in zip(red.options, p.node_cost))
        limited = red.memory_limit is not None
        again = Problem([p.names[g] for g in red.groups], red.cost,
                        red.memory if limited else [np.zeros(len(c)) for c in red.cost], red.edges,
                        memory_limit=red.memory_limit, memory_base=red.memory_base if limited else 0.0)
        red2 = _presolve(again, True)
        assert red2.groups == list(range(len(red.groups))) and not red2.fixed and not red2.replaced_by, trial
        assert [len(o) for o in red2.options] == [len(o) for o in red.options], trial
        assert len(red2.edges) == len(red.edges), trial
    assert reduced > 100  # the problems gave presolve work to do


def test_planning_errors_pickle_whole() -> None:
    """Rank 0 sends a planning error to the other ranks pickled (``api._shared_plan``): the solver's and the
    planner's errors come back with their figures (an exception's default pickling calls ``__init__`` with the
    message alone, which InfeasibleError's signature refused)."""
    import pickle

    from autopart.planner import NoPlanFits

    e = pickle.loads(pickle.dumps(InfeasibleError("no fit", 3.0, [("w", 2.0)], "end of backward")))
    assert (type(e), str(e), e.min_memory, e.contributors, e.binding) == \
        (InfeasibleError, "no fit", 3.0, [("w", 2.0)], "end of backward")
    n = pickle.loads(pickle.dumps(NoPlanFits("none", 5.0, 4.0, "peak", [("activations", "mm", 1.0)])))
    assert (n.min_memory, n.limit, n.binding, n.terms) == (5.0, 4.0, "peak", [("activations", "mm", 1.0)])


def test_lp_relaxation_first_keeps_the_optimum(monkeypatch) -> None:
    """Given a warm start, HiGHS solves the MIP's LP relaxation first (``SolverOptions.lp_first``) and takes its
    optimum where it is integral: that is then the MIP's optimum. Where it is not (a memory row cutting the
    relaxation's vertex) the MIP runs as before. On random problems, cycles and memory limits included, each with
    a random feasible start, both paths occur and every answer is the brute-force optimum, as the MIP alone finds
    it; a start that is optimal is the answer (a tie keeps it)."""
    import autopart.solver.ilp as ilp

    paths = []
    run = ilp._run_mathopt

    def spy(*args, **kwargs):
        raw, scale = run(*args, **kwargs)
        paths.append(raw.relaxation)
        return raw, scale

    monkeypatch.setattr(ilp, "_run_mathopt", spy)
    rng = np.random.default_rng(5)
    lp_only = SolverOptions(relative_gap=0.0, time_limit_s=10.0, presolve=False, use_dp=False)
    mip_only = dataclasses.replace(lp_only, lp_first=False)
    for trial in range(150):
        p = random_problem(rng, memory=trial % 2 == 0)
        best = brute_force(p)
        if best is None:
            continue
        feasible = [c for c in itertools.product(*(range(len(c)) for c in p.node_cost)) if math.isfinite(
            p.evaluate(c)[0]) and (p.memory_limit is None or p.evaluate(c)[1] <= p.memory_limit)]
        start = list(best[1]) if trial % 5 == 0 else list(feasible[int(rng.integers(len(feasible)))])
        p = dataclasses.replace(p, hint=start)
        first, mip = solve(p, lp_only), solve(p, mip_only)
        assert first.status == "optimal" and first.gap <= 1e-9, trial
        assert math.isclose(first.objective, best[0], rel_tol=1e-9, abs_tol=1e-12), trial
        assert math.isclose(first.objective, mip.objective, rel_tol=1e-9, abs_tol=1e-12), trial
        if start == list(best[1]) and paths[-2]:  # an optimal start, taken by the relaxation's path: kept
            assert list(first.choice) == start, trial
    assert True in paths and False in paths  # both the relaxation's answer and the MIP's fallback were taken
    # exact ties (every option of every group costs the same, on a cycle): the start is the answer
    n = 6
    tie = Problem([f"t{i}" for i in range(n)], [np.ones(3) for _ in range(n)], [np.zeros(3) for _ in range(n)],
                  [(i, (i + 1) % n, np.full((3, 3), 0.5)) for i in range(n)], hint=[1, 2, 0, 2, 1, 1])
    assert list(solve(tie, lp_only).choice) == tie.hint and paths[-1]


def test_native_solver_output_stays_off_stdout():
    """What a native solver prints to fd 1 (HiGHS's stray debugging printf) is logged at DEBUG, not written to the
    process' standard output, which ``autopart advise --json`` fills with JSON. In a child process whose stdout is a
    pipe and C stdio buffered (no PYTHONUNBUFFERED), so that the C library's buffer is flushed in time."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import ctypes, logging, os, sys
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(name)s: %(message)s")
        from autopart.solver.ilp import _native_stdout_logged
        print("before", flush=True)
        with _native_stdout_logged():
            os.write(1, b"raw write\\n")
            ctypes.CDLL(None).printf(b"buffered printf %d", 7)
        print("after", flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "before\nafter\n", run.stdout
    assert "raw write" in run.stderr and "buffered printf 7" in run.stderr, run.stderr


def test_a_cutoff_prunes_only_problems_whose_lp_bound_is_above_it(monkeypatch) -> None:
    """``SolverOptions.cutoff``: where the MIP's LP relaxation bounds every choice above the cutoff, ``solve``
    raises ``SolverCutoff`` with that bound, without the MIP; otherwise it returns the optimum as without one. On
    random memory-bounded problems (presolve's fixed groups included), against brute force: a pruned problem's
    optimum is above its cutoff and its bound is at most the optimum; a cutoff just above the optimum never prunes;
    a cutoff below the LP bound always does. CP-SAT ignores the cutoff."""
    import autopart.solver.ilp as ilp
    from autopart.solver import SolverCutoff

    mips = []
    run = ilp._run_mathopt

    def spy(mip, red, backend, options, *args):
        raw, scale = run(mip, red, backend, options, *args)
        mips.append(raw.cutoff)
        return raw, scale

    monkeypatch.setattr(ilp, "_run_mathopt", spy)
    rng = np.random.default_rng(11)
    exact = SolverOptions(relative_gap=0.0, time_limit_s=10.0)
    pruned = solved = 0
    for _ in range(120):
        p = random_problem(rng, memory=True)
        best = brute_force(p)
        if best is None:
            continue
        opt = best[0]
        sol = solve(p, dataclasses.replace(exact, cutoff=opt * (1 + 1e-3) + 1e-9))  # the optimum beats it
        assert math.isclose(sol.objective, opt, rel_tol=1e-9, abs_tol=1e-12)
        cut = opt * float(rng.uniform(0.8, 1.0))
        try:
            sol = solve(p, dataclasses.replace(exact, cutoff=cut))
        except SolverCutoff as e:
            assert e.bound <= opt * (1 + 1e-7) + 1e-12 and e.bound > cut and e.cutoff == cut
            assert mips[-1]  # the LP's answer: no MIP
            pruned += 1
            with pytest.raises(SolverCutoff):  # below the bound, always
                solve(p, dataclasses.replace(exact, cutoff=e.bound * 0.999))
            if p.num_memory_rows == 1:  # CP-SAT solves as without a cutoff
                assert math.isclose(solve(p, dataclasses.replace(exact, backend="cp-sat", cutoff=cut)).objective,
                                    opt, rel_tol=1e-6, abs_tol=1e-9)
        else:
            assert math.isclose(sol.objective, opt, rel_tol=1e-9, abs_tol=1e-12)
            solved += 1
    assert pruned > 10 and solved > 5, (pruned, solved)
