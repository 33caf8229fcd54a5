"""Which MIP backend proves sharding problems optimal fastest? Prints a table: N, K, memory row, backend, seconds...

Synthetic problems shaped like merged sharding graphs: a chain of N groups (layers of ops) with skip edges every
few groups (residual connections), K options per group drawn from a shared placement vocabulary so that equal option
indices need no resharding (C_aa = 0) and the rest cost a tensor-size-dependent amount; ~3 % of pairs forbidden.
Options trade compute against memory (more sharding: less memory, more communication). "tight" puts the memory
limit 15 % of the way from the smallest to the largest achievable peak, so the cheapest-time plan does not fit.

Run: ``PYTHONPATH=. python benchmarks/bench_solver_backends.py`` (default under 2 minutes);
``--full`` adds N=250 with skip edges and K=12, and CP-SAT everywhere (use ``--time-limit 20`` for the table in
``autopart/solver/ilp.py``). "+pre" rows are ``backend="auto"`` with presolve and the tree DP on.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from autopart.solver import Problem, SolverOptions, solve

WIDTHS = (5, 3, 4, 7, 14, 8, 9, 8, 7)


def sharding_chain(n: int, k: int, tight: bool, seed: int = 0, skip: int | None = 3) -> Problem:
    """A chain of n groups with skip edges (i, i+skip) at every other group (none: a tree) and k options each."""
    rng = np.random.default_rng(seed)
    shard = rng.uniform(1.0, 8.0, size=k)
    flops = rng.uniform(1e-4, 1e-3, size=n)
    size = rng.uniform(1e7, 1e8, size=n)
    comm = np.log2(shard) * rng.uniform(0.5, 1.5, size=k)
    cost = [flops[i] / shard * rng.uniform(0.8, 1.2, size=k) + size[i] * 1e-11 * comm for i in range(n)]
    memory = [size[i] / shard * rng.uniform(0.9, 1.1, size=k) for i in range(n)]
    pairs = [(i, i + 1) for i in range(n - 1)] + ([(i, i + skip) for i in range(0, n - skip, 2)] if skip else [])
    edges = []
    for u, v in pairs:
        mat = size[u] * 1e-11 * rng.uniform(0.5, 2.0, size=(k, k)) * np.abs(shard[:, None] - shard[None, :] + 1)
        np.fill_diagonal(mat, 0.0)
        mat[rng.random((k, k)) < 0.03] = np.inf
        np.fill_diagonal(mat, 0.0)
        edges.append((u, v, mat))
    lo = sum(float(m.min()) for m in memory)
    hi = sum(float(m.max()) for m in memory)
    limit = lo + 0.15 * (hi - lo) if tight else None
    return Problem([f"g{i}" for i in range(n)], cost, memory, edges, memory_limit=limit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="larger shapes and CP-SAT on all of them")
    parser.add_argument("--time-limit", type=float, default=6.0)
    args = parser.parse_args()
    shapes = [(50, 4, 3), (50, 12, 3), (150, 8, 3), (250, 8, None)]
    if args.full:
        shapes += [(250, 8, 3), (250, 12, 3)]
    solve(sharding_chain(5, 2, True), SolverOptions(presolve=False))  # load the solver libraries once
    header = ("N", "K", "skip", "memory", "backend", "seconds", "status", "gap", "vars")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, WIDTHS, strict=True)))
    for n, k, skip in shapes:
        for tight in (False, True):
            problem = sharding_chain(n, k, tight, skip=skip)
            runs = [("highs", False), ("scip", False), ("cp-sat", False), ("auto", True)]
            if not args.full and n * k > 600:
                runs = [r for r in runs if r[0] != "cp-sat"]
            for backend, presolve in runs:
                options = SolverOptions(
                    backend=backend, presolve=presolve, use_dp=presolve, time_limit_s=args.time_limit
                )
                t0 = time.perf_counter()
                sol = solve(problem, options)
                seconds = time.perf_counter() - t0
                label = f"{sol.backend}+pre" if presolve else backend
                memory = "tight" if tight else "none"
                row = (
                    n,
                    k,
                    skip or "-",
                    memory,
                    label,
                    f"{seconds:.2f}",
                    sol.status,
                    f"{sol.gap:.1e}",
                    sol.num_variables,
                )
                print(" ".join(f"{c:>{w}}" for c, w in zip(row, WIDTHS, strict=True)), flush=True)


if __name__ == "__main__":
    main()
