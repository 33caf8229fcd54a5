r"""Choose one sharding option per group so that compute plus resharding time is least within a memory budget.

The solver sees indices and numbers only. Upstream code merges follower nodes into groups, ties repeated layers by
scaling their costs, and prices every option (`Problem`); this module picks the options (`solve`).

Formulation
-----------
Data: groups :math:`i \in V` with options :math:`k \in K_i`, node cost :math:`c_{ik}` (seconds) and memory
:math:`m_{ik}` (bytes per device); edges :math:`(u, v) \in E` with resharding cost :math:`C^{uv}_{ab}` (seconds);
forbidden options :math:`c_{ik} = \infty` and forbidden pairs :math:`C^{uv}_{ab} = \infty`; memory base :math:`B`
and limit :math:`L`. Memory may have several rows :math:`r` (``node_memory`` entries of shape (K, R)), each a
moment of the step whose live bytes must fit: the planner uses two, the end of forward (states + saved activations)
and the end of backward (states + gradients). One row summing both would refuse budgets that plans meet. An edge may
also hold memory :math:`M^{uv}_{abr}` (``edge_memory``): bytes that depend on the pair of options, such as an
activation saved sharded for backward and gathered again there only when the producer's option is sharded.

Variables: :math:`x_{ik} \in \{0, 1\}` for every allowed option, :math:`e^{uv}_{ab} \in [0, 1]` (continuous) for
every allowed pair. Forbidden options and pairs get no variable.

.. math::

    \min \; & \sum_{i, k} c_{ik} x_{ik} + \sum_{(u,v) \in E} \sum_{a, b} C^{uv}_{ab} e^{uv}_{ab}          \\
    \text{choose}_i:            \; & \sum_k x_{ik} = 1                          & \forall i \in V       \\
    \text{tie\_src}_{uv,a}:     \; & \sum_b e^{uv}_{ab} = x_{ua}                & \forall (u,v), a      \\
    \text{tie\_dst}_{uv,b}:     \; & \sum_a e^{uv}_{ab} = x_{vb}                & \forall (u,v), b      \\
    \text{memory}_r:            \; & B_r + \sum_{i, k} m_{ikr} x_{ik}
                                    + \sum_{(u,v), a, b} M^{uv}_{abr} e^{uv}_{ab} \le L        & \forall r

With integral :math:`x`, the two tie families pin :math:`e^{uv}` to the single pair :math:`(a, b)` chosen at the
endpoints (the transportation polytope with unit marginals has one point), so :math:`e` needs no integrality and a
forbidden pair, having no variable, forbids the combination; for the same reason the edge memory terms are exact at
integral :math:`x` (the LP relaxation may spread :math:`e`, as it may :math:`x`). This "marginal" formulation has a
much tighter LP relaxation than the product linearization (`e \ge x_a + x_b - 1`), which left 8.8-32 % gaps on this
platform.

Scaling happens in one place, `_scales`: objective coefficients are multiplied by a power of ten so the largest is
about 1e3 (MIP) or rounded to integers with the largest about 1e8 (CP-SAT); the memory row is divided by its
right-hand side (MIP) or kept in whole bytes, rounded up, with the budget rounded down (CP-SAT). Reported objectives
are recomputed from the original seconds, never unscaled.

Presolve (`_presolve`, all exact)
---------------------------------
1. forbidden options (infinite node cost) and options with no allowed partner on some edge are removed;
2. parallel edges are summed (cost and memory), self-loops moved onto the diagonal of node costs and memory, and
   edges whose cost matrix is separable (:math:`C_{ab} = r_a + s_b`, e.g. all zero) with no forbidden pair, and
   whose memory matrix (if any) is separable on every row, are folded into node costs and memory and dropped;
3. a group left with one option is fixed: its costs become a constant, its edge rows (cost and memory) move onto its
   neighbours;
4. option :math:`k` of group :math:`i` is dropped when another option :math:`j` is no worse in node cost, in memory
   (when the memory row binds), on every incident edge row, and on every incident edge's memory row (a pair
   forbidden to :math:`k` imposes nothing), elementwise (strictly better somewhere, or equal with lower index):
   replacing :math:`k` by :math:`j` in any solution keeps it feasible and does not raise its cost;
5. a memory row is dropped when even the largest option everywhere fits (each edge at its largest allowed pair),
   and the problem is reported infeasible when even the smallest does not (each edge at its least allowed pair).

Steps repeat until nothing changes. Without a memory row the groups split into connected components; a component
that is a tree is solved exactly by dynamic programming in numpy (`_solve_tree`, backend "dp"), the rest by the MIP.

Measurements (2-core CPU, ortools 9.15, `benchmarks/bench_solver_backends.py --full --time-limit 20`; seconds to
proven optimum at relative gap 1e-4, or the gap left at the 20 s limit; presolve and DP off so every backend sees the
same model; chain of N groups, K options, skip edges every other group, "-" = no skips, i.e. a tree; "tight" = limit
15 % of the way from the smallest to the largest peak, well below the unconstrained optimum's peak)::

    N    K  skip memory   highs        scip         cp-sat (1 worker, linearization 2)   auto (presolve + DP)
    50   4  3    none     0.04         0.07         0.43                                 0.05
    50   4  3    tight    1.69         1.37         0.87                                 2.03
    50   12 3    none     0.35         0.91         7.64                                 0.30
    50   12 3    tight    4.63         10.78        16.88                                5.11
    150  8  3    none     0.32         1.14         7.68                                 0.35
    150  8  3    tight    9.15         limit 2.7%   limit 2.4%                           10.29
    250  8  -    none     0.55         1.77         10.27                                0.02 (dp)
    250  8  -    tight    9.43         limit 0.4%   limit 0.2%                           9.82
    250  8  3    none     0.62         1.98         9.88                                 0.67
    250  8  3    tight    limit 0.8%   limit 51%    limit 2.3%                           limit 1.1%
    250  12 3    none     2.72         6.12         19.35                                1.72
    250  12 3    tight    limit 1.3%   limit 49%    limit 23%                            -

HiGHS is fastest to proven optimality on every shape but the smallest tight one, so ``backend="auto"`` picks it.
The tree DP turns a 0.55 s MIP into 0.02 s. Presolve removes nothing on these random matrices (no option is dominated
and no edge is separable); it pays on real graphs, where replicated-only groups and identical options are common.
The memory row is what makes problems hard.

Cutoff (``SolverOptions.cutoff``): a caller comparing variants of a problem (the planner's recompute and offload
variants, a pipeline stage against the best candidate) passes the objective it already has. HiGHS then solves the
MIP's LP relaxation first; where its bound is above the cutoff, no choice can beat it and ``SolverCutoff`` is raised
without the MIP. The memory-bounded MIPs' relaxations are within 1-2.5% of their optima while HiGHS takes seconds
to close that last gap (Llama-70B on 16x8 H100s, no recompute: LP 0.4 s, bound 2.152 s, MIP 6 s to prove 2.186 s,
where selective recompute's plan is 1.738 s). OR-Tools' MathOpt has no cutoff for HiGHS ("cutoff_limit not
supported"), hence the LP done here.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np

from autopart import forked

BACKENDS = ("highs", "cp-sat", "scip", "auto")
_log = logging.getLogger("autopart.solver")
_GIB = float(1 << 30)
_TINY = 1e-30
_MIP_MAX_COEF = 1e3
_CPSAT_MAX_COEF = 1e8
_MEMORY_REL_TOL = 1e-6


@dataclass
class Problem:
    """One decision variable per 'group' (a merged node; repeated layers already tied upstream by scaling costs)."""

    names: list[str]
    node_cost: list[np.ndarray]
    node_memory: list[np.ndarray]  # (K,) for one memory row, or (K, R) for R rows
    edges: list[tuple[int, int, np.ndarray]]
    memory_limit: float | None = None
    memory_base: float | list[float] | np.ndarray = 0.0  # one per row
    hint: list[int] | None = None
    memory_labels: list[str] | None = None  # what each memory row is, for messages
    # per edge (aligned with ``edges``): bytes on the memory rows that depend on the pair of options at its two
    # ends, (Ka, Kb) for one row or (Ka, Kb, R); None (or a None entry) for none. Entries may be negative (a pair
    # that keeps less than the node terms count), but node plus edge terms must describe real bytes
    edge_memory: list[np.ndarray | None] | None = None

    @property
    def num_memory_rows(self) -> int:
        m = np.asarray(self.node_memory[0]) if self.node_memory else np.zeros(1)
        return 1 if m.ndim == 1 else int(m.shape[1])

    def memory_matrix(self, i: int) -> np.ndarray:
        """Group i's memory as (K, R)."""
        m = np.asarray(self.node_memory[i], dtype=float)
        return m[:, None] if m.ndim == 1 else m

    def edge_memory_matrix(self, e: int) -> np.ndarray | None:
        """Edge e's memory as (Ka, Kb, R), or None when it has none."""
        if self.edge_memory is None or self.edge_memory[e] is None:
            return None
        m = np.asarray(self.edge_memory[e], dtype=float)
        return m[:, :, None] if m.ndim == 2 else m

    def base_vector(self) -> np.ndarray:
        b = np.atleast_1d(np.asarray(self.memory_base, dtype=float))
        return np.repeat(b, self.num_memory_rows) if b.size == 1 else b

    def label(self, r: int) -> str:
        if self.memory_labels is not None and r < len(self.memory_labels):
            return self.memory_labels[r]
        return "memory" if self.num_memory_rows == 1 else f"memory row {r}"

    def peaks(self, choice: tuple[int, ...] | list[int]) -> np.ndarray:
        """Bytes per device on every memory row for a choice."""
        total = self.base_vector() + sum(self.memory_matrix(i)[k] for i, k in enumerate(choice))
        for e, (u, v, _) in enumerate(self.edges):
            em = self.edge_memory_matrix(e)
            if em is not None:
                total = total + em[choice[u], choice[v]]
        return total

    def validate(self) -> None:
        """Raise ValueError naming the first malformed group or edge."""
        n = len(self.names)
        if len(self.node_cost) != n or len(self.node_memory) != n:
            raise ValueError(
                f"Problem has {n} names, {len(self.node_cost)} node_cost and {len(self.node_memory)} node_memory "
                "entries; give one of each per group."
            )
        rows = self.num_memory_rows
        for i, (c, m) in enumerate(zip(self.node_cost, self.node_memory, strict=True)):
            c, m = np.asarray(c), np.asarray(m)
            if c.ndim != 1 or c.size == 0 or m.shape[:1] != c.shape or m.ndim not in (1, 2) or \
                    (1 if m.ndim == 1 else m.shape[1]) != rows:
                raise ValueError(
                    f"group {self.names[i]!r}: node_cost shape {c.shape} and node_memory shape {m.shape}: give a "
                    f"non-empty (K,) cost and (K,) or (K, R) memory, R the same for every group (here {rows})."
                )
            if np.isnan(c).any() or (c < 0).any() or np.isnan(m).any() or (~np.isfinite(m)).any():
                raise ValueError(
                    f"group {self.names[i]!r}: costs must be >= 0 or inf and memory finite; got cost {c}, memory {m}."
                )
        for u, v, mat in self.edges:
            if not (0 <= u < n and 0 <= v < n):
                raise ValueError(f"edge ({u}, {v}) refers to a group outside 0..{n - 1}.")
            mat = np.asarray(mat)
            want = (len(self.node_cost[u]), len(self.node_cost[v]))
            if mat.shape != want:
                raise ValueError(
                    f"edge {self.names[u]!r} -> {self.names[v]!r}: cost matrix shape {mat.shape}, expected {want}."
                )
            if np.isnan(mat).any() or (mat < 0).any():
                raise ValueError(f"edge {self.names[u]!r} -> {self.names[v]!r}: costs must be >= 0 or inf.")
        if self.edge_memory is not None:
            if len(self.edge_memory) != len(self.edges):
                raise ValueError(f"edge_memory has {len(self.edge_memory)} entries for {len(self.edges)} edges; give "
                                 "one per edge (None where an edge has no memory term).")
            for e, (u, v, _) in enumerate(self.edges):
                em = self.edge_memory_matrix(e)
                want = (len(self.node_cost[u]), len(self.node_cost[v]), rows)
                if em is not None and (em.ndim != 3 or em.shape != want or not np.isfinite(em).all()):
                    raise ValueError(
                        f"edge {self.names[u]!r} -> {self.names[v]!r}: edge_memory shape "
                        f"{np.shape(self.edge_memory[e])}, expected finite {want[:2]} or {want}."
                    )
        if self.hint is not None and len(self.hint) != n:
            raise ValueError(f"hint has {len(self.hint)} entries for {n} groups.")
        if self.base_vector().shape != (rows,):
            raise ValueError(f"memory_base has {self.base_vector().size} entries for {rows} memory rows.")

    def evaluate(self, choice: tuple[int, ...] | list[int]) -> tuple[float, float]:
        """Return (seconds, peak bytes per device) of a choice, computed from the original data."""
        cost = sum(float(self.node_cost[i][k]) for i, k in enumerate(choice))
        cost += sum(float(mat[choice[u], choice[v]]) for u, v, mat in self.edges)
        return cost, float(self.peaks(choice).max())


@dataclass(frozen=True)
class SolverOptions:
    """How hard and with what to search. `presolve` and `use_dp` exist to compare paths; leave them on."""

    time_limit_s: float = 30.0
    seed: int = 0
    backend: str = "auto"
    relative_gap: float = 1e-4
    threads: int = 1
    presolve: bool = True
    use_dp: bool = True
    explain: bool = True  # on infeasible memory, solve for the least peak (else report a lower bound only)
    # HiGHS, given a warm start: solve the MIP's LP relaxation first, and where its optimum is integral take it (it
    # is the MIP's optimum, proven: the relaxation's bound is its own objective); else the MIP (``_run_mathopt``)
    lp_first: bool = True
    # an objective the caller already has from elsewhere (another variant of the problem): where the MIP's LP
    # relaxation bounds every choice above it, ``solve`` raises ``SolverCutoff`` instead of solving the MIP, which
    # could only prove a worse optimum (HiGHS; "cp-sat" and "scip" solve as without it)
    cutoff: float | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"SolverOptions.backend={self.backend!r}; choose one of {BACKENDS}.")
        if not self.time_limit_s > 0:
            raise ValueError(f"SolverOptions.time_limit_s={self.time_limit_s} must be > 0.")
        if not 0 <= self.relative_gap < 1:
            raise ValueError(f"SolverOptions.relative_gap={self.relative_gap} must be in [0, 1).")
        if self.threads < 1:
            raise ValueError(f"SolverOptions.threads={self.threads} must be >= 1.")


@dataclass(frozen=True)
class Solution:
    """The chosen option per group and what the solver proved about it."""

    choice: tuple[int, ...]
    status: str
    objective: float
    bound: float
    gap: float
    wall_time_s: float
    backend: str
    num_variables: int
    num_constraints: int
    # the caller's warm start (``Problem.hint``): "none" (not given), "used" (handed to the MIP backend),
    # "unusable" (an option presolve removed), "not needed" (no MIP left after presolve and the tree DP, or the
    # MIP's LP relaxation had an integral optimum: ``SolverOptions.lp_first``),
    # "reused" (the same problem was solved before, inside ``share_solutions``); its objective is what the solver
    # started from
    hint: str = "none"
    hint_objective: float | None = None
    tolerance: float | None = None  # the relative gap it was solved to (``SolverOptions.relative_gap``)

    def __str__(self) -> str:
        return (
            f"Solution({self.status}, {self.objective * 1e3:.4g} ms, gap {self.gap:.2%}, {self.backend}, "
            f"{self.num_variables} vars, {self.wall_time_s:.2f} s)"
        )

    def to_json(self) -> dict:
        return {
            "choice": list(self.choice),
            "status": self.status,
            "objective": self.objective,
            "bound": self.bound,
            "gap": self.gap,
            "wall_time_s": self.wall_time_s,
            "backend": self.backend,
            "num_variables": self.num_variables,
            "num_constraints": self.num_constraints,
            "hint": self.hint,
            "hint_objective": self.hint_objective,
            "tolerance": self.tolerance,
        }

    @staticmethod
    def from_json(d: dict) -> Solution:
        return Solution(
            choice=tuple(int(k) for k in d["choice"]),
            status=str(d["status"]),
            objective=float(d["objective"]),
            bound=float(d["bound"]),
            gap=float(d["gap"]),
            wall_time_s=float(d["wall_time_s"]),
            backend=str(d["backend"]),
            num_variables=int(d["num_variables"]),
            num_constraints=int(d["num_constraints"]),
            hint=str(d.get("hint", "none")),
            hint_objective=d.get("hint_objective"),
            tolerance=d.get("tolerance"),
        )


class SolverTimeout(RuntimeError):
    """The backend found no feasible assignment within its time limit (the problem may be feasible)."""


class SolverCutoff(Exception):
    """No choice beats ``SolverOptions.cutoff``: the LP relaxation's bound on every choice's objective (``bound``,
    the fixed groups' costs included) is above it; the MIP was not solved."""

    def __init__(self, bound: float, cutoff: float):
        super().__init__(f"LP relaxation bound {bound:.6g} above the cutoff {cutoff:.6g}")
        self.bound = bound
        self.cutoff = cutoff

    def __reduce__(self):
        return type(self), (self.bound, self.cutoff)


# a cutoff prunes where the LP bound exceeds it by more than this (relative): the relaxation's bound carries the
# LP's tolerances, and a problem that ties is solved
CUTOFF_REL_TOL = 1e-6


def cutoff_threshold(cutoff: float) -> float:
    """The bound above which ``cutoff`` prunes (``SolverOptions.cutoff``; the planner compares a bound it kept)."""
    return cutoff + CUTOFF_REL_TOL * abs(cutoff)


class InfeasibleError(ValueError):
    """No choice satisfies the memory limit (or the forbidden pairs); says by how much and what dominates memory."""

    def __init__(self, message: str, min_memory: float, contributors: list[tuple[str, float]], binding: str = ""):
        super().__init__(message)
        self.min_memory = min_memory
        self.contributors = contributors
        self.binding = binding  # the memory row (moment of the step) at the reported peak

    def __reduce__(self):  # pickled whole (a planning error rank 0 sends the other ranks)
        return type(self), (str(self), self.min_memory, self.contributors, self.binding)


# ----------------------------------------------------------------------------------------------------------------
# Presolve
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _Reduced:
    """The problem after presolve: free groups (indices into the original) and their surviving options."""

    groups: list[int]
    options: list[np.ndarray]
    cost: list[np.ndarray]
    memory: list[np.ndarray]  # (K, R): only the rows that can still bind
    edges: list[tuple[int, int, np.ndarray]]
    offset: float
    memory_base: np.ndarray  # (R,)
    memory_limit: float | None
    fixed: dict[int, int]
    replaced_by: dict[tuple[int, int], int] = field(default_factory=dict)
    edge_memory: list[np.ndarray | None] = field(default_factory=list)  # aligned with edges: (Ka, Kb, R) or None

    def edge_mem(self, e: int) -> np.ndarray | None:
        return self.edge_memory[e] if self.edge_memory else None


def _separable(mat: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Return (r, s) with mat[a, b] == r[a] + s[b] when that holds (and no entry is inf), else None."""
    if not np.isfinite(mat).all():
        return None
    r = mat[:, 0] - mat[0, 0]
    s = mat[0, :].copy()
    scale = max(float(np.abs(mat).max()), _TINY)
    if np.abs(mat - r[:, None] - s[None, :]).max() <= 1e-12 * scale:
        return r, s
    return None


def _presolve(problem: Problem, enabled: bool, explain: bool = True) -> _Reduced:
    """Exact reductions described in the module docstring. Requires a validated problem."""
    n = len(problem.names)
    opts = [np.arange(len(c)) for c in problem.node_cost]
    cost = [np.asarray(c, dtype=float).copy() for c in problem.node_cost]
    mem = [problem.memory_matrix(i).copy() for i in range(n)]
    edges: dict[tuple[int, int], np.ndarray] = {}
    emem: dict[tuple[int, int], np.ndarray] = {}  # edge memory, (Ku, Kv, R), only for edges that have some
    for e, (u, v, mat) in enumerate(problem.edges):
        mat = np.asarray(mat, dtype=float)
        em = problem.edge_memory_matrix(e)
        if u == v:
            diag = np.diag(mat).copy()
            cost[u] = cost[u] + diag
            if em is not None:
                mem[u] = mem[u] + em[np.arange(len(diag)), np.arange(len(diag))]
            continue
        key, mat = ((u, v), mat) if u < v else ((v, u), mat.T)
        edges[key] = edges[key] + mat if key in edges else mat.copy()
        if em is not None:
            em = em if u < v else em.transpose(1, 0, 2)
            emem[key] = emem[key] + em if key in emem else em.copy()
    adj: list[set[tuple[int, int]]] = [set() for _ in range(n)]
    for key in edges:
        adj[key[0]].add(key)
        adj[key[1]].add(key)
    offset, base, limit = 0.0, problem.base_vector().copy(), problem.memory_limit
    fixed: dict[int, int] = {}
    replaced_by: dict[tuple[int, int], int] = {}

    # what changed since it was last looked at: an edge to check again for forbidden rows and separability, a group
    # for dominance. A clean one would give the same answer as last time (nothing), so skipping it changes nothing
    dirty_edges: set[tuple[int, int]] = set(edges)
    dirty_nodes: set[int] = set(range(n))

    def touch(i: int) -> None:
        """Group i's options, costs or memory changed: it and its neighbours' view of it are stale."""
        dirty_nodes.add(i)
        for key in adj[i]:
            dirty_edges.add(key)
            dirty_nodes.add(key[0] if key[1] == i else key[1])

    def keep(i: int, mask: np.ndarray) -> None:
        if mask.all():
            return
        opts[i], cost[i], mem[i] = opts[i][mask], cost[i][mask], mem[i][mask]
        for key in adj[i]:
            edges[key] = edges[key][mask, :] if key[0] == i else edges[key][:, mask]
            if key in emem:
                emem[key] = emem[key][mask, :] if key[0] == i else emem[key][:, mask]
        touch(i)

    def rows(i: int, key: tuple[int, int]) -> np.ndarray:
        return edges[key] if key[0] == i else edges[key].T

    def mem_rows(i: int, key: tuple[int, int]) -> np.ndarray:
        """Edge memory seen from group i: (K_i, K_other, R)."""
        return emem[key] if key[0] == i else emem[key].transpose(1, 0, 2)

    def edge_mem_range(agg) -> np.ndarray:
        """Per memory row, the sum over edges of ``agg`` (np.min / np.max) of their memory over allowed pairs."""
        total = np.zeros(len(base))
        for key, em in emem.items():
            total = total + agg(em[np.isfinite(edges[key])], axis=0)
        return total

    def drop_edge(key: tuple[int, int]) -> None:
        del edges[key]
        emem.pop(key, None)
        adj[key[0]].discard(key)
        adj[key[1]].discard(key)
        dirty_edges.discard(key)
        dirty_nodes.update(key)

    def fail_empty(i: int) -> None:
        neighbours = sorted({problem.names[k[0] if k[1] == i else k[1]] for k in adj[i]})
        raise InfeasibleError(
            f"group {problem.names[i]!r} has no usable option: every option has infinite cost or is forbidden with "
            f"every option of a neighbour ({', '.join(neighbours) or 'none'}). Likely cause: a sharding rule "
            "produced no strategy compatible with its neighbours; fix: allow a Replicate strategy for this group or "
            "a resharding path on its edges.",
            math.inf,
            [],
        )

    for i in range(n):
        keep(i, np.isfinite(cost[i]))
    changed = True
    while changed:
        changed = False
        free = [i for i in range(n) if i not in fixed]
        for i in free:
            if len(opts[i]) == 0:
                fail_empty(i)
        for key in list(edges):
            if key not in dirty_edges:
                continue
            dirty_edges.discard(key)
            u, v = key
            mat = edges[key]
            ok_u, ok_v = np.isfinite(mat).any(axis=1), np.isfinite(mat).any(axis=0)
            if not ok_u.all():
                keep(u, ok_u)
                changed = True
            if not ok_v.all():
                keep(v, ok_v)
                changed = True
            for i in key:
                if len(opts[i]) == 0:
                    fail_empty(i)
            if not enabled or key not in edges:
                continue
            sep = _separable(edges[key])
            msep = [_separable(emem[key][:, :, r]) for r in range(emem[key].shape[2])] if key in emem else []
            if sep is not None and all(m is not None for m in msep):
                cost[u] = cost[u] + sep[0]
                cost[v] = cost[v] + sep[1]
                if msep:  # edge memory r_a + s_b: node terms of either end
                    mem[u] = mem[u] + np.stack([m[0] for m in msep], axis=1)
                    mem[v] = mem[v] + np.stack([m[1] for m in msep], axis=1)
                drop_edge(key)
                changed = True
        if changed:
            continue
        if limit is not None and free:
            # edge terms bound by their least / largest allowed pair (a pair's ends may not both be chosen)
            if (base + sum(mem[i].min(axis=0) for i in free) + edge_mem_range(np.min) > limit).any():
                raise _memory_infeasible(problem, explain)
            slack = base + sum(mem[i].max(axis=0) for i in free) + edge_mem_range(np.max) <= limit
            if slack.any():  # this row fits whatever is chosen: drop it
                for i in range(n):
                    mem[i] = mem[i][:, ~slack]
                for key in emem:
                    emem[key] = emem[key][:, :, ~slack]
                base = base[~slack]
                if not base.size:
                    limit = None
                dirty_nodes.update(range(n))  # fewer memory rows: a group's features and an edge's split change
                dirty_edges.update(emem)
                changed = True
        if not enabled:
            break
        for i in free:
            if len(opts[i]) == 1:
                for key in list(adj[i]):
                    j = key[1] if key[0] == i else key[0]
                    cost[j] = cost[j] + rows(i, key)[0]
                    if key in emem:
                        mem[j] = mem[j] + mem_rows(i, key)[0]
                    drop_edge(key)
                    keep(j, np.isfinite(cost[j]))
                offset += float(cost[i][0])
                base = base + mem[i][0]
                fixed[i] = int(opts[i][0])
                changed = True
        if changed:
            continue
        for i in free:
            if i not in dirty_nodes:
                continue
            dirty_nodes.discard(i)
            k = len(opts[i])
            parts = [cost[i][:, None]] + [rows(i, key) for key in sorted(adj[i])]
            if limit is not None:
                parts.append(mem[i])
                # edge memory per partner option and row; a forbidden pair counts as +inf, so an option is only
                # dominated by one that is allowed, and no larger, with every partner the dominated one allows
                for key in sorted(adj[i] & emem.keys()):
                    em = np.where(np.isinf(rows(i, key))[:, :, None], np.inf, mem_rows(i, key))
                    parts.append(em.reshape(k, -1))
            feat = np.concatenate(parts, axis=1)
            le = (feat[:, None, :] <= feat[None, :, :]).all(axis=2)
            lt = (feat[:, None, :] < feat[None, :, :]).any(axis=2)
            idx = np.arange(k)
            dominates = le & (lt | (idx[:, None] < idx[None, :]))
            np.fill_diagonal(dominates, False)
            dominated = dominates.any(axis=0)
            if dominated.any():
                for b in np.flatnonzero(dominated):
                    a = (
                        int(np.flatnonzero(dominates[:, b] & ~dominated)[0])
                        if (dominates[:, b] & ~dominated).any()
                        else int(np.flatnonzero(dominates[:, b])[0])
                    )
                    replaced_by[(i, int(opts[i][b]))] = int(opts[i][a])
                keep(i, ~dominated)
                changed = True
    free = [i for i in range(n) if i not in fixed]
    pos = {g: p for p, g in enumerate(free)}
    return _Reduced(
        groups=free,
        options=[opts[i] for i in free],
        cost=[cost[i] for i in free],
        memory=[mem[i] for i in free],
        edges=[(pos[u], pos[v], mat) for (u, v), mat in edges.items()],
        offset=offset,
        memory_base=base,
        memory_limit=limit,
        fixed=fixed,
        replaced_by=replaced_by,
        edge_memory=[emem.get(key) for key in edges],
    )


def _reduced_hint(problem: Problem, red: _Reduced) -> list[int] | None:
    """Map the caller's hint onto surviving options, following dominance replacements; None if unusable."""
    if problem.hint is None:
        return None
    out = []
    for p, g in enumerate(red.groups):
        k = int(problem.hint[g])
        while (g, k) in red.replaced_by:
            k = red.replaced_by[(g, k)]
        where = np.flatnonzero(red.options[p] == k)
        if len(where) == 0:
            return None
        out.append(int(where[0]))
    return out


# ----------------------------------------------------------------------------------------------------------------
# Exact dynamic program on forests
# ----------------------------------------------------------------------------------------------------------------


def _find(parent: list[int], a: int) -> int:
    """Union-find root of ``a`` (halving the path on the way)."""
    while parent[a] != a:
        parent[a] = parent[parent[a]]
        a = parent[a]
    return a


def _components(n: int, edges: list[tuple[int, int, np.ndarray]]) -> list[tuple[list[int], list[int]]]:
    """Connected components as (groups, edge indices)."""
    parent = list(range(n))
    for u, v, _ in edges:
        parent[_find(parent, u)] = _find(parent, v)
    comps: dict[int, tuple[list[int], list[int]]] = {}
    for i in range(n):
        comps.setdefault(_find(parent, i), ([], []))[0].append(i)
    for e, (u, _, _) in enumerate(edges):
        comps[_find(parent, u)][1].append(e)
    return list(comps.values())


def _solve_tree(
    cost: list[np.ndarray], edges: list[tuple[int, int, np.ndarray]], groups: list[int], edge_ids: list[int]
) -> dict[int, int]:
    """Min-sum labelling of a tree: leaves-up messages M_v(a) = min_b C(a, b) + cost_v(b) + sum of v's messages."""
    nbrs: dict[int, list[tuple[int, np.ndarray]]] = {i: [] for i in groups}
    for e in edge_ids:
        u, v, mat = edges[e]
        nbrs[u].append((v, mat))
        nbrs[v].append((u, mat.T))
    root = groups[0]
    order, parent_mat, parent = [root], {root: None}, {root: -1}
    for i in order:
        for j, mat in nbrs[i]:
            if j != parent[i]:
                parent[j], parent_mat[j] = i, mat
                order.append(j)
    total = {i: cost[i].astype(float).copy() for i in groups}
    best_child: dict[int, np.ndarray] = {}
    for j in reversed(order[1:]):
        table = parent_mat[j] + total[j][None, :]
        best_child[j] = table.argmin(axis=1)
        total[parent[j]] += table.min(axis=1)
    choice = {root: int(total[root].argmin())}
    for j in order[1:]:
        choice[j] = int(best_child[j][choice[parent[j]]])
    return choice


def forest_bound(cost: list[np.ndarray], edges: list[tuple[int, int, np.ndarray]]) -> float:
    """A lower bound on the least ``sum_i cost[i][x_i] + sum_(u, v, C) C[x_u, x_v]`` over choices ``x``, found in
    milliseconds for a graph of ~100 groups: the edges of a spanning forest (those whose cost varies most; a
    forbidden pair counts as varying most) are kept and that forest is solved exactly (``_solve_tree``), every other
    edge adds its least entry. Each term bounds its share of any choice's cost from below, so the sum does; it is at
    least the sum of every node's and every edge's least entry, and on the planner's 2-block stage problems 2-8x that.
    Parallel edges are summed; an edge from a group to itself (two members of one tied group: one option) adds its
    diagonal to the group's cost."""
    n = len(cost)
    node = [np.asarray(c, dtype=float).copy() for c in cost]
    merged: dict[tuple[int, int], np.ndarray] = {}
    for u, v, mat in edges:
        if u == v:
            node[u] = node[u] + np.diag(mat)
        elif (u, v) in merged:
            merged[(u, v)] = merged[(u, v)] + mat
        elif (v, u) in merged:
            merged[(v, u)] = merged[(v, u)] + mat.T
        else:
            merged[(u, v)] = np.asarray(mat, dtype=float)

    def spread(mat: np.ndarray) -> float:
        finite = mat[np.isfinite(mat)]
        if finite.size < mat.size:
            return math.inf
        return float(finite.max() - finite.min()) if finite.size else 0.0

    parent = list(range(n))
    tree: list[tuple[int, int, np.ndarray]] = []
    rest = 0.0
    for (u, v), mat in sorted(merged.items(), key=lambda kv: -spread(kv[1])):
        ru, rv = _find(parent, u), _find(parent, v)
        if ru != rv:
            parent[ru] = rv
            tree.append((u, v, mat))
        else:
            rest += float(mat.min())
    total = rest
    for groups, edge_ids in _components(n, tree):
        choice = _solve_tree(node, tree, groups, edge_ids)
        total += sum(float(node[i][choice[i]]) for i in groups)
        total += sum(float(tree[e][2][choice[tree[e][0]], choice[tree[e][1]]]) for e in edge_ids)
    return total


# ----------------------------------------------------------------------------------------------------------------
# MIP model
# ----------------------------------------------------------------------------------------------------------------


def _scales(red: _Reduced, integer: bool) -> tuple[float, float]:
    """The one place costs and memory are scaled: returns (cost multiplier, memory multiplier)."""
    finite = [c[np.isfinite(c)] for c in red.cost] + [m[np.isfinite(m)] for _, _, m in red.edges]
    top = max((float(np.abs(f).max()) for f in finite if f.size), default=0.0)
    if integer:
        cost_scale = _CPSAT_MAX_COEF / top if top > 0 else 1.0
        return cost_scale, 1.0
    cost_scale = 10.0 ** math.floor(math.log10(_MIP_MAX_COEF / top)) if top > 0 else 1.0
    if red.memory_limit is None:
        return cost_scale, 1.0
    rhs = red.memory_limit - red.memory_base
    return cost_scale, np.where(rhs > 0, 1.0 / np.where(rhs > 0, rhs, 1.0), 1.0)


@dataclass
class _Mip:
    """Backend-neutral sparse MIP: variables, objective and named rows in coordinate form (seconds and bytes)."""

    x_start: np.ndarray
    num_vars: int = 0
    objective: list[np.ndarray] = field(default_factory=list)
    integer: list[np.ndarray] = field(default_factory=list)
    row_names: list[str] = field(default_factory=list)
    row_lb: list[float] = field(default_factory=list)
    row_ub: list[float] = field(default_factory=list)
    coo: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    memory_rows: list[int] = field(default_factory=list)
    edge_pairs: list[tuple[int, int, np.ndarray, np.ndarray, int]] = field(default_factory=list)

    def _add_rows(self, names: list[str], lb: float, ub: float, rows, cols, vals) -> None:
        start = len(self.row_names)
        self.row_names += names
        self.row_lb += [lb] * len(names)
        self.row_ub += [ub] * len(names)
        self.coo.append((np.asarray(rows) + start, np.asarray(cols), np.asarray(vals, dtype=float)))

    def add_choice_variables(self, red: _Reduced) -> None:
        """x_{ik} in {0,1} for every surviving option; objective term c_{ik} x_{ik}."""
        sizes = np.array([len(c) for c in red.cost])
        self.num_vars = int(sizes.sum())
        self.objective.append(np.concatenate(red.cost))
        self.integer.append(np.ones(self.num_vars, dtype=bool))

    def add_choose_constraints(self, red: _Reduced, names: list[str]) -> None:
        """choose_i:  sum_k x_{ik} = 1  for every group i."""
        sizes = np.diff(np.append(self.x_start, self.num_vars))
        rows = np.repeat(np.arange(len(sizes)), sizes)
        self._add_rows([f"choose[{n}]" for n in names], 1.0, 1.0, rows, np.arange(self.num_vars), np.ones(len(rows)))

    def add_edge_tie_constraints(self, red: _Reduced, names: list[str]) -> None:
        """tie_src_{uv,a}: sum_b e_ab - x_ua = 0;  tie_dst_{uv,b}: sum_a e_ab - x_vb = 0;  e_ab in [0,1] for allowed
        (finite) pairs only; objective term C_ab e_ab."""
        for u, v, mat in red.edges:
            ku, kv = mat.shape
            a, b = np.nonzero(np.isfinite(mat))
            ids = self.num_vars + np.arange(len(a))
            self.edge_pairs.append((u, v, a, b, int(self.num_vars)))
            self.num_vars += len(a)
            self.objective.append(mat[a, b])
            self.integer.append(np.zeros(len(a), dtype=bool))
            tag = f"{names[u]}->{names[v]}"
            rows = np.concatenate([a, np.arange(ku)])
            cols = np.concatenate([ids, self.x_start[u] + np.arange(ku)])
            vals = np.concatenate([np.ones(len(a)), -np.ones(ku)])
            self._add_rows([f"tie_src[{tag},{k}]" for k in range(ku)], 0.0, 0.0, rows, cols, vals)
            rows = np.concatenate([b, np.arange(kv)])
            cols = np.concatenate([ids, self.x_start[v] + np.arange(kv)])
            self._add_rows(
                [f"tie_dst[{tag},{k}]" for k in range(kv)],
                0.0,
                0.0,
                rows,
                cols,
                np.concatenate([np.ones(len(b)), -np.ones(kv)]),
            )

    def add_memory_constraint(self, red: _Reduced) -> None:
        """memory_r:  sum_{i,k} m_{ikr} x_{ik} + sum_{uv,a,b} M^{uv}_{abr} e^{uv}_{ab} <= L - B_r  (bytes per
        device), one row per binding moment r. Edge terms are exact at integral x, where e is the chosen pair.
        Requires ``add_edge_tie_constraints`` to have made the e variables."""
        if red.memory_limit is None:
            return
        mem = np.concatenate(red.memory, axis=0)
        for r in range(mem.shape[1]):
            self.memory_rows.append(len(self.row_names))
            nz = np.flatnonzero(mem[:, r])
            cols, vals = [nz], [mem[nz, r]]
            for e, (_, _, a, b, start) in enumerate(self.edge_pairs):
                em = red.edge_mem(e)
                if em is not None:
                    v = em[a, b, r]
                    hit = np.flatnonzero(v)
                    cols.append(start + hit)
                    vals.append(v[hit])
            cols, vals = np.concatenate(cols), np.concatenate(vals)
            self._add_rows([f"memory[{r}]"], -math.inf, red.memory_limit - float(red.memory_base[r]),
                           np.zeros(len(cols), dtype=int), cols, vals)

    def arrays(self, cost_scale: float, memory_scale: float):
        """Assembled (objective, integer, row lb, row ub, rows, cols, vals) with scaling applied, rows sorted."""
        obj = np.concatenate(self.objective) * cost_scale
        rows = np.concatenate([r for r, _, _ in self.coo]).astype(np.int64)
        cols = np.concatenate([c for _, c, _ in self.coo]).astype(np.int64)
        vals = np.concatenate([v for _, _, v in self.coo])
        lb, ub = np.array(self.row_lb), np.array(self.row_ub)
        scale = np.broadcast_to(np.asarray(memory_scale, dtype=float), (max(len(self.memory_rows), 1),))
        for r, row in enumerate(self.memory_rows):
            vals = np.where(rows == row, vals * scale[r], vals)
            ub[row] *= scale[r]
        order = np.lexsort((cols, rows))
        return obj, np.concatenate(self.integer), lb, ub, rows[order], cols[order], vals[order]

    def hint_vector(self, red: _Reduced, hint: list[int]) -> np.ndarray:
        """Full 0/1 assignment of x and e for a choice of surviving option positions."""
        vec = np.zeros(self.num_vars)
        vec[self.x_start + np.array(hint, dtype=np.int64)] = 1.0
        for u, v, a, b, start in self.edge_pairs:
            hit = np.flatnonzero((a == hint[u]) & (b == hint[v]))
            vec[start + hit] = 1.0
        return vec


def _build_mip(red: _Reduced, names: list[str]) -> _Mip:
    sizes = np.array([len(c) for c in red.cost], dtype=np.int64)
    mip = _Mip(x_start=np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64))
    group_names = [names[g] for g in red.groups]
    mip.add_choice_variables(red)
    mip.add_choose_constraints(red, group_names)
    mip.add_edge_tie_constraints(red, group_names)
    mip.add_memory_constraint(red)
    return mip


@dataclass
class _RawResult:
    values: np.ndarray | None
    optimal: bool
    infeasible: bool
    bound: float
    relaxation: bool = False  # the LP relaxation's optimum, integral (``SolverOptions.lp_first``): no MIP solved
    cutoff: bool = False  # the LP relaxation's bound is above ``SolverOptions.cutoff``: no MIP solved


# HiGHS's own presolve on a problem with this many variables or more costs more than it saves: the edge variables
# of large option sets make it slow (~1 s for 45k variables on 2 cores) while the LP relaxation of such a problem is
# tight (without a memory row its root solution is integral); off there, the same optimum in about half the time
# (Llama-70B's free stage and no-stage problems, 43-46k variables: 1.5 -> 0.9 s; FSDP's, 3.6k: 0.65 -> 0.1 s). With a
# memory row too: the 51 memory-bounded problems over 0.3 s that six `autopart advise` runs and Llama-70B on 1024
# H100s solve took 83.5 s with it and 49.4 s without (Llama-70B on 64 H100s without stages: 8-12 s -> 3-5 s a
# problem, HiGHS restarting its search four times after presolving), objectives within the 1e-3 gap (worst +0.02%);
# on bench_solver_backends' tight chains no slower (50x12: 3.1 -> 1.9 s, 250x8 tree: 5.8 -> 2.9 s).
HIGHS_PRESOLVE_OFF_VARS = 3000


LP_INTEGRAL_TOL = 1e-9  # a relaxation's value this close to 0 or 1 is integral (HiGHS's MIP takes 1e-6)


def _skip_highs_presolve(mip: _Mip, red: _Reduced) -> bool:
    return mip.num_vars >= HIGHS_PRESOLVE_OFF_VARS


@contextmanager
def _native_stdout_logged():
    """Run a native solver with the process' stdout (fd 1) sent to a temporary file, its text logged at DEBUG
    (``autopart.solver``). HiGHS prints debugging lines with ``printf`` (OR-Tools 9.12-9.14:
    "HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();" on some warm-started MIPs), which
    went into ``autopart advise --json``'s standard output ahead of the JSON. The C library's buffers are flushed
    before fd 1 is given back, so nothing it printed reaches stdout later."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no fd 1 to redirect
        yield
        return
    flush = _c_fflush()
    flush()  # what C stdio holds from before goes to stdout, not into the log
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            yield
        finally:
            flush()
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace").strip()
            if text:
                _log.debug("native solver output: %s", text)


@functools.lru_cache(maxsize=1)
def _c_fflush():
    """``fflush(NULL)`` of the C library (all its output streams), or a no-op where ctypes cannot reach it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        return lambda: libc.fflush(None)
    except (OSError, AttributeError, TypeError):
        return lambda: None


def _native_solve(backend: str, *args):
    """``core_solver.solve(*args)`` (OR-Tools MathOpt's) with what the native solver prints logged
    (``_native_stdout_logged``) and the threads it starts noted (``forked.watch``: no fork after them)."""
    from ortools.math_opt.core.python import solver as core_solver

    with _native_stdout_logged(), forked.watch(backend):
        return core_solver.solve(*args)


def _run_mathopt(
    mip: _Mip, red: _Reduced, backend: str, options: SolverOptions, time_left: float, hint: np.ndarray | None
) -> tuple[_RawResult, float]:
    from ortools.math_opt import model_parameters_pb2, model_pb2
    from ortools.math_opt.python import mathopt

    cost_scale, memory_scale = _scales(red, integer=False)
    obj, integer, lb, ub, rows, cols, vals = mip.arrays(cost_scale, memory_scale)
    model = model_pb2.ModelProto(name="autopart")
    model.variables.ids.extend(range(mip.num_vars))
    model.variables.lower_bounds.extend([0.0] * mip.num_vars)
    model.variables.upper_bounds.extend([1.0] * mip.num_vars)
    model.variables.integers.extend(integer.tolist())
    nz = np.flatnonzero(obj)
    model.objective.linear_coefficients.ids.extend(nz.tolist())
    model.objective.linear_coefficients.values.extend(obj[nz].tolist())
    model.linear_constraints.ids.extend(range(len(lb)))
    model.linear_constraints.lower_bounds.extend(lb.tolist())
    model.linear_constraints.upper_bounds.extend(ub.tolist())
    model.linear_constraints.names.extend(mip.row_names)
    model.linear_constraint_matrix.row_ids.extend(rows.tolist())
    model.linear_constraint_matrix.column_ids.extend(cols.tolist())
    model.linear_constraint_matrix.coefficients.extend(vals.tolist())

    solver_type = mathopt.SolverType.HIGHS if backend == "highs" else mathopt.SolverType.GSCIP
    init = mathopt.StreamableSolverInitArguments().to_proto()
    callbacks = mathopt.CallbackRegistration().to_proto()

    def values_of(result) -> np.ndarray | None:
        if not (result.solutions and result.solutions[0].HasField("primal_solution")):
            return None
        sparse = result.solutions[0].primal_solution.variable_values
        values = np.zeros(mip.num_vars)
        values[np.array(sparse.ids, dtype=np.int64)] = np.array(sparse.values)
        return values

    # the cutoff (of the MIP's own part: ``solve``) in the model's scaled units
    cutoff = None if options.cutoff is None else options.cutoff * cost_scale
    first = options.lp_first and hint is not None
    if backend == "highs" and (first or cutoff is not None) and integer.any():
        # The LP relaxation first (dual simplex, no presolve). These problems' relaxations are tight: on the 89
        # HiGHS problems of eight plans (Llama-70B on 1024 H100s, GPT-2 on 64 A100s, MoE-64e, Mamba-1.4B, CPU
        # clusters, ZeRO-3; 300 to 57k variables) every optimum was integral, with the MIP's objective, in 3.4 s
        # against the MIP's 29.7 s: HiGHS's MIP spends most of its time around a root LP that is already integral
        # (probing, symmetry detection, cut rounds). Integral, it is the MIP's optimum; otherwise the MIP runs.
        # Only with a warm start (every problem above 3k variables there had one), which the answer keeps where it
        # ties: among optimal choices the LP's vertex and the MIP's differ, and the pipeline search, which judges a
        # stage's sharding by more than its objective (the blocks' balance, the micro-batches its batch split
        # allows), found a worse candidate from some of the LP's (Mamba-1.4B on (2, 8) A100s: p=2 at 0.127 s for
        # 0.081 s; the plan the same)
        t0 = time.perf_counter()
        del model.variables.integers[:]
        model.variables.integers.extend([False] * mip.num_vars)
        lp_params = mathopt.SolveParameters(
            time_limit=timedelta(seconds=max(time_left, 0.01)), presolve=mathopt.Emphasis.OFF,
            lp_algorithm=mathopt.LPAlgorithm.DUAL_SIMPLEX)
        result = _native_solve(backend, model, solver_type.value, init, lp_params.to_proto(),
                               model_parameters_pb2.ModelSolveParametersProto(), None, callbacks, None, None)
        solved = mathopt.TerminationReason(result.termination.reason) == mathopt.TerminationReason.OPTIMAL
        values = values_of(result) if solved else None
        if solved and cutoff is not None:
            bound = result.termination.objective_bounds.dual_bound
            if bound > cutoff:
                return _RawResult(None, False, False, bound / cost_scale, cutoff=True), cost_scale
        if first and values is not None and \
                np.all(np.abs(values[integer] - np.round(values[integer])) <= LP_INTEGRAL_TOL):
            bound = result.termination.objective_bounds.dual_bound
            # among optimal choices the caller's start, as the MIP kept it when nothing beat it (a tie)
            lhs = np.bincount(rows, weights=vals * hint[cols], minlength=len(lb))
            if np.all(lhs >= lb - 1e-9 * (1 + np.abs(lb))) and np.all(lhs <= ub + 1e-9 * (1 + np.abs(ub))) and \
                    float(obj @ hint) <= bound + 1e-12 * max(1.0, abs(bound)):
                values = hint
            return _RawResult(values, True, False, bound / cost_scale, relaxation=True), cost_scale
        time_left -= time.perf_counter() - t0
        del model.variables.integers[:]
        model.variables.integers.extend(integer.tolist())
    params = mathopt.SolveParameters(
        time_limit=timedelta(seconds=max(time_left, 0.01)),
        random_seed=options.seed,
        relative_gap_tolerance=options.relative_gap,
        absolute_gap_tolerance=0.0,
        threads=None if backend == "highs" else options.threads,
        presolve=mathopt.Emphasis.OFF if backend == "highs" and _skip_highs_presolve(mip, red) else None,
    )
    model_params = model_parameters_pb2.ModelSolveParametersProto()
    if hint is not None:
        sol = model_params.solution_hints.add()
        sol.variable_values.ids.extend(range(mip.num_vars))
        sol.variable_values.values.extend(hint.tolist())
    result = _native_solve(backend, model, solver_type.value, init, params.to_proto(), model_params, None, callbacks,
                           None, None)
    reason = mathopt.TerminationReason(result.termination.reason)
    values = values_of(result)
    infeasible = reason in (mathopt.TerminationReason.INFEASIBLE, mathopt.TerminationReason.INFEASIBLE_OR_UNBOUNDED)
    bound = result.termination.objective_bounds.dual_bound / cost_scale
    return _RawResult(values, reason == mathopt.TerminationReason.OPTIMAL, infeasible, bound), cost_scale


def _run_cpsat(
    mip: _Mip, red: _Reduced, options: SolverOptions, time_left: float, hint: np.ndarray | None
) -> tuple[_RawResult, float]:
    from ortools.sat.python import cp_model

    cost_scale, _ = _scales(red, integer=True)
    obj, _, lb, ub, rows, cols, vals = mip.arrays(cost_scale, 1.0)
    obj = np.rint(obj).astype(np.int64)
    model = cp_model.CpModel()
    xs = [model.new_bool_var(f"v{j}") for j in range(mip.num_vars)]
    bounds = np.searchsorted(rows, np.arange(len(lb) + 1))
    for r in range(len(lb)):
        sl = slice(bounds[r], bounds[r + 1])
        if r in mip.memory_rows:
            coefs = np.ceil(vals[sl]).astype(np.int64).tolist()
            rhs = math.floor(ub[r])
            model.add(cp_model.LinearExpr.weighted_sum([xs[c] for c in cols[sl]], coefs) <= rhs)
        else:
            coefs = np.rint(vals[sl]).astype(np.int64).tolist()
            model.add(cp_model.LinearExpr.weighted_sum([xs[c] for c in cols[sl]], coefs) == int(lb[r]))
    nz = np.flatnonzero(obj)
    model.minimize(cp_model.LinearExpr.weighted_sum([xs[j] for j in nz], obj[nz].tolist()))
    if hint is not None:
        for j, val in enumerate(hint):
            model.add_hint(xs[j], int(val))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(time_left, 0.01)
    solver.parameters.random_seed = options.seed
    solver.parameters.relative_gap_limit = options.relative_gap
    solver.parameters.num_workers = options.threads
    if options.threads == 1:
        solver.parameters.linearization_level = 2
    status = solver.solve(model)
    values = None
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        values = np.array([solver.value(x) for x in xs], dtype=float)
    bound = solver.best_objective_bound / cost_scale if values is not None else -math.inf
    return _RawResult(values, status == cp_model.OPTIMAL, status == cp_model.INFEASIBLE, bound), cost_scale


# ----------------------------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _MemoryProbes:
    """The least peak memory subject only to forbidden options and pairs (``_memory_probes``): ``lower``, a bound no
    choice goes below (the largest single-row minimum, exact); ``choice`` and ``peaks``, the best of the probes'
    choices (a peak that is reachable); ``with_sum``: the rows' sum was probed too."""

    lower: float
    choice: tuple[int, ...]
    peaks: np.ndarray
    with_sum: bool


def _edge_memory_floor(problem: Problem) -> tuple[np.ndarray, list[np.ndarray | None]]:
    """Edge memory over allowed pairs: the sum of each edge's least entries per row (a bound) and each edge's memory
    shifted by them (non-negative, a cost for the probes)."""
    rows = problem.num_memory_rows
    emins, eshift = np.zeros(rows), []
    for e, (_, _, mat) in enumerate(problem.edges):
        em = problem.edge_memory_matrix(e)
        ok = np.isfinite(np.asarray(mat, dtype=float))
        lo = em[ok].min(axis=0) if em is not None and ok.any() else np.zeros(rows)
        emins = emins + lo
        eshift.append(None if em is None else em - lo)
    return emins, eshift


def _memory_probes(problem: Problem, with_sum: bool = True, prior: _MemoryProbes | None = None) -> _MemoryProbes:
    """Minimise each memory row on its own (exact, costs ignored; forbidden options and pairs kept), and, with
    ``with_sum`` and several rows, their sum (``prior``: the single rows' probes, already made). Each probe is a
    problem without a memory row (the tree DP or a MIP whose LP relaxation is tight): 0.1-0.3 s for Llama-70B's
    45k-variable problems, where HiGHS took 2-13 s to prove the memory-bounded problem infeasible."""
    rows = problem.num_memory_rows
    with_sum = with_sum and rows > 1
    if prior is not None and (prior.with_sum or not with_sum):
        return prior
    global _SOLVE_LOG, _SHARED
    mats = [problem.memory_matrix(i) for i in range(len(problem.names))]
    base = problem.base_vector()
    emins, eshift = _edge_memory_floor(problem)
    weights = [] if prior is not None else [np.eye(rows)[r] for r in range(rows)]
    weights += [np.ones(rows)] if with_sum else []
    best = (prior.choice, prior.peaks) if prior is not None else None
    lower = prior.lower if prior is not None else 0.0
    for w in weights:
        probe = Problem(
            names=problem.names,
            node_cost=[np.where(np.isfinite(c), m @ w, np.inf) for c, m in zip(problem.node_cost, mats, strict=True)],
            node_memory=[np.zeros(len(c)) for c in problem.node_cost],
            edges=[(u, v, np.where(np.isfinite(mat), 0.0 if sh is None else np.maximum(sh @ w, 0.0), np.inf))
                   for (u, v, mat), sh in zip(problem.edges, eshift, strict=True)],
        )
        # a probe is part of this solve, not one of the caller's: neither logged nor shared
        log, shared, _SOLVE_LOG, _SHARED = _SOLVE_LOG, _SHARED, None, None
        try:
            sol = solve(probe, SolverOptions(relative_gap=0.0, time_limit_s=60.0))
        finally:
            _SOLVE_LOG, _SHARED = log, shared
        peaks = problem.peaks(sol.choice)
        if w.sum() == 1:
            lower = max(lower, float((base @ w) + (emins @ w) + sol.bound))
        if best is None or peaks.max() < best[1].max():
            best = (tuple(sol.choice), peaks)
    return _MemoryProbes(lower, tuple(best[0]), best[1], with_sum)


def _memory_infeasible(problem: Problem, explain: bool = True, probes: _MemoryProbes | None = None) -> InfeasibleError:
    """Find the least peak memory subject only to forbidden options and pairs, and explain the shortfall.

    One row: the minimum is exact. Several rows (the peak is their maximum): each row is minimised on its own, and
    so is their sum; the best of those choices is a peak that is reachable, and the largest single-row minimum is
    a bound no choice goes below; the message gives both when they differ. ``explain=False`` skips the solves and
    reports the bound of every group's smallest usable option (a quick "does not fit"). ``probes``: the solves
    already made (``_memory_probes``).
    """
    rows = problem.num_memory_rows
    mats = [problem.memory_matrix(i) for i in range(len(problem.names))]
    base = problem.base_vector()
    if not explain and probes is None:
        low = base + _edge_memory_floor(problem)[0] + sum(
            m[np.isfinite(np.asarray(c))].min(axis=0) for m, c in zip(mats, problem.node_cost))
        r = int(np.argmax(low))
        return InfeasibleError(
            f"no sharding choice fits the memory limit of {(problem.memory_limit or 0.0) / _GIB:.3g} GiB per "
            f"device: every choice needs at least {float(low[r]) / _GIB:.3g} GiB at the {problem.label(r)}.",
            float(low[r]), [], problem.label(r))
    probes = _memory_probes(problem, with_sum=explain, prior=probes)
    lower = probes.lower
    best = (probes.choice, probes.peaks)
    choice, peaks = best
    r = int(np.argmax(peaks))
    peak = float(peaks[r])
    terms = sorted(
        ((problem.names[i], float(mats[i][k, r])) for i, k in enumerate(choice)),
        key=lambda t: -t[1],
    )[:5]
    limit = problem.memory_limit or 0.0
    listing = ", ".join(f"{name} {b / _GIB:.3g} GiB" for name, b in terms)
    at = f" at the {problem.label(r)}" if rows > 1 else ""
    reach = (f"the smallest achievable peak is {peak / _GIB:.3g} GiB" if rows == 1 or peak <= lower * (1 + 1e-9)
             else f"a peak of {peak / _GIB:.3g} GiB is reachable and none below {lower / _GIB:.3g} GiB")
    return InfeasibleError(
        f"no sharding choice fits the memory limit of {limit / _GIB:.3g} GiB per device: {reach}{at} "
        f"({float(base[r]) / _GIB:.3g} GiB fixed base). Largest terms there: {listing}. Fix: raise the memory budget "
        f"to at least {peak / _GIB:.3g} GiB, add devices so more state can be sharded, or enable activation "
        "checkpointing / optimizer-state sharding to shrink these terms.",
        peak,
        terms,
        problem.label(r),
    )


def _fits(problem: Problem, choice) -> bool:
    """``choice`` is allowed (no forbidden option or pair) and within the memory limit."""
    if choice is None:
        return False
    objective, peak = problem.evaluate(choice)
    return math.isfinite(objective) and (problem.memory_limit is None or
                                         peak <= problem.memory_limit * (1 + _MEMORY_REL_TOL))


def _needs_fit_proof(problem: Problem, red: _Reduced) -> bool:
    """A finite memory row is left for the MIP and the caller's hint does not show that some choice fits."""
    return red.memory_limit is not None and problem.memory_limit is not None and \
        math.isfinite(problem.memory_limit) and not _fits(problem, problem.hint)


def solve(problem: Problem, options: SolverOptions = SolverOptions()) -> Solution:  # noqa: B008
    """Return the cheapest choice per group within the memory limit.

    Raises InfeasibleError (a ValueError) when no choice fits, RuntimeError when the time limit ends with no
    solution found, ValueError on malformed input.
    """
    start = time.perf_counter()
    problem.validate()
    key = _content_key(problem, options) if _SHARED is not None else None
    if key is not None and key in _SHARED.solutions:
        return _SHARED.answer(problem, _SHARED.solutions[key], start)
    red = _presolve(problem, options.presolve, options.explain)
    chosen: dict[int, int] = dict(red.fixed)
    backend_used, num_vars, num_rows = "dp", 0, 0
    optimal, bound_extra = True, 0.0
    mip_groups = list(range(len(red.groups)))
    hint_state = "none" if problem.hint is None else "not needed"
    if options.use_dp and red.memory_limit is None and red.groups:
        mip_groups = []
        for comp, edge_ids in _components(len(red.groups), red.edges):
            if len(edge_ids) == len(comp) - 1:
                for p, k in _solve_tree(red.cost, red.edges, comp, edge_ids).items():
                    chosen[red.groups[p]] = int(red.options[p][k])
            else:
                mip_groups += comp
    if mip_groups:
        keep = set(mip_groups)
        pos = {p: q for q, p in enumerate(sorted(keep))}
        sub = _Reduced(
            groups=[red.groups[p] for p in sorted(keep)],
            options=[red.options[p] for p in sorted(keep)],
            cost=[red.cost[p] for p in sorted(keep)],
            memory=[red.memory[p] for p in sorted(keep)],
            edges=[(pos[u], pos[v], m) for u, v, m in red.edges if u in keep],
            offset=0.0,
            memory_base=red.memory_base,
            memory_limit=red.memory_limit,
            fixed={},
            replaced_by=red.replaced_by,
            edge_memory=[red.edge_mem(e) for e, (u, _, _) in enumerate(red.edges) if u in keep],
        )
        assert red.memory_limit is None or len(keep) == len(red.groups), "memory row couples every group"
        backend_used = "highs" if options.backend == "auto" else options.backend
        probes = None
        if _needs_fit_proof(problem, sub):
            # no plan known to fit: first the exact least memory of each row on its own (problems without a memory
            # row, fast). Where one is over the limit nothing fits, proven without the MIP, which can take seconds
            # to show it (Llama-70B on 64 H100s without recompute: 2-13 s a problem, against 0.1-0.3 s here)
            probes = _memory_probes(problem, with_sum=False)
            if probes.lower > problem.memory_limit * (1 + _MEMORY_REL_TOL) + 1.0:
                raise _memory_infeasible(problem, options.explain, probes)
        mip = _build_mip(sub, problem.names)
        hint = _reduced_hint(problem, sub)
        if probes is not None and _fits(problem, probes.choice):  # the caller's hint does not fit (or is none)
            hint = _reduced_hint(dataclasses.replace(problem, hint=list(probes.choice)), sub)  # a start that fits
        hint_vec = mip.hint_vector(sub, hint) if hint is not None else None
        if problem.hint is not None:
            hint_state = "used" if hint is not None else "unusable"
        time_left = options.time_limit_s - (time.perf_counter() - start)
        if backend_used == "cp-sat":
            raw, _ = _run_cpsat(mip, sub, options, time_left, hint_vec)
        else:
            # the cutoff of the MIP's part: less the fixed groups' costs. Only where the MIP holds every free group
            # (a memory row couples them); without one the tree DP's components are exact and outside it
            cut = None if options.cutoff is None or red.memory_limit is None else \
                cutoff_threshold(options.cutoff) - red.offset
            raw, _ = _run_mathopt(mip, sub, backend_used, dataclasses.replace(options, cutoff=cut), time_left,
                                  hint_vec)
            if raw.relaxation and problem.hint is not None:  # (the relaxation runs only with a start)
                hint_state = "not needed"  # the relaxation, integral, needs no start
        num_vars, num_rows = mip.num_vars, len(mip.row_names)
        if raw.cutoff:
            bound = red.offset + raw.bound
            if _SOLVE_LOG is not None:
                _SOLVE_LOG.cutoffs.append((bound, options.cutoff, time.perf_counter() - start))
            raise SolverCutoff(bound, options.cutoff)
        if raw.values is None:
            if raw.infeasible:
                if sub.memory_limit is not None:
                    raise _memory_infeasible(problem, options.explain, probes)
                raise InfeasibleError(
                    "no choice satisfies the forbidden option pairs (infinite resharding costs) around "
                    f"{', '.join(problem.names[g] for g in sub.groups[:5])}; likely cause: incompatible sharding "
                    "rules on a cycle of groups; fix: allow a resharding path (finite cost) on those edges.",
                    math.inf,
                    [],
                )
            other = "cp-sat" if backend_used == "highs" else "highs"
            raise SolverTimeout(
                f"{backend_used} found no solution within {options.time_limit_s:g} s for {len(sub.groups)} groups "
                f"({num_vars} variables); raise the time limit (time_limit_s) or try backend='{other}'."
            )
        for q, g in enumerate(sub.groups):
            seg = raw.values[mip.x_start[q] : mip.x_start[q] + len(sub.cost[q])]
            chosen[g] = int(sub.options[q][int(np.argmax(seg))])
        optimal = raw.optimal
        bound_extra = raw.bound
    choice = tuple(chosen[i] for i in range(len(problem.names)))
    objective, peak = problem.evaluate(choice)
    if problem.memory_limit is not None and peak > problem.memory_limit * (1 + _MEMORY_REL_TOL) + 1.0:
        raise RuntimeError(
            f"solver returned a choice with peak {peak / _GIB:.6g} GiB above the limit "
            f"{problem.memory_limit / _GIB:.6g} GiB (numerical tolerance); report this problem."
        )
    if mip_groups:
        exact_part = objective - _objective_of(red, chosen, set(mip_groups))
        bound = min(objective, exact_part + bound_extra)
    else:
        bound = objective
    gap = (objective - bound) / max(abs(objective), _TINY)
    hint_objective = None
    if problem.hint is not None:
        hint_objective, hint_peak = problem.evaluate(problem.hint)
        if not math.isfinite(hint_objective) or (problem.memory_limit is not None
                                                 and hint_peak > problem.memory_limit * (1 + _MEMORY_REL_TOL)):
            hint_state = "infeasible"  # a forbidden pair or over the memory limit: the backend starts cold
    sol = Solution(
        choice=choice,
        status="optimal" if optimal else "feasible",
        objective=objective,
        bound=bound,
        gap=gap,
        wall_time_s=time.perf_counter() - start,
        backend=backend_used,
        num_variables=num_vars,
        num_constraints=num_rows,
        hint=hint_state,
        hint_objective=hint_objective,
        tolerance=options.relative_gap,
    )
    if _SOLVE_LOG is not None:
        _SOLVE_LOG.append(sol)
    if key is not None and optimal:
        _SHARED.solutions[key] = sol
    return sol


class SolveLog(list):
    """The ``Solution`` of every solve inside ``record_solves``; ``cutoffs``: the solves ended by their cutoff instead
    (``SolverCutoff``), as (LP bound, cutoff, seconds)."""

    def __init__(self) -> None:
        super().__init__()
        self.cutoffs: list[tuple[float, float, float]] = []


_SOLVE_LOG: SolveLog | None = None


def _content_key(problem: Problem, options: SolverOptions) -> bytes:
    """What decides a solve's answer, hashed: costs and edges, the memory model when a limit makes it count, and the
    solver options. Names, labels and the hint are left out (a hint only seeds the search)."""
    h = hashlib.sha1(repr(dataclasses.replace(options, cutoff=None)).encode())  # an optimum holds whatever cutoff
    for c in problem.node_cost:
        a = np.ascontiguousarray(c, dtype=float)
        h.update(a.shape[0].to_bytes(4, "little"))
        h.update(a.tobytes())
    for u, v, mat in problem.edges:
        a = np.ascontiguousarray(mat, dtype=float)
        h.update(np.array([u, v, *a.shape], dtype=np.int64).tobytes())
        h.update(a.tobytes())
    h.update(repr(problem.memory_limit).encode())
    if problem.memory_limit is not None:
        for i in range(len(problem.names)):
            h.update(np.ascontiguousarray(problem.memory_matrix(i)).tobytes())
        h.update(problem.base_vector().tobytes())
        for e in range(len(problem.edges)):
            em = problem.edge_memory_matrix(e)
            h.update(b"-" if em is None else np.ascontiguousarray(em).tobytes())
    return h.digest()


@dataclass
class _Shared:
    """Solutions proven optimal inside a ``share_solutions`` block, by problem content."""

    solutions: dict[bytes, Solution] = field(default_factory=dict)
    hits: int = 0

    def answer(self, problem: Problem, known: Solution, start: float) -> Solution:
        """``known`` for ``problem`` (the same costs and constraints): re-evaluated on it, hint state "reused"."""
        self.hits += 1
        objective, _ = problem.evaluate(known.choice)
        hint_objective = problem.evaluate(problem.hint)[0] if problem.hint is not None else None
        return Solution(choice=known.choice, status=known.status, objective=objective, bound=known.bound,
                        gap=known.gap, wall_time_s=time.perf_counter() - start, backend=known.backend,
                        num_variables=known.num_variables, num_constraints=known.num_constraints, hint="reused",
                        hint_objective=hint_objective, tolerance=known.tolerance)


_SHARED: _Shared | None = None


@contextmanager
def share_solutions():
    """Inside the block, ``solve`` answers a problem it has already solved to proven optimality -- the same costs,
    edges, memory rows and limit (when there is one) and options, whatever the names or hint -- with that solution
    instead of solving it again (the planner meets such twins: a 2-block graph and the whole graph it stands for
    price the same ILP). Yields the store; its ``hits`` counts the answers given so."""
    global _SHARED
    outer, _SHARED = _SHARED, _Shared()
    try:
        yield _SHARED
    finally:
        _SHARED = outer


@contextmanager
def record_solves():
    """Collect every ``Solution`` that ``solve`` returns inside the block (the planner reports their statuses and
    optimality gaps: a plan rests on many solves -- candidates, recipes, variants -- not only the one it records)."""
    global _SOLVE_LOG
    outer, _SOLVE_LOG = _SOLVE_LOG, SolveLog()
    try:
        yield _SOLVE_LOG
    finally:
        if outer is not None:
            outer.extend(_SOLVE_LOG)
            outer.cutoffs.extend(_SOLVE_LOG.cutoffs)
        _SOLVE_LOG = outer


def _objective_of(red: _Reduced, chosen: dict[int, int], positions: set[int]) -> float:
    """Reduced-problem cost of the groups at `positions` and the edges among them, for the given choice."""
    pick = {p: int(np.flatnonzero(red.options[p] == chosen[red.groups[p]])[0]) for p in positions}
    total = sum(float(red.cost[p][pick[p]]) for p in positions)
    total += sum(float(m[pick[u], pick[v]]) for u, v, m in red.edges if u in positions)
    return total
