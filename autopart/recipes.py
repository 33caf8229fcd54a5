"""The standard recipes every plan is checked against (issue 6: never worse than what practitioners run).

Each recipe is a configuration practitioners reach for first, expressed as planner options (roles per mesh axis, a
ZeRO level, a pipeline) with everything else (per-node shardings inside those roles, checkpointing, offload) left to
the same solver, so a recipe is scored under exactly the cost model the free plan is:

========================  ===========================================================================
``ddp``                   every axis data parallel (the batch split over all of them, nested in mesh order),
                          whole model states (PyTorch DDP)
``zero1``                 every axis data parallel, optimizer states sliced (distributed optimizer)
``fsdp``                  every axis data parallel, ZeRO-3 (FSDP ``fully_shard``)
``megatron``              the last (intra-node) axis tensor parallel, the others data parallel
``megatron-fsdp``         the same with ZeRO-3 on the data axes
``megatron-1f1b``         the same with 1F1B pipeline stages over the first axis (degree, micro-batches
                          and stage boundaries searched); on a 1-D mesh, stages over it, data parallel inside
========================  ===========================================================================

``score`` plans each recipe that applies to the mesh (a recipe that does not fit is reported with its reason), and
``make_plan`` returns the best of the free plan and the recipes: the free search is exact per sharding problem but
bounded by time limits, gaps and its pipeline-degree pruning, so a recipe can in principle win; when it does, the
recipe's plan is returned and ``plan.solver["recipes"]`` says so. Each recipe row gives its predicted step, memory
and the free plan's gain over it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch

RECIPES = ("ddp", "zero1", "fsdp", "megatron", "megatron-fsdp", "megatron-1f1b")


def recipe_options(name: str, axis_names: tuple[str, ...], mesh: tuple[int, ...]) -> dict[str, Any] | None:
    """PlanOptions fields of recipe ``name`` on this mesh (None when it does not apply: nothing to split)."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; recipes are {', '.join(RECIPES)}")
    n = len(axis_names)
    data = {a: "dp" for a in axis_names}
    if name == "ddp":
        return {"roles": data, "zero": 0, "pipeline": "off"}
    if name == "zero1":
        return {"roles": data, "zero": 1, "pipeline": "off"}
    if name == "fsdp":
        return {"roles": data, "zero": 3, "pipeline": "off"}
    if name == "megatron-1f1b":
        roles = {a: ("tp" if i == n - 1 and n > 1 else "dp") for i, a in enumerate(axis_names)}
        if mesh[0] < 2:
            return None
        return {"roles": roles, "zero": 0, "pipeline": {"axis": axis_names[0], "schedule": "1f1b"}}
    roles = {a: ("tp" if i == n - 1 else "dp") for i, a in enumerate(axis_names)}
    if n == 1 and name == "megatron-fsdp":
        return None  # nothing left for data parallelism
    if n == 1:  # no data-parallel axis to set a ZeRO level on (``zero=`` needs one)
        return {"roles": roles, "pipeline": "off"}
    return {"roles": roles, "zero": 3 if name == "megatron-fsdp" else 0, "pipeline": "off"}


def whole_states_bytes(traced) -> float:
    """Bytes of every parameter and of the gradient of every trainable one, unsharded: what each device holds at
    the end of backward under a recipe that keeps parameters whole on every device (DDP, ZeRO-1), whatever
    checkpointing or offload (which moves optimizer states, not parameters or gradients) it is given."""
    total = 0.0
    for node in traced.graph.find_nodes(op="placeholder"):
        if node.name not in traced.params or node.name in traced.tied:
            continue
        val = node.meta["val"]
        nbytes = val.numel() * val.element_size()
        total += nbytes * (2 if val.dtype.is_floating_point and traced.params[node.name] not in traced.frozen else 1)
    return total


def score(traced, cluster, axis_names: tuple[str, ...], opts, plan_fn, reduced=None,
          pipelined: bool | None = None) -> list[dict]:
    """Plan every applicable recipe with ``plan_fn(traced, cluster, axis_names, opts)``; one row per recipe
    (``pipelined``: only the recipes with (True) or without (False) pipeline stages; None: all).

    ``reduced`` (``pipelining.reduce_blocks``: a 2-block graph and the block count): recipes without stages are
    solved on it, as the pipeline search ranks its candidates (the same ILP, tied blocks priced L times: its
    objective and memory rows are the whole graph's); such a row's step is that objective (``"scored_on"``) and
    carries the options to solve it again on the whole graph (``"options"``), which ``make_plan`` does when the
    recipe might beat the search, and the 2-block plan that warm-starts that solve and the search
    (``"warm_plan"``). A pipelined recipe ranks its candidates on the reduction as the search does and is scored
    by the winner as ranked (``PlanOptions.rank_only``: the pipeline model over the expanded blocks), carrying its
    options the same way: its stage plan is solved on the whole graph only where it might win. DDP and ZeRO-1
    keep parameters and gradients whole on every device: when those alone exceed the memory budget
    (``whole_states_bytes``) the recipe is reported as not fitting without a solve."""
    from autopart.plan import _fmt_bytes

    rows = []
    trainable = any(fqn not in traced.frozen for fqn in traced.params.values())
    limit = opts.memory_limit if opts.memory_limit is not None else cluster.memory_budget
    whole = None
    # the batch sizes of the inputs (dim 0): data parallelism over every device needs one that splits evenly
    batches = [int(n.meta["val"].shape[0]) for n in traced.graph.find_nodes(op="placeholder")
               if n.name in traced.user_inputs and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim()]
    ways = math.prod(cluster.mesh_shape)
    for name in RECIPES:
        kw = recipe_options(name, axis_names, cluster.mesh_shape)
        if kw is None or (name == "zero1" and not trainable):  # no optimizer state to slice in inference
            continue
        if pipelined is not None and (kw["pipeline"] != "off") != pipelined:
            continue
        if name in ("ddp", "zero1", "fsdp") and batches and not any(b % ways == 0 and b >= ways for b in batches):
            rows.append({"recipe": name, "fits": False, "plan_s": 0.0,
                         "why": f"not planned: a batch of {max(batches)} does not split over {ways} devices"})
            continue
        t0 = time.perf_counter()
        row: dict[str, Any] = {"recipe": name}
        # the recipe's roles are the recipe's, not the user's: no role warnings from its plans
        o = dataclasses.replace(opts, recipes=False, explain_infeasible=False, role_warnings=False, **kw)
        if name in ("ddp", "zero1"):
            whole = whole_states_bytes(traced) if whole is None else whole
            if whole > limit:
                row.update(fits=False, plan_s=time.perf_counter() - t0,
                           why=f"parameters and gradients, whole on every device, are {_fmt_bytes(whole)} per device "
                               f"alone, over the {_fmt_bytes(limit)} budget (bound, not solved)")
                rows.append(row)
                continue
        try:
            if reduced is not None and kw["pipeline"] == "off":
                p = plan_fn(reduced[0], cluster, axis_names, dataclasses.replace(o, virtual_layers=reduced[1]))
                row["options"] = o
                row["scored_on"] = f"2 of {reduced[1]} blocks (solver objective)"
                row["warm_plan"] = p
                row["by_objective"] = True  # its step is an ILP objective (``planner.OBJECTIVE_OVER_RECORD``)
            elif reduced is not None:  # pipelined: its candidates ranked on the reduction, the winner as ranked
                from autopart.pipelining import AS_RANKED

                p = plan_fn(traced, cluster, axis_names, dataclasses.replace(o, rank_only=True))
                if p.pipeline and p.pipeline.get("candidates_ranked_on", "").endswith(AS_RANKED):
                    row["options"] = o
                    row["scored_on"] = f"2 of {reduced[1]} blocks (pipeline ranking)"
                    row["warm_plan"] = None
            else:
                p = plan_fn(traced, cluster, axis_names, o)
        except ValueError as e:
            row.update(fits=False, why=str(e).splitlines()[0][:300])
        else:
            step = p.solver["objective"] if row.get("by_objective") else p.predicted["step_time_s"]
            pp = p.pipeline
            row.update(fits=True, step_time_s=step, memory_bytes=p.predicted["memory_bytes"]["total"],
                       checkpoint=sorted(set(p.checkpoint.values())),
                       pipeline=f"pp={pp['degree']} m={pp['micro_batches']} {pp['schedule']}" if pp else "")
            if "scored_on" not in row:
                row["plan"] = p
        row["plan_s"] = time.perf_counter() - t0
        rows.append(row)
    return rows


def report(rows: list[dict], chosen_step: float, chosen_from: str) -> list[dict]:
    """JSON-able rows for ``plan.solver["recipes"]``: the plan's predicted gain over each recipe."""
    out = []
    for r in rows:
        r = {k: v for k, v in r.items() if k not in ("plan", "options", "warm_plan", "by_objective")}
        if r.get("fits"):
            r["gain"] = r["step_time_s"] / chosen_step - 1.0
        r["chosen"] = r["recipe"] == chosen_from
        out.append(r)
    return out


def table(rows: list[dict]) -> str:
    """The recipes section of ``print(plan)``."""
    from autopart.plan import _fmt_bytes, _fmt_time
    from autopart.planner import OBJECTIVE_OVER_RECORD

    lines = ["standard recipes under the same cost model (the plan's predicted gain over each; ~ = scored on the "
             f"2-block graph: the solver's objective, up to {OBJECTIVE_OVER_RECORD:g}x the step it records, or a "
             "pipeline's ranking):"]
    for r in rows:
        if r.get("fits"):
            extra = ", ".join(x for x in (r.get("pipeline"), "recompute " + "/".join(r["checkpoint"])
                                          if r.get("checkpoint") else "") if x)
            approx = "~" if r.get("scored_on") else " "  # scored on the 2-block graph (objective or ranking)
            lines.append(f"  {r['recipe']:<14}{approx}{_fmt_time(r['step_time_s']):>10}  "
                         f"{_fmt_bytes(r['memory_bytes']):>10}"
                         f"  {r['gain']:+7.1%}{'  (chosen)' if r.get('chosen') else ''}{'  ' + extra if extra else ''}")
        else:
            lines.append(f"  {r['recipe']:<14} " + (r["why"][:110] if r["why"].startswith("not planned")
                                                     else f"does not fit: {r['why'][:100]}"))
    return "\n".join(lines)
