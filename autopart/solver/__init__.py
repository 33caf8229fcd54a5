"""What we choose: one sharding option per group, minimising time within a memory budget (see `ilp`)."""

from autopart.solver.ilp import InfeasibleError, Problem, Solution, SolverCutoff, SolverOptions, solve

__all__ = ["InfeasibleError", "Problem", "Solution", "SolverCutoff", "SolverOptions", "solve"]
