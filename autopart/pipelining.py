r"""Pipeline parallelism as a planner decision: Alpa's nesting of an ILP inside a DP over layers.

For each candidate pipeline axis and degree :math:`p` (a mesh axis not pinned to another role, split into
:math:`p` stages, pipeline outermost: rank ``i`` of that axis is stage ``i // (n/p)``), the sharding ILP prices
and solves the model on the *stage mesh* (the world mesh with that axis divided by :math:`p`). Its solution gives
per transformer block (the embedding folded into the first block, the head and loss into the last):

* ``time``: forward + backward of the block's nodes (compute, internal and output collectives) and the
  conversions on edges into it -- proportional to the micro-batch size; conversions of *parameters* (ZeRO
  gathers) are per micro-batch whatever its size;
* ``act``: bytes saved for backward (proportional to the micro-batch), and what full recompute keeps (the block's
  output);
* ``states``: parameters, gradients (they accumulate over the micro-batches) and optimizer states;
* ``reduce``: the data-parallel gradient reduction (once per step; as the runtime runs it, launched from the last
  micro-batch's backward, ``runtime.grads.OVERLAP_IN_PIPELINE``, except for a parameter several blocks use, which
  the stages holding it sum first, after the schedule; the critical path over the ranks,
  ``solver.pipeline.reduction_tail``), and
  ZeRO-1's parameter all-gather after the optimizer step (once per step, in flat buckets, each parameter charged its
  bandwidth and its share of a bucket's latency; behind the first micro-batch's forward where the device overlaps
  communication, ``solver.pipeline.gather_exposed``);
* the bytes of every value crossing each block boundary (what a stage sends: activations, and inputs such as
  labels or rotary tables that later stages use).

The ILP ran at the traced batch :math:`B`; a micro-batch of :math:`b = B/m` scales the proportional terms by
:math:`1/m`. ``autopart.solver.pipeline.partition`` then chooses the stage boundaries and per-block
checkpointing exactly for each micro-batch count and schedule (GPipe, 1F1B, interleaved 1F1B with 2 chunks per
rank), memory per stage under that schedule's activations in flight, and the step time with the bubble
(``solver/pipeline.py``). The step adds the slowest rank's exposed gradient reduction. The fastest candidate wins over
the plan without pipeline (``p = 1``) only if faster, or if that plan does not fit.

Approximation, stated: the per-node shardings are the ILP's at the traced batch on the stage mesh, scaled to the
micro-batch; ``parallelize`` re-solves the shardings at the micro-batch size (parameters pinned) for the program it
runs, so the executed program is exact and the plan's prediction is the scaled one.

Search cost: candidates are ranked on ``reduce_blocks`` (2 of the L identical blocks, tied groups priced L times:
the same ILP, tested equal), the winner re-solved on the whole graph. Per degree the stage mesh is solved with the
Megatron recipe inside it (last axis tp, others dp: quick, and its batch split is what micro-batches need) and,
for the ``FREE_DEGREES`` best degrees of that ranking, with free shardings.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopart.cost import Cluster, collective_time
from autopart.placement import Shard, parse_spec
from autopart.planner import _local_bytes, fixed_op_s, grad_reduction_share, reduce_scale
from autopart.runtime.grads import (
    OVERLAP_IN_PIPELINE,  # pipelines reduce from the last micro-batch's backward
    bucket_limit,
)
from autopart.solver.pipeline import (
    SCHEDULES,
    CoreSharing,
    LayerCost,
    StageMemoryError,
    best_pipeline,
    gather_exposed,
    reduction_tail,
    schedule_step_time,
    stage_peak,
)
from autopart.trace import Traced


@dataclass
class Unit:
    """One block of the model (the pipeline's unit of assignment), at the traced batch."""

    name: str
    time_s: float = 0.0  # proportional to the micro-batch
    fixed_s: float = 0.0  # per micro-batch, independent of its size (parameter gathers)
    # the least time_s a micro-batch takes whatever its size: its ops' parameters read (and, training, their
    # gradients written) at the memory bandwidth (a decoding step reads every weight; planner's param_read_s)
    floor_s: float = 0.0
    # the part of time_s of the nodes that read parameters (whose floor_s it is): only they keep a floor, the
    # rest (attention over the K/V cache, norms) shrinks with the micro-batch. None: all of time_s
    floored_s: float | None = None
    fwd_s: float = 0.0  # forward compute of the recomputable nodes (what full recompute costs)
    act_bytes: float = 0.0
    ckpt_act_bytes: float = 0.0  # kept under full recompute (the block's input/output)
    state_bytes: float = 0.0  # parameters + optimizer states (+ gathered copies) + the decoding state (``kv_bytes``)
    # serving: what decoding keeps of every sequence of the batch at the block's nodes, the attentions' K/V cache
    # and a state-space layer's recurrent state (``planner.kv_cache_bytes``). Resident like the weights, whatever
    # the micro-batch count and however many are in flight: each micro-batch's sequences keep it on the stage
    # between decoding steps (in ``state_bytes``, not ``act_bytes``)
    kv_bytes: float = 0.0
    grad_bytes: float = 0.0
    # allocated once (the loss's temporaries as backward starts; forward-only, its largest op's working set)
    transient_bytes: float = 0.0
    reduce_s: float = 0.0  # data-parallel gradient reduction, once per step
    late_s: float = 0.0  # the same, of parameters other blocks use too: after the schedule and the stages' sum
    gather_s: float = 0.0  # ZeRO-1/2 parameter all-gather after the optimizer step (bucketed), once per step
    step_s: float = 0.0  # the optimizer step of its parameters, once per step
    out_bytes: float = 0.0  # bytes crossing the boundary after this unit (sent to the next stage)
    checkpointable: bool = False
    full: bool = False  # full recompute forced by the user (a per-layer checkpoint dict): priced in, not a choice
    # the same, counting only nodes of the block itself (not the embedding or head folded into it)
    block_time_s: float = 0.0
    block_fixed_s: float = 0.0
    block_floor_s: float = 0.0
    block_floored_s: float = 0.0
    block_fwd_s: float = 0.0
    block_act_bytes: float = 0.0
    block_ckpt_bytes: float = 0.0
    block_state_bytes: float = 0.0
    block_kv_bytes: float = 0.0
    block_grad_bytes: float = 0.0
    block_transient_bytes: float = 0.0
    block_reduce_s: float = 0.0
    block_late_s: float = 0.0
    block_gather_s: float = 0.0
    block_step_s: float = 0.0

    def cost(self, m: int) -> LayerCost:
        rec = self.ckpt_act_bytes / m if self.checkpointable and self.ckpt_act_bytes < self.act_bytes else None
        # a micro-batch's nodes that read parameters take at least the read, the others their share: a decoding
        # micro-batch reads every weight of the block, and its own sequences' K/V cache (not the floor's max of
        # the two, which hid the cache's read under the weights')
        floored = self.time_s if self.floored_s is None else min(self.floored_s, self.time_s)
        t = (self.time_s - floored) / m + max(floored / m, min(self.floor_s, floored)) + self.fixed_s
        fwd = min(self.fwd_s / m, t)
        if self.full:  # recomputed whatever the partition: keeps its input, runs its forward again in backward
            return LayerCost(fwd_s=fwd, bwd_s=t, act_bytes=min(self.ckpt_act_bytes, self.act_bytes) / m,
                             state_bytes=self.state_bytes + self.grad_bytes, recompute_act_bytes=None,
                             grad_bytes=self.grad_bytes, transient_bytes=self.transient_bytes / m)
        return LayerCost(fwd_s=fwd, bwd_s=t - fwd, act_bytes=self.act_bytes / m,
                         state_bytes=self.state_bytes + self.grad_bytes, recompute_act_bytes=rec,
                         grad_bytes=self.grad_bytes, transient_bytes=self.transient_bytes / m)


def _whole_grad_bytes(rec: dict) -> float:
    """A parameter's whole local gradient from its plan record: ``grad_whole_bytes`` under ZeRO-2 (whose
    ``grad_bytes`` is the slice kept after the step), else ``grad_bytes``."""
    return rec.get("grad_whole_bytes", rec.get("grad_bytes", 0.0))


def block_units(plan, traced: Traced, mesh: tuple[int, ...], cluster: Cluster) -> tuple[list[Unit], dict[str, int]]:
    """Per-block costs of a (stage-mesh) sharding plan, and the unit index of every planned node.

    Nodes outside any block go to the first block if they come before it in the graph (embedding, rotary tables),
    else to the block before them (head, loss after the last). Parameters go to the block of their first user
    and are *also* held by every other block using them (a tied embedding/head: both end stages hold a copy)."""
    nodes = plan.nodes
    order = [n for n in traced.graph.nodes if n.name in nodes]
    layers: list[str] = []
    for n in order:
        lay = nodes[n.name]["layer"]
        if lay and nodes[n.name]["op"] != "param" and lay not in layers:
            layers.append(lay)
    if len(layers) < 2:
        raise ValueError(f"pipeline parallelism needs repeated blocks to split between stages; the graph has "
                         f"{len(layers)} block(s) ({layers}): use pipeline='off'")
    index = {lay: i for i, lay in enumerate(layers)}
    units = [Unit(lay, floored_s=0.0) for lay in layers]
    unit_of: dict[str, int] = {}
    cur = 0
    for n in order:
        rec = nodes[n.name]
        if rec["op"] in ("param", "buffer", "constant", "input"):
            continue
        lay = rec["layer"]
        cur = index[lay] if lay in index else cur
        unit_of[n.name] = cur
    users_units: dict[str, list[int]] = defaultdict(list)
    for n in order:
        if n.name in unit_of:
            for a in n.all_input_nodes:
                users_units[a.name].append(unit_of[n.name])
    for n in order:  # placeholders: parameters with their users; inputs enter at stage 0
        if n.name in unit_of:
            continue
        us = sorted(set(users_units.get(n.name, [])))
        unit_of[n.name] = us[0] if us and nodes[n.name]["op"] != "input" else 0
        if nodes[n.name]["op"] == "param":
            # ZeRO-1/2's all-gather after the step: its bandwidth (``gather_s``) and its share of its bucket's
            # latency (``gather_latency_s``, ``planner.zero1_latency_shares``: buckets filled over the whole model
            # in the runtime's order; a stage's first and last may be split by a boundary, not counted)
            gather = nodes[n.name].get("gather_s", 0.0) + nodes[n.name].get("gather_latency_s", 0.0)
            for u in us or [0]:
                own = nodes[n.name]["layer"] == units[u].name
                units[u].gather_s += gather
                units[u].block_gather_s += gather * own
                step = nodes[n.name].get("optimizer_step_s", 0.0)  # every stage holding it steps its copy
                units[u].step_s += step
                units[u].block_step_s += step * own
                # the runtime's work per parameter (its compute_s: Device.param_latency), once per micro-batch
                units[u].fixed_s += nodes[n.name]["compute_s"]
                units[u].block_fixed_s += nodes[n.name]["compute_s"] * own
                units[u].state_bytes += nodes[n.name]["memory_bytes"]
                # held whole until the parameter's last accumulation, ZeRO-2's too: the runtime reduce-scatters it
                # into the slice from there (runtime/grads.py), while every stage peaks before
                grads = _whole_grad_bytes(nodes[n.name])
                units[u].grad_bytes += grads
                units[u].block_state_bytes += nodes[n.name]["memory_bytes"] * own
                units[u].block_grad_bytes += grads * own
    for n in order:
        rec = nodes[n.name]
        if rec["op"] in ("param", "buffer", "constant", "input"):
            if rec["op"] in ("buffer", "constant"):
                units[unit_of[n.name]].state_bytes += rec["memory_bytes"]
            continue
        u = units[unit_of[n.name]]
        own = rec["layer"] == u.name
        tr = rec.get("transient_bytes", 0.0)
        work = rec.get("working_bytes", 0.0)  # forward-only: the op's inputs and outputs while it runs
        kv = rec.get("kv_cache_bytes", 0.0)
        kept = rec["memory_bytes"] - tr - kv
        u.kv_bytes += kv
        u.state_bytes += kv
        u.block_kv_bytes += kv * own
        u.block_state_bytes += kv * own
        lat = fixed_op_s(rec, cluster.device)  # paid by every micro-batch, not split between them
        u.time_s += rec["time_s"] - lat
        u.fixed_s += lat
        u.block_fixed_s += lat * own
        u.act_bytes += kept
        u.transient_bytes = max(u.transient_bytes + tr, work)
        u.state_bytes += rec.get("output_bytes", 0.0)  # forward-only: the outputs of every micro-batch, held
        u.block_time_s += (rec["time_s"] - lat) * own
        u.floor_s += rec.get("param_read_s", 0.0)
        u.block_floor_s += rec.get("param_read_s", 0.0) * own
        if rec.get("param_read_s", 0.0) > 0:
            u.floored_s += rec["time_s"] - lat
            u.block_floored_s += (rec["time_s"] - lat) * own
        u.block_act_bytes += kept * own
        u.block_transient_bytes = max(u.block_transient_bytes + tr * own, work * own)
        if rec["region"] in ("layer", "attention"):
            u.fwd_s += rec["fwd_s"]
            u.block_fwd_s += rec["fwd_s"] * own
            u.checkpointable = True
            keep = rec.get("keep_bytes", 0.0)  # full recompute keeps the block's input
            u.ckpt_act_bytes += keep
            u.block_ckpt_bytes += keep * own
        else:
            u.ckpt_act_bytes += kept
            u.block_ckpt_bytes += kept * own
    for c in plan.collectives:
        if c["user"] not in unit_of:
            continue
        u = units[unit_of[c["user"]]]
        own = nodes.get(c["user"], {}).get("layer") == u.name
        if nodes.get(c["value"], {}).get("op") == "param":
            u.fixed_s += c["time_s"]
            u.block_fixed_s += c["time_s"] * own
        else:  # on activations: the bytes scale with the micro-batch, the latency is paid by each
            lat = c.get("latency_s", 0.0)
            u.time_s += c["time_s"] - lat
            u.block_time_s += (c["time_s"] - lat) * own
            u.fixed_s += lat
            u.block_fixed_s += lat * own
    fqn_node = {fqn: ph for ph, fqn in traced.params.items()}
    by_name = {n.name: n for n in order}
    for fqn, axes in plan.reduced.items():
        ph = fqn_node.get(fqn)
        if ph is None or ph not in unit_of:
            continue
        val = by_name[ph].meta.get("val") if ph in by_name else None
        # summed in the reduce dtype (grad_bytes are in the gradients' own, PlanOptions.grad_dtype); ZeRO-2's
        # reduce-scatter moves the whole gradient, not the slice it keeps
        nbytes = _whole_grad_bytes(nodes[ph]) * (
            reduce_scale(val.dtype, plan.options.get("reduce_dtype"))
            / reduce_scale(val.dtype, plan.options.get("grad_dtype")) if val is not None else 1.0)
        # its share of the runtime's bucket, not a collective of its own: per-parameter latencies priced pp2xdp2's
        # gradient reduction at 6x the sharding plan's. One several blocks use (a tied embedding and head, on the
        # first and the last stage) is reduced after the schedule, once those stages summed it
        # (``runtime.pipeline.PipelinedModule.reduce_gradients``)
        t = grad_reduction_share(nbytes, axes, plan.zero.get(fqn) in (1, 2), cluster,
                                 bucket_limit(axes, plan.options.get("bucket_bytes", {})))
        us = sorted(set(users_units.get(ph, [])) or {0})
        for u in us:
            own = nodes[ph]["layer"] == units[u].name
            if len(us) > 1:
                units[u].late_s += t
                units[u].block_late_s += t * own
            else:
                units[u].reduce_s += t
                units[u].block_reduce_s += t * own
    # bytes crossing each boundary: a value made in unit u and last used in unit w crosses boundaries u..w-1
    node_of = {n.name: n for n in order}
    for name, us in users_units.items():
        rec = nodes.get(name)
        if rec is None or rec["op"] in ("param", "buffer", "constant"):
            continue
        src = unit_of[name]
        last = max(us)
        if last <= src:
            continue
        val = node_of[name].meta.get("val")
        out = rec["output"]
        if not isinstance(val, torch.Tensor) or not isinstance(out, str):
            continue
        nbytes = _local_bytes(val, parse_spec(out), mesh)
        for k in range(src, last):
            units[k].out_bytes += nbytes
    return units, unit_of


_REDUCED: dict = {}


def reduce_blocks(traced: Traced, keep: int = 2, pins: dict | None = None) -> tuple[Traced, int] | None:
    """``_reduce_blocks`` memoised for the last few graphs: one reduction serves the search, its candidates and the
    recipes, so the solves on it share one graph (and ``planner._Session`` finds them by it). None where ``pins``
    (``PlanOptions.pins``) name a node or parameter of a block: the kept blocks stand for every block alike, and
    a dropped block's names are not in the reduced graph (a pin on ``blocks.3`` was refused as no such name)."""
    import weakref

    if pins and _pins_a_block(traced, pins):
        return None
    key = (id(traced.gm), keep)
    hit = _REDUCED.get(key)
    if hit is None or hit[0]() is not traced.gm:  # the same object, not a new one at a reused address
        hit = (weakref.ref(traced.gm), _reduce_blocks(traced, keep))
        if len(_REDUCED) >= 4:
            _REDUCED.pop(next(iter(_REDUCED)))
        _REDUCED[key] = hit
    return hit[1]


def _pins_a_block(traced: Traced, pins: dict) -> bool:
    """Whether a pin names (by node name, parameter FQN or a tied alias) a node or parameter inside a block, or
    nothing in the graph (refused by the whole graph's names, whose suggestions include every block's)."""
    from autopart.planner import _layer_of, pin_names

    by_name = {n.name: n for n in traced.graph.nodes}
    names = pin_names(traced)
    return any(n not in by_name or _layer_of(by_name[n], traced) for n in (names.get(k, k) for k in pins))


def _reduce_blocks(traced: Traced, keep: int = 2) -> tuple[Traced, int] | None:
    """The graph with only its first ``keep`` of L identical consecutive blocks (users of a dropped block's nodes
    read the same node of the last kept block), and L; None when the graph is not that shape. Solved with
    ``PlanOptions.virtual_layers = L``, its tied groups are priced as L blocks: the sharding problem of the whole
    model at a fraction of the size (the pipeline search ranks its candidates on it)."""
    from autopart.planner import _layer_of

    nodes = list(traced.graph.nodes)
    layer = {n: _layer_of(n, traced) for n in nodes}
    order: list[str] = []
    per: dict[str, list[fx.Node]] = defaultdict(list)
    for n in nodes:
        if n.op == "call_function" and layer[n]:
            if layer[n] not in per:
                order.append(layer[n])
            per[layer[n]].append(n)
    if len(order) <= keep or len({lay.rsplit(".", 1)[0] for lay in order}) != 1:
        return None

    def sig(n: fx.Node):
        v = n.meta.get("val")
        return (str(n.target), tuple(v.shape) if isinstance(v, torch.Tensor) else None)

    ref = [sig(n) for n in per[order[0]]]
    if any([sig(n) for n in per[lay]] != ref for lay in order[1:]):
        return None
    first = nodes.index(per[order[0]][0])
    last = nodes.index(per[order[-1]][-1])
    if any(n.op == "call_function" and not layer[n] for n in nodes[first:last + 1]):
        return None  # something between the blocks: keep the whole graph
    dropped = set(order[keep:])
    counterpart = {}
    for lay in dropped:
        for j, n in enumerate(per[lay]):
            counterpart[n] = per[order[keep - 1]][j]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    kept_ph = set()
    for n in nodes:
        if layer[n] in dropped:
            continue
        env[n] = g.node_copy(n, lambda a: env[counterpart.get(a, a)])
        if n.op == "placeholder":
            kept_ph.add(n.name)
    gm = fx.GraphModule(traced.gm, g)
    red = dataclasses.replace(
        traced, gm=gm, params={k: v for k, v in traced.params.items() if k in kept_ph},
        buffers={k: v for k, v in traced.buffers.items() if k in kept_ph},
        constants={k: v for k, v in traced.constants.items() if k in kept_ph},
        tied={k: v for k, v in traced.tied.items() if k in kept_ph},
        constant_values={k: v for k, v in traced.constant_values.items() if k in kept_ph},
        fingerprint=traced.fingerprint + f"-{keep}of{len(order)}")
    return red, len(order)


def expand_units(units: list[Unit], n_blocks: int) -> list[Unit]:
    """Units of a 2-block reduction -> the model's ``n_blocks``: the first keeps the embedding, the last the head;
    the blocks between are the second block without the head (its own nodes only)."""
    first, second = units
    inner = dataclasses.replace(second, name="", time_s=second.block_time_s, fixed_s=second.block_fixed_s,
                                floor_s=second.block_floor_s, floored_s=second.block_floored_s,
                                fwd_s=second.block_fwd_s, act_bytes=second.block_act_bytes,
                                ckpt_act_bytes=second.block_ckpt_bytes, out_bytes=first.out_bytes,
                                state_bytes=second.block_state_bytes, kv_bytes=second.block_kv_bytes,
                                grad_bytes=second.block_grad_bytes,
                                transient_bytes=second.block_transient_bytes, reduce_s=second.block_reduce_s,
                                late_s=second.block_late_s, gather_s=second.block_gather_s,
                                step_s=second.block_step_s)
    out = [first]
    for i in range(1, n_blocks - 1):
        out.append(dataclasses.replace(inner, name=f"{first.name.rsplit('.', 1)[0]}.{i}"))
    out.append(dataclasses.replace(second, name=f"{first.name.rsplit('.', 1)[0]}.{n_blocks - 1}"))
    return out


def stage_of_units(boundaries: list[int], n_units: int) -> list[int]:
    """Chunk index of every unit from the partition's start indices."""
    out = []
    ends = list(boundaries[1:]) + [n_units]
    for c, (i, j) in enumerate(zip(boundaries, ends)):
        out += [c] * (j - i)
    return out


# the search's winner solved again for its micro-batch count (``PlanOptions.latency_passes``): False, the stage
# shardings priced at the traced batch alone (the tests compare the two)
REFINE_PASSES = True
FREE_DEGREES = 1  # pipeline degrees (best by the Megatron recipe inside stages) also solved with free stage shardings


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Candidate:
    axis: int
    degree: int
    plan: object  # the stage-mesh sharding Plan
    units: list[Unit]
    pipe: object  # PipelinePlan
    step_s: float
    reduce_s: float
    batch: int
    micro_batch_size: int
    key: tuple = ()  # how it was found: (stage cluster, stage mesh, axis, p, recipe, memory limit of the ILP)
    ranked_on: str = "full graph"


# how ``Candidate.ranked_on`` (the plan's ``pipeline["candidates_ranked_on"]``) ends for a winner returned as ranked on
# the 2-block graph (``PlanOptions.rank_only``)
AS_RANKED = "not re-solved on the whole graph"


def _batch_of(traced: Traced) -> int:
    for name in traced.user_inputs:
        node = next(n for n in traced.graph.nodes if n.name == name)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() > 0:
            return int(val.shape[0])
    raise ValueError("pipeline parallelism splits the batch (dim 0 of the inputs) into micro-batches, but the "
                     "traced inputs have no tensor with a batch dimension")


def _batch_shards(plan, traced: Traced, mesh) -> int:
    """How many ways a stage splits the batch: the product of ``batch_axes``. A micro-batch must still split that
    many ways."""
    return math.prod(mesh[i] for i in batch_axes(plan, traced))


def batch_axes(plan, traced: Traced) -> set[int]:
    """The mesh axes on which a plan splits the batch: those on which the inputs or any activation is sharded on
    its batch dimension (dim 0 of the batch's size, batch-first models). A batch x sequence flattened into dim 0
    (the tokens of a linear under sequence parallelism, reduce-scattered there by a collective matmul) splits with
    the sequence, whatever the micro-batch: it does not count. Nor does a tensor that no input flows into (a RoPE
    table of the sequence's length, [seq, head_dim]: sharded by sequence on a tensor axis, and as long as the batch
    when seq == batch, e.g. 4096 sequences of 4096 tokens)."""
    batch_sized = _batch_sized(traced)
    axes: set[int] = set()
    for name, sized in batch_sized.items():
        rec = plan.nodes.get(name)
        if rec is None or rec["op"] in ("param", "buffer", "constant"):
            continue
        outs = rec["output"] if isinstance(rec["output"], list) else [rec["output"]]
        for out, ok in zip(outs, sized if len(sized) == len(outs) else sized * len(outs)):
            if ok and "S(0)" in out:  # (a spec string: the quick test before parsing it)
                for i, p in enumerate(parse_spec(out)):
                    if isinstance(p, Shard) and p.dim == 0:
                        axes.add(i)
    return axes


_BATCH_SIZED: dict[int, tuple] = {}


def _batch_sized(traced: Traced) -> dict[str, list[bool]]:
    """Of every node an input flows into: per output, whether dim 0 may be the batch (a tensor whose dim 0 is the
    batch's size, or not a tensor); {} without a batch dimension. Per traced graph, computed once."""
    hit = _BATCH_SIZED.get(id(traced))
    if hit is not None and hit[0] is traced:
        return hit[1]
    try:
        batch = _batch_of(traced)
    except ValueError:
        batch = None
    out: dict[str, list[bool]] = {}
    if batch is not None:
        from_inputs = set(traced.user_inputs)
        for n in traced.graph.nodes:
            if n.name not in from_inputs and not any(a.name in from_inputs for a in n.all_input_nodes):
                continue
            from_inputs.add(n.name)
            val = n.meta.get("val")
            vs = list(val) if isinstance(val, (list, tuple)) else [val]
            out[n.name] = [not (isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] != batch) for v in vs]
    if len(_BATCH_SIZED) > 16:
        _BATCH_SIZED.clear()
    _BATCH_SIZED[id(traced)] = (traced, out)
    return out


def _schedules(forced: dict) -> list:
    if "schedule" in forced:
        s = forced["schedule"]
        if s not in SCHEDULES:
            raise ValueError(f"pipeline schedule {s!r} is not one of {SCHEDULES}")
        return [(s, int(forced.get("virtual", 2))) if s == "interleaved" else s]
    if int(forced.get("virtual", 1)) > 1:  # chunks per rank given: the interleaved schedule's
        return [("interleaved", int(forced["virtual"]))]
    return ["gpipe", "1f1b", ("interleaved", 2)]


def search(traced: Traced, cluster: Cluster, axis_names: tuple[str, ...], opts, solve_stage, limit: float,
           forced: dict, allow_checkpoint: bool | dict[str, str] = True
           ) -> tuple[Candidate | None, list[dict], list[str]]:
    """Best pipelined candidate over axes x degrees x micro-batches x schedules (None if none fits).
    ``allow_checkpoint``: True, the partition's DP chooses each block's full recompute; False, none; a dict (block
    name -> "full" / "none"), the user's per-layer choice: those blocks recomputed, the others not."""
    mesh = cluster.mesh_shape
    roles = {axis_names.index(a): r for a, r in opts.roles.items()}
    pp_axes = [i for i, r in roles.items() if r == "pp"]
    if "axis" in forced:
        if forced["axis"] not in axis_names:
            raise ValueError(f"pipeline axis {forced['axis']!r} is not a mesh axis {axis_names}")
        axes = [axis_names.index(forced["axis"])]
    elif pp_axes:
        axes = pp_axes
    else:  # unpinned axes (pipeline={"axis": ...} splits a pinned data-parallel axis: stages stay dp inside)
        axes = [i for i in range(len(mesh)) if i not in roles and mesh[i] > 1]
    batch = _batch_of(traced)
    tried, errors = [], []
    best: Candidate | None = None

    def schedules_for(units, p, m):
        # interleaved: 2 chunks per rank need 2p blocks; torch's ScheduleInterleaved1F1B runs m micro-batches in
        # rounds of max(1, m // p) and needs m to be a multiple of that. 1F1B: torch's Schedule1F1B needs m >= p
        # (with fewer, every forward fits in its warm-up: it runs as GPipe, which has no such bound)
        rounds = max(1, m // p)
        return [s for s in _schedules(forced) if s == "gpipe" or (s == "1f1b" and m >= p) or
                (s not in ("gpipe", "1f1b") and len(units) >= 2 * p and m % rounds == 0)]

    def best_over_m(units, sub, stage_mesh, axis, p, mem_limit, log):
        f = _batch_shards(sub, traced, stage_mesh)
        ms = [m for m in _divisors(batch) if (batch // m) % f == 0]
        if "micro_batches" in forced:
            ms = [m for m in ms if m == int(forced["micro_batches"])]
            if not ms:
                errors.append(f"p={p}: {forced['micro_batches']} micro-batches do not split batch {batch} "
                              f"into parts divisible by the {f} ranks a stage splits activations over")
        found = None
        # decoding (forward only, a K/V cache held between steps) is served continuously: priced kept full
        steady = bool(opts.kv_cache_tokens) and not any(u.grad_bytes for u in units)
        dev = cluster.device  # ranks sharing a host's cores compute faster in the fill and drain
        sharing = CoreSharing(math.prod(stage_mesh), dev.host_ranks, dev.alone_speedup) \
            if dev.alone_speedup > 1 and dev.host_ranks > 1 else None
        for m in ms:
            layer_costs = [u.cost(m) for u in units]
            send = max(u.out_bytes for u in units[:-1]) / m
            p2p = 2 * collective_time("send_recv", send, 2, cluster.link(axis))
            try:
                scheds = schedules_for(units, p, m)
                if not scheds:
                    errors.append(f"p={p} m={m}: 1F1B needs m >= p micro-batches (torch's Schedule1F1B; with fewer "
                                  f"use 'gpipe', the same schedule there)" if _schedules(forced) == ["1f1b"] else
                                  f"p={p} m={m}: interleaved needs 2 blocks per rank and m a multiple of "
                                  f"max(1, m // p) (torch's ScheduleInterleaved1F1B)")
                    continue
                pl = best_pipeline(layer_costs, mem_limit, [p], [m], scheds, p2p, sharing, steady)
            except ValueError as e:
                if log:
                    errors.append(f"p={p} m={m}: {str(e).splitlines()[-1].strip()}")
                    _keep_least(state, e)
                continue
            tail = reduction_tail(pl, layer_costs, [u.reduce_s for u in units], cluster.device.comm_overlap,
                                  [u.gather_s for u in units], after_schedule=not OVERLAP_IN_PIPELINE,
                                  late_s=[u.late_s for u in units], step_s=[u.step_s for u in units])
            step = pl.step_s + tail
            if log:
                tried.append({"axis": axis_names[axis], "degree": p, "micro_batches": m,
                              "schedule": str(pl.options), "step_time_s": step})
            if found is None or step < found.step_s:
                found = Candidate(axis, p, sub, units, pl, step, tail, batch, batch // m)
        return found

    state = {"best": None, "n_blocks": math.inf}
    run = _stage_search(traced, cluster, axis_names, solve_stage, limit, allow_checkpoint, best_over_m, state, errors)

    reduced = reduce_blocks(traced, pins=opts.pins)

    def stage_candidate(stage_cluster, stage_mesh, axis, p, recipe, warm=None):
        pipe = run(stage_cluster, stage_mesh, axis, p, recipe, reduced, warm=warm)
        if pipe is not None and (state["best"] is None or pipe.step_s < state["best"].step_s):
            state["best"] = pipe
        return pipe

    # besides the stage mesh's fastest sharding at the full batch, the Megatron recipe inside each stage (the last
    # axis tensor parallel, the others data parallel): the ILP prices the whole batch at once and cannot see that a
    # stage wants its batch split where micro-batches still divide, which the recipe guarantees
    free_axes = [a for a in axis_names if a not in opts.roles]
    recipes = ([True] if len(mesh) > 1 and len(free_axes) > 1 else []) + [False]  # the recipe first: a quick
    # solve whose result lets the bound skip free solves that cannot win
    ranking: list[tuple] = []
    for axis in axes:
        degrees = [mesh[axis]] if axis in pp_axes else [d for d in _divisors(mesh[axis]) if d > 1]
        if "stages" in forced:
            degrees = [d for d in degrees if d == int(forced["stages"])]
            if not degrees:
                errors.append(f"{forced['stages']} stages do not divide mesh axis {axis_names[axis]} "
                              f"({mesh[axis]})")
        for p in degrees:
            if p > state["n_blocks"]:
                errors.append(f"p={p}: only {state['n_blocks']} blocks")
                continue
            stage_mesh = tuple(n // p if i == axis else n for i, n in enumerate(mesh))
            stage_cluster = dataclasses.replace(cluster, mesh_shape=stage_mesh)
            pipe = stage_candidate(stage_cluster, stage_mesh, axis, p, recipes[0])
            ranking.append((pipe.step_s if pipe is not None else math.inf, axis, p, stage_cluster, stage_mesh,
                            pipe.plan if pipe is not None else None))
            if pipe is not None and (best is None or pipe.step_s < best.step_s):
                best = pipe
    if len(recipes) > 1:
        # the free stage sharding (a bigger ILP, ~2 s for a 70B model) only for the degrees the recipe ranks best
        # warm-started from the recipe's stage sharding (feasible there: the recipe only restricts options)
        for _, axis, p, stage_cluster, stage_mesh, warm in sorted(ranking, key=lambda r: r[0])[:FREE_DEGREES]:
            pipe = stage_candidate(stage_cluster, stage_mesh, axis, p, False, warm)
            if pipe is not None and (best is None or pipe.step_s < best.step_s):
                best = pipe
    if REFINE_PASSES and best is not None and best.pipe.options.micro_batches > 1:
        # the stage problems above are solved at the traced batch, where each activation collective pays its
        # latency once; the winner runs m micro-batches, each paying it (tensor parallelism's all-reduces: m x 2
        # a block). Its stage mesh is solved again with that count (``PlanOptions.latency_passes``), which may
        # trade collectives for bytes or compute; the pipeline model judges the two, as every candidate
        stage_cluster, stage_mesh, axis, p, recipe, _, _ = best.key
        again = run(stage_cluster, stage_mesh, axis, p, recipe, reduced, warm=best.plan,
                    passes=best.pipe.options.micro_batches)
        if again is not None and again.step_s < best.step_s * (1 - 1e-9):
            best = again
    if best is not None and reduced is not None and opts.rank_only:
        best.ranked_on = f"2 of {reduced[1]} blocks (virtual_layers), {AS_RANKED}"
    elif best is not None and reduced is not None:
        # ranked on the 2-block graph (the same ILP, tied blocks priced L times: identical per-block costs);
        # the winner is solved again on the whole graph, whose nodes the plan records
        stage_cluster, stage_mesh, axis, p, recipe, sub_limit, passes = best.key
        final = run(stage_cluster, stage_mesh, axis, p, recipe, None, (sub_limit,), warm=best.plan, passes=passes)
        if final is None:
            raise AssertionError(f"pipeline candidate p={p} fits on the 2-block graph but not on the whole graph")
        final.ranked_on = f"2 of {reduced[1]} blocks (virtual_layers), winner re-solved on the whole graph"
        best = final
    return best, tried, errors, (state.get("least") or (None, None))[1]


def _keep_least(state: dict, e: Exception) -> None:
    """Keep in ``state["least"]`` the failure closest to fitting: a pipeline no partition of which fits
    (``StageMemoryError``, its least per-device peak) or a stage mesh no sharding of which fits (``NoPlanFits``, its
    smallest peak); ``search`` returns it for the error's figures."""
    from autopart.planner import NoPlanFits

    need = e.need if isinstance(e, StageMemoryError) else e.min_memory if isinstance(e, NoPlanFits) else math.nan
    if math.isfinite(need) and (state.get("least") is None or need < state["least"][0]):
        state["least"] = (need, e)


def _stage_search(traced, cluster, axis_names, solve_stage, limit, allow_checkpoint, best_over_m, state, errors):
    """One stage mesh: solve its shardings (fastest; if nothing then fits, memory-bounded) and the best pipeline.
    ``reduced``: (2-block graph, block count) to solve on instead of the whole graph (``reduce_blocks``)."""

    def run(stage_cluster, stage_mesh, axis, p, recipe, reduced=None, limits=None, warm=None, passes=0):
        from autopart.planner import OBJECTIVE_OVER_RECORD, Pruned

        pipe = None
        for attempt, sub_limit in enumerate(limits or (math.inf, limit * p)):
            # a pipeline's step is about its stage plan's total time over p (each block runs once per stage and
            # micro-batch) or more: a stage problem whose ILP cannot go below p x the best step x
            # OBJECTIVE_OVER_RECORD is skipped. The factor: the stage ILP prices the gradient reduction whole, which
            # the schedule partly hides (the steps of p=2 candidates were 0.75-0.83 x their objective / p, Llama-7B
            # and -70B, GPT-1.3B on 64-1024 GPUs)
            cutoff = state["best"].step_s * p * OBJECTIVE_OVER_RECORD if state["best"] is not None and limits is None \
                else None
            try:
                sub = solve_stage(stage_cluster, sub_limit, recipe, reduced, cutoff, warm, passes)
            except Pruned as e:
                errors.append(f"p={p} on {axis_names[axis]}{' (recipe roles)' if recipe else ''}: pruned (bound "
                              f"{e.args[0] / p:.4g} s >= best {state['best'].step_s:.4g} s x "
                              f"{OBJECTIVE_OVER_RECORD:g})")
                break
            except ValueError as e:
                errors.append(f"p={p} on {axis_names[axis]}{' (recipe roles)' if recipe else ''}: stage sharding: "
                              f"{e}")
                _keep_least(state, e)
                break
            if reduced is not None:
                units = expand_units(block_units(sub, reduced[0], stage_mesh, stage_cluster)[0], reduced[1])
            else:
                units, _ = block_units(sub, traced, stage_mesh, stage_cluster)
            state["n_blocks"] = len(units)
            if allow_checkpoint is not True:
                for u in units:
                    u.checkpointable = False
                    u.full = isinstance(allow_checkpoint, dict) and allow_checkpoint.get(u.name) == "full"
            if len(units) < p:
                errors.append(f"p={p}: only {len(units)} blocks")
                break
            pipe = best_over_m(units, sub, stage_mesh, axis, p, limit, True)
            if pipe is not None:
                pipe.key = (stage_cluster, stage_mesh, axis, p, recipe, sub_limit, passes)
            if pipe is not None or attempt == 1 or limits is not None:
                break
            # nothing fits with the fastest stage sharding. A memory-bounded one is no faster per block than
            # this sharding with memory ignored (a bound when every block has the same sharding, as tied blocks
            # do): skip the bounded solve when that bound already loses
            bound = best_over_m(units, sub, stage_mesh, axis, p, math.inf, False)
            if bound is None or (state["best"] is not None and bound.step_s >= state["best"].step_s):
                break
        return pipe

    return run


def record(cand: Candidate, traced: Traced, cluster: Cluster, axis_names: tuple[str, ...], wall_s: float,
           tried: list[dict], p1_step: float | None, bound: bool = False):
    """The stage-mesh plan of ``cand`` with its pipeline section, predictions and per-layer checkpointing."""
    pl, units = cand.pipe, cand.units
    o = pl.options
    plan = cand.plan
    stages = stage_of_units(list(pl.boundaries), len(units))
    ckpt = dict(plan.checkpoint)  # a mode forced on every layer (already priced in the units)
    ckpt.update({units[i].name: "full" for i, c in enumerate(pl.checkpointed) if c or units[i].full})
    ends = list(pl.boundaries[1:]) + [len(units)]
    m = o.micro_batches
    stage_recs = []
    for c, (i, j) in enumerate(zip(pl.boundaries, ends)):
        us = units[i:j]
        n_fl = o.in_flight(c)
        act = sum((min(u.ckpt_act_bytes, u.act_bytes) if pl.checkpointed[i + k] or u.full else u.act_bytes) / m
                  for k, u in enumerate(us))
        states, grads = sum(u.state_bytes for u in us), sum(u.grad_bytes for u in us)
        kv = sum(u.kv_bytes for u in us)  # in ``states`` (resident), reported apart
        tr = max((u.transient_bytes for u in us), default=0.0) / m  # held one layer at a time
        # GPipe peaks as backward starts, every micro-batch's activations held and gradients not yet allocated
        # (solver/pipeline.py); the other schedules hold their in-flight count with gradients allocated
        total = float(stage_peak(states + grads, grads, act, tr, n_fl, o.schedule == "gpipe"))
        stage_recs.append({
            "index": c, "rank": c % o.stages, "layers": [u.name for u in us],
            "time_s": pl.stage_time_s[c], "in_flight": n_fl,
            "memory_bytes": {"states": states - kv, "gradients": grads, "activations": n_fl * act + tr,
                             "kv_cache": kv, "total": total},
            "send_bytes": us[-1].out_bytes / m if j < len(units) else 0.0,
            "checkpointed": [u.name for k, u in enumerate(us) if pl.checkpointed[i + k] or u.full],
        })
    world = cluster.mesh_shape
    pipeline = {
        "axis": cand.axis, "axis_name": axis_names[cand.axis], "degree": o.stages,
        "world_mesh_shape": list(world), "micro_batches": m, "micro_batch_size": cand.micro_batch_size,
        "batch": cand.batch, "schedule": o.schedule, "virtual": o.virtual,
        "bubble_fraction": pl.bubble_fraction, "step_time_s": cand.step_s, "pipeline_s": pl.step_s,
        # decoding served continuously: the step priced with the pipeline kept full (``PipelineOptions.steady``);
        # one call of the runtime, which fills and drains it, takes ``drained_step_time_s``
        "steady": o.steady,
        "drained_step_time_s": cand.step_s - pl.step_s + schedule_step_time(
            pl.stage_time_s, dataclasses.replace(o, steady=False)) if o.steady else cand.step_s,
        "gradient_reduction_s": cand.reduce_s, "p2p_s": o.p2p_s,
        "stages": stage_recs, "stage_of_layer": {units[i].name: c for i, c in enumerate(stages)},
        # forward-only (no parameter trains: inference), the order the runtime runs it in
        "grid": pl.grid(forward_only=not any(u.grad_bytes for u in units)) if o.micro_batches * o.chunks <= 64
        else "",
        "candidates": sorted(tried, key=lambda r: r["step_time_s"])[:12],
        # the plan without stages: its recorded step, or, not solved (``bound``), a lower bound on its ILP objective,
        # which may exceed the step it would record (``planner.OBJECTIVE_OVER_RECORD``)
        "no_pipeline_step_time_s": p1_step, "no_pipeline_is_lower_bound": bool(bound and p1_step is not None),
        "search_s": wall_s,
        "optimality": "stage boundaries, checkpointing: exact DP per (degree, micro-batches, schedule), all "
                      "enumerated; per-node shardings: the stage-mesh ILP's status (solver)",
        "candidates_ranked_on": cand.ranked_on,
        "stage_shardings_searched": "Megatron recipe inside the stage for every degree; free shardings for the "
                                    f"{FREE_DEGREES} best degree(s) of that ranking (all degrees when axes are pinned)",
    }
    # ZeRO-1/2's all-gather after the step: what the next forward does not hide (all of it, the rank gathering
    # most, without overlap); the rest of the tail is the exposed reduction
    gather = gather_exposed(pl, [u.cost(m) for u in units], [u.gather_s for u in units], cluster.device.comm_overlap)
    pipeline["param_gather_s"] = gather
    pipeline["param_gather_total_s"] = max(sum(u.gather_s for u, c in zip(units, stages) if c % o.stages == r)
                                           for r in range(o.stages))
    # the optimizer step's share of the tail: what the tail loses without it (a later stage's step hides in its fill)
    no_step = reduction_tail(pl, [u.cost(m) for u in units], [u.reduce_s for u in units], cluster.device.comm_overlap,
                             [u.gather_s for u in units], after_schedule=not OVERLAP_IN_PIPELINE,
                             late_s=[u.late_s for u in units])
    pipeline["optimizer_step_s"] = max(0.0, cand.reduce_s - no_step)
    pipeline["gradient_reduction_s"] = max(0.0, no_step - gather)
    # per rank, which holds all of its chunks (interleaved: v of them), then the largest rank's of each part
    per_rank = rank_memory(stage_recs)
    mem = {k: max(r[k] for r in per_rank.values()) for k in ("states", "gradients", "activations", "total",
                                                             "kv_cache")}
    comp = sum(u.time_s for u in units)  # at the traced batch: all micro-batches, one stage's share below
    predicted = dict(plan.predicted)
    predicted.update({"step_time_s": cand.step_s, "compute_s": comp / o.stages,
                      "comm_s": max(0.0, cand.step_s - comp / o.stages - pipeline["optimizer_step_s"]),
                      "optimizer_step_s": pipeline["optimizer_step_s"],
                      "memory_bytes": {"parameters_and_optimizer": mem["states"], "gradients": mem["gradients"],
                                       "activations": mem["activations"], "total": mem["total"],
                                       "kv_cache": mem["kv_cache"]},
                      "sharding_only": plan.predicted})
    return dataclasses.replace(plan, pipeline=pipeline, checkpoint=ckpt, predicted=predicted)


def rank_memory(stages: list[dict]) -> dict[int, dict[str, float]]:
    """Per pipeline rank, each part of its memory (a stage record's ``memory_bytes``) summed over the chunks it
    holds (interleaved schedules give it several)."""
    per_rank: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in stages:
        for k, v in s["memory_bytes"].items():
            per_rank[s["rank"]][k] += v
    return per_rank


def buffer_chunks(gm: fx.GraphModule, buffers: dict[str, str], tied: dict[str, str], stage_of: dict[str, int],
                  ranks: int, layer_of: dict[str, str] | None = None) -> dict[str, set[int]]:
    """The chunks that read or update each buffer (by FQN; a stage holds the buffers of its chunks). Raises
    ``NotImplementedError`` where the graph updates a buffer in place (a running statistic, a step count)
    and chunks on more than one pipeline rank use it: each rank holds its own copy, updated by its own chunks only,
    so the others would read a value the single-process model had updated (or keep their own diverging updates),
    silently. A buffer only read (a rotary table shared by every layer), or read and updated by one rank's chunks
    (each block's own batch-norm statistics), is fine. ``stage_of``: chunk per call (``assign_stages``), chunk
    ``c`` on rank ``c % ranks``; ``layer_of``: a node's layer, for the message."""
    from autopart.trace import _mutated_args, _source_line

    writers: dict[str, set[int]] = defaultdict(set)
    users: dict[str, set[int]] = defaultdict(set)
    where: dict[str, list[str]] = defaultdict(list)
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.name not in stage_of:
            continue
        written = {a for a in _mutated_args(n) if isinstance(a, fx.Node)}
        for a in n.all_input_nodes:
            name = tied.get(a.name, a.name)
            if a.op != "placeholder" or name not in buffers:
                continue
            fqn = buffers[name]
            users[fqn].add(stage_of[n.name])
            if a in written:
                writers[fqn].add(stage_of[n.name])
                where[fqn].append(f"updated at {_source_line(n)}")
            where[fqn].append(f"{n.name} (chunk {stage_of[n.name]}"
                              + (f", {layer_of[n.name]}" if layer_of and layer_of.get(n.name) else "") + ")")
    for fqn in sorted(writers):
        held = sorted({c % ranks for c in users[fqn]})
        if len(held) > 1:
            raise NotImplementedError(
                f"pipeline: buffer {fqn!r} is updated in place by chunk(s) {sorted(writers[fqn])} and used by chunks "
                f"{sorted(users[fqn])}, on pipeline ranks {held}. Each rank holds its own copy of a buffer and updates "
                f"it from its own chunks only, so the others would read a stale value: not supported. Uses: "
                f"{', '.join(dict.fromkeys(where[fqn][:8]))}. Fix: keep the layers that read and update it in one "
                f"stage, or plan without pipeline stages (pipeline='off').")
    return dict(users)


def assign_stages(gm: fx.GraphModule, plan, stage_of_layer: dict[str, int]) -> dict[str, int]:
    """Chunk (global stage index) of every call of a rewritten graph: nodes of a planned block go with it; the
    others follow their latest input, and those fed only by placeholders (a parameter's gather, an embedding
    lookup, a position table) go with their earliest user."""
    sol = stage_of_layer
    layers = list(sol)
    first_layer = layers[0]
    stage: dict[str, int] = {}
    nodes = list(gm.graph.nodes)
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        lay = (plan.nodes.get(n.name) or {}).get("layer") or (n.meta.get("autopart.checkpoint") or ("",))[0]
        if lay in sol:
            stage[n.name] = sol[lay]
    for n in nodes:  # forward: a node follows its latest input; before the first block: stage 0
        if n.op in ("placeholder", "output"):
            continue
        if n.name in stage:
            continue
        ins = [stage[a.name] for a in n.all_input_nodes if stage.get(a.name) is not None]
        stage[n.name] = max(ins) if ins else None  # None: only parameters/inputs feed it; placed by its users
    for n in reversed(nodes):  # parameter-only chains: with their earliest user
        if stage.get(n.name, 0) is None:
            us = [stage[u.name] for u in n.users if stage.get(u.name) is not None]
            stage[n.name] = min(us) if us else sol[first_layer]
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        for a in n.all_input_nodes:
            if a.name in stage and stage[a.name] > stage[n.name]:
                raise AssertionError(f"pipeline split: {n.name} (stage {stage[n.name]}) uses {a.name} from a later "
                                     f"stage {stage[a.name]}")
    return stage
