"""From a traced graph to a Plan: list options, price them, tie repeated layers, solve, record.

Pricing conventions (the runtime's ``autopart.passes.collectives`` implements exactly these):

* a node's option is *split* on mesh axis ``i`` when any of its input or output placements there is not
  ``Replicate``; its compute (forward + backward roofline) divides by the size of every split axis;
* an edge converts the producer's output placement into the consumer's input placement axis by axis; a
  value's gradient has the dual placement (``Shard`` -> ``Shard``, ``Partial`` -> ``Replicate``, ``Replicate`` ->
  ``Replicate``), so each conversion has a forward and a backward collective:

  ====================  ==================  ===========================================================
  conversion            forward             backward (only if the value needs a gradient)
  ====================  ==================  ===========================================================
  R -> R, split user    none                all-reduce (the user's local backward gives addends)
  S(d) -> R             all-gather          reduce-scatter if the user is split, else take own shard
  P -> R                all-reduce          all-reduce if the user is split, else none
  R -> S(d)             take own shard      all-gather
  P -> S(d)             reduce-scatter      all-gather
  S(d) -> S(e)          all-to-all          all-to-all
  R -> P                keep on rank 0      none
  S -> P                forbidden
  ====================  ==================  ===========================================================

* parameters whose every use needs the "R -> R, split user" backward all-reduce on an axis skip it there and are
  reduced after backward in buckets instead (data-parallel gradient reduction), priced the same way.
* a value converted to one target for several users is converted once by the runtime (and its gradient reduced
  once), but each user edge carries the whole conversion: the ILP over-counts such conversions (the plan's
  record, one entry per conversion the runtime makes, is the truth). A pairwise term cannot see the other users;
  dividing the conversion among them is exact when they all take one target but under-counts when they do not,
  and the solver then picks plans that gather a value for one user cheaply (MoE's router one-hot: 9% slower by
  the record), so the safe side it is.
* memory per device: parameters + gradients + optimizer states (Adam: 2 states of the parameter's dtype... taken
  as ``optimizer_bytes_per_param``) for the local shard, plus the local bytes of every activation kept for
  backward. An activation all-gathered for a user that saves it (S(d) -> R before a column-parallel matmul under
  sequence parallelism) is kept as the shard and gathered again in backward (``regather_spec``): its bytes and the
  backward all-gather depend on both ends' options, an edge memory term of the ILP and an edge cost.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import math
import re
import time
import warnings
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from autopart import regions
from autopart.cost import (
    Cluster,
    Device,
    backward_flops,
    collective_time,
    exposed_after,
    hierarchical_time,
    node_bytes,
    node_flops,
    roofline_time,
)
from autopart.cost.comm import exposed_before
from autopart.cost.compute import compute_dtype
from autopart.placement import Partial, Replicate, Shard, Strided, is_shard, parse_spec, spec_str

# the runtime's reduction and gather bucket, and how many reduction buckets it holds at once: priced as run
from autopart.runtime.grads import BUCKET_BYTES, REDUCE_IN_FLIGHT, bucket_key, bucket_limit
from autopart.runtime.zero1 import GATHER_IN_FLIGHT  # after-step gather buckets outstanding, priced as run
from autopart.strategy import OpOption, options_for, tensor_inputs
from autopart.strategy import ssm as ssm_rules
from autopart.strategy.context import CP_TAGS, SDPA, cp_axis, cp_comm_time, cp_variants, gqa_split, seq_axis
from autopart.strategy.registry import NESTED_INPUTS
from autopart.trace import Traced

aten = torch.ops.aten
_VIEW_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int, aten.t.default,
             aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default, aten.alias.default,
             aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.chunk.default, aten.contiguous.default}


@dataclass(frozen=True)
class PlanOptions:
    """What the user pins and how hard the solver works."""

    roles: dict[str, str] = field(default_factory=dict)  # mesh axis name -> "dp" | "tp"
    pins: dict[str, str] = field(default_factory=dict)  # parameter FQN or node name -> spec string ("S(0)R")
    memory_limit: float | None = None  # bytes per device; None = the cluster's budget
    time_limit_s: float = 30.0
    seed: int = 0
    backend: str = "auto"
    relative_gap: float = 1e-3
    optimizer_bytes_per_param: float = 8.0  # Adam: two fp32 states per fp32 parameter
    local_batch: bool = False  # each rank passes only its own data-parallel slice of the inputs
    tie_layers: bool = True
    checkpoint: dict[str, str] | str | None = None  # force: "full"/"selective"/"none" for every layer, or per layer
    zero: int | None = None  # force a ZeRO level on the "dp" axes (None: the solver decides per parameter)
    offload: str | frozenset | None = None  # force "none" | "optimizer" | "activations" | "both" (None: solver)
    # None: the solver decides whether and how to pipeline; "off"; or a dict forcing any of "stages",
    # "micro_batches", "schedule" ("gpipe" | "1f1b" | "interleaved"), "virtual", "axis" (mesh axis name)
    pipeline: dict | str | None = None
    # internal: the graph holds 2 of this many identical blocks (``pipelining.reduce_blocks``); tied groups are
    # priced as if they had this many members
    virtual_layers: int = 0
    objective_cutoff: float | None = None  # internal: raise ``Pruned`` if no plan can be cheaper than this
    recipes: bool = True  # also score the standard recipes (``autopart.recipes``) and never return a slower plan
    explain_infeasible: bool = True  # a plan that does not fit: solve for its least peak (else a lower bound)
    # warn when a 'dp' role cannot split the batch (``build_problem``); off for the recipes' own roles
    role_warnings: bool = True
    # inference (no parameter needs a gradient): the K/V cache of this many tokens per sequence held at every
    # attention, in its layout (heads split by tensor parallelism split it too), read once per decoding step
    kv_cache_tokens: int = 0
    memory_margin: float = 0.0  # memory_limit is the user's budget less this share (api.MEMORY_MODEL_MARGIN)
    # internal: a Plan of the same graph (or its 2-block reduction) and mesh whose choices seed the ILP
    # (a recipe's plan for the search, the 2-block solution for the whole-graph re-solve)
    warm_start: Any = None
    # collective matmul (``passes.tp_overlap``): the all-gather into a linear and the reduce-scatter out of one run
    # as ring steps behind the linear's matmuls, and are priced so (``tp_overlap_hidden``); None: where the
    # cluster's device overlaps communication with compute (``Device.comm_overlap``: GPUs, not the cpu preset)
    tp_comm_overlap: bool | None = None
    # internal: a pipeline stage's sharding problem (``_make_plan``'s ``solve_stage``); its gradient reduction runs
    # from the schedule's last micro-batches, priced by the pipeline model (``solver.pipeline.reduction_tail``), so
    # the ILP prices it whole rather than at the share one backward would hide (``grad_reduction_shares``)
    stage: bool = False
    # gradient accumulation without stages (``pipeline={"stages": 1, "micro_batches": m}``): forward and backward run
    # over m micro-batches of batch/m one after another, the data-parallel reduction once, from the last one's
    # backward (``runtime/module.py``). The ILP holds one micro-batch's activations; ``_record`` prices the rest
    micro_batches: int = 1
    # internal: how many micro-batches forward and backward run in (0: ``micro_batches``), so that the ILP prices
    # what each pays whatever its size: an activation collective's latency, a parameter's gathers
    # (``_edge_prices``'s ``passes``). A pipeline stage's problem is solved at the traced batch (``stage``; the
    # pipeline model splits it) and priced for the search's micro-batch count this way (``pipelining.search``)
    latency_passes: int = 0
    # internal: a pipeline's candidates ranked on the 2-block reduction (``pipelining.reduce_blocks``) and the
    # winner returned as ranked, not solved again on the whole graph (``recipes.score``: a pipelined recipe's score;
    # ``make_plan`` solves it on the whole graph where it might win)
    rank_only: bool = False
    # the dtype the data-parallel gradient reduction sums in (its buckets and collectives, and ZeRO-3's backward
    # reduce-scatters), e.g. "float32" for bf16 gradients as Megatron-LM (``accumulate_allreduce_grads_in_fp32``)
    # and FSDP2's ``reduce_dtype``; the reduced gradient is cast back to its own dtype. None: each gradient's own
    reduce_dtype: str | None = None
    # the dtype gradients are kept and accumulated in (``Tensor.grad_dtype``): "float32" for bf16 parameters, so that
    # micro-batches, pipeline schedules and repeated ``forward_backward`` calls sum in fp32, as Megatron-LM's fp32
    # ``main_grad`` and FSDP2's fp32 sharded gradients; the optimizer then needs master weights
    # (``pm.optimizer(cls, master_dtype=torch.float32)``). The reduction sums in it too unless ``reduce_dtype``
    # says otherwise. None: each parameter's own dtype
    grad_dtype: str | None = None

    def __post_init__(self) -> None:
        for name, what in (("reduce_dtype", "the gradient reduction sums in it"),
                           ("grad_dtype", "gradients accumulate in it")):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, torch.dtype):  # as a string: plans save it as JSON
                object.__setattr__(self, name, str(value).removeprefix("torch."))
            dt = getattr(torch, str(getattr(self, name)), None)
            if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
                raise ValueError(f"{name}={value!r}: give a floating dtype such as 'float32' or torch.float32 ({what}),"
                                 f" or None (each gradient's own)")
        if self.grad_dtype is not None and self.reduce_dtype is None:  # the gradients' own dtype is now this one
            object.__setattr__(self, "reduce_dtype", self.grad_dtype)
        for axis, role in self.roles.items():
            if role not in ("dp", "tp", "pp"):
                raise ValueError(f"role {role!r} for mesh axis {axis!r} is not one of 'dp', 'tp', 'pp'")
        if self.tp_comm_overlap not in (None, True, False):
            raise ValueError(f"tp_comm_overlap={self.tp_comm_overlap!r}: use True, False or None (on where the "
                             "cluster's device overlaps communication with compute)")
        if isinstance(self.pipeline, str) and self.pipeline != "off":
            raise ValueError(f"pipeline={self.pipeline!r}: use None (the solver decides), 'off', or a dict such as "
                             "{'stages': 2, 'schedule': '1f1b', 'micro_batches': 4}")
        if isinstance(self.pipeline, dict):
            bad = set(self.pipeline) - {"stages", "micro_batches", "schedule", "virtual", "axis"}
            if bad:
                raise ValueError(f"pipeline options {sorted(bad)} unknown: use stages, micro_batches, schedule, "
                                 "virtual, axis")
            m = self.pipeline.get("micro_batches", 1)
            if not isinstance(m, int) or isinstance(m, bool) or m < 1:
                raise ValueError(f"pipeline micro_batches={m!r}: give a whole number >= 1 (with stages=1, the number "
                                 "of gradient-accumulation micro-batches the batch is split into)")
        if not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"micro_batches={self.micro_batches!r}: give a whole number >= 1")
        if not isinstance(self.latency_passes, int) or self.latency_passes < 0:
            raise ValueError(f"latency_passes={self.latency_passes!r}: give a whole number >= 0 (0: micro_batches)")
        if not 0 <= self.relative_gap < 1:
            raise ValueError(f"relative_gap={self.relative_gap!r}: give a fraction in [0, 1) (0.001: each ILP's plan "
                             "proven within 0.1% of the best)")


def reduce_scale(dtype: torch.dtype, reduce_dtype: str | None) -> float:
    """Bytes a gradient of ``dtype`` takes in the reduction (``PlanOptions.reduce_dtype``) per byte of its own;
    in general, bytes per element of ``reduce_dtype`` over ``dtype``'s for a floating ``dtype`` (the gradient's
    own, ``PlanOptions.grad_dtype``, too), 1 where either is not given or not floating."""
    if reduce_dtype is None or not dtype.is_floating_point:
        return 1.0
    return getattr(torch, reduce_dtype).itemsize / dtype.itemsize


class Pruned(Exception):
    """No plan of the problem can beat ``PlanOptions.objective_cutoff``: its lower bound is ``args[0]``."""


# The ILP's objective exceeds the step its plan records by up to this factor: it prices each gradient's bucketed
# reduction at its share of the exposed chain (``grad_reduction_shares``: the derivative, 1 for the chain's busy tail),
# which counts the tail whole where the record hides its start behind backward. Measured: 2-block objective / whole
# graph record 1.00-1.48 over 27 recipe plans of GPT-124M/1.3B and Llama-7B/70B on 16-128 H100s and A100s (DDP
# 1.03-1.48, Megatron TP x DP 1.08-1.36, FSDP 1.00-1.01). Where an objective stands in for a plan's step (a recipe
# scored on the 2-block graph, the plan without stages that does not fit), it is compared with other plans' steps
# after dividing by this, so a plan whose record might be faster is solved and recorded rather than dropped (gpt-1.3b
# on 16 H100s: ZeRO-1 scored 0.0735 s by its objective, 0.0510 s by its record, against the search's 0.0565 s). The
# pipeline search prunes stage meshes by the same factor (``pipelining``)
OBJECTIVE_OVER_RECORD = 1.5
# The relative gap the ZeRO-free check of a plan that chose ZeRO-1/2 is screened to (``_sharding_plan``; solved again
# to the plan's own gap where it wins by the record). The check compares records, which differ from the objectives by
# more than this; a memory-bound check's MIP spends seconds closing its last percent (Llama-70B on 8x8 H100s: 9.5 s
# to 0.1%, 3.1 s to 2%, the same record within 0.01%)
NO_ZERO_SCREEN_GAP = 0.02


def value_of(node: fx.Node) -> Any:
    return node.meta.get("val")


def tensor_bytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _no_bytes(val: torch.Tensor) -> torch.Tensor:
    """``val``'s dtype and rank with no elements (on the meta device): a conversion of it costs its latency."""
    return torch.empty((0,) * val.dim(), dtype=val.dtype, device="meta")


def split_ways(spec, mesh_shape) -> int:
    """The ranks ``spec`` splits a value over: the product of the axes it shards (``Shard`` or ``Strided``)."""
    f = 1
    for p, n in zip(spec, mesh_shape):
        if isinstance(p, (Shard, Strided)):  # is_shard, inline: pricing calls this ~200k times a 70B plan
            f *= n
    return f


def _local_bytes(val: torch.Tensor, spec, mesh_shape) -> float:
    return val.numel() * val.element_size() / split_ways(spec, mesh_shape)


def embedding_rows_bytes(node: fx.Node) -> float:
    """Bytes a forward-only embedding lookup moves: its indices, the rows it gathers and its output (``node_bytes``
    counts its whole table, which training's backward writes as a dense gradient)."""
    idx, out = value_of(node.args[1]), value_of(node)
    return float(tensor_bytes(idx.shape, idx.dtype) + 2 * tensor_bytes(out.shape, out.dtype))


def local_bytes_share(node: fx.Node, option: OpOption, val, mesh_shape, split: int,
                      rows_only: bool = False) -> float:
    """The share of an op's bytes (``node_bytes``: its tensors read and written) one device moves under ``option``:
    each tensor input and output at its local size (a shard of a ``Shard`` placement; a replicated or partial one
    whole), over all of them whole. Its FLOPs split ``split`` ways (every axis the option splits any of them on),
    but a tensor it leaves replicated is read whole on every device: a linear under data parallelism reads its
    whole weight on each (decoding, with a few tokens a device, is that read), under tensor parallelism its whole
    input. ``1 / split`` where every tensor is split alike (elementwise ops), or where the option's placements do
    not line up with the node's tensors. ``rows_only``: an embedding's bytes are the rows it gathers, not its table.
    """
    ins = tensor_inputs(node)
    outs = val if isinstance(val, (tuple, list)) else (val,)
    out_specs = _outs(option)
    if len(option.inputs) != len(ins) or len(out_specs) != len(outs):
        return 1.0 / split
    full = local = 0.0
    pairs = [(value_of(n), p) for n, p in zip(ins, option.inputs)]
    # grouped-query heads split wider than the K/V heads: each device reads one of the K/V heads it holds whole
    gqa = gqa_split(node, ins, option.inputs, tuple(mesh_shape)) if node.target == SDPA else None
    kv_reads = {id(value_of(ins[j])): gqa.kv_heads for j in (gqa.key, gqa.value)} if gqa else {}
    if rows_only:  # a forward-only lookup (``embedding_rows_bytes``): the rows it reads, split like its output
        pairs = pairs[1:]
    for x, spec in pairs + list(zip(outs, out_specs)):
        if isinstance(x, torch.Tensor) and spec is not None:
            full += tensor_bytes(x.shape, x.dtype)
            local += _local_bytes(x, spec, mesh_shape) / kv_reads.get(id(x), 1)
    return local / full if full > 0 else 1.0 / split


def is_split(option: OpOption, axis: int) -> bool:
    return any(not isinstance(s[axis], Replicate) for s in option.inputs) or \
        any(not isinstance(o[axis], Replicate) for o in _outs(option))


def split_axes(option: OpOption, n_axes: int) -> tuple[bool, ...]:
    """``is_split`` on each of a mesh's ``n_axes`` axes, memoised on the option (pricing asks per edge)."""
    s = option.__dict__.get("_split")
    if s is None or len(s) != n_axes:
        s = tuple(is_split(option, i) for i in range(n_axes))
        object.__setattr__(option, "_split", s)
    return s


def output_spec(option: OpOption, index: int | None):
    return option.output[index] if index is not None else option.output


@dataclass(frozen=True)
class Step:
    """One axis of a conversion: forward collective and the backward collective autograd will run."""

    axis: int
    src: Any
    dst: Any
    fwd: str  # "none" | "all_gather" | "all_reduce" | "shard" | "reduce_scatter" | "all_to_all" | "mask"
    bwd: str  # "none" | "all_reduce" | "reduce_scatter" | "shard" | "all_gather" | "all_to_all"


@functools.lru_cache(maxsize=65536)
def _nested_shard(spec, mesh_shape) -> bool:
    """A dim of ``spec`` is split on more than one axis (only stacked expert weights are)."""
    dims = [p.dim for p, n in zip(spec, mesh_shape) if is_shard(p) and n > 1]
    return len(dims) != len(set(dims))


@functools.lru_cache(maxsize=1 << 16)
def _batch_nesting(option: OpOption, mesh_shape, exempt: tuple[int, ...] = ()) -> frozenset:
    """The mesh axes splitting dim 0 of a spec of ``option`` (its outputs', its inputs' but those ``exempt``:
    stacked expert weights) where more than one axis splits it (the batch split over several data-parallel axes
    at once); empty where none nests."""
    out = option.output
    specs = (*(out if out and isinstance(out[0], tuple) else (out,)),
             *(spec for j, spec in enumerate(option.inputs) if j not in exempt))
    axes: set[int] = set()
    for spec in specs:
        cut = [i for i, (p, n) in enumerate(zip(spec, mesh_shape)) if n > 1 and is_shard(p) and p.dim == 0]
        if len(cut) > 1:
            axes.update(cut)
    return frozenset(axes)


def conversion_steps(src, dst, split: tuple[bool, ...], needs_grad: bool, mesh_shape,
                     param_reduced: tuple[bool, ...] = ()) -> tuple[Step, ...] | None:
    """The per-axis steps converting ``src`` to ``dst`` (None if impossible); see the module docstring table. A
    ``Strided`` layout (a fused projection's blocks) converts to nothing else: it is a parameter's, used as stored
    by the ops that split it into its blocks. Memoised: pricing asks for the same few thousand conversions of
    every value pattern's options (a tuple of immutable steps, shared by the callers)."""
    try:  # tuples already (pricing's ~140k calls a 70B plan): no copies
        return _conversion_steps(src, dst, split, needs_grad, mesh_shape, param_reduced)
    except TypeError:  # a list among them
        return _conversion_steps(tuple(src), tuple(dst), tuple(split), bool(needs_grad), tuple(mesh_shape),
                                 tuple(param_reduced))


@functools.lru_cache(maxsize=1 << 18)
def _conversion_steps(src: tuple, dst: tuple, split: tuple[bool, ...], needs_grad: bool, mesh_shape: tuple,
                      param_reduced: tuple[bool, ...]) -> tuple[Step, ...] | None:
    if any(a != b and n > 1 and (isinstance(a, Strided) or isinstance(b, Strided))
           for a, b, n in zip(src, dst, mesh_shape)):
        return None
    steps = []
    for i, n in enumerate(mesh_shape):
        a, b = src[i], dst[i]
        if n == 1:
            continue
        g = needs_grad
        if a == b:
            if isinstance(a, Replicate) and split[i] and g and not (param_reduced and param_reduced[i]):
                steps.append(Step(i, a, b, "none", "all_reduce"))
            continue
        if isinstance(b, Replicate):
            if isinstance(a, Shard):
                steps.append(Step(i, a, b, "all_gather", ("reduce_scatter" if split[i] else "shard") if g else "none"))
            else:
                steps.append(Step(i, a, b, "all_reduce", "all_reduce" if g and split[i] else "none"))
        elif isinstance(b, Shard):
            if isinstance(a, Replicate):
                steps.append(Step(i, a, b, "shard", "all_gather" if g else "none"))
            elif isinstance(a, Partial):
                steps.append(Step(i, a, b, "reduce_scatter", "all_gather" if g else "none"))
            else:
                steps.append(Step(i, a, b, "all_to_all", "all_to_all" if g else "none"))
        else:
            if isinstance(a, Shard):
                return None
            steps.append(Step(i, a, b, "mask", "none"))
    moving = [st for st in steps if st.src != st.dst]
    if moving and (len(moving) > 1 or _nested_shard(src, mesh_shape) or _nested_shard(dst, mesh_shape)):
        return tuple(_ordered(steps, src, dst, mesh_shape, split, needs_grad))
    return tuple(steps)


def _ordered(steps: list[Step], src, dst, mesh_shape, split: tuple[bool, ...], needs_grad: bool) -> list[Step]:
    """``steps`` (one per axis, in axis order) in an order whose every intermediate layout is a valid one.

    A dim split on several axes holds its pieces nested in mesh order: the first axis cuts the dim, the next cuts
    that piece, and so on (``runtime.module._local_chunk``, DTensor's order). So a step may only release a dim on
    the axis that cut it last (an all-gather of the pieces of any other axis would join pieces of different rows),
    and may only start splitting a dim on an axis later than every axis that splits it (a shard of the rank's piece
    nests the axis inside the others). Axes keep their part of each dim's splitting order that ``src`` and ``dst``
    share (the longest common prefix of its axes); the rest release it innermost first, then the target's axes cut
    it in mesh order. Examples: (R, S(0)) -> (S(0), R) gathers on axis 1 before it shards on axis 0; a swap
    ((S(0), S(1)) -> (S(1), S(0))) gathers on one axis first and splits again last; (S(0), S(0)) -> (R, S(0))
    gathers on axis 1, then axis 0, and cuts axis 1 again, although axis 1 splits dim 0 in both. A step releasing
    one dim and splitting another on its axis (an all-to-all) waits until both are allowed; where dims wait on each
    other in a cycle, one such step becomes an all-gather now and a shard later."""
    live = [i for i, n in enumerate(mesh_shape) if n > 1]

    def axes_of(spec, d):
        return [i for i in live if isinstance(spec[i], Shard) and spec[i].dim == d]

    dims = {p.dim for spec in (src, dst) for p in spec if isinstance(p, Shard)}
    prefix = {}
    for d in dims:
        s_axes, d_axes = axes_of(src, d), axes_of(dst, d)
        k = 0
        while k < min(len(s_axes), len(d_axes)) and s_axes[k] == d_axes[k]:
            k += 1
        prefix[d] = k
    pending, out = list(steps), []  # a step whose axis keeps its placement (a gradient's all-reduce) is always ready
    for i in live:
        a = src[i]
        if a == dst[i] and isinstance(a, Shard) and i not in axes_of(src, a.dim)[:prefix[a.dim]]:
            # it cuts the dim inside an axis this conversion releases: released, and cut again later
            pending.append(Step(i, a, Replicate(), "all_gather",
                                ("reduce_scatter" if split[i] else "shard") if needs_grad else "none"))
            pending.append(Step(i, Replicate(), a, "shard", "all_gather" if needs_grad else "none"))
    cur = list(src)

    def releases(st):
        return st.src.dim if isinstance(st.src, Shard) and st.src != st.dst else None

    def cuts(st):
        return st.dst.dim if isinstance(st.dst, Shard) and st.src != st.dst else None

    def can_release(st):
        d = releases(st)
        return d is None or axes_of(cur, d)[-1] == st.axis

    def can_cut(st):
        d = cuts(st)
        if d is None:
            return True
        now, target = axes_of(cur, d), axes_of(dst, d)
        # every axis still to release from d is gone, and st's axis is the next of the target's order
        return now == target[:len(now)] and len(now) < len(target) and target[len(now)] == st.axis and \
            not any(o is not st and releases(o) == d for o in pending)

    while pending:
        ready = next((st for st in pending if can_release(st) and can_cut(st)), None)
        if ready is None:  # a cycle of dims changing axes: release one now, cut it again later
            st = next(x for x in pending if x.fwd == "all_to_all" and can_release(x))
            pending.remove(st)
            ready = Step(st.axis, st.src, Replicate(), "all_gather",
                         ("reduce_scatter" if split[st.axis] else "shard") if needs_grad else "none")
            pending.append(Step(st.axis, Replicate(), st.dst, "shard", "all_gather" if needs_grad else "none"))
        else:
            pending.remove(ready)
        out.append(ready)
        cur[ready.axis] = ready.dst
    return out


_COMM_KIND = {"all_gather": "all_gather", "all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter",
              "all_to_all": "all_to_all"}


def transition_time(val: torch.Tensor, src, dst, split: tuple[bool, ...], needs_grad: bool, cluster: Cluster,
                    param_reduced: tuple[bool, ...] = (), bucketed: bool = False, regather: bool = False,
                    scatter_grad: bool = False, chained: bool = False, reduce_dtype: str | None = None) -> float:
    """Seconds to convert a value from spec ``src`` to ``dst``, forward and backward. ``bucketed``: the value is a
    parameter whose gradient all-reduce shares a bucket with the others (priced by bandwidth and its share of one
    bucket's latency, its bytes over ``bucket_bytes``, and in full here: the ILP scales that part by the share
    backward does not hide, ``grad_reduction_shares``, through ``transition_parts``; ``gradient_reduction`` prices
    it in the plan's step).
    ``regather``: a ZeRO-3 parameter its consumer keeps for backward (``saves_input``), gathered again there.
    ``scatter_grad``: a ZeRO-1/2 parameter, whose gradient is reduce-scattered into each rank's slice instead of
    all-reduced (half the bytes on a ring).
    ``chained``: a ZeRO-3 parameter's collectives, priced at the links' ``Link.in_chain`` (back-to-back) prices:
    the runtime gathers a parameter just before each op that uses it, so they come one per parameterized op, a
    single op's compute apart (in a Transformer block mostly a norm's or an elementwise op's), where the
    calibration's after-compute links follow a burst of compute (``calibrate._measure_links``) and the wait for
    out-of-step ranks grows with the compute before (4 ranks on 2 cores: a 64 KiB all-reduce 4.9-5.4 ms back to
    back, 5.9-7.0 ms after a 2 ms GEMM, 11-15 ms after 7.5 ms). Its backward reduce-scatter sums in
    ``reduce_dtype`` (``PlanOptions.reduce_dtype``), as a bucketed gradient's reduction does."""
    base, reduction, _ = transition_parts(val, src, dst, split, needs_grad, cluster, param_reduced, bucketed,
                                          regather, scatter_grad, chained, reduce_dtype=reduce_dtype)
    return base + reduction


def transition_parts(val: torch.Tensor, src, dst, split: tuple[bool, ...], needs_grad: bool, cluster: Cluster,
                     param_reduced: tuple[bool, ...] = (), bucketed: bool = False, regather: bool = False,
                     scatter_grad: bool = False, chained: bool = False,
                     buckets: dict | None = None,
                     reduce_dtype: str | None = None) -> tuple[float, float, tuple[int, ...]]:
    """``transition_time`` in two parts: (seconds of everything but a bucketed gradient's data-parallel reduction,
    seconds of that reduction, the mesh axes it sums over (ascending; empty without one)). ``buckets``: bucket
    bytes per set of summed axes (``ilp_bucket_bytes``; absent: the links' ``bucket_bytes``); ``reduce_dtype``: the
    dtype it is summed in (``PlanOptions.reduce_dtype``), and a ZeRO-3 parameter's (``chained``) backward
    reduce-scatter too."""
    mesh = cluster.mesh_shape
    steps = conversion_steps(src, dst, split, needs_grad, mesh, param_reduced)
    if steps is None:
        return math.inf, 0.0, ()
    total = 0.0
    cur = list(src)
    summed: list[tuple[int, float]] = []  # a bucketed gradient's sum, per axis: one hierarchical reduction below
    whole = val.numel() * val.element_size()
    ways = split_ways(cur, mesh)  # kept up to date step by step (``_local_bytes`` of each step's gathered layout)
    for st in steps:
        n = mesh[st.axis]
        if isinstance(cur[st.axis], (Shard, Strided)):
            ways //= n
        nbytes = whole / ways  # gathered on the step's axis
        cur[st.axis] = st.dst
        if isinstance(st.dst, (Shard, Strided)):
            ways *= n
        if bucketed and st.fwd == "none" and st.bwd == "all_reduce":
            summed.append((st.axis, nbytes))
            continue
        link = cluster.links[st.axis].in_chain() if chained else cluster.links[st.axis]
        for kind, backward in ((st.fwd, False), (st.bwd, True)):
            if kind in _COMM_KIND:
                # all-to-all: each rank's buffer is its shard, 1/n of the array gathered on the axis
                sent = nbytes / mesh[st.axis] if kind == "all_to_all" else nbytes
                if chained and backward and kind == "reduce_scatter":  # ZeRO-3's gradient, summed in reduce_dtype
                    sent *= reduce_scale(val.dtype, reduce_dtype)
                if scatter_grad and kind == "all_reduce" and st.fwd == "none":
                    kind = "reduce_scatter"
                total += collective_time(_COMM_KIND[kind], sent, mesh[st.axis], link)
        if regather and st.fwd == "all_gather":
            total += collective_time("all_gather", nbytes, mesh[st.axis], link)
    if not summed:
        return total, 0.0, ()
    axes = tuple(sorted(a for a, _ in summed))
    return total, grad_reduction_share(max(b for _, b in summed) * reduce_scale(val.dtype, reduce_dtype), axes,
                                       scatter_grad, cluster, (buckets or {}).get(axes)), axes


def tp_overlap_on(opts: PlanOptions, cluster: Cluster) -> bool:
    """Whether plans for ``cluster`` run and price collective matmuls (``PlanOptions.tp_comm_overlap``)."""
    return cluster.device.comm_overlap if opts.tp_comm_overlap is None else opts.tp_comm_overlap


def linear_input_fused(value: fx.Node) -> bool:
    """Every user of ``value`` is an ``aten.linear`` taking it as its input: an all-gather of it that ends its
    conversion is fused with them (``passes.tp_overlap``)."""
    return bool(value.users) and all(
        u.op == "call_function" and u.target == aten.linear.default and not u.kwargs and u.args[0] is value and
        value not in u.args[1:] for u in value.users)


def linear_output_fused(node: fx.Node) -> bool:
    """``node`` is an ``aten.linear`` with one user: a reduce-scatter that begins its output's conversion to that
    user is fused with it (``passes.tp_overlap``)."""
    return node.op == "call_function" and node.target == aten.linear.default and not node.kwargs and \
        len(node.users) == 1


def overlap_hidden(comm: float, compute: float, n: int) -> float:
    """Seconds of a collective of ``comm`` seconds on ``n`` ranks that a collective matmul of ``compute`` seconds
    hides: n ring steps of compute/n each, the n - 1 exchanges of comm/(n - 1) each behind one step's compute, take
    (n - 1) max(comm/(n - 1), compute/n) + compute/n instead of comm + compute."""
    return 0.0 if n <= 1 else (n - 1) * min(comm / (n - 1), compute / n)


def tp_overlap_comms(val: torch.Tensor, src, dst, split: tuple[bool, ...], needs_grad: bool, cluster: Cluster,
                     into: bool) -> tuple[tuple[float, int], ...]:
    """The collectives of the conversion ``src -> dst`` of ``val`` that the runtime runs as collective matmuls with
    a linear, as (seconds, ranks) pairs: ``into``: the value feeds the linear, and a conversion whose last
    data-moving step is an all-gather on a dimension other than the last is fused with it; else the value is the
    linear's output, and a conversion whose first step is a reduce-scatter on such a dimension is. Forward and
    backward: the backward's collective (the all-gather's reduce-scatter, the reduce-scatter's all-gather) runs
    behind the input gradient's matmuls. Empty where nothing is fused. Independent of the linear's compute, so
    ``_edge_prices`` caches it per (value, source, target) and ``overlap_hidden`` applies each option's compute."""
    mesh = cluster.mesh_shape
    steps = conversion_steps(src, dst, split, needs_grad, mesh) or []
    if into:
        moving = [st for st in steps if st.fwd != "none"]
        st = moving[-1] if moving else None
        kind = "all_gather"
    else:
        st = steps[0] if steps else None
        kind = "reduce_scatter"
    if st is None or st.fwd != kind:
        return ()
    dim = (st.src if into else st.dst).dim
    if val.dim() < 2 or dim % val.dim() == val.dim() - 1:
        return ()
    full = list(regather_spec(src, dst, split, needs_grad, mesh) if into else src)
    full[st.axis] = Replicate()
    nbytes, n, link = _local_bytes(val, full, mesh), mesh[st.axis], cluster.link(st.axis)
    comms = [(collective_time(kind, nbytes, n, link), n)]
    if st.bwd in ("all_gather", "reduce_scatter"):
        comms.append((collective_time(st.bwd, nbytes, n, link), n))
    return tuple(comms)


def hidden_behind(comms: tuple[tuple[float, int], ...], compute: float) -> float:
    """Seconds of the fused collectives ``comms`` (``tp_overlap_comms``) a linear of ``compute`` forward seconds
    hides: the backward's collective hides behind the input gradient's matmuls, which have the forward's flops."""
    return sum(overlap_hidden(c, compute, n) for c, n in comms)


def tp_overlap_hidden(val: torch.Tensor, src, dst, split: tuple[bool, ...], needs_grad: bool, cluster: Cluster,
                      compute: float, into: bool) -> float:
    """Seconds of the conversion ``src -> dst`` of ``val`` that the runtime's collective matmul hides behind a linear
    of ``compute`` forward seconds on this rank (``hidden_behind``); 0.0 where nothing is fused."""
    return hidden_behind(tp_overlap_comms(val, src, dst, split, needs_grad, cluster, into), compute)


# A gradient-reduction or ZeRO gather bucket over some mesh axes holds at least ``BUCKET_BYTES`` (DDP's 25 MiB), more
# where one collective's latency over those axes would be more than this share of its transfer time: a ring's latency
# grows with its ranks ((n - 1) hops), so at DDP's size a 48-rank ring across nodes (10 us a hop, 50 GB/s per GPU)
# spends as long on latency as on bytes. Megatron-Core sizes its buckets for the same reason, max(40M, 1M x dp)
# parameters ("larger DP sizes need larger buckets to ensure collectives do not become latency-bound",
# ``DistributedDataParallelConfig.bucket_size``); at 48 ranks this rule gives 192 MB, Megatron's 48M fp32 gradients.
BUCKET_LATENCY_SHARE = 0.125
BUCKET_CAP = 2**30  # at most 1 GiB a bucket: the buckets in flight are held in memory (``REDUCE_IN_FLIGHT``)
# and at most 1/MIN_BUCKETS of the bytes reduced over the axes (never below BUCKET_BYTES): backward hides the chain
# of buckets but the last, launched when it ends, so a model of one bucket would hide none of its reduction
MIN_BUCKETS = 8
_BUCKET_BYTES: dict = {}


def bucket_bytes(axes, cluster: Cluster, total: float | None = None) -> int:
    """Bytes a gradient-reduction bucket (``runtime/grads.py``) or a ZeRO-1/2 gather bucket (``runtime/zero1.py``)
    over mesh ``axes`` holds at most: ``BUCKET_BYTES``, or, where a reduce-scatter over those axes' links
    (``hierarchical_time``) would spend more than ``BUCKET_LATENCY_SHARE`` of its bandwidth time on latency, the size
    at which it spends that share (rounded up to a MiB, at most ``BUCKET_CAP``); with the ``total`` bytes reduced
    over those axes given, at most ``total / MIN_BUCKETS`` of it (not below ``BUCKET_BYTES``). The planner records
    the sizes above ``BUCKET_BYTES`` in the plan (``plan.options["bucket_bytes"]``, ``plan_bucket_bytes``), which
    the runtime fills its buckets to and the plan's record prices."""
    mesh = cluster.mesh_shape
    axes = tuple(sorted((a for a in axes if mesh[a] > 1), reverse=True))
    key = (axes, mesh, tuple(cluster.link(a) for a in axes), BUCKET_BYTES)
    hit = _BUCKET_BYTES.get(key)
    if hit is None:
        # a bucket's latency: the default protocol's (its bytes are past the low-latency protocol's range)
        latency = hierarchical_time("reduce_scatter", 0.0, [(mesh[a], cluster.link(a).default_protocol())
                                                             for a in axes])
        per_byte = hierarchical_time("reduce_scatter", float(2**30), [(mesh[a], cluster.link(a).without_latency())
                                                                       for a in axes]) / 2**30
        hit = BUCKET_BYTES
        if latency > 0 and per_byte > 0:
            want = latency / (BUCKET_LATENCY_SHARE * per_byte)
            hit = int(min(BUCKET_CAP, max(BUCKET_BYTES, math.ceil(want / 2**20) * 2**20)))
        if len(_BUCKET_BYTES) > 256:
            _BUCKET_BYTES.clear()
        _BUCKET_BYTES[key] = hit
    if total is not None:
        hit = min(hit, max(BUCKET_BYTES, math.ceil(total / MIN_BUCKETS / 2**20) * 2**20))
    return hit


def _limit(axes, cluster: Cluster, sizes: dict[str, int] | None) -> int:
    """A bucket's size over ``axes``: the plan's record ``sizes`` (``plan_bucket_bytes``, as the runtime reads it),
    or before there is one the links' ``bucket_bytes``."""
    return bucket_bytes(axes, cluster) if sizes is None else bucket_limit(axes, sizes)


def largest_bucket_bytes(cluster: Cluster) -> int:
    """The largest ``bucket_bytes`` over any set of ``cluster``'s mesh axes: what the memory rows hold per bucket in
    flight before the shardings (and so the reduced axes) are known."""
    n = len(cluster.mesh_shape)
    return max(bucket_bytes(axes, cluster) for r in range(1, n + 1) for axes in itertools.combinations(range(n), r))


def plan_bucket_bytes(totals: dict[tuple, float], cluster: Cluster) -> dict[str, int]:
    """The ``plan.options["bucket_bytes"]`` record: per set of mesh axes the plan reduces gradients or gathers
    ZeRO-1/2 parameters over, as ``"0,1"``, its ``bucket_bytes`` for the ``totals`` bytes reduced (else gathered)
    over them, where larger than ``BUCKET_BYTES`` (the runtime's default for the rest)."""
    out = {}
    for axes, total in sorted(totals.items()):
        b = bucket_bytes(axes, cluster, total)
        if axes and b > BUCKET_BYTES:
            out[bucket_key(axes)] = b
    return out


def choose_bucket_bytes(traced: Traced, nodes: dict, reduced: dict, zero: dict, gathered: list,
                        totals: dict[tuple, float], cluster: Cluster, micro_batches: int = 1,
                        reduce_dtype: str | None = None) -> dict[str, int]:
    """The plan's bucket sizes (``plan.options["bucket_bytes"]``): per set of axes, of ``BUCKET_BYTES`` doubled up to
    the links' ``bucket_bytes`` for its ``totals``, the size whose step exposes least of the gradient reduction and
    ZeRO-1/2's gather as the record prices them (``gradient_reduction``, ``param_gather``; the smaller on a tie). A
    larger bucket pays fewer latencies but holds back more of the last one, which only the end of backward launches
    (the links' size alone made Megatron 32B's own plan 1% slower). One pass over the sets, each with the others'
    sizes chosen so far."""
    sizes = plan_bucket_bytes(totals, cluster)

    def exposed(trial: dict[str, int]) -> float:
        return gradient_reduction(traced, nodes, reduced, zero, cluster, micro_batches, trial, reduce_dtype)[1] + \
            param_gather(traced, nodes, gathered, cluster, micro_batches, trial)[1]

    for axes, total in sorted(totals.items()):
        key = bucket_key(axes)
        top = bucket_bytes(axes, cluster, total)
        if not axes or top <= BUCKET_BYTES:
            continue
        ladder = [BUCKET_BYTES * 2**k for k in range(64) if BUCKET_BYTES * 2**k < top] + [top]
        best = None
        for size in ladder:
            trial = {k: v for k, v in sizes.items() if k != key} | ({key: size} if size > BUCKET_BYTES else {})
            t = exposed(trial)
            if best is None or t < best[0] - 1e-12:
                best = (t, trial)
        sizes = best[1]
    return sizes


def grad_reduction_share(nbytes: float, axes, zero1: bool, cluster: Cluster, bucket: int | None = None) -> float:
    """One parameter's share of its gradient bucket's reduction (``grad_reduction_time``): its ``nbytes`` over the
    links and through the bucket's copies, and the bucket's latency in proportion to its bytes (``bucket_bytes``
    a bucket, or ``bucket``; a parameter larger than that pays the latency once)."""
    mesh = cluster.mesh_shape
    kind = "reduce_scatter" if zero1 else "all_reduce"
    axes = sorted(axes, reverse=True)
    return hierarchical_time(kind, nbytes, [(mesh[a], cluster.link(a).without_latency()) for a in axes]) + \
        min(1.0, nbytes / (bucket or bucket_bytes(axes, cluster))) * \
        hierarchical_time(kind, 0.0, [(mesh[a], cluster.link(a).default_protocol()) for a in axes]) + \
        grad_bucket_copy_time(nbytes, zero1, math.prod(mesh[a] for a in axes), cluster.device)


def regather_spec(src, dst, split: tuple[bool, ...], needs_grad: bool, mesh_shape) -> tuple | None:
    """The layout an activation is kept in for backward when its consumer saves it gathered: if the conversion
    ``src -> dst`` ends in an all-gather (its last step that moves data), the runtime
    (``runtime.collectives.all_gather_activation``) keeps that all-gather's input, this spec, and gathers again
    in backward (Megatron sequence parallelism, K22 §4.2.2); None when the conversion ends otherwise."""
    steps = conversion_steps(src, dst, split, needs_grad, mesh_shape)
    moving = [st for st in steps or () if st.fwd != "none"]  # "none": a view of its input, the same storage
    if not moving or moving[-1].fwd != "all_gather":
        return None
    spec = list(src)
    for st in moving[:-1]:
        spec[st.axis] = st.dst
    return tuple(spec)


def regather_time(val: torch.Tensor, kept, dst, cluster: Cluster) -> float:
    """Backward's second all-gather of an activation kept as ``kept`` (``regather_spec``) for a consumer that
    uses it as ``dst``: the last all-gather of the conversion again (the one axis where the two differ). The
    runtime gathers once for all the users that save the one gathered tensor; callers share this time among the
    value's saving users as they share its bytes (exact when they all take the same conversion)."""
    axis = next(i for i, (a, b) in enumerate(zip(kept, dst)) if a != b)
    full = list(kept)
    full[axis] = Replicate()
    return collective_time("all_gather", _local_bytes(val, full, cluster.mesh_shape), cluster.mesh_shape[axis],
                           cluster.link(axis))


@dataclass
class Graphinfo:
    """Per node: options, whether real rules made them, whether its value needs a gradient, its layer."""

    nodes: list[fx.Node]
    options: dict[str, list[OpOption]]
    known: dict[str, bool]
    needs_grad: dict[str, bool]
    layer: dict[str, str]
    kind: dict[str, str]  # "param" | "buffer" | "input" | "constant" | "op"


_LAYER_RE = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def _layer_of(node: fx.Node, traced: Traced) -> str:
    if node.op == "placeholder":
        fqn = traced.params.get(node.name) or traced.buffers.get(node.name) or ""
        m = _LAYER_RE.match(fqn)
        return f"{m.group(1)}.{m.group(2)}" if m else ""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        m = _LAYER_RE.match(path.replace("L['self'].", "").replace("L__self__.", ""))
        if m:
            return f"{m.group(1)}.{m.group(2)}"
    return ""


def _strided_uses(node: fx.Node, mesh_shape) -> list[Strided]:
    """The ``Strided`` layouts the users of a parameter take it in (a fused projection's weight and bias:
    ``strategy.views.fused_blocks``), which the parameter can only be stored in (no step converts them)."""
    out: set[Strided] = set()
    for u in node.users:
        ins = tensor_inputs(u) if u.op == "call_function" else []
        if node in ins:
            j = ins.index(node)
            out.update(p for o in options_for(u, tuple(mesh_shape))[0] for p in o.inputs[j] if isinstance(p, Strided))
    return sorted(out)


def _placeholder_options(node: fx.Node, kind: str, mesh_shape) -> list[OpOption]:
    val = value_of(node)
    strided = _strided_uses(node, mesh_shape) if kind == "param" else []
    per_axis = []
    for n in mesh_shape:
        choices = [Replicate()]
        if kind in ("param", "input") and n > 1:
            choices += [Shard(d) for d in range(val.dim()) if val.shape[d] % n == 0 and val.shape[d] >= n]
            choices += [p for p in strided if p.fits(val.shape[p.dim], n)]
        per_axis.append(choices)
    import itertools

    out = []
    # a dim split over several axes nests in mesh order (DTensor's): stacked expert weights along the expert dim
    # (expert parallelism, ``regions._ep_experts``) and an input along its batch dim (data parallelism over several
    # axes). Other parameters do not: their gradient buckets reduce axis by axis (``edge_matrix``)
    experts = kind == "param" and _expert_weight(node)
    for combo in itertools.product(*per_axis):
        dims = [p.dim for p in combo if is_shard(p)]
        if len(dims) != len(set(dims)):  # (a strided dim never nests: only a parameter that is no expert weight
            # has strided layouts)
            ways = math.prod(n for p, n in zip(combo, mesh_shape) if isinstance(p, Shard))
            if (experts or kind == "input") and set(dims) == {0} and val.shape[0] % ways == 0:
                out.append(OpOption((), tuple(combo)))
            continue
        out.append(OpOption((), tuple(combo)))
        if kind == "param" and any(isinstance(p, Shard) for p in combo):
            # ZeRO-3 / FSDP: gathered for each use, freed, gathered again for backward (a fused projection's
            # strided split stays as it is: ZeRO-3 gathers only its plain splits, over another dim)
            out.append(OpOption((), tuple(combo), tag="zero3"))
    if kind == "param":  # replicated; optimizer states (ZeRO-1), also gradients (ZeRO-2) flat-sliced where replicated
        base = [o for o in out if not o.tag and zero1_ways(o.output, mesh_shape) > 1]
        out += [OpOption((), o.output, tag=tag) for tag in ("zero1", "zero2") for o in base]
    return out


def zero1_ways(spec, mesh) -> int:
    """Over how many ranks a ZeRO-1/2 parameter's optimizer states (ZeRO-2: and gradient) are split: every mesh
    axis it is replicated on (their gradients are equal there after reduction, so each rank can update its slice
    of the flat parameter)."""
    return math.prod(n for p, n in zip(spec, mesh) if isinstance(p, Replicate) and n > 1)


def analyze(traced: Traced, mesh_shape: tuple[int, ...]) -> Graphinfo:
    nodes, options, known, needs_grad, layer, kind = [], {}, {}, {}, {}, {}
    for node in traced.graph.nodes:
        val = value_of(node)
        if node.op == "placeholder":
            if node.name in traced.tied:
                continue
            k = ("param" if node.name in traced.params else "buffer" if node.name in traced.buffers
                 else "constant" if node.name in traced.constants else "input")
            if not isinstance(val, torch.Tensor):
                continue
            kind[node.name] = k
            options[node.name] = _placeholder_options(node, k, mesh_shape)
            known[node.name] = True
            needs_grad[node.name] = (k == "param" and val.dtype.is_floating_point
                                     and traced.params[node.name] not in traced.frozen)
        elif node.op == "call_function":
            if node.target.__name__ == "getitem" if hasattr(node.target, "__name__") else False:
                continue
            if not isinstance(val, torch.Tensor) and not (
                    isinstance(val, (tuple, list)) and val and all(isinstance(v, torch.Tensor) for v in val)):
                continue
            kind[node.name] = "op"
            options[node.name], known[node.name] = options_for(node, mesh_shape)
            options[node.name] = cp_variants(node, options[node.name])  # context parallelism: ring / all-gather
            floaty = any(v.dtype.is_floating_point for v in (val if isinstance(val, (tuple, list)) else [val]))
            needs_grad[node.name] = floaty and any(needs_grad.get(_producer(a)[0].name, False)
                                                   for a in tensor_inputs(node))
        else:
            continue
        nodes.append(node)
        layer[node.name] = _layer_of(node, traced)
    return Graphinfo(nodes, options, known, needs_grad, layer, kind)


_ANALYZED: dict = {}


def _analyzed(traced: Traced, mesh: tuple[int, ...]) -> Graphinfo:
    """``analyze`` memoised for the last few (graph, mesh) pairs (the pipeline search solves each stage mesh twice);
    callers get their own options dict (they replace entries with filtered lists)."""
    key = (id(traced.gm), mesh)
    store = _SESSION.analyzed if _SESSION is not None else _ANALYZED  # a make_plan call keeps all of its own
    hit = store.get(key)
    if hit is None or hit[0]() is not traced.gm:  # the same object, not a new one at a reused address
        hit = (weakref.ref(traced.gm), analyze(traced, mesh))
        if len(store) >= 4 and store is _ANALYZED:
            store.pop(next(iter(store)))
        store[key] = hit
    info = hit[1]
    return dataclasses.replace(info, options=dict(info.options))


def needs_grad_map(traced: Traced) -> dict[str, bool]:
    """Which nodes' values need a gradient: float values downstream of a floating-point parameter."""
    out: dict[str, bool] = {}
    for node in traced.graph.nodes:
        val = value_of(node)
        vals = val if isinstance(val, (tuple, list)) else [val]
        floaty = any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in vals)
        if node.op == "placeholder":
            out[node.name] = node.name in traced.params and floaty and traced.params[node.name] not in traced.frozen
        elif node.op == "call_function":
            out[node.name] = floaty and any(out.get(a.name, False) for a in node.all_input_nodes)
    return out


def _producer(a: fx.Node) -> tuple[fx.Node, int | None]:
    """Resolve ``getitem(multi_output_node, i)`` to its producer and index."""
    if a.op == "call_function" and getattr(a.target, "__name__", "") == "getitem":
        return a.args[0], a.args[1]
    return a, None


def param_reduced_axes(node: fx.Node, chosen: dict[str, OpOption], info: Graphinfo, mesh_shape) -> tuple[bool, ...]:
    """Axes on which a parameter's every use adds up gradients across ranks (reduced after backward)."""
    spec = chosen[node.name].output
    out = []
    for i, n in enumerate(mesh_shape):
        ok = n > 1 and isinstance(spec[i], Replicate) and info.needs_grad.get(node.name, False)
        for user in node.users:
            if not ok:
                break
            uopt = chosen.get(user.name)
            if uopt is None:
                ok = False
                break
            j = tensor_inputs(user).index(node)
            ok = isinstance(uopt.inputs[j][i], Replicate) and is_split(uopt, i)
        out.append(ok)
    return tuple(out)
_SAVES_INPUTS = {aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default, aten.addmm.default,
                 aten.mul.Tensor, aten.div.Tensor, aten.gelu.default, aten.silu.default, aten.pow.Tensor_Scalar,
                 aten.layer_norm.default, aten.rms_norm.default, aten.sin.default, aten.cos.default,
                 aten.scaled_dot_product_attention.default, aten.outer.default, aten.amax.default}
_SAVES_OUTPUT = {aten.tanh.default, aten.rsqrt.default, aten.exp.default, aten.sigmoid.default,
                 aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int,
                 aten.scaled_dot_product_attention.default, aten.sqrt.default, aten.amax.default}
_SAVES_NOTHING = _VIEW_OPS | {aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.clone.default,
                              aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default,
                              aten.embedding.default, aten.cat.default, aten.sum.dim_IntList, aten.mean.dim,
                              aten.sum.default, aten.mean.default, aten.dropout.default, aten.unbind.int,
                              aten.split_with_sizes.default, aten.tensor_split.indices,
                              aten.tensor_split.sections, aten.squeeze.dim, aten.squeeze.dims,
                              aten.cumsum.default, aten.pad.default, aten.constant_pad_nd.default}


# the input an op of ``_SAVES_INPUTS`` does not keep: a bias (the gradient of a sum needs neither addend)
_UNSAVED_INPUT = {aten.linear.default: 2, aten.addmm.default: 0}


def _saves(node: fx.Node) -> tuple[bool, bool]:
    """(saves its floating inputs, saves its output) for backward; unknown ops: conservatively the inputs."""
    t = node.target
    if t in _SAVES_NOTHING:
        return False, False
    return (t in _SAVES_INPUTS or t not in _SAVES_OUTPUT), t in _SAVES_OUTPUT


def saves_input(node: fx.Node, j: int) -> bool:
    """Whether ``node`` keeps its tensor input ``j`` for backward (``_saves``, less a bias): a ZeRO-3 parameter
    it keeps is gathered again in backward, one it does not (a bias, an embedding table) is not."""
    return _saves(node)[0] and _UNSAVED_INPUT.get(node.target) != j


def regathered_input(node: fx.Node, j: int, info: Graphinfo) -> bool:
    """Whether input ``j`` of ``node``, reaching it through an all-gather, is kept for backward as the all-gather's
    input and gathered again there (``regather_spec``): an activation that needs a gradient, which the node saves
    (cross-entropy's saved bytes are its own, see ``saved_bytes``)."""
    a = tensor_inputs(node)[j]
    u, _ = _producer(a)
    return (info.kind.get(u.name) == "op" and info.needs_grad.get(u.name, False) and _saves(node)[0]
            and node.target != aten.cross_entropy_loss.default and value_of(a).dtype.is_floating_point)


def _saving_users(info: Graphinfo) -> dict[str, int]:
    """How many nodes save each value for backward (a value saved by three users is one tensor in memory; so is
    an output its producer saves and a user saves as its input, as attention's output and the projection after)."""
    count: dict[str, int] = defaultdict(int)
    for n in info.nodes:
        if info.kind[n.name] != "op":
            continue
        save_in, save_out = _saves(n)
        if save_in:
            for a in tensor_inputs(n):
                count[a.name] += 1
        if save_out and isinstance(value_of(n), torch.Tensor):
            count[n.name] += 1
    return count


def saved_bytes(node: fx.Node, option: OpOption, info: Graphinfo, mesh, saving_users: dict[str, int]) -> float:
    """Bytes this node's backward keeps from forward under ``option`` (the activation memory model).

    Inputs it saves count in the layout it consumes them in (a gathered input is saved gathered), shared among
    the users that save the same value; parameters are not counted here (model states are). An activation the
    runtime keeps sharded and gathers again in backward (``regather_spec``) depends on its producer's option too:
    the difference is an edge term (``Problem.edge_saved``). Cross-entropy keeps
    its log-probabilities and, at the start of backward where the peak is, two more logits-sized temporaries.
    """
    if node.target is regions.OP:  # what its module's autograd keeps, measured per token at trace time
        r, split = regions.region(node.args[0]), math.prod(n for n, p in zip(mesh, option.inputs[0])
                                                            if isinstance(p, Shard))
        return r.saved_per_token * r.tokens / split
    save_in, save_out = _saves(node)
    total = 0.0
    if save_in:
        for j, a in enumerate(tensor_inputs(node)):
            u, _ = _producer(a)
            v = value_of(a)
            if info.kind.get(u.name) in ("param", "input", "buffer", "constant") or not v.dtype.is_floating_point:
                continue
            total += _local_bytes(v, option.inputs[j], mesh) / max(1, saving_users.get(a.name, 1))
    if save_out:
        val = value_of(node)
        outs = option.output if isinstance(option.output[0], tuple) else (option.output,)
        share = max(1, saving_users.get(node.name, 1)) if isinstance(val, torch.Tensor) else 1
        for v, sp in zip(val if isinstance(val, (tuple, list)) else [val], outs):
            total += _local_bytes(v, sp, mesh) / share
    if node.target == aten.cross_entropy_loss.default:
        total = _local_bytes(value_of(node.args[0]), option.inputs[0], mesh) + transient_bytes(node, option, mesh)
    if node.target == aten.dropout.default and len(node.args) > 1 and node.args[1] > 0:
        total = _local_bytes(value_of(node), option.output, mesh) / value_of(node).dtype.itemsize  # bool mask
    return total


def working_bytes(node: fx.Node, info: Graphinfo, option: OpOption | None, mesh_shape) -> float:
    """What a forward-only op holds while it runs, per device: its activation inputs and its outputs, in the
    layout of ``option`` (unsharded where None). Parameters, buffers and constants are states, counted apart."""
    total = 0.0
    for j, a in enumerate(tensor_inputs(node)):
        v = value_of(a)
        if info.kind.get(a.name) in ("param", "buffer", "constant") or not isinstance(v, torch.Tensor):
            continue
        total += _local_bytes(v, option.inputs[j], mesh_shape) if option is not None and j < len(option.inputs) \
            else float(tensor_bytes(v.shape, v.dtype))
    outs = value_of(node)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    specs = _outs(option) if option is not None else ()
    for i, v in enumerate(outs):
        if isinstance(v, torch.Tensor):
            total += _local_bytes(v, specs[i], mesh_shape) if i < len(specs) else float(tensor_bytes(v.shape, v.dtype))
    return total


def working_vectors(prob: Problem, mesh_shape) -> list[np.ndarray]:
    """Per group, per option: ``working_bytes`` of its op (0 for parameters and inputs). Forward-only plans hold
    no saved activations: their activation peak is the largest op's working set under the chosen options
    (``working_of``), not the sum the ILP's rows take."""
    info = prob.info
    by_name = {n.name: n for n in info.nodes}
    out = []
    for g, members in enumerate(prob.groups):
        n = by_name[members[0]]
        out.append(np.array([working_bytes(n, info, o, mesh_shape) for o in info.options[n.name]])
                   if info.kind[n.name] == "op" else np.zeros(len(prob.node_cost[g])))
    return out


def working_of(vectors: list[np.ndarray], choice) -> float:
    """The forward-only working set of ``choice``: the largest op's (``working_vectors``)."""
    return max((float(v[c]) for v, c in zip(vectors, choice)), default=0.0)


def kv_cache_bytes(node: fx.Node, option: OpOption, mesh, tokens: int) -> float:
    """Bytes of the decoding state a node holds per step under ``option`` when the step decodes over ``tokens``
    cached positions (0: not decoding, none): an attention's K and V cache, its key and value inputs (batch, kv
    heads, sequence, head dim) in the layout it consumes them in, scaled to ``tokens``; a state-space scan's or
    convolution's recurrent state (``ssm_state_bytes``), whatever ``tokens``."""
    if not tokens:
        return 0.0
    if node.target in ssm_rules.SCAN_OPS or node.target in ssm_rules.CONV_OPS:
        return ssm_state_bytes(node, option, mesh)
    if node.target != aten.scaled_dot_product_attention.default:
        return 0.0
    ins = tensor_inputs(node)
    total = 0.0
    for j in (1, 2):
        v = value_of(ins[j])
        total += _local_bytes(v, option.inputs[j], mesh) * tokens / max(1, v.shape[-2])
    return total


def ssm_state_bytes(node: fx.Node, option: OpOption, mesh) -> float:
    """What a decoding Mamba block keeps per sequence between steps, as mamba_ssm's inference cache does, in the
    layout the node consumes its input in: the scan's state (batch, heads, headdim, d_state), ``x``'s bytes per
    position times ``d_state`` (``b`` is (batch, seq, d_state)); the causal convolution's last ``d_conv - 1``
    inputs, ``x``'s bytes per position times that. In the activations' dtype. Per position: the sequence split
    (context parallelism) taken back out, each rank holding the state of its sequences whole."""
    ins = tensor_inputs(node)
    x = value_of(ins[0])
    spec = option.inputs[0]
    seq_ways = math.prod(n for p, n in zip(spec, mesh) if is_shard(p) and p.dim % x.dim() == 1)
    per_position = _local_bytes(x, spec, mesh) * seq_ways / max(1, x.shape[1])
    if node.target in ssm_rules.SCAN_OPS:
        return per_position * value_of(ins[3]).shape[-1]
    return per_position * (value_of(ins[1]).shape[-1] - 1)


def transient_bytes(node: fx.Node, option: OpOption, mesh) -> float:
    """The part of ``saved_bytes`` that is not kept from forward but allocated as this node's backward starts
    (cross-entropy's two logits-sized temporaries): held once, however many micro-batches are in flight."""
    if node.target == aten.cross_entropy_loss.default:
        return 2 * _local_bytes(value_of(node.args[0]), option.inputs[0], mesh)
    return 0.0


def kept_input_bytes(node: fx.Node, option: OpOption, info: Graphinfo, mesh, saving_users: dict[str, int],
                     outside) -> float:
    """The part of ``saved_bytes`` that a checkpointed region around this node still keeps: saved inputs made
    outside the region (``outside(producer)``), which ``torch.utils.checkpoint`` holds to run it again."""
    if not _saves(node)[0] or node.target == aten.cross_entropy_loss.default:
        return 0.0
    total = 0.0
    for j, a in enumerate(tensor_inputs(node)):
        u, _ = _producer(a)
        v = value_of(a)
        if info.kind.get(u.name) in ("param", "input", "buffer", "constant") or not v.dtype.is_floating_point:
            continue
        if outside(u):
            total += _local_bytes(v, option.inputs[j], mesh) / max(1, saving_users.get(a.name, 1))
    return total


def internal_comm_time(node: fx.Node, option: OpOption, cluster: Cluster, with_backward: bool = True,
                       latency: bool = False) -> float:
    """Collectives an option runs inside its lowering (not on an edge): vocab-parallel cross-entropy's three
    all-reduces of one value per token, and the global count of a batch-sharded mean cross-entropy; context-parallel
    attention's K/V exchange and causal imbalance (``strategy.context.cp_comm_time``); an expert-parallel
    token-local node's all-to-alls (``ep_comm_time``).
    ``latency``: the same collectives moving no bytes, what each micro-batch pays whatever its size (``_record``'s
    ``comm_latency_s``). Context parallelism's ring steps hide behind the attention they overlap, which shrinks
    with the micro-batch: not split out (0), its time scales with the batch."""
    if option.tag in CP_TAGS:
        return 0.0 if latency else cp_comm_time(node, option, cluster)
    if node.target is regions.OP:
        return ep_comm_time(node, option, cluster, with_backward, latency)
    if node.target != aten.cross_entropy_loss.default:
        return 0.0
    mesh = cluster.mesh_shape
    logits = option.inputs[0]
    rows = value_of(node.args[0]).shape[0]
    t = 0.0
    for i, p in enumerate(logits):
        if p == Shard(1):
            local_rows = rows / math.prod(n for j, n in enumerate(mesh) if logits[j] == Shard(0))
            t += 3 * collective_time("all_reduce", 0 if latency else local_rows * 4, mesh[i], cluster.link(i))
    for i, p in enumerate(option.output):
        if isinstance(p, Partial):
            t += collective_time("all_reduce", 0 if latency else 8, mesh[i], cluster.link(i))
    return t




def ep_axes(node: fx.Node, inputs: tuple) -> tuple[int, ...]:
    """The mesh axes a token-local node's option (its input specs ``inputs``) splits the experts over."""
    r = regions.region(node.args[0])
    if not r.expert_inputs:
        return ()
    ins = tensor_inputs(node)
    specs = [inputs[ins.index(node.args[1][i])] for i in r.expert_inputs]
    return tuple(a for a in range(len(specs[0])) if any(sp[a] == Shard(0) for sp in specs))


def ep_comm_time(node: fx.Node, option: OpOption, cluster: Cluster, with_backward: bool = True,
                 latency: bool = False) -> float:
    """Expert parallelism inside a token-local node (``regions._ep_experts``): per axis the experts are split
    over, the rank's (token, expert) pairs -- its tokens times top-k hidden rows -- go to their experts' ranks and
    come back, two all-to-alls forward and two more backward (their gradients), each rank keeping 1/n of its
    buffer on average (balanced routing). Axes nest: the pairs the first axis delivers are dispatched again over the
    second. ``latency``: the same all-to-alls moving no bytes."""
    axes = ep_axes(node, option.inputs)
    if not axes:
        return 0.0
    r = regions.region(node.args[0])
    x = node.args[1][0].meta["val"]
    mesh = cluster.mesh_shape
    first = option.inputs[tensor_inputs(node).index(node.args[1][0])]
    split = math.prod(n for a, n in enumerate(mesh) if isinstance(first[a], Shard))
    nbytes = 0.0 if latency else x.numel() / split * max(1, r.top_k) * x.element_size()
    one = sum(collective_time("all_to_all", nbytes, mesh[a], cluster.link(a)) for a in axes)
    return one * (4 if with_backward else 2)


def _fx_vals(x: Any) -> Any:
    return torch.utils._pytree.tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, x)


def _role_filter(node: fx.Node, kind: str, opts: list[OpOption], roles: dict[int, str], traced: Traced,
                 info: Graphinfo, zero: int | None = None) -> list[OpOption]:
    dp_axes = [i for i, r in roles.items() if r == "dp"]
    # stacked expert weights may stay split along the expert dim on a data axis: expert parallelism over the
    # data-parallel ranks (each rank's tokens go to their experts' ranks), not ZeRO (never gathered)
    ep = [o for o in opts if not o.tag and any(o.output[i] == Shard(0) for i in dp_axes)] \
        if kind == "param" and dp_axes and _expert_weight(node) else []
    if kind == "param" and zero is not None:
        opts = _zero_filter(opts, dp_axes, zero)
        opts = opts + [o for o in ep if o not in opts]
    if not roles:
        return opts
    if kind not in ("param", "input"):
        return opts
    val = value_of(node)
    # per axis, computed once: can a parameter be sharded there / can an input be split on its batch dim there
    any_shard = {axis: any(is_shard(q.output[axis]) for q in opts) for axis in roles}
    any_batch = {axis: any(q.output[axis] == Shard(0) for q in opts) for axis in roles}
    if kind == "param":
        # a weight every user takes whole on a tensor axis (a token-local module's, an op without a rule) stays
        # whole there: sharded, it would have to be gathered for each use, which a tensor axis forbids
        any_shard.update({axis: False for axis, role in roles.items()
                          if role == "tp" and _used_whole(node, axis, info)})
    keep = []
    for o in opts:
        ok = True
        for axis, role in roles.items():
            if kind == "param":
                p = o.output[axis]
                if role == "dp" and not isinstance(p, Replicate) and (zero == 0 or o.tag != "zero3") and o not in ep:
                    ok = False  # sharded on a data axis: only as ZeRO-3 (ZeRO-1/2 keep the parameter replicated;
                    # their tags on a layout sharded there, sliced over the other axes, are no ZeRO-3)
                if role == "tp" and isinstance(p, Replicate) and val.dim() >= 2 and any_shard[axis]:
                    ok = False
            if kind == "input" and role == "tp" and not isinstance(o.output[axis], Replicate):
                ok = False
            if kind == "input" and role == "dp" and val.dim() > 0 and any_batch[axis] and o.output[axis] != Shard(0):
                ok = False
        if ok:
            keep.append(o)
    return keep


def _expert_weight(node: fx.Node) -> bool:
    """``node`` is a parameter only token-local nodes use, each as one of its stacked expert weights
    (``Region.expert_inputs``): split along dim 0 there, it is expert parallel."""
    users = list(node.users)
    return bool(users) and all(
        u.target is regions.OP and any(u.args[1][i] is node for i in regions.region(u.args[0]).expert_inputs)
        for u in users)


def _used_whole(node: fx.Node, axis: int, info: Graphinfo) -> bool:
    """Every user of ``node`` is an op whose every option takes it whole (Replicate) on ``axis``."""
    for u in node.users:
        uopts = info.options.get(u.name)
        if info.kind.get(u.name) != "op" or not uopts:
            return False
        j = tensor_inputs(u).index(node)
        if not _whole_only(uopts, j, axis):
            return False
    return bool(node.users)


def _zero_filter(opts: list[OpOption], dp_axes: list[int], zero: int) -> list[OpOption]:
    """Force a ZeRO level on the data-parallel axes: 0 keeps parameters replicated there with whole optimizer
    states; 1 keeps them replicated with the optimizer states flat-sliced (the distributed optimizer: gradients
    reduce-scattered, each rank updates its slice, the parameter all-gathered after the step; any size, no
    dimension needs to divide); 2 also keeps only the gradient's slice (the ZeRO paper's P_os+g: the whole
    gradient lives until its bucket is reduce-scattered); 3 shards parameters along a dimension, gathered for each
    use in forward and again in backward."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero}: ZeRO levels are 0, 1, 2, 3")
    if not dp_axes:
        if zero == 0:  # nothing is data parallel: nothing to keep whole or slice
            return opts
        raise ValueError(f"zero={zero} slices model states over the data-parallel axes, but no mesh axis has role "
                         "'dp': name one, roles={'<axis>': 'dp'}, or leave zero unset")

    def ok(o: OpOption) -> bool:
        sharded = all(isinstance(o.output[i], Shard) for i in dp_axes)
        if zero < 3:
            return not any(is_shard(o.output[i]) for i in dp_axes) and o.tag == ("", "zero1", "zero2")[zero]
        return sharded and o.tag == "zero3"

    keep = [o for o in opts if ok(o)]
    if zero == 3:  # a strided layout ZeRO-3 cannot split further (a fused projection's bias: its one dim is the
        # strided one) stays, whole on the data axes, rather than leave its users no layout they can take
        have = {tuple(p for i, p in enumerate(o.output) if i not in dp_axes) for o in keep}
        keep += [o for o in opts if not o.tag and any(isinstance(p, Strided) for p in o.output) and
                 not any(is_shard(o.output[i]) for i in dp_axes) and
                 tuple(p for i, p in enumerate(o.output) if i not in dp_axes) not in have]
    return keep or [o for o in opts if not o.tag and not any(is_shard(o.output[i]) for i in dp_axes)]


def check_inputs(opts: PlanOptions) -> None:
    """Arguments no plan can satisfy, named before any solve (``PlanInputError``): a ZeRO level, memory budget,
    checkpoint or offload mode, stage count or pipeline schedule that does not exist."""
    if opts.zero not in (None, 0, 1, 2, 3):
        raise PlanInputError(f"zero={opts.zero!r}: ZeRO levels are 0 (none), 1 (optimizer states), 2 (and "
                             "gradients), 3 (and parameters); or leave it None for the planner to choose")
    if opts.memory_limit is not None and not opts.memory_limit > 0:
        raise PlanInputError(f"memory budget {opts.memory_limit!r} bytes per device: give a positive size (bytes or "
                             "'12GiB'), or leave it None for the device's capacity")
    _check_checkpoint_modes(opts.checkpoint)
    _forced_offload(opts)
    from autopart.solver.pipeline import SCHEDULES

    pp = opts.pipeline if isinstance(opts.pipeline, dict) else {}  # its keys: PlanOptions checks them
    for k in ("stages", "virtual"):
        if k in pp and not (isinstance(pp[k], int) and not isinstance(pp[k], bool) and pp[k] >= 1):
            raise PlanInputError(f"pipeline[{k!r}]={pp[k]!r}: give a whole number >= 1")
    if "schedule" in pp and pp["schedule"] not in SCHEDULES:
        raise PlanInputError(f"pipeline['schedule']={pp['schedule']!r}: schedules are {', '.join(SCHEDULES)}")
    if pp.get("virtual", 1) > 1 and pp.get("schedule", "interleaved") != "interleaved":
        raise PlanInputError(f"pipeline virtual={pp['virtual']} is the interleaved schedule's chunks per rank, but "
                             f"schedule={pp['schedule']!r} runs one: drop virtual, or use schedule='interleaved'")


def _check_forward_only(traced: Traced, opts: PlanOptions) -> None:
    """Recompute or activation offload forced on a forward-only graph (it saves nothing for backward): no plan can
    honour it (``PlanInputError``, before any solve)."""
    if any(fqn not in traced.frozen for fqn in traced.params.values()):
        return
    if any(m != "none" for m in _checkpoint_modes(opts.checkpoint)):
        raise PlanInputError(f"checkpoint={opts.checkpoint!r} on a forward-only graph (no parameter requires a "
                             "gradient): recompute frees what forward saves for backward, and serving saves "
                             "nothing; plan it with checkpoint='none' (or leave it to the planner)")
    if "activations" in (_forced_offload(opts) or ()):
        raise PlanInputError(f"offload={opts.offload!r} on a forward-only graph (no parameter requires a "
                             "gradient): activation offload moves what forward saves for backward, and serving "
                             "saves nothing (a K/V cache stays on the device); plan it with offload='none' or "
                             "'optimizer'")


def _checkpoint_modes(checkpoint: str | dict | None) -> list[str]:
    """The modes a ``checkpoint`` argument names: one for every layer, or one per layer of a dict."""
    return [checkpoint] if isinstance(checkpoint, str) else \
        list(checkpoint.values()) if isinstance(checkpoint, dict) else []


def _check_checkpoint_modes(checkpoint: str | dict | None) -> None:
    for mode in _checkpoint_modes(checkpoint):
        if mode not in ("full", "selective", "none"):
            raise PlanInputError(f"checkpoint={checkpoint!r}: modes are 'full', 'selective' or 'none' (one for "
                                 "every layer, or a dict layer -> mode)")


class PlanInputError(ValueError):
    """A planning argument that cannot be right whatever the solver does (a pin that does not parse or names
    nothing, a checkpoint or offload mode that does not exist): raised as is, not as "no plan fits"."""


class NoPlanFits(ValueError):
    """No plan fits the memory budget. Beside its message, what callers read without parsing it (``advise``):
    ``min_memory``, the smallest per-device peak any plan reaches (bytes; nan when not known), ``limit`` the bytes
    it had to fit, ``binding`` the moment of the step where memory binds, and ``terms``, the largest terms of that
    peak as ``(kind, node, bytes)`` (kind: "model states (parameter, gradient, optimizer)", "weights",
    "K/V cache", "recurrent state" or "activations"). A pipelined search's error carries its plan without stages'
    figures (the whole mesh, one stage) when it has them, in ``without``."""

    def __init__(self, message: str, min_memory: float = math.nan, limit: float = math.nan, binding: str = "",
                 terms: list[tuple[str, str, float]] | None = None, without: NoPlanFits | None = None):
        super().__init__(message)
        self.min_memory, self.limit, self.binding, self.terms = min_memory, limit, binding, list(terms or [])
        self.without = without

    @property
    def figures(self) -> NoPlanFits:
        """The error whose figures describe this failure: itself, or, a pipelined search's without figures of its
        own, its plan without stages' (``without``)."""
        return self if self.terms or self.without is None else self.without

    def held(self) -> dict[str, float]:
        """Bytes of each kind of state decoding holds between steps among the largest terms at the smallest peak:
        ``{"K/V cache": b, "recurrent state": b}`` (of ``figures``)."""
        out: dict[str, float] = defaultdict(float)
        for kind, _, b in self.figures.terms:
            if kind in ("K/V cache", "recurrent state"):
                out[kind] += b
        return dict(out)

    def peak(self) -> float:
        """The smallest per-device peak any plan reaches (of ``figures``)."""
        return self.figures.min_memory


def _pin_filter(name: str, opts: list[OpOption], pin: str) -> list[OpOption]:
    # "S(2) [cp_ring]": that tagged variant only, as options print (OpOption.__str__); "R []": the untagged one
    # only (``Plan.param_pins``: not the ZeRO-1/2 slices of the same placement); "R": any variant of it
    text, bracket, tag = pin.partition("[")
    try:
        spec, tag = parse_spec(text.strip()), tag.rstrip("] ").strip()
    except ValueError as e:
        raise PlanInputError(f"pins[{name!r}] = {pin!r}: {e}. A placement has one entry per mesh axis: R "
                             "(replicated), S(dim) (sharded along dim), P (partial sum), e.g. 'RS(0)' on a 2-D "
                             "mesh") from None
    axes = next((len(o.output) for o in opts if o.output and not isinstance(o.output[0], tuple)), len(spec))
    if len(spec) != axes:
        raise PlanInputError(f"pins[{name!r}] = {pin!r} has {len(spec)} entries; the mesh has {axes} axes: give "
                             f"one placement per axis (R, S(dim) or P), e.g. {'R' * (axes - 1) + 'S(0)'!r}")
    pin = text.strip() + (f" [{tag}]" if bracket else "")
    keep = [o for o in opts if (o.output if not (o.output and isinstance(o.output[0], tuple)) else o.output[0]) == spec
            and (not bracket or o.tag == tag)]
    if not keep:
        raise PlanInputError(f"pin {name}={pin!r} is not a legal placement here; legal output specs: "
                         f"{sorted({spec_str(o.output) for o in opts if not isinstance(o.output[0], tuple)})}")
    return keep


@dataclass
class Problem:
    """The planner's view before solving: groups of tied nodes and their priced options."""

    info: Graphinfo
    groups: list[list[str]]
    group_of: dict[str, int]
    node_cost: list[np.ndarray]
    compute_cost: list[np.ndarray]
    node_memory: list[np.ndarray]
    edges: dict[tuple[int, int], np.ndarray]
    tied_layers: int
    fwd_compute: list[np.ndarray] = field(default_factory=list)  # forward-only compute (what recompute costs)
    region: list[str] = field(default_factory=list)  # per group: "" | "layer" | "attention" | "layer_output"
    grad_memory: list[np.ndarray] = field(default_factory=list)  # parameter gradients after the reduction
    bucket_memory: list[np.ndarray] = field(default_factory=list)  # gradients that go through reduction buckets
    scale: list[int] = field(default_factory=list)  # per group: how many nodes its costs stand for
    # what full / selective recompute still keeps of a node's saved bytes: inputs from outside the layer / region
    keep_full: list[np.ndarray] = field(default_factory=list)
    keep_selective: list[np.ndarray] = field(default_factory=list)
    # per edge (u group, v group) whose consumer keeps a gathered activation as its shard (``regather_spec``):
    # (shard bytes, gathered bytes the consumer's node term counts), both (Ku, Kv) and scaled like the edge cost, and
    # whether the value is kept under full / selective recompute of the consumer's layer (it comes from outside
    # the recomputed region); ``edge_memory_rows`` turns them into the ILP's edge memory
    edge_saved: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, bool, bool]] = field(default_factory=dict)
    # per group: the latency of its communication (inside its lowering, of its graph outputs), which every
    # micro-batch pays; ``node_cost`` holds it ``passes - 1`` more times (``PlanOptions.latency_passes``), which
    # ``_record`` takes off again
    node_latency: list[np.ndarray] = field(default_factory=list)
    passes: int = 1
    # gradient accumulation without stages (``PlanOptions.micro_batches``; empty otherwise): per group, the gradient
    # it holds from the first micro-batch's backward to the last one's, when the reduction starts. The end-of-forward
    # row holds it: every micro-batch but the first runs forward beside it. ZeRO-2 holds the whole gradient there
    # and its slice (``grad_memory``) only after the reduction; the other levels the same in both
    held_grad_memory: list[np.ndarray] = field(default_factory=list)


_ATTN_RE = re.compile(r"(^|[._])(self_)?attn($|[._])|attention", re.IGNORECASE)


def _region(node: fx.Node, info: Graphinfo, last_of_layer: set[str]) -> str:
    """Where activation checkpointing reaches this node: the layer's output is kept (it is the next layer's
    input); attention-module nodes are what selective recompute drops; other layer nodes only full recompute."""
    if not info.layer.get(node.name) or info.kind[node.name] != "op":
        return ""
    if node.name in last_of_layer:
        return "layer_output"
    stack = node.meta.get("nn_module_stack") or {}
    inner = list(stack.values())[-1][0] if stack else ""
    return "attention" if _ATTN_RE.search(inner) else "layer"


def param_state_bytes(val: torch.Tensor, spec, mesh, opts: PlanOptions, tag: str = "",
                      trainable: bool = True) -> tuple[float, float]:
    """(parameter, optimizer-state) bytes of one parameter's local shard under ``spec``; its gradient is the
    parameter's size (ZeRO-2's slice: ``param_grad_bytes``). ZeRO-1/2 (``tag`` "zero1"/"zero2") keep a
    ``1/zero1_ways`` slice of the flat states (rounded up). A frozen parameter (``trainable=False``) has no
    optimizer state."""
    local = _local_bytes(val, spec, mesh)
    if not trainable:
        return local, 0.0
    optim = local * opts.optimizer_bytes_per_param / val.dtype.itemsize
    if tag in ("zero1", "zero2"):
        ways = zero1_ways(spec, mesh)
        numel = local / val.dtype.itemsize
        optim = math.ceil(numel / ways) * opts.optimizer_bytes_per_param
    return local, optim


def param_grad_bytes(val: torch.Tensor, spec, mesh, tag: str = "", grad_dtype: str | None = None) -> float:
    """Bytes of one parameter's gradient kept to the optimizer step: its local shard's size; under ZeRO-2 this
    rank's ``1/zero1_ways`` slice of it (rounded up; the whole gradient only passes through a reduction bucket).
    In ``grad_dtype`` (``PlanOptions.grad_dtype``) where given, else the parameter's."""
    scale = reduce_scale(val.dtype, grad_dtype)  # bytes of the gradient's dtype per byte of the parameter's
    local, size = _local_bytes(val, spec, mesh) * scale, val.dtype.itemsize * scale
    if tag != "zero2":
        return local
    return math.ceil(local / size / zero1_ways(spec, mesh)) * size


def zero1_gather_time(val: torch.Tensor, spec, cluster: Cluster, latency: bool = True) -> float:
    """ZeRO-1/2's all-gather of the updated parameter after the optimizer step, axis by axis (innermost first).
    The runtime gathers the parameters in flat buckets (``runtime/zero1.py``): the ILP prices each parameter's
    bandwidth alone (``latency=False``), the plan's record adds the latency once per bucket
    (``zero1_gather_latency``). Beside the collectives, the runtime's copies: the updated slice packed into the
    bucket and the gathered block unpacked into the parameter (read and write, at the device's bandwidth): work
    plain data parallelism does not do, which is what separates the two when their collectives cost the same
    (a ring's reduce-scatter and all-gather are its all-reduce)."""
    mesh = cluster.mesh_shape
    axes = [i for i, p in enumerate(spec) if isinstance(p, Replicate) and mesh[i] > 1]
    ways = max(1, math.prod(mesh[i] for i in axes))
    size = _local_bytes(val, spec, mesh) / ways
    t = roofline_time(0.0, 2 * size * (ways + 1), cluster.device) if axes else 0.0
    for i in reversed(axes):
        size *= mesh[i]
        link = cluster.link(i)
        t += collective_time("all_gather", size, mesh[i], link if latency else link.without_latency())
    return t


_FORWARD_FLOOR: dict = {}
_WORK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def op_work(n: fx.Node) -> tuple[int, int, torch.dtype | None, int]:
    """(forward FLOPs, bytes read and written, compute dtype, backward FLOPs) of op node ``n``, whatever the mesh:
    memoised per graph (by name; a graph that gained or lost nodes since is priced afresh) -- reading the values
    of a node's arguments (``_fx_vals``) cost more than the pricing itself, once per stage mesh the search
    builds a problem for (the whole graph's floors: 0.4 s of a Llama-70B plan)."""
    graph = n.graph
    memo = _WORK.get(graph)
    if memo is None or memo[0] != len(graph.nodes):
        memo = _WORK[graph] = (len(graph.nodes), {})
    hit = memo[1].get(n.name)
    if hit is None:
        val = value_of(n)
        args = _fx_vals(n.args)
        flops = node_flops(n.target, args, _fx_vals(n.kwargs), val)
        nbytes = node_bytes(_fx_vals(list(n.args) + list(n.kwargs.values())), val, n.target)
        hit = memo[1][n.name] = (flops, nbytes, compute_dtype(args, val), backward_flops(n.target, flops, n.args))
    return hit


def _forward_floor(info: Graphinfo, device, world: int) -> tuple[dict[str, float], float]:
    """Forward compute before each node with every op's roofline split over ``world`` devices, and in all."""
    before, clock, _ = _floors(info, device, world)
    return before, clock


def _floors(info: Graphinfo, device, world: int) -> tuple[dict[str, float], float, dict[str, float]]:
    """``_forward_floor``'s two, and each op's backward seconds (of those that need a gradient) at the same split;
    memoised for the last few (graph, device, world) (the pipeline search builds a problem per stage mesh)."""
    graph = info.nodes[0].graph if info.nodes else None
    key = (id(graph), device, world)
    hit = _FORWARD_FLOOR.get(key)
    if hit is not None and hit[0]() is graph:
        return hit[1]
    before, clock, bwd = {}, 0.0, {}
    for n in info.nodes:
        before[n.name] = clock
        if info.kind[n.name] == "op":
            flops, nbytes, dt, bflops = op_work(n)  # fp32 matmuls run at the device's fp32 rate (dt)
            fwd = roofline_time(flops / world, nbytes / world, device, n.target, n.kwargs, dtype=dt)
            clock += fwd
            if info.needs_grad[n.name]:
                both = roofline_time((flops + bflops) / world, 3 * nbytes / world,
                                     device, n.target, n.kwargs, with_backward=True, dtype=dt)
                bwd[n.name] = max(0.0, both - fwd)
    if len(_FORWARD_FLOOR) >= 8:
        _FORWARD_FLOOR.pop(next(iter(_FORWARD_FLOOR)))
    if graph is not None:
        _FORWARD_FLOOR[key] = (weakref.ref(graph), (before, clock, bwd))
    return before, clock, bwd


def ilp_bucket_bytes(info: Graphinfo, cluster: Cluster, reduce_dtype: str | None = None) -> dict[tuple[int, ...], int]:
    """Per set of mesh axes (ascending, each of more than one rank), the ``bucket_bytes`` the ILP prices a gradient's
    share of a bucket's latency with, before the shardings are chosen: for every trainable parameter reduced over
    them in its smallest layout replicated there (sharded on every other axis), as ``grad_reduction_shares``
    estimates the chain."""
    mesh = cluster.mesh_shape
    whole = sum(value_of(n).numel() * value_of(n).element_size() * reduce_scale(value_of(n).dtype, reduce_dtype)
                for n in info.nodes if info.kind[n.name] == "param" and info.needs_grad[n.name])
    multi = [i for i, k in enumerate(mesh) if k > 1]
    out = {}
    for r in range(1, len(multi) + 1):
        for axes in itertools.combinations(multi, r):
            others = math.prod(mesh[i] for i in range(len(mesh)) if i not in axes)
            out[axes] = bucket_bytes(axes, cluster, whole / others)
    return out


def grad_reduction_shares(info: Graphinfo, cluster: Cluster, micro_batches: int = 1,
                          reduce_dtype: str | None = None) -> dict[tuple[str, tuple[int, ...]], float]:
    """Per parameter node and set of mesh axes its gradient is summed over, the share of its bucketed reduction's
    seconds (``grad_reduction_share``) the ILP prices: 1 where a second more of it would end the step a second
    later, 0 where backward hides it. Empty (all of it) where the device does not overlap communication with
    compute.

    As ``gradient_reduction`` runs the chain in the plan's step, estimated before the shardings are chosen: per set
    of axes, every trainable parameter reduced over them (its smallest layout replicated there: sharded on every
    other axis) and backward as fast as the whole mesh makes it (each op's roofline split over every device); a
    parameter's gradient is ready when backward has passed its first user. The chain ``end_k = max(end_(k-1),
    ready_k) + cost_k`` ends ``max(0, end - window)`` after backward; a parameter's reduction delays that end
    one-for-one iff the step's reduction is exposed at all and the chain never waits for a gradient after it, its
    share is then 1, else 0 (the derivative of the exposed time in its seconds). Without this the ILP priced every
    gradient reduction in full where the step hides all but its last buckets, and chose tensor over data
    parallelism that was faster (Llama-8B on 8 H100s: a TP+DP plan 1.3-1.7% slower than ZeRO-1). Under gradient
    accumulation over ``micro_batches`` only the last micro-batch's backward (1/m of the traced one) hides it."""
    if not cluster.device.comm_overlap:
        return {}
    mesh = cluster.mesh_shape
    _, _, bwd = _floors(info, cluster.device, math.prod(mesh))
    after, clock = {}, 0.0  # backward seconds from its start until it has passed node n
    for n in reversed(info.nodes):
        clock += bwd.get(n.name, 0.0) / micro_batches
        after[n.name] = clock
    window = clock
    params = [n for n in info.nodes if info.kind[n.name] == "param" and info.needs_grad[n.name]]
    ready = {n.name: max((after[u.name] for u in n.users if u.name in after), default=window) for n in params}
    shares: dict[tuple[str, tuple[int, ...]], float] = {}
    for axes, bucket in ilp_bucket_bytes(info, cluster, reduce_dtype).items():
        others = math.prod(mesh[i] for i in range(len(mesh)) if i not in axes)
        size = {n.name: value_of(n).numel() * value_of(n).element_size() / others *
                reduce_scale(value_of(n).dtype, reduce_dtype) for n in params}
        chain = sorted((ready[n.name], grad_reduction_share(size[n.name], axes, False, cluster, bucket), n.name)
                       for n in params)
        ends, end = [], 0.0
        for rd, c, _ in chain:
            end = max(end, rd) + c
            ends.append(end)
        exposed = end > window
        busy = True  # no wait for a gradient after this one
        for k in range(len(chain) - 1, -1, -1):
            shares[chain[k][2], axes] = 1.0 if exposed and busy else 0.0
            if k > 0 and ends[k - 1] < chain[k][0]:
                busy = False
    return shares


def zero1_gather_shares(info: Graphinfo, cluster: Cluster, micro_batches: int = 1) -> dict[str, float]:
    """Per ZeRO-1/2-able parameter node and set of gathered mesh axes, the share of its after-step gather's
    bandwidth the ILP prices: the part of
    ``param_gather``'s exposed time it adds, per second of its bandwidth. Empty (all of it) where the device does
    not overlap communication with compute.

    Estimated before the shardings are chosen, per set of gathered axes, with every parameter that can be ZeRO-1/2 over
    them so (its cheapest such layout) and the forward as fast as the whole mesh makes it (each op's roofline split over
    every device): the buckets' chain ``C_k`` against each parameter's first use ``e_k`` (``exposed_before`` with all in
    flight, in the order of first use, as the runtime packs them) is late by ``L_k = max(0, C_k - e_k)``, the exposed
    time is ``max_k L_k``, and parameter ``k`` is charged the increase of that running maximum it causes. The shares sum
    to the record's exposed gather when every such parameter is ZeRO-1/2 (fewer shorten the chain: the ILP then prices a
    little more than the record); the earliest parameters (the embedding) carry them, the rest hide. A pipeline stage's
    first micro-batch is a fraction of the traced batch (``solver.pipeline.gather_exposed`` prices that window): there
    the ILP's shares are lower than what the pipeline record charges. Under gradient accumulation over
    ``micro_batches`` only the first micro-batch's forward (1/m of the traced one) hides the gather.

    The chain holds each parameter's share of its bucket's latency beside its bandwidth (its gathered bytes over
    ``bucket_bytes``, at most one bucket's: ``zero1_bucket_latency``), as the record's chain does
    (``param_gather``); the ILP prices the bandwidth alone (``zero1_gather_time(latency=False)``), so a share can
    exceed 1 where latency is exposed. Without it a mesh axis across many nodes (96 ranks: ~1 ms a bucket) hid a
    chain the record found exposed (Megatron 16B on (96, 2) H100s: 0.037 s exposed, 0.001 s priced)."""
    if not cluster.device.comm_overlap:
        return {}
    before, clock = _forward_floor(info, cluster.device, math.prod(cluster.mesh_shape))
    mesh = cluster.mesh_shape
    chains: dict[tuple, list] = defaultdict(list)  # per set of gathered axes: (node, bandwidth, latency, first use)
    for n in info.nodes:
        if info.kind[n.name] != "param" or not info.needs_grad[n.name]:
            continue
        cheapest: dict[tuple, tuple[float, float]] = {}
        for o in info.options[n.name]:
            if o.tag in ("zero1", "zero2"):
                axes, _, gathered = zero1_gather_entry(value_of(n), o.output, mesh)
                bw = zero1_gather_time(value_of(n), o.output, cluster, latency=False)
                if bw < cheapest.get(axes, (math.inf, 0.0))[0]:
                    cheapest[axes] = (bw, gathered)
        first = min((before[u.name] for u in n.users if u.name in before), default=clock) / micro_batches
        for axes, (bw, gathered) in cheapest.items():
            if bw > 0:
                chains[axes].append((n.name, bw, gathered, first))
    shares = {}
    for axes, chain in chains.items():  # a layout family at a time: gathering over more axes hides less
        bucket = bucket_bytes(axes, cluster, sum(c[2] for c in chain))
        chain = [(name, bw, min(1.0, g / bucket) * zero1_bucket_latency(axes, cluster), e) for name, bw, g, e in chain]
        chain.sort(key=lambda c: c[3])
        done, worst = 0.0, 0.0
        for name, bw, lat, e in chain:
            done += bw + lat
            late = max(worst, done - e)
            shares[name, axes] = (late - worst) / bw
            worst = late
    return shares


def zero1_gather_entry(val: torch.Tensor, spec, mesh) -> tuple[tuple[int, ...], torch.dtype, float]:
    """(axes, dtype, gathered bytes) of a ZeRO-1/2 parameter, as the runtime fills its gather buckets: the axes it
    is replicated on, and its padded slice times the ranks over them."""
    axes = tuple(i for i, p in enumerate(spec) if isinstance(p, Replicate) and mesh[i] > 1)
    ways = math.prod(mesh[i] for i in axes)
    return axes, val.dtype, math.ceil(_local_bytes(val, spec, mesh) / val.dtype.itemsize / ways) * ways * \
        val.dtype.itemsize


def zero1_bucket_latency(axes, cluster: Cluster) -> float:
    """Latency of one gather bucket over ``axes``: one all-gather per axis (its time for no bytes, under the default
    protocol: a bucket is past the low-latency protocol's range)."""
    return sum(collective_time("all_gather", 0.0, cluster.mesh_shape[i], cluster.link(i).default_protocol())
               for i in axes)


def zero1_buckets(entries, cluster: Cluster, sizes: dict[str, int] | None = None) -> list[tuple[tuple[int, ...],
                                                                                                 list[int]]]:
    """ZeRO-1/2's after-step gather buckets as ``runtime/zero1.py`` fills them, in its launch order: per set of
    axes and dtype, parameters in the order given (the runtime's: forward's first use), at most ``bucket_bytes``
    gathered bytes (``_limit``: the plan's ``sizes``; a larger parameter alone). ``entries``: each parameter's
    ``zero1_gather_entry``. Returned: (axes, entry indices) per bucket."""
    out: list[tuple[tuple[int, ...], list[int]]] = []
    open_: dict[tuple, tuple[list[int], float]] = {}
    for i, (axes, dtype, nbytes) in enumerate(entries):
        b, used = open_.get((axes, dtype), (None, 0.0))
        if b is None or used + nbytes > _limit(axes, cluster, sizes):
            b, used = [], 0.0
            out.append((axes, b))
        b.append(i)
        open_[(axes, dtype)] = (b, used + nbytes)
    return out


def zero1_gather_latency(entries, cluster: Cluster, sizes: dict[str, int] | None = None) -> float:
    """Seconds ZeRO-1/2's bucketed parameter all-gather after the step adds to the bandwidth the ILP prices per
    parameter (``zero1_gather_time(latency=False)``): the latency, once per bucket per axis (``zero1_buckets``)."""
    return sum(zero1_bucket_latency(axes, cluster) for axes, _ in zero1_buckets(entries, cluster, sizes))


def zero1_latency_shares(entries, cluster: Cluster, sizes: dict[str, int] | None = None) -> list[float]:
    """Per entry (``zero1_gather_entry``, in the runtime's order), its share of its bucket's latency
    (``zero1_buckets``), by gathered bytes: they sum to ``zero1_gather_latency``. What a pipeline stage's units add
    to each parameter's bandwidth: parameters smaller than a bucket but too large to share one (two 16 MiB blocks
    of a 25 MiB bucket) pay a whole bucket each, as the runtime gathers them."""
    out = [0.0] * len(entries)
    for axes, idx in zero1_buckets(entries, cluster, sizes):
        lat = zero1_bucket_latency(axes, cluster)
        nbytes = sum(entries[i][2] for i in idx)
        for i in idx:
            out[i] = lat * entries[i][2] / nbytes if nbytes else lat / len(idx)
    return out


def param_gather(traced: Traced, nodes: dict, gathered: list, cluster: Cluster,
                 micro_batches: int = 1, sizes: dict[str, int] | None = None) -> tuple[float, float]:
    """(total, exposed) seconds of ZeRO-1/2's parameter all-gather after the step, from the plan's node records
    ``nodes`` (``fwd_s``, ``op``) and ``gathered``: per ZeRO-1/2 parameter, in the order forward first uses them
    (the runtime's bucket order), (its node, its ``zero1_gather_entry``, seconds of its bandwidth).

    As the runtime runs it (``runtime/zero1.py``): buckets of ``zero1_buckets``, each one all-gather per axis (its
    bandwidth and latency), launched after the step ``GATHER_IN_FLIGHT`` at a time, one after the other; the next
    forward waits for bucket ``k`` just before the first use of its parameters. Where the device overlaps
    communication with compute (``Device.comm_overlap``) the forward compute before that use hides it
    (``autopart.cost.comm.exposed_before``): the first bucket, needed at once, is exposed, the others as far as
    forward does not keep up. Otherwise all of it is exposed. A tied group's stand-ins (a block reduction's
    ``virtual_layers``) share their node's first use, which counts them exposed sooner than their layers would.
    With gradient accumulation over ``micro_batches`` only the first micro-batch's forward (1/m of the traced
    batch's) hides it: the later ones find every bucket gathered."""
    buckets = zero1_buckets([e for _, e, _ in gathered], cluster, sizes)
    cost = [zero1_bucket_latency(axes, cluster) + sum(gathered[i][2] for i in idx) for axes, idx in buckets]
    total = sum(cost)
    if not cluster.device.comm_overlap or not buckets:
        return total, total
    graph = [n for n in traced.graph.nodes if n.name in nodes]
    before, clock = {}, 0.0  # forward compute before each node
    for n in graph:
        before[n.name] = clock
        if nodes[n.name]["op"] not in ("param", "buffer", "constant", "input"):
            clock += nodes[n.name]["fwd_s"] / micro_batches
    node_of = {n.name: n for n in graph}
    first_use = {name: min((before[u.name] for u in node_of[name].users if u.name in before), default=clock)
                 for name in {g[0] for g in gathered}}
    deadline = [min(first_use[gathered[i][0]] for i in idx) for _, idx in buckets]
    return total, exposed_before(deadline, cost, GATHER_IN_FLIGHT)


def grad_reduction_time(nbytes: float, axes, zero1: bool, cluster: Cluster) -> float:
    """The data-parallel reduction of ``nbytes`` of a rank's gradients over mesh ``axes``: one all-reduce over
    them; for ZeRO-1/2 parameters a reduce-scatter (the rank keeps the slice of the summed gradient its optimizer
    states cover). Over several axes the bytes shrink outward (``cost.comm.hierarchical_time``), innermost axis
    first, as the runtime reduces them (``runtime/grads.py``); the bucket's copies in and out of its flat buffer
    (``grad_bucket_copy_time``) are part of it."""
    mesh = cluster.mesh_shape
    levels = [(mesh[i], cluster.link(i)) for i in sorted(axes, reverse=True)]
    ways = math.prod(mesh[i] for i in axes)
    return hierarchical_time("reduce_scatter" if zero1 else "all_reduce", nbytes, levels) + \
        grad_bucket_copy_time(nbytes, zero1, ways, cluster.device)


def grad_bucket_copy_time(nbytes: float, zero1: bool, ways: int, device: Device) -> float:
    """Seconds the runtime's gradient bucket (``runtime/grads.py``) moves ``nbytes`` of gradients through memory
    around its collective, the link's time aside: an all-reduced bucket is a ``cat`` of the gradients into one flat
    buffer (read and write) and a copy of the sum back into them (read and write), 4 x ``nbytes``; a reduce-scattered
    one (ZeRO-1/2) is a zeroed flat buffer, the gradients copied into it (3 x ``nbytes``) and the rank's summed slice
    copied out (2 x ``nbytes / ways``). On 4 gloo ranks sharing 2 cores (GPT d_model 256, dp4: one 13.7 MB bucket)
    the ``cat`` and the copies back were 13 ms of rank 0's profiled step, priced at nothing before."""
    moved = 3 * nbytes + 2 * nbytes / max(1, ways) if zero1 else 4 * nbytes
    return moved / device.mem_bandwidth


def param_nodes(traced: Traced) -> dict[str, fx.Node]:
    """Each parameter's placeholder by FQN (a parameter reached under two names: the first placeholder)."""
    graph = {n.name: n for n in traced.graph.nodes}
    out: dict[str, fx.Node] = {}
    for ph, fqn in traced.params.items():
        out.setdefault(fqn, graph[ph])
    return out


def reduction_totals(traced: Traced, nodes: dict, reduced: dict, mesh,
                     reduce_dtype: str | None = None) -> dict[tuple, float]:
    """Bytes of gradients the plan reduces over each set of mesh axes (``reduced``: FQN -> axes; each gradient its
    local size, from its node's ``output`` spec in ``nodes``, in the reduction's dtype), keyed by the sorted axes."""
    node_of = param_nodes(traced)
    out: dict[tuple, float] = defaultdict(float)
    for fqn, axes in reduced.items():
        n = node_of[fqn]
        out[tuple(sorted(axes))] += _local_bytes(value_of(n), parse_spec(nodes[n.name]["output"]), mesh) * \
            reduce_scale(value_of(n).dtype, reduce_dtype)
    return dict(out)


def gradient_reduction(traced: Traced, nodes: dict, reduced: dict, zero: dict, cluster: Cluster,
                       micro_batches: int = 1, sizes: dict[str, int] | None = None,
                       reduce_dtype: str | None = None) -> tuple[float, float]:
    """(total, exposed) seconds of the data-parallel gradient reduction of the parameters in ``reduced`` (FQN ->
    axes), from the plan's node records ``nodes`` (``compute_s``, ``fwd_s``, ``output``) and ``zero`` levels.

    As the runtime runs it: per set of reduced axes, gradients in backward order (a parameter's is final when
    backward reaches its first user) in buckets of ``bucket_bytes``, each one collective per axis
    (``grad_reduction_time``: its latency too) launched as its last gradient is produced. Where the device overlaps
    communication with compute (``Device.comm_overlap``) the buckets run behind the backward compute still to come
    (``autopart.cost.comm.exposed_after``); what is left when backward ends is exposed. Otherwise all of it is.
    With gradient accumulation over ``micro_batches`` the buckets launch from the last micro-batch's backward
    (``runtime/module.py``): only its backward, 1/m of the traced batch's, hides them. ``sizes``: the plan's bucket
    sizes (``plan_bucket_bytes``; None: the links' ``bucket_bytes``); ``reduce_dtype``: the dtype the buckets sum in
    (``PlanOptions.reduce_dtype``; None: each gradient's own)."""
    graph = [n for n in traced.graph.nodes if n.name in nodes]
    order = {n.name: i for i, n in enumerate(graph)}
    bwd = [(nodes[n.name]["compute_s"] - nodes[n.name]["fwd_s"]) / micro_batches
           if nodes[n.name]["op"] not in ("param", "buffer", "constant", "input") else 0.0 for n in graph]
    after = np.concatenate([np.cumsum(bwd[::-1])[::-1], [0.0]])  # backward time of node i and all later nodes
    window = float(after[0])
    mesh = cluster.mesh_shape
    node_by_fqn = {}
    for ph, fqn in traced.params.items():
        node_by_fqn.setdefault(fqn, ph)
    node_of = {n.name: n for n in graph}
    by_set: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for fqn, axes in reduced.items():
        n = node_of[node_by_fqn[fqn]]
        users = [order[u.name] for u in n.users if u.name in order]
        ready = float(after[min(users)]) if users else window
        nbytes = _local_bytes(value_of(n), parse_spec(nodes[n.name]["output"]), mesh) * \
            reduce_scale(value_of(n).dtype, reduce_dtype)
        by_set[(tuple(axes), zero.get(fqn) in (1, 2))].append((ready, nbytes))  # ZeRO-1/2: reduce-scatter
    launches = []
    for (axes, zero1), grads in by_set.items():
        grads.sort()
        start = 0
        limit = _limit(axes, cluster, sizes)
        while start < len(grads):  # at most bucket_bytes per bucket, as the runtime fills them
            end, nb = start, 0.0
            while end < len(grads) and (end == start or nb + grads[end][1] <= limit):
                nb += grads[end][1]
                end += 1
            launches.append((grads[end - 1][0], grad_reduction_time(nb, axes, zero1, cluster)))
            start = end
    total = sum(c for _, c in launches)
    if not cluster.device.comm_overlap:
        return total, total
    launches.sort()
    return total, exposed_after([r for r, _ in launches], [c for _, c in launches], window)


def optimizer_step_bytes(val: torch.Tensor, option, mesh, opts: PlanOptions) -> tuple[float, float, float]:
    """(weight bytes the step updates, bytes it reads and writes, gradient bytes it reads) for one trainable
    parameter: the local shard, or under ZeRO-1/2 this rank's slice; its states and weight read and written, its
    gradient (in ``PlanOptions.grad_dtype``) read."""
    local, states = param_state_bytes(val, option.output, mesh, opts, option.tag, True)
    sliced = option.tag in ("zero1", "zero2")
    moved = param_grad_bytes(val, option.output, mesh, "zero2") if sliced else local
    grad = param_grad_bytes(val, option.output, mesh, "zero2" if sliced else "", opts.grad_dtype)
    return moved, 2 * (states + moved) + grad, grad


def optimizer_offload_seconds(val: torch.Tensor, option, mesh, opts: PlanOptions, trainable: bool,
                              cluster: Cluster) -> float:
    """Seconds one parameter's optimizer step on the host adds (``offload`` "optimizer"), per step: its gradient
    down and its updated value up the device-host link (the local shard, or under ZeRO-1/2 this rank's slice
    only: the all-gather after the step spreads the slices, DeepSpeed's ZeRO-Offload), and the step itself, which
    is memory-bound on the host: the states and the host copy read and written, the gradient read
    (``Device.host_step_bandwidth``, the host's memory bandwidth per rank; 0 on presets without one: not priced).
    A frozen parameter has no step."""
    if not trainable:
        return 0.0
    moved, touched, grad = optimizer_step_bytes(val, option, mesh, opts)
    device = cluster.device
    step = touched / device.host_step_bandwidth if device.host_step_bandwidth else 0.0
    return (moved + grad) / device.host_bandwidth + step


def optimizer_step_seconds(val: torch.Tensor, option, mesh, opts: PlanOptions, trainable: bool, cluster: Cluster,
                           on_host: bool = False) -> float:
    """Seconds one parameter's optimizer step takes, once per step (whatever the micro-batches). On the device a
    memory-bound pass over the rank's share of it (its local shard; under ZeRO-1/2 its slice, the point of the
    distributed optimizer): the states and the weight read and written, the gradient read, at
    ``Device.optimizer_bandwidth`` (``mem_bandwidth`` unless calibrated), plus ``Device.optimizer_param_latency``
    (the step's work per tensor: 0 unless calibrated). A master copy is part of the states
    (``optimizer_bytes_per_param``). On the host (``on_host``: the plan offloads the optimizer),
    ``optimizer_offload_seconds``. A frozen parameter has no step."""
    if not trainable:
        return 0.0
    if on_host:
        return optimizer_offload_seconds(val, option, mesh, opts, trainable, cluster)
    _, touched, _ = optimizer_step_bytes(val, option, mesh, opts)
    device = cluster.device
    return touched / (device.optimizer_bandwidth or device.mem_bandwidth) + device.optimizer_param_latency


def optimizer_step_costs(prob: Problem, offload: frozenset, cluster: Cluster, opts: PlanOptions) -> list[np.ndarray]:
    """Per group, per option, the seconds of the optimizer step of its parameters (``optimizer_step_seconds``;
    zero for ops, buffers and frozen parameters): priced in the ILP beside the nodes' costs, so that ZeRO-1/2's
    sliced step counts for it, and reported apart (``predicted["optimizer_step_s"]``), since it is paid once per
    step, not per micro-batch."""
    node_of = {n.name: n for n in prob.info.nodes}
    mesh = cluster.mesh_shape
    on_host = "optimizer" in offload
    out = []
    for gid, members in enumerate(prob.groups):
        first = members[0]
        if prob.info.kind[first] != "param" or not prob.info.needs_grad[first]:
            out.append(np.zeros(len(prob.node_cost[gid])))
            continue
        val = value_of(node_of[first])
        n = prob.scale[gid] if prob.scale else len(members)  # a tied group stands for this many nodes
        out.append(n * np.array([optimizer_step_seconds(val, o, mesh, opts, True, cluster, on_host)
                                 for o in prob.info.options[first]]))
    return out


def apply_offload(prob: Problem, cost: list[np.ndarray], mem: list[np.ndarray], offload: frozenset,
                  cluster: Cluster, opts: PlanOptions) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Host offload (ZeRO-Offload style), priced with the device-host link:

    * ``optimizer``: optimizer states live on the host and the optimizer steps there: device memory loses the
      states; each step moves the gradient down and the parameter back up (2 x local parameter bytes; with
      ZeRO-1/2, 2 x this rank's slice: DeepSpeed's ZeRO-Offload) and runs on the host's memory bandwidth
      (``optimizer_offload_seconds``, priced with the device's step by ``optimizer_step_costs``);
    * ``activations``: tensors saved for backward go to the host in forward and come back in backward
      (``torch.autograd.graph.save_on_cpu``): device activation memory is dropped, 2 x their bytes cross the link.
    On a CPU cluster the host is the device: the memory moves nowhere, so offload only costs time there.
    """
    if not offload:
        return cost, mem
    cost, mem = list(cost), list(mem)
    bw = cluster.device.host_bandwidth
    on_cpu = cluster.device.name == "cpu"
    node_of = {n.name: n for n in prob.info.nodes}
    mesh = cluster.mesh_shape
    for gid, members in enumerate(prob.groups):
        kind = prob.info.kind[members[0]]
        if kind == "param" and "optimizer" in offload:
            val = value_of(node_of[members[0]])
            popts = prob.info.options[members[0]]
            pairs = [param_state_bytes(val, o.output, mesh, opts, o.tag, prob.info.needs_grad[members[0]])
                     for o in popts]
            n = prob.scale[gid] if prob.scale else len(members)  # a tied group stands for this many nodes
            states = np.array([s for _, s in pairs]) * n
            if not on_cpu:
                mem[gid] = mem[gid] - states
        elif kind == "op" and "activations" in offload:
            cost[gid] = cost[gid] + 2 * mem[gid] / bw
            if not on_cpu:
                mem[gid] = mem[gid] * 0.0
    return cost, mem


def _forced_offload(opts: PlanOptions) -> frozenset | None:
    if opts.offload is None:
        return None
    want = {"none": set(), "optimizer": {"optimizer"}, "activations": {"activations"},
            "both": {"optimizer", "activations"}}
    if isinstance(opts.offload, str):
        if opts.offload not in want:
            raise PlanInputError(f"offload={opts.offload!r}: use 'none', 'optimizer', 'activations' or 'both'")
        return frozenset(want[opts.offload])
    bad = set(opts.offload) - {"optimizer", "activations"}
    if bad:
        raise PlanInputError(f"offload {sorted(bad)}: what can be offloaded is 'optimizer' and 'activations'")
    return frozenset(opts.offload)


def apply_checkpoint(prob: Problem, modes: dict[str, str]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Node costs and memories with ``modes`` (layer -> "full" | "selective") applied: checkpointed nodes keep only
    the inputs their region takes from outside it (the layer's input under full recompute; what enters attention
    under selective) and run their forward again (forward compute; their forward collectives are not re-priced).
    Tied groups are scaled by the share of their members' layers in each mode."""
    cost = [c.copy() for c in prob.node_cost]
    mem = [m.copy() for m in prob.node_memory]
    for gid in range(len(prob.groups)):
        full, sel = _checkpoint_shares(prob, gid, modes)
        if full or sel:
            keep_f = prob.keep_full[gid] if prob.keep_full else 0.0
            keep_s = prob.keep_selective[gid] if prob.keep_selective else 0.0
            mem[gid] = mem[gid] * (1 - full - sel) + keep_f * full + keep_s * sel
            cost[gid] = cost[gid] + prob.fwd_compute[gid] * (full + sel)
    return cost, mem


def _checkpoint_shares(prob: Problem, gid: int, modes: dict[str, str]) -> tuple[float, float]:
    """The shares of group ``gid``'s members recomputed under full / selective checkpointing (``modes``)."""
    reg = prob.region[gid]
    if not modes or not reg or reg == "layer_output":
        return 0.0, 0.0
    members = prob.groups[gid]
    full = sum(1 for n in members if modes.get(prob.info.layer[n]) == "full") / len(members)
    sel = sum(1 for n in members if modes.get(prob.info.layer[n]) == "selective" and reg == "attention") \
        / len(members)
    return full, sel


def edge_memory_rows(prob: Problem, keys: list[tuple[int, int]], modes: dict[str, str], offload: frozenset,
                     cluster: Cluster) -> list[np.ndarray | None]:
    """Per edge of ``keys``, its bytes on ``MEMORY_ROWS`` as (Ku, Kv, 2), or None: an activation the consumer
    keeps as its shard and gathers again in backward (``Problem.edge_saved``) holds the shard where the consumer's
    node term counted it gathered, at the end of forward. Under checkpointing this applies as far as the consumer
    still keeps the value (``apply_checkpoint``'s shares); with activations offloaded the node term is gone and the
    shard stays on the device (the runtime's saved-tensor hook keeps it rather than offload it)."""
    out: list[np.ndarray | None] = []
    offloaded = "activations" in offload and cluster.device.name != "cpu"
    for key in keys:
        rec = prob.edge_saved.get(key)
        if rec is None:
            out.append(None)
            continue
        shard, gathered, outside_full, outside_sel = rec
        full, sel = _checkpoint_shares(prob, key[1], modes)
        kept = (1 - full - sel) + full * outside_full + sel * outside_sel
        em = np.zeros(shard.shape + (len(MEMORY_ROWS),))
        em[:, :, 0] = (shard if offloaded else shard - gathered) * kept
        out.append(em)
    return out


def _tie_groups(info: Graphinfo, enabled: bool) -> tuple[list[list[str]], dict[str, int], int]:
    """Group nodes of structurally identical repeated layers (``blocks.0`` ~ ``blocks.1`` ~ ...)."""
    by_layer: dict[str, list[fx.Node]] = defaultdict(list)
    for n in info.nodes:
        if info.layer[n.name]:
            by_layer[info.layer[n.name]].append(n)
    tied: dict[str, int] = {}
    groups: list[list[str]] = []
    layers = 0
    if enabled:
        families: dict[str, list[str]] = defaultdict(list)
        for lay in by_layer:
            families[lay.rsplit(".", 1)[0]].append(lay)

        def sig(n: fx.Node):
            v = value_of(n)
            shp = tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(tuple(x.shape) for x in v)
            return (n.op, str(n.target) if n.op != "placeholder" else info.kind[n.name], shp,
                    len(info.options[n.name]))

        for lays in families.values():
            seqs = [[sig(n) for n in by_layer[lay]] for lay in lays]
            if len(lays) < 2 or any(s != seqs[0] for s in seqs):
                continue
            layers = max(layers, len(lays))
            for j in range(len(seqs[0])):
                gid = len(groups)
                groups.append([by_layer[lay][j].name for lay in lays])
                for name in groups[-1]:
                    tied[name] = gid
    for n in info.nodes:
        if n.name not in tied:
            tied[n.name] = len(groups)
            groups.append([n.name])
    return groups, tied, layers


def _node_prices(rep: fx.Node, opts_r: list[OpOption], val, info: Graphinfo, cluster: Cluster, opts: PlanOptions,
                 dp_axes: list[int], saving_users: dict[str, int], last_of_layer: set[str]) -> tuple[np.ndarray, ...]:
    """Per option of one node: (compute, gradient bytes, bucketed gradient bytes, forward compute, internal
    communication, memory, bytes kept under full / selective recompute, the internal communication's latency:
    what each micro-batch pays), for one node (``build_problem``)."""
    mesh = cluster.mesh_shape
    device = cluster.device
    comp = np.zeros(len(opts_r))
    grad = np.zeros(len(opts_r))
    bucket = np.zeros(len(opts_r))
    fwd = np.zeros(len(opts_r))
    icomm = np.zeros(len(opts_r))
    ilat = np.zeros(len(opts_r))
    mem = np.zeros(len(opts_r))
    # no gathered copy is kept from forward to backward: a parameter sharded on a data axis is ZeRO-3 (gathered
    # again for backward); ZeRO-1/2 keep it replicated (the "sharded + gathered copy" layout is gone)
    kfull = np.zeros(len(opts_r))
    ksel = np.zeros(len(opts_r))
    if info.kind[rep.name] == "op":
        flops, nbytes, dt, bflops = op_work(rep)  # fp32 matmuls run at the device's fp32 rate (dt)
        g = info.needs_grad[rep.name]
        rows = rep.target == aten.embedding.default and not g
        if rows:
            nbytes = embedding_rows_bytes(rep)
        tflops = flops + (bflops if g else 0)
        tbytes = nbytes * (3 if g else 1)
        for a, o in enumerate(opts_r):
            f = math.prod(n for n, cut in zip(mesh, split_axes(o, len(mesh))) if cut)
            share = local_bytes_share(rep, o, val, mesh, f, rows_only=rows)
            comp[a] = roofline_time(tflops / f, tbytes * share, device, rep.target, rep.kwargs, with_backward=g,
                                    dtype=dt)
            fwd[a] = roofline_time(flops / f, nbytes * share, device, rep.target, rep.kwargs, dtype=dt)
            icomm[a] = internal_comm_time(rep, o, cluster, with_backward=g)
            if icomm[a] > 0:
                ilat[a] = min(icomm[a], internal_comm_time(rep, o, cluster, with_backward=g, latency=True))
            if g:
                mem[a] = saved_bytes(rep, o, info, mesh, saving_users)
                if info.layer.get(rep.name):
                    lay = info.layer[rep.name]
                    kfull[a] = kept_input_bytes(rep, o, info, mesh, saving_users,
                                                lambda u, lay=lay: info.layer.get(u.name) != lay)
                    ksel[a] = kept_input_bytes(
                        rep, o, info, mesh, saving_users, lambda u, lay=lay: info.layer.get(u.name) != lay or
                        _region(u, info, last_of_layer) != "attention")
            kv = kv_cache_bytes(rep, o, mesh, opts.kv_cache_tokens)
            if kv:  # decoding reads the whole cache once per step: of K/V heads held whole, the one it attends with
                mem[a] += kv
                gqa = gqa_split(rep, tensor_inputs(rep), o.inputs, mesh) if rep.target == SDPA else None
                comp[a] += kv / (gqa.kv_heads if gqa else 1) / device.mem_bandwidth
    elif info.kind[rep.name] == "param":
        for a, o in enumerate(opts_r):
            local, optim = param_state_bytes(val, o.output, mesh, opts, o.tag, info.needs_grad[rep.name])
            mem[a] = local + optim
            # the runtime's work per parameter per step, more for a ZeRO-3 one (0 unless calibrated)
            comp[a] = device.param_latency + (device.zero3_latency if o.tag == "zero3" else 0.0)
            if o.tag in ("zero1", "zero2") and info.needs_grad[rep.name]:
                # all of it; build_problem keeps the share forward does not hide; latency per bucket: _record
                icomm[a] = zero1_gather_time(val, o.output, cluster, latency=False)
            grad[a] = param_grad_bytes(val, o.output, mesh, o.tag, opts.grad_dtype) if info.needs_grad[rep.name] \
                else 0.0
            if any(isinstance(o.output[i], Replicate) for i in (dp_axes or range(len(mesh))) if mesh[i] > 1):
                # summed in a flat bucket, whole, in the reduction's dtype
                bucket[a] = local * reduce_scale(val.dtype, opts.reduce_dtype) if info.needs_grad[rep.name] else 0.0
    elif info.kind[rep.name] in ("buffer", "constant"):
        for a, o in enumerate(opts_r):
            mem[a] = _local_bytes(val, o.output, mesh)
    return comp, grad, bucket, fwd, icomm, mem, kfull, ksel, ilat


def _whole_only(opts: list[OpOption], j: int, axis: int) -> bool:
    """Every option of a node takes its input ``j`` whole on ``axis`` (an op without a sharding rule, or whose rule
    cannot split this input): on a data-parallel axis its batch is gathered for it, computed on every rank and
    split again after it, a priced fallback rather than no plan."""
    return all(isinstance(o.inputs[j][axis], Replicate) for o in opts)


def _edge_prices(val, a: fx.Node, idx: int | None, j: int, uopts: list[OpOption], vopts: list[OpOption], g: bool,
                 bucketed: bool, fixed_axes: list[int], data_axes: list[int], kept_sharded: bool,
                 saving_users: dict[str, int], cluster: Cluster, cache: dict, spec_ids: dict, saved: bool = True,
                 fused: tuple[bool, np.ndarray] | None = None, reduction_share: dict | None = None,
                 buckets: dict | None = None, reduce_dtype: str | None = None, passes: int = 1):
    """Prices of one edge pattern per value, unscaled (``build_problem``): conversion seconds (Ku, Kv) and, when the
    consumer keeps the value sharded (``regathered_input``), the shard and gathered bytes it saves (Ku, Kv), else
    None. ``cache`` and ``spec_ids``: the conversion times and spec ids shared by the problems of a session.
    ``saved``: the consumer keeps it for backward (``saves_input``: under ZeRO-3, gathered again there).
    ``fused``: (into, forward seconds of the linear per option) where the edge's collective runs as a collective
    matmul with the consumer (into) or producer linear (``tp_overlap_hidden``). ``reduction_share``: per set of
    summed axes, the share of a bucketed gradient's reduction priced (``grad_reduction_shares``; 1 where absent).
    ``buckets``: a bucketed gradient's bucket bytes per set of summed axes (``ilp_bucket_bytes``).
    ``passes``: forward and backward run that many times a step over parts of the traced batch (micro-batches:
    ``PlanOptions.latency_passes``). The bytes are the traced batch's whatever the count, but an activation's
    conversion pays its links' latency in every pass (``latency_s`` of ``plan.collectives``: its conversion of no
    bytes, at most its exposed time), and a parameter's conversion (ZeRO-3's gathers and reduce-scatters, a
    weight's layout change) runs whole in every pass; a bucketed gradient's reduction runs once."""
    mesh = cluster.mesh_shape
    mat = np.zeros((len(uopts), len(vopts)))
    lkey = ("latency", val.dim(), val.dtype, g)
    vkey = (tuple(val.shape), val.dtype, g, bucketed, saved, tuple(sorted(buckets.items())) if bucketed and buckets
            else (), reduce_dtype if bucketed else None)
    # specs as small ints (hashing Placement tuples per pair dominated this loop)
    srcs = [output_spec(ao, idx) for ao in uopts]
    src_ids = [spec_ids.setdefault(sp, len(spec_ids)) for sp in srcs]
    src_fixed = [tuple(spec_ids.setdefault((sp[i],), len(spec_ids)) if is_shard(sp[i]) else -1
                       for i in fixed_axes) for sp in srcs]
    regathers = [ao.tag == "zero3" for ao in uopts]
    scatters = [ao.tag in ("zero1", "zero2") for ao in uopts]  # gradient reduce-scattered into slices
    src_keys = list(zip(src_ids, regathers, scatters))
    fixed_kinds = set(src_fixed) if fixed_axes else set()
    shard_b = gathered_b = None
    if kept_sharded:
        shard_b, gathered_b = np.zeros_like(mat), np.zeros_like(mat)
        share = max(1, saving_users.get(a.name, 1))
    # a weight's dim split over several axes (stacked expert weights): its pieces nest, which no per-axis step
    # converts, so such a layout is used as stored
    mesh_t = tuple(mesh)
    nested = [bucketed and _nested_shard(sp, mesh_t) for sp in srcs]
    for bi, bo in enumerate(vopts):
        dst = bo.inputs[j]
        dst_id = spec_ids.setdefault(dst, len(spec_ids))
        dst_nested = bucketed and _nested_shard(dst, mesh_t)
        dst_fixed = tuple(spec_ids.setdefault((dst[i],), len(spec_ids)) for i in fixed_axes)
        split = split_axes(bo, len(mesh))
        if any(not isinstance(dst[i], Replicate) for i in data_axes):
            mat[:, bi] = math.inf  # dp axis: weights are used whole (stored sharded under ZeRO, gathered)
            continue
        # tp axis: weights stay sharded in use; dp: the batch stays split
        clash = {sf for sf in fixed_kinds if any(s != -1 and s != d for s, d in zip(sf, dst_fixed))}
        known = cache.setdefault((vkey, dst_id, split), {})  # by (source spec id, regathered, scattered)
        col = []
        for ai, sk in enumerate(src_keys):
            if clash and src_fixed[ai] in clash or (nested[ai] or dst_nested) and srcs[ai] != dst:
                col.append(math.inf)
                continue
            parts = known.get(sk)
            if parts is None:
                parts = known[sk] = transition_parts(val, srcs[ai], dst, split, g, cluster, bucketed=bucketed,
                                                     regather=regathers[ai] and saved, scatter_grad=scatters[ai],
                                                     chained=regathers[ai], buckets=buckets if bucketed else None,
                                                     reduce_dtype=reduce_dtype)
            red = parts[1] * (reduction_share.get(parts[2], 1.0) if reduction_share else 1.0)
            t = parts[0] + red
            if fused is not None:
                into, lin_fwd = fused
                ok = (vkey, src_ids[ai], dst_id, split, "overlap", into)
                comms = cache.get(ok)
                if comms is None:
                    comms = cache[ok] = tp_overlap_comms(val, srcs[ai], dst, split, g, cluster, into)
                if comms:  # a collective hidden whole leaves 0 (not -1e-16 of rounding, which the solver rejects)
                    t = max(0.0, t - hidden_behind(comms, lin_fwd[bi if into else ai]))
            if kept_sharded:  # saved as its shard, gathered again in backward
                rk = (vkey, src_ids[ai], dst_id, split, "regather")
                hit = cache.get(rk)
                if hit is None:
                    kept = regather_spec(srcs[ai], dst, split, g, mesh)
                    hit = cache[rk] = (0.0, 0.0, 0.0) if kept is None else (
                        regather_time(val, kept, dst, cluster), _local_bytes(val, kept, mesh),
                        _local_bytes(val, dst, mesh))
                t += hit[0] / share
                shard_b[ai, bi], gathered_b[ai, bi] = hit[1] / share, hit[2] / share
            if passes > 1 and t < math.inf:
                if bucketed:  # everything but the once-a-step reduction runs in every pass
                    t += (passes - 1) * (t - red)
                else:
                    lk = (lkey, src_ids[ai], dst_id, split)
                    lat = cache.get(lk)
                    if lat is None:
                        lat = cache[lk] = transition_time(_no_bytes(val), srcs[ai], dst, split, g, cluster)
                    t += (passes - 1) * min(lat, t)
            col.append(t)
        mat[:, bi] = col
    return mat, shard_b, gathered_b


def pin_names(traced: Traced) -> dict[str, str]:
    """Parameter FQN (a tied alias too) -> its placeholder's name: what a pin may name besides a graph node."""
    names = {fqn: n for n, fqn in traced.params.items()}
    for fqn, others in traced.aliases.items():
        for o in others:
            names.setdefault(o, next(n for n, f in traced.params.items() if f == fqn))
    return names


def build_problem(traced: Traced, cluster: Cluster, axis_names: tuple[str, ...], opts: PlanOptions) -> Problem:
    mesh = cluster.mesh_shape
    info = _analyzed(traced, tuple(mesh))
    roles = {}
    for name, role in opts.roles.items():
        if name not in axis_names:
            raise PlanInputError(f"role given for mesh axis {name!r}, but the mesh axes are {axis_names}")
        roles[axis_names.index(name)] = role
    fqn_to_node = pin_names(traced)
    for key, pin in opts.pins.items():
        name = fqn_to_node.get(key, key)
        if name not in info.options:
            import difflib

            close = difflib.get_close_matches(key, [*fqn_to_node, *info.options], n=3)
            raise PlanInputError(f"pin for {key!r}: no parameter or graph node has that name"
                                 + (f"; did you mean {', '.join(map(repr, close))}?" if close else ""))
        info.options[name] = _pin_filter(key, info.options[name], pin)
    dp_axes = [i for i, r in roles.items() if r == "dp"]
    batch_split = dict.fromkeys(dp_axes, False)  # does some input split its batch there
    # a stage's plan runs in micro-batches, as does an accumulated one: the ILP prices the whole batch, so a
    # batch split over several axes that micro-batches no longer divide would look best and then forbid them
    # (``pipelining._batch_shards``). There the batch nests only over the data-parallel axes the roles name
    nest_only = frozenset(dp_axes) if opts.stage or opts.micro_batches > 1 else None
    for n in info.nodes:
        kept = _role_filter(n, info.kind[n.name], info.options[n.name], roles, traced, info, opts.zero)
        if info.kind[n.name] == "input" and value_of(n).dim() > 0 and len(dp_axes) > 1 and \
                all(any(o.output[i] == Shard(0) for o in info.options[n.name]) for i in dp_axes) and not kept:
            names = [axis_names[i] for i in dp_axes]
            ways = math.prod(mesh[i] for i in dp_axes)
            raise PlanInputError(
                f"roles make mesh axes {names} data parallel: input {n.name!r} (shape {tuple(value_of(n).shape)}) "
                f"must split its batch (dim 0) over all of them at once, into {ways} equal pieces, and "
                f"{value_of(n).shape[0]} does not. Pass a batch that is a multiple of {ways}, or give one of these "
                "axes another role ('tp') or none")
        info.options[n.name] = kept or info.options[n.name]
        if nest_only is not None and info.kind[n.name] in ("op", "input"):
            exempt = tuple(sorted(NESTED_INPUTS[n.target](n, tensor_inputs(n)))) if n.target in NESTED_INPUTS else ()
            info.options[n.name] = [o for o in info.options[n.name] if _batch_nesting(o, mesh, exempt) <= nest_only]
        if info.kind[n.name] == "input" and value_of(n).dim() > 0:
            for i in dp_axes:
                batch_split[i] |= any(o.output[i] == Shard(0) for o in info.options[n.name])
    unsplit = [i for i, ok in batch_split.items() if not ok and mesh[i] > 1]
    if unsplit and opts.role_warnings and not opts.stage and any(
            info.kind[n.name] == "input" and value_of(n).dim() > 0 for n in info.nodes):
        shapes = {n.name: tuple(value_of(n).shape) for n in info.nodes
                  if info.kind[n.name] == "input" and value_of(n).dim() > 0}
        i = unsplit[0]
        warnings.warn(
            f"roles make mesh axis {axis_names[i]!r} ({mesh[i]} devices) data parallel, but no input's batch (dim 0) "
            f"splits {mesh[i]} ways evenly (inputs {shapes}): every device of that axis computes the whole batch "
            f"(ZeRO still shards states there). Pass a batch that is a multiple of {mesh[i]} to split it",
            stacklevel=2)
    if opts.local_batch:
        dp_axes = [i for i, r in roles.items() if r == "dp"] or list(range(len(mesh)))
        for n in info.nodes:
            if info.kind[n.name] == "input" and value_of(n).dim() > 0:
                keep = [o for o in info.options[n.name]
                        if all(o.output[i] == Shard(0) for i in dp_axes)]
                if not keep:
                    raise ValueError(f"local_batch=True needs input {n.name} (shape {tuple(value_of(n).shape)}) "
                                     f"sharded on dim 0 over axes {dp_axes}, which its size does not allow")
                info.options[n.name] = keep
    groups, group_of, tied_layers = _tie_groups(info, opts.tie_layers)
    node_of = {n.name: n for n in info.nodes}
    dp_axes = [i for i, r in roles.items() if r == "dp"]
    # ZeRO-1/2's after-step gather: what forward does not hide
    gather_share = zero1_gather_shares(info, cluster, opts.micro_batches)
    # the gradient reduction: what backward does not hide
    reduction_shares = {} if opts.stage else grad_reduction_shares(info, cluster, opts.micro_batches,
                                                                   opts.reduce_dtype)
    buckets = ilp_bucket_bytes(info, cluster, opts.reduce_dtype)
    share_axes = sorted({ax for _, ax in reduction_shares})
    node_cost, compute_cost, node_memory, fwd_compute, region, grad_memory, bucket_memory = [], [], [], [], [], [], []
    fwd_once = []  # forward seconds per option of one member of each group (what a collective matmul hides behind)
    keep_full, keep_selective = [], []
    saving_users = _saving_users(info)
    last_of_layer: set[str] = set()
    seen_layer: dict[str, str] = {}
    for n in info.nodes:
        if info.kind[n.name] == "op" and info.layer[n.name]:
            seen_layer[info.layer[n.name]] = n.name
    last_of_layer = set(seen_layer.values())
    # conversion times by (value, source, target, ...): shared by every problem of a make_plan call on this cluster
    cache, spec_ids = _SESSION.pricing(cluster) if _SESSION is not None else ({}, {})
    if _SESSION is not None:
        _SESSION.keep.append(traced)  # the node and edge prices below name the graph by id: alive while they are
    out_nodes = set()
    for o in traced.graph.find_nodes(op="output"):
        for a in torch.utils._pytree.tree_leaves(o.args):
            if isinstance(a, fx.Node):
                out_nodes.add(_producer(a))
    scales = []
    passes = opts.latency_passes or opts.micro_batches
    accumulating = opts.micro_batches > 1 and not opts.stage
    held_grad_memory: list[np.ndarray] = []
    node_latency = []
    for members in groups:
        rep = node_of[members[0]]
        k = opts.virtual_layers if opts.virtual_layers and len(members) > 1 else len(members)
        scales.append(k)
        opts_r = info.options[rep.name]
        val = value_of(rep)
        # a node's prices depend on the graph, the node, its options (the same objects in every problem of a
        # session on this mesh: ``_analyzed``), the data axes and two options: problems that differ elsewhere (roles
        # on other nodes, the ZeRO level of parameters, budgets) share them
        nkey = ("node", id(traced.gm), rep.name, tuple(map(id, opts_r)), tuple(dp_axes),
                opts.optimizer_bytes_per_param, opts.kv_cache_tokens, opts.reduce_dtype)
        hit = cache.get(nkey)
        if hit is None:
            hit = cache[nkey] = (opts_r, *_node_prices(rep, opts_r, val, info, cluster, opts, dp_axes, saving_users,
                                                       last_of_layer))
        _, comp, grad, bucket, fwd, icomm, mem, kfull, ksel, ilat = hit
        held = grad  # what it holds while micro-batches accumulate
        if passes > 1 and info.kind[rep.name] == "param" and info.needs_grad[rep.name]:
            # several micro-batches (accumulation, a pipeline's): the runtime accumulates ZeRO-2's whole gradient
            # and reduce-scatters it into the slice only from the last backward (runtime/grads.py), so until then
            # it holds what ZeRO-1 holds
            whole = [a for a, o in enumerate(opts_r) if o.tag == "zero2"]
            if whole:
                held = grad.copy()  # the cached prices stay the one pass's
                for a in whole:
                    held[a] = param_grad_bytes(val, opts_r[a].output, mesh, "", opts.grad_dtype)
                if opts.stage:
                    # a pipeline stage holds it through the schedule, whose peak is mid-way (its memory is the
                    # pipeline model's, from the records' ``grad_whole_bytes``)
                    grad = held
        if info.kind[rep.name] == "param" and gather_share:  # the share forward does not hide, per gathered axes
            icomm = icomm.copy()  # the cached prices stay whole
            for a, o in enumerate(opts_r):
                if o.tag in ("zero1", "zero2"):
                    axes = zero1_gather_entry(val, o.output, mesh)[0]
                    icomm[a] *= float(np.mean([gather_share.get((m, axes), 1.0) for m in members]))
        cost = comp + icomm
        lat = ilat
        for name in members:
            for prod, idx in out_nodes:
                if prod.name == name:
                    v = value_of(prod) if idx is None else value_of(prod)[idx]
                    rr = tuple(Replicate() for _ in mesh)
                    lat = lat.copy()
                    for a, o in enumerate(opts_r):
                        gather = functools.partial(transition_time, src=output_spec(o, idx), dst=rr,
                                                   split=(False,) * len(mesh), needs_grad=False, cluster=cluster)
                        out_t = gather(v)
                        cost[a] += out_t
                        if out_t > 0:
                            lat[a] += min(out_t, gather(_no_bytes(v)))
        node_latency.append(lat * k)
        # m micro-batches pay it m times (the record's node times keep the traced batch's: ``_record``)
        node_cost.append(cost * k + (passes - 1) * node_latency[-1])
        compute_cost.append(comp * k)
        node_memory.append(mem * k)
        fwd_compute.append(fwd * k)
        fwd_once.append(fwd)
        grad_memory.append(grad * k)
        if accumulating:
            held_grad_memory.append(held * k)
        bucket_memory.append(bucket * k)
        keep_full.append(kfull * k)
        keep_selective.append(ksel * k)
        region.append(_region(rep, info, last_of_layer))
    edges: dict[tuple[int, int], np.ndarray] = {}
    edge_saved: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, bool, bool]] = {}
    # The graph's edges by (producer group, consumer group, input index, output index): the instances of one tied
    # pattern (one per layer inside a layer, one per layer boundary between layers, one into the first layer from
    # outside) share a price, priced once and counted as often as the graph holds the edge
    instances: dict[tuple, list[str]] = defaultdict(list)
    for v in info.nodes:
        if info.kind[v.name] == "op":
            for j, a in enumerate(tensor_inputs(v)):
                u, idx = _producer(a)
                if u.name in info.options:
                    instances[(group_of[u.name], group_of[v.name], j, idx)].append(v.name)
    priced: set[tuple] = set()
    overlap = tp_overlap_on(opts, cluster)
    for v in info.nodes:
        if info.kind[v.name] != "op":
            continue
        vopts = info.options[v.name]
        for j, a in enumerate(tensor_inputs(v)):
            u, idx = _producer(a)
            if u.name not in info.options:
                continue
            gu, gv = group_of[u.name], group_of[v.name]
            key = (gu, gv)
            if (gu, gv, j, idx) in priced:
                continue  # tied: one price for every instance of the pattern
            priced.add((gu, gv, j, idx))
            val = value_of(a)
            uopts = info.options[u.name]
            g = info.needs_grad[u.name]
            fixed_axes = [i for i, r in roles.items() if r == "tp"] if info.kind[u.name] == "param" else \
                [i for i, r in roles.items() if r == "dp" and not _whole_only(vopts, j, i)] \
                if info.kind[u.name] in ("input", "op") else []
            bucketed = info.kind[u.name] == "param"
            # (an expert weight may reach a token-local node split along the expert dim on a data axis)
            data_axes = [i for i, r in roles.items() if r == "dp"] if bucketed and not (
                v.target is regions.OP and _expert_weight(a)) else []
            kept_sharded = regathered_input(v, j, info)
            fused = (True, fwd_once[gv]) if overlap and j == 0 and linear_input_fused(a) else \
                (False, fwd_once[gu]) if overlap and a is u and linear_output_fused(u) else None
            # an edge's prices depend on the graph, the edge, the options at its ends (the same objects in every
            # problem of a session on this mesh) and the role axes: shared by problems that differ elsewhere
            share = None
            if bucketed and reduction_shares:  # a tied group's members are ready at different times: their mean
                share = {axes: float(np.mean([reduction_shares.get((m, axes), 1.0) for m in groups[gu]]))
                         for axes in share_axes}
            ekey = ("edge", id(traced.gm), v.name, j, tuple(map(id, uopts)), tuple(map(id, vopts)),
                    tuple(fixed_axes), tuple(data_axes), fused is not None, tuple(sorted((share or {}).items())),
                    tuple(sorted(buckets.items())) if bucketed else (), opts.reduce_dtype if bucketed else None,
                    passes)
            hit = cache.get(ekey)
            if hit is None:
                hit = cache[ekey] = (uopts, vopts, *_edge_prices(
                    val, a, idx, j, uopts, vopts, g, bucketed, fixed_axes, data_axes, kept_sharded, saving_users,
                    cluster, cache, spec_ids, saves_input(v, j), fused, share, buckets, opts.reduce_dtype, passes))
            _, _, mat, shard_b, gathered_b = hit
            # how many edges of the whole model this one stands for: its instances in the graph; under virtual
            # layers (``PlanOptions.virtual_layers``) one that recurs up to the last layer recurs in the virtual ones
            inst = instances[(gu, gv, j, idx)]
            scale = len(inst) + (scales[gv] - len(groups[gv]) if len(groups[gv]) > 1 and groups[gv][-1] in inst
                                 else 0)
            if bucketed and g:
                # a parameter's gradient is reduced once, whatever number of ops use it (tied embeddings): its users'
                # edges share that reduction (and the gather the runtime runs once per target spec)
                mat = mat / max(1, sum(1 for w in u.users if info.kind.get(w.name) == "op"))
            edges[key] = edges.get(key, 0) + mat * scale
            if kept_sharded and gathered_b.any():
                lay = info.layer.get(v.name)
                outside_full = bool(lay) and info.layer.get(u.name) != lay
                outside_sel = bool(lay) and (info.layer.get(u.name) != lay or
                                             _region(u, info, last_of_layer) != "attention")
                s0, g0, _, _ = edge_saved.get(key, (0.0, 0.0, False, False))
                edge_saved[key] = (s0 + shard_b * scale, g0 + gathered_b * scale, outside_full, outside_sel)
    return Problem(info, groups, group_of, node_cost, compute_cost, node_memory, edges, tied_layers, fwd_compute,
                   region, grad_memory, bucket_memory, scales, keep_full, keep_selective, edge_saved, node_latency,
                   passes, held_grad_memory)


def one_micro_batch(prob: Problem, m: int) -> Problem:
    """``prob`` (priced at the traced batch) with the memory of one of ``m`` gradient-accumulation micro-batches:
    what ops save for backward (node terms, what recompute keeps, the shards consumers keep) divided by ``m``, as
    the pipeline search scales its blocks (``pipelining.Unit.cost``); parameters, gradients and optimizer states
    as they are. Times stay the traced batch's (all ``m`` micro-batches): ``_record`` prices what accumulation
    changes there. Approximation, stated: an op's saved bytes are taken as proportional to the batch."""
    ops = [prob.info.kind[g[0]] == "op" for g in prob.groups]

    def per(rows: list[np.ndarray]) -> list[np.ndarray]:
        return [r / m if op else r for r, op in zip(rows, ops)] if rows else rows

    saved = {key: ((s / m, g / m, f, sel) if ops[key[0]] else (s, g, f, sel))
             for key, (s, g, f, sel) in prob.edge_saved.items()}
    return dataclasses.replace(prob, node_memory=per(prob.node_memory), keep_full=per(prob.keep_full),
                               keep_selective=per(prob.keep_selective), edge_saved=saved)


# The three moments of a training step whose live bytes the ILP bounds (``memory_rows``); the plan's peak is the
# largest (``peak_forward`` / ``peak_backward`` / ``peak_optimizer`` in ``plan.predicted["memory_bytes"]``).
MEMORY_ROWS = ("end of forward (model states, gathered parameters, saved activations, one recomputed layer; under "
               "gradient accumulation, the gradients accumulated so far)",
               "end of backward (model states, gradients, one reduction bucket)",
               "optimizer step (model states, gradients, the step's temporaries; after it, the ZeRO-1/2 parameter "
               "gather in flight instead of their gradients)")

# What torch's AdamW allocates during ``step`` beyond its states, as a share of the states of the parameter group it
# steps: the foreach implementation (what ``ParallelModule.optimizer`` defaults to) computes ``sqrt(exp_avg_sq)`` for
# the whole group at once (one of Adam's two states; divided and added to in place, then used by ``addcdiv_``), and
# steps the runtime's groups one after the other (the plain parameters, then the ZeRO-1/2 slices, runtime/zero1.py).
# The single-tensor loop (``foreach=False``) holds two parameter-sized temporaries of the largest parameter: less.
OPTIMIZER_STEP_TEMPORARY = 0.5


def optimizer_temporaries(prob: Problem, opts: PlanOptions, offload: frozenset, cluster: Cluster) -> list[np.ndarray]:
    """Per group, the optimizer step's temporaries (``OPTIMIZER_STEP_TEMPORARY`` of its optimizer states) per
    option: zero but for trainable parameters, and zero where the optimizer steps on the host (``offload``
    "optimizer" off a CPU cluster: the device keeps parameters and gradients only)."""
    out = []
    on_host = "optimizer" in offload and cluster.device.name != "cpu"
    node_of = {n.name: n for n in prob.info.nodes}
    for gid, members in enumerate(prob.groups):
        name = members[0]
        popts = prob.info.options[name]
        if prob.info.kind[name] != "param" or not prob.info.needs_grad[name] or on_host:
            out.append(np.zeros(len(popts)))
            continue
        k = prob.scale[gid] if prob.scale else len(members)
        states = [param_state_bytes(value_of(node_of[name]), o.output, cluster.mesh_shape, opts, o.tag)[1]
                  for o in popts]
        out.append(np.array(states) * k * OPTIMIZER_STEP_TEMPORARY)
    return out


def zero1_gather_bytes(entries, cluster: Cluster, sizes: dict[str, int] | None = None) -> float:
    """Bytes ZeRO-1/2's bucketed all-gather after the step holds at once, buckets filled as ``zero1_buckets``
    fills them (from ``zero1_gather_entry`` per parameter) and gathered in that order:
    ``GATHER_IN_FLIGHT`` consecutive buckets, each its gathered buffer ``G``, the packed slices ``G / N`` (N ranks
    over its axes) and, over several axes, the last-but-one gather's output and its re-packed copy, ``G / n`` each
    (n the outermost axis, gathered last: ``runtime/zero1.gather_bucket``). The step launches the first
    ``GATHER_IN_FLIGHT`` and forward launches each next one as it consumes one, so any such window is live."""
    mesh = cluster.mesh_shape
    buckets = [(axes, sum(entries[i][2] for i in idx)) for axes, idx in zero1_buckets(entries, cluster, sizes)]
    held = [g + g / math.prod(mesh[i] for i in axes) + (2 * g / mesh[axes[0]] if len(axes) > 1 else 0.0)
            for axes, g in buckets]
    return max((sum(held[max(0, i + 1 - GATHER_IN_FLIGHT): i + 1]) for i in range(len(held))), default=0.0)


def zero1_gather_entries(prob: Problem, choice, mesh) -> list[tuple]:
    """``zero1_gather_entry`` of every trainable ZeRO-1/2 parameter of ``choice``, in graph order (a tied group's
    member once per node it stands for)."""
    out = []
    for n in prob.info.nodes:
        if prob.info.kind[n.name] != "param" or not prob.info.needs_grad[n.name]:
            continue
        gid = prob.group_of[n.name]
        o = prob.info.options[n.name][choice[gid]]
        if o.tag in ("zero1", "zero2"):
            k = prob.scale[gid] if prob.scale else len(prob.groups[gid])
            out += [zero1_gather_entry(value_of(n), o.output, mesh)] * max(1, round(k / len(prob.groups[gid])))
    return out


def optimizer_row_base(prob: Problem, choice, temps: list[np.ndarray], cluster: Cluster) -> float:
    """What the optimizer row's linear terms (``memory_rows``: states, gradients, temporaries) miss for ``choice``:
    after the step the ZeRO-1/2 gradients are freed and their gather buckets are in flight, which weigh more than
    those gradients and the temporaries when few parameters are sliced (ZeRO-2: the gradients are slices already);
    zero otherwise. (The row sums the temporaries of both parameter groups, which the runtime steps one at a time:
    exact with one group, over by the smaller group's with two.)"""
    zero_grads = sum(float(prob.grad_memory[g][c]) for g, c in enumerate(choice)
                     if prob.info.options[prob.groups[g][0]][c].tag in ("zero1", "zero2"))
    temp = sum(float(t[c]) for t, c in zip(temps, choice))
    return max(0.0, zero1_gather_bytes(zero1_gather_entries(prob, choice, cluster.mesh_shape), cluster) - zero_grads -
               temp)


def reduction_bucket_bytes(prob: Problem, choice, cluster: Cluster,
                           bucket: int | None = None) -> tuple[float, float]:
    """The gradient reduction's buckets at the end of backward (``runtime/grads.py``), what the end-of-backward
    row adds to the gradients kept, as (flat buckets, what reduce-scattering adds): a bucket of all-reduced
    gradients (at most ``bucket``, the plan's largest, or before there is a plan ``largest_bucket_bytes``) and one of
    reduce-scattered ones (ZeRO-1/2), which also holds its
    reduce-scatter output (the slices: 1/N of it, N the ranks they span) and, on a CPU cluster, gloo's copy of the
    flat input, alive as long as the collective's work (measured: an ``aten.split`` of the flat's size). At most
    ``REDUCE_IN_FLIGHT`` buckets of each kind: the runtime finishes the oldest launched bucket beyond that many
    (``runtime/grads.py``; counted per kind, which is the safe side when both kinds interleave)."""
    reduced = scattered = slices = 0.0
    for g, c in enumerate(choice):
        b = float(prob.bucket_memory[g][c])
        o = prob.info.options[prob.groups[g][0]][c]
        if b and o.tag in ("zero1", "zero2"):
            scattered += b
            slices += b / zero1_ways(o.output, cluster.mesh_shape)
        else:
            reduced += b
    cap = REDUCE_IN_FLIGHT * (bucket or largest_bucket_bytes(cluster))
    held = min(cap, scattered)
    extra = held * (1.0 if cluster.device.name == "cpu" else 0.0) + (slices * held / scattered if held else 0.0)
    return min(cap, reduced) + held, extra


def bucket_rows(prob: Problem, cluster: Cluster) -> list[np.ndarray] | None:
    """Per group and option, its bytes in the reduction buckets at the end of backward (``reduction_bucket_bytes``,
    summed per parameter: its gradient, and for a reduce-scattered one its slice of the output and, on a CPU
    cluster, gloo's copy), when every gradient fits one bucket: the ILP's end-of-backward row then adds them
    exactly, whatever the plan replicates. None when they may not (the row's base carries the buckets then)."""
    if sum(float(b.max()) for b in prob.bucket_memory) > BUCKET_BYTES:
        return None
    copy = 1.0 if cluster.device.name == "cpu" else 0.0
    out = []
    for g, members in enumerate(prob.groups):
        popts = prob.info.options[members[0]]
        out.append(np.array([float(prob.bucket_memory[g][a]) * (
            1 + copy + 1 / zero1_ways(o.output, cluster.mesh_shape) if o.tag in ("zero1", "zero2") else 1.0)
            for a, o in enumerate(popts)]))
    return out


def memory_rows(prob: Problem, mem: list[np.ndarray], temps: list[np.ndarray],
                buckets: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Per group, its bytes at each of ``MEMORY_ROWS`` as a (K, 3) array, from ``mem`` (the node memory after
    checkpointing and offload: states for parameters and buffers, saved activations for ops), ``temps`` (the
    optimizer step's temporaries, ``optimizer_temporaries``) and ``buckets`` (``bucket_rows``, when linear)."""
    out = []
    for g, m in enumerate(mem):
        kind = prob.info.kind[prob.groups[g][0]]
        states = m if kind in ("param", "buffer", "constant") else 0.0 * m
        grads = states + prob.grad_memory[g]
        forward = m + prob.held_grad_memory[g] if prob.held_grad_memory else m
        out.append(np.stack([forward, grads + (buckets[g] if buckets is not None else 0.0), grads + temps[g]], axis=1))
    return out


def _outs(o: OpOption) -> tuple:
    return o.output if o.output and isinstance(o.output[0], tuple) else (o.output,)


def warm_start_choice(plan, prob: Problem) -> list[int] | None:
    """The option index per group of ``prob`` that ``plan`` chose for the group's first node (matched by the option
    as it prints), or None when some group has no counterpart there (the solver then starts cold). ``plan`` is a
    sharding plan of the same graph or of its 2-block reduction (whose tied groups start with the same nodes)."""
    if plan is None:
        return None
    out = []
    for members in prob.groups:
        rec = plan.nodes.get(members[0])
        alt = plan.alternatives.get(str(rec["group"])) if rec is not None else None
        if alt is None:
            return None
        want = alt["options"][alt["chosen"]]
        idx = next((i for i, o in enumerate(prob.info.options[members[0]]) if str(o) == want), None)
        if idx is None:
            return None
        out.append(idx)
    return out


class _Session:
    """Work shared by the solves of one ``make_plan`` call: the search, its pipeline candidates and the recipes
    solve many of the same sharding problems (a stage mesh with the Megatron roles for the search and again for the
    ``megatron-1f1b`` recipe; the same 2-block graph), so each problem is solved once (``sharding_plan``)."""

    def __init__(self) -> None:
        self.plans: dict[tuple, Any] = {}
        self.hits = 0
        self.analyzed: dict = {}  # planner._analyzed's store
        self.transitions: dict = {}  # cluster -> (conversion times, spec ids) for build_problem
        self.keep: list = []  # the graphs the keys name by id, alive while the session is

    @staticmethod
    def _key(traced: Traced, cluster: Cluster, axis_names, opts: PlanOptions) -> tuple:
        # the cutoff only prunes, the warm start only seeds and ``recipes`` is read by make_plan alone: none of
        # them changes the plan a problem solves to
        o = dataclasses.replace(opts, objective_cutoff=None, warm_start=None, recipes=True, explain_infeasible=True,
                                role_warnings=True)
        return id(traced), cluster, tuple(axis_names), repr(o)

    def pricing(self, cluster: Cluster) -> tuple[dict, dict]:
        return self.transitions.setdefault(cluster, ({}, {}))

    def sharding_plan(self, traced: Traced, cluster: Cluster, axis_names, opts: PlanOptions):
        key = self._key(traced, cluster, axis_names, opts)
        hit = self.plans.get(key)
        if hit is None and opts.zero == 0 and opts.checkpoint is not None and opts.offload is not None:
            # ZeRO-0 restricts the options of the same problem with ZeRO left to the solver: when that problem's
            # optimum uses no ZeRO it is the restricted problem's optimum too (checkpoint and offload forced: one
            # variant is solved, so the variant logic cannot tell the two apart)
            wider = self.plans.get(self._key(traced, cluster, axis_names, dataclasses.replace(opts, zero=None)))
            if wider is not None and not isinstance(wider[0], Exception) and _zero_free(wider[0], axis_names, opts):
                hit = wider
        if hit is not None and (not isinstance(hit[0], Exception) or hit[1] == opts.explain_infeasible):
            self.hits += 1
            if isinstance(hit[0], Exception):
                raise hit[0]
            return dataclasses.replace(hit[0], solver=dict(hit[0].solver))
        try:
            plan = _sharding_plan(traced, cluster, axis_names, opts)
        except Pruned:
            raise
        except ValueError as e:
            self.plans[key] = (e, opts.explain_infeasible)
            self.keep.append(traced)
            raise
        if plan.solver.get("pruned_by_cutoff"):  # the cutoff decided more than pruning: not the problem's plan
            return plan
        self.plans[key] = (plan, opts.explain_infeasible)
        self.keep.append(traced)
        return dataclasses.replace(plan, solver=dict(plan.solver))


def _zero_free(plan, axis_names, opts: PlanOptions) -> bool:
    """No parameter of ``plan`` is sharded on a data-parallel axis or has ZeRO-1 states (ZeRO level 0 there)."""
    dp = [axis_names.index(a) for a, r in opts.roles.items() if r == "dp"]
    return not plan.zero and all(isinstance(parse_spec(s)[i], Replicate) for s in plan.params.values() for i in dp)


_SESSION: _Session | None = None
SHARE_WORK = True  # False: every problem solved anew, nothing shared between solves (the tests compare the two)


def _shared_sharding_plan(traced: Traced, cluster: Cluster, axis_names, opts: PlanOptions):
    """``_sharding_plan`` through the current ``make_plan`` session (solved once per problem), or directly."""
    if _SESSION is None:
        return _sharding_plan(traced, cluster, axis_names, opts)
    return _SESSION.sharding_plan(traced, cluster, axis_names, opts)


def make_plan(traced: Traced, cluster: Cluster, axis_names: tuple[str, ...], opts: PlanOptions):
    """The fastest plan that fits: per-node shardings (the ILP), and, where a mesh axis allows it and it pays,
    pipeline stages, micro-batches and schedule around them (``autopart.pipelining``). When nothing is forced
    (no roles, ZeRO level, checkpointing, offload or pipeline given), the standard recipes (``autopart.recipes``:
    DDP, ZeRO-1, FSDP, Megatron TP x DP / FSDP / 1F1B) are scored under the same cost model, the plan is never
    slower than the best of them, and ``plan.solver["recipes"]`` reports the gain over each. Raises
    ``ValueError`` if nothing fits.

    Order, for shared work: the recipes without stages first (on the 2-block reduction: quick), the best of them
    warm-starts the search's plan without stages; then the search; then ``megatron-1f1b``, whose stage problems
    the search mostly solved already (``_Session``). ``plan.solver["ilp"]`` sums up every ILP solve made."""
    from contextlib import nullcontext

    from autopart.solver.ilp import record_solves, share_solutions

    check_inputs(opts)
    global _SESSION
    # the collector's passes over the oldest generation walk what lives on through planning (the traced graph,
    # the model): ~0.4 s of a 70B plan. Those objects are left out of them while planning (``gc.freeze``; not when
    # the caller froze some: unfreezing would release theirs)
    freeze = _SESSION is None and gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    outer, _SESSION = _SESSION, _Session() if SHARE_WORK else None
    t0 = time.perf_counter()
    try:
        with record_solves() as solves, share_solutions() if SHARE_WORK else nullcontext() as shared:
            plan = _make_plan_with_recipes(traced, cluster, axis_names, opts)
    finally:
        session, _SESSION = _SESSION, outer
        if freeze:
            gc.unfreeze()
    reused = (session.hits if session is not None else 0) + (shared.hits if shared is not None else 0)
    plan.solver["ilp"] = solve_summary(solves, reused, opts.relative_gap)
    plan.solver["planning_s"] = time.perf_counter() - t0
    return plan


def solve_summary(solves: list, reused: int = 0, gap: float | None = None) -> dict:
    """Statuses and optimality gaps (best bound vs objective) over ILP solves, and how warm starts went. ``gap``: the
    plan's tolerance; the solves made to a looser one (screening: ``NO_ZERO_SCREEN_GAP``) are counted apart, not in
    ``max_gap``. ``cut_off``: the solves ended by their LP bound, without a MIP (``SolverCutoff``)."""
    hinted = [s for s in solves if s.hint != "none"]
    loose = [gap is not None and s.tolerance is not None and s.tolerance > gap for s in solves]
    own = [s for s, x in zip(solves, loose) if not x]
    screened = [s for s, x in zip(solves, loose) if x]
    cutoffs = getattr(solves, "cutoffs", [])
    return {
        "solves": len(own), "reused": reused,
        "optimal": sum(s.status == "optimal" for s in own),
        "max_gap": max((s.gap for s in own), default=0.0),
        "screening": {"solves": len(screened), "max_gap": max((s.gap for s in screened), default=0.0),
                      "tolerance": max((s.tolerance for s in screened), default=0.0)},
        "cut_off": {"solves": len(cutoffs), "solve_s": sum(c[2] for c in cutoffs)},
        "solve_s": sum(s.wall_time_s for s in solves) + sum(c[2] for c in cutoffs),
        "warm_started": [{"hint": s.hint, "hint_objective": s.hint_objective, "objective": s.objective,
                          "bound": s.bound, "gap": s.gap, "status": s.status} for s in hinted],
    }


def _make_plan_with_recipes(traced: Traced, cluster: Cluster, axis_names: tuple[str, ...], opts: PlanOptions):
    forced = (opts.roles or opts.zero is not None or opts.checkpoint is not None or opts.offload is not None
              or opts.pipeline is not None or opts.virtual_layers or opts.objective_cutoff is not None)
    if not opts.recipes or forced or math.prod(cluster.mesh_shape) == 1:
        return _make_plan(traced, cluster, axis_names, opts)
    from autopart import recipes
    from autopart.pipelining import reduce_blocks

    reduced = reduce_blocks(traced, pins=opts.pins)
    t0 = time.perf_counter()
    rows = recipes.score(traced, cluster, axis_names, opts, _make_plan, reduced, pipelined=False)
    warm = min((r for r in rows if r.get("fits")), key=lambda r: r["step_time_s"], default=None)
    t1 = time.perf_counter()
    plan, err = None, None
    try:
        plan = _make_plan(traced, cluster, axis_names, dataclasses.replace(
            opts, warm_start=(warm.get("warm_plan") or warm.get("plan")) if warm is not None else None))
    except PlanInputError:
        raise
    except ValueError as e:
        err = e
    t2 = time.perf_counter()
    rows += recipes.score(traced, cluster, axis_names, opts, _make_plan, reduced, pipelined=True)
    rows.sort(key=lambda r: recipes.RECIPES.index(r["recipe"]))
    step = plan.predicted["step_time_s"] if plan is not None else math.inf
    for r in rows:  # a recipe scored on the 2-block graph that might win: solve it on the whole graph
        # (a row scored by its ILP objective: that over ``OBJECTIVE_OVER_RECORD``; a pipelined one by its record)
        over = OBJECTIVE_OVER_RECORD if r.get("by_objective") else 1.0
        if r.get("fits") and "options" in r and r["step_time_s"] / over < step * 1.05:
            try:
                r["plan"] = _make_plan(traced, cluster, axis_names,
                                       dataclasses.replace(r["options"], warm_start=r["warm_plan"]))
            except ValueError:
                continue
            r["step_time_s"] = r["plan"].predicted["step_time_s"]
            r.pop("scored_on", None)
            r.pop("by_objective", None)
    fits = [r for r in rows if r.get("fits") and "plan" in r]
    best = min(fits, key=lambda r: r["step_time_s"], default=None)
    chosen = "search"
    if best is not None and (plan is None or best["step_time_s"] < plan.predicted["step_time_s"] * (1 - 1e-9)):
        plan, chosen = best["plan"], best["recipe"]
    if plan is None:
        raise err
    plan.solver["recipes"] = recipes.report(rows, plan.predicted["step_time_s"], chosen)
    plan.solver["recipes_s"] = (t1 - t0) + (time.perf_counter() - t2)
    plan.solver["search_s"] = t2 - t1
    plan.solver["warm_start_from"] = warm["recipe"] if warm is not None else None
    return plan


def _make_plan(traced: Traced, cluster: Cluster, axis_names: tuple[str, ...], opts: PlanOptions):
    from autopart import pipelining

    for name in opts.roles:
        if name not in axis_names:
            raise PlanInputError(f"role given for mesh axis {name!r}, but the mesh axes are {axis_names}")
    roles = {axis_names.index(a): r for a, r in opts.roles.items()}
    if opts.zero and "dp" not in roles.values():  # said once, not per pipeline stage candidate
        raise PlanInputError(f"zero={opts.zero} slices model states over the data-parallel axes, but no mesh axis has "
                         f"role 'dp' (roles={opts.roles}): name one, roles={{'<axis>': 'dp'}}, or leave zero unset")
    _check_forward_only(traced, opts)
    pp_axes = [i for i, r in roles.items() if r == "pp"]
    forced = opts.pipeline if isinstance(opts.pipeline, dict) else {}
    free_axes = [i for i, n in enumerate(cluster.mesh_shape) if i not in roles and n > 1]
    if "axis" in forced and forced["axis"] in axis_names:
        if roles.get(axis_names.index(forced["axis"]), "dp") != "dp":
            role = roles[axis_names.index(forced["axis"])]
            raise PlanInputError(f"pipeline axis {forced['axis']!r} has role {role!r}; stages can split an unpinned "
                                 "or a data-parallel axis")
        free_axes.append(axis_names.index(forced["axis"]))
    stages = int(forced.get("stages", 1))
    if stages > 1:  # forced stages: an axis that holds them (the search's: the named one, 'pp' ones, else free)
        mesh = cluster.mesh_shape
        axes = [axis_names.index(forced["axis"])] if "axis" in forced and forced["axis"] in axis_names else \
            pp_axes or free_axes
        if not axes:
            raise PlanInputError(f"pipeline stages={stages} forced, but every mesh axis has a role "
                                 f"(roles={opts.roles}) and stages split an axis without one: give an axis role "
                                 "'pp', leave one unpinned, or name a data-parallel axis for them, "
                                 "pipeline={'axis': '<axis>', ...}")
        if not any(mesh[i] % stages == 0 for i in axes):
            raise PlanInputError(f"pipeline stages={stages} forced, but it divides none of the mesh axes stages may "
                                 f"split: " + ", ".join(f"{axis_names[i]} ({mesh[i]})" for i in axes))
    # no repeated blocks to split (a model without numbered layers): nothing to pipeline unless asked for
    blockless = not forced and not pp_axes and len({_layer_of(n, traced) for n in traced.graph.nodes
                                                     if n.op == "call_function"} - {""}) < 2
    if opts.pipeline == "off" or not (pp_axes or free_axes) or int(forced.get("stages", 2)) == 1 or blockless:
        if pp_axes:
            raise ValueError(f"mesh axis {axis_names[pp_axes[0]]!r} has role 'pp' but pipeline is off")
        m = int(forced.get("micro_batches", 1)) if int(forced.get("stages", 2)) == 1 else opts.micro_batches
        # the micro-batch count is the planner's where nothing was said of pipelines or recompute
        search = opts.pipeline is None and opts.checkpoint is None and opts.offload is None and m == 1
        return _accumulated_plan(traced, cluster, axis_names, dataclasses.replace(opts, pipeline="off",
                                                                                  micro_batches=m), search)
    limit = opts.memory_limit if opts.memory_limit is not None else cluster.memory_budget
    stage_roles = {a: r for a, r in opts.roles.items() if r != "pp"}
    ck = opts.checkpoint if isinstance(opts.checkpoint, str) else None
    allow: bool | dict[str, str] = ck in (None, "selective")
    selective: dict[str, str] = {}
    if opts.checkpoint is not None and not isinstance(opts.checkpoint, str):
        # per layer (the names checked as without stages): the "full" blocks priced recomputed whatever the
        # partition (pipelining.Unit.full); the "selective" ones in the stage plans solved on the whole graph. The
        # candidates ranked on the 2-block reduction, which has no such layers, go without them: the winner, solved
        # again on the whole graph, is priced with them
        modes = _forced_checkpoint(opts, _analyzed(traced, tuple(cluster.mesh_shape)))
        allow = {lay: m for lay, m in modes.items() if m == "full"}
        selective = {lay: m for lay, m in modes.items() if m == "selective"}
        ck = "none"

    def solve_stage(stage_cluster: Cluster, lim: float, recipe: bool = False, reduced=None, cutoff=None, warm=None,
                    passes: int = 0):
        # the stage DP decides per-layer full recompute; a forced mode applies to every layer of the stage plan.
        # Offload is not searched with stages (the forced one still applies): the stage DP is what frees memory
        roles_k = dict(stage_roles)
        if recipe:  # Megatron inside the stage: the last axis tensor parallel, every other one data parallel
            for i, a in enumerate(axis_names):
                roles_k.setdefault(a, "tp" if i == len(axis_names) - 1 else "dp")
        o = dataclasses.replace(opts, roles=roles_k, memory_limit=lim, pipeline="off",
                                checkpoint=selective if selective and reduced is None else ck or "none",
                                offload=opts.offload if opts.offload is not None else "none",
                                objective_cutoff=cutoff, warm_start=warm, stage=True, latency_passes=passes)
        if reduced is not None:
            return _shared_sharding_plan(reduced[0], stage_cluster, axis_names,
                                         dataclasses.replace(o, virtual_layers=reduced[1]))
        return _shared_sharding_plan(traced, stage_cluster, axis_names, o)

    t0 = time.perf_counter()
    cand, tried, errors, least = pipelining.search(traced, cluster, axis_names, opts, solve_stage, limit, forced,
                                                   allow_checkpoint=allow)
    wall = time.perf_counter() - t0
    base, base_err, base_bound, cand_note = None, None, None, ""
    no_pp = dataclasses.replace(opts, pipeline="off")
    if not pp_axes and "stages" not in forced:
        # the fastest plan without stages, memory ignored: when it fits it is the plan without stages; if not, it
        # bounds that plan's step time from below, and the (slow) memory-bounded solve runs only if the pipeline
        # does not already beat the bound. Solved on the 2-block reduction when the model has one (the same ILP;
        # its objective is the bound), and skipped when even its cheapest-options floor loses to the pipeline
        reduced = pipelining.reduce_blocks(traced, pins=opts.pins)
        cutoff = cand.step_s * OBJECTIVE_OVER_RECORD if cand is not None else None  # an objective against a step
        try:  # warm-started from opts.warm_start (make_plan: the best recipe without stages, on the reduction)
            if reduced is not None:
                free = _shared_sharding_plan(reduced[0], cluster, axis_names, dataclasses.replace(
                    no_pp, memory_limit=math.inf, virtual_layers=reduced[1], objective_cutoff=cutoff))
            else:
                free = _shared_sharding_plan(traced, cluster, axis_names, dataclasses.replace(
                    no_pp, memory_limit=math.inf, objective_cutoff=cutoff))
        except Pruned as e:
            base_bound = e.args[0]
        except PlanInputError:
            raise
        except ValueError as e:
            base_err = e
        else:
            limit0 = opts.memory_limit if opts.memory_limit is not None else cluster.memory_budget
            if free.solver.get("free_memory_row_bytes", math.inf) <= limit0:
                base = free if reduced is None else _shared_sharding_plan(
                    traced, cluster, axis_names, dataclasses.replace(no_pp, memory_limit=math.inf, warm_start=free))
            else:
                base_bound = min(free.solver["objective"], free.predicted["step_time_s"]) if reduced is None \
                    else free.solver["objective"]
    # the bound is the ILP's (its objective, or the floor of it): the plan's record may be lower by the factor
    if base is None and base_bound is not None and (cand is None or
                                                    cand.step_s * OBJECTIVE_OVER_RECORD >= base_bound):
        from autopart.solver.ilp import SolverTimeout

        try:  # where it needs recompute or offload to fit, also with gradient accumulation (one more solve)
            base = _accumulated_plan(traced, cluster, axis_names, no_pp,
                                     search=opts.checkpoint is None and opts.offload is None and "stages" not in forced)
        except PlanInputError:
            raise
        except ValueError as e:
            base_err = e
        except SolverTimeout as e:
            # a pipeline plan is in hand: the plan without stages, which fits only with recompute or offload, could
            # not be solved in time, and the answer is the pipeline (its bound says it might have been faster); a
            # timeout there had failed the whole plan (Llama-405B on (512, 8) H100s: no plan for the mesh)
            if cand is None:
                raise
            base_err = e
            cand_note = f"the plan without stages was not solved in time ({e}); its bound {base_bound:.4g} s"
    p1 = base.predicted["step_time_s"] if base is not None else base_bound
    not_planned = "a mesh axis has role 'pp'" if pp_axes else \
        f"pipeline stages={forced['stages']} forced" if "stages" in forced else ""
    if cand is not None and (base is None or cand.step_s < base.predicted["step_time_s"] * (1 - 1e-9)):
        out = pipelining.record(cand, traced, cluster, axis_names, wall, tried, p1, bound=base is None)
        if cand_note:
            out.solver["unsolved"] = cand_note
        if not_planned:  # the plan without stages was not planned: not that it does not fit
            out.pipeline["no_pipeline_not_planned"] = not_planned
        return out
    if base is not None:
        base.solver["pipeline_search_s"] = wall
        base.solver["pipeline_candidates"] = sorted(tried, key=lambda r: r["step_time_s"])[:8]
        return base
    detail = "\n".join(f"  {e}" for e in list(dict.fromkeys(errors))[-12:])  # a line once (stage solves repeat)
    without = base_err if base_err is not None else f"not planned ({not_planned})"
    message = (f"no plan fits {cluster.name} mesh {cluster.mesh_shape}: without pipeline: {without}\n"
               f"with pipeline stages:\n{detail}")
    if isinstance(base_err, NoPlanFits) or least is None:
        raise NoPlanFits(message, without=base_err if isinstance(base_err, NoPlanFits) else None)
    # no plan without stages to describe (stages forced, a 'pp' axis): the figures of the pipeline closest to fitting
    raise _stage_figures(message, least, any(fqn not in traced.frozen for fqn in traced.params.values()))


def _stage_figures(message: str, least: Exception, training: bool) -> NoPlanFits:
    """``NoPlanFits`` with the figures of a pipelined search's failure closest to fitting (``pipelining.search``'s
    ``least``): a stage mesh no sharding of which fits (its own figures), or a pipeline no partition of which fits,
    its binding stage's model states and activations in flight."""
    if isinstance(least, NoPlanFits):
        return NoPlanFits(message, least.min_memory, least.limit, f"a pipeline stage's sharding: {least.binding}",
                          least.terms)
    first, last = least.layers
    where = f"blocks {first}..{last}" if first != last else f"block {first}"
    states = "model states (parameter, gradient, optimizer)" if training else "weights"
    return NoPlanFits(message, least.need, least.limit,
                      f"pipeline {least.where} ({where}; every allowed block checkpointed)",
                      [(states, where, least.states), ("activations", f"{where}, micro-batches in flight",
                                                       least.activations)])


def _accumulated_plan(traced: Traced, cluster: Cluster, axis_names: tuple[str, ...], opts: PlanOptions,
                      search: bool = False):
    """The sharding plan without stages, run in ``opts.micro_batches`` gradient-accumulation micro-batches (one:
    the plain plan). The batch must split into them, and each micro-batch still as many ways as the plan splits the
    batch (``pipelining._batch_shards``, the rule pipelined micro-batches follow).

    ``search``: where the plan in one pass does not fit without recompute or offload (or not at all), also one plan with
    micro-batches (``_micro_batches_to_fit``: one extra solve, the count read off the first solve's numbers), kept
    if predicted faster. On GPU presets accumulation costs only the reduction the shorter last backward no longer
    hides; recompute costs about a third of forward and backward."""
    m = opts.micro_batches
    if m == 1:
        try:
            plan = _shared_sharding_plan(traced, cluster, axis_names, opts)
        except ValueError as e:
            if not search or isinstance(e, PlanInputError):
                raise
            plan, err = None, e
        if not search or (plan is not None and not plan.checkpoint and not plan.offload):
            return plan
        m = _micro_batches_to_fit(plan, traced, cluster, axis_names, opts)
        acc = None
        if m > 1:
            try:
                acc = _accumulated_plan(traced, cluster, axis_names, dataclasses.replace(opts, micro_batches=m))
            except ValueError:
                acc = None
        best = acc if acc is not None and (plan is None or acc.predicted["step_time_s"] <
                                           plan.predicted["step_time_s"]) else plan
        if best is None:
            raise err
        best.solver["accumulation_tried"] = {
            "micro_batches": m, "step_time_s": acc.predicted["step_time_s"] if acc is not None else None,
            "one_pass_step_time_s": plan.predicted["step_time_s"] if plan is not None else None,
            "one_pass_checkpoint": sorted(set(plan.checkpoint.values())) if plan is not None else None,
            "one_pass_offload": list(plan.offload) if plan is not None else None}
        return best
    from autopart.pipelining import _batch_of, _batch_shards

    if not any(needs_grad_map(traced).values()):
        raise ValueError(f"micro_batches={m} without pipeline stages is gradient accumulation, which needs a training "
                         "step; this model has no parameter requiring a gradient (plan it with micro_batches=1)")
    batch = _batch_of(traced)
    if batch % m:
        raise ValueError(f"micro_batches={m} does not divide the traced batch of {batch}: pick a divisor of {batch} "
                         f"(or trace another batch size)")
    plan = _shared_sharding_plan(traced, cluster, axis_names, opts)
    ways = _batch_shards(plan, traced, cluster.mesh_shape)
    if (batch // m) % ways:
        raise ValueError(f"micro_batches={m}: micro-batches of {batch // m} do not split over the {ways} ranks the "
                         f"plan splits the batch over; use micro_batches dividing {batch // ways}")
    return plan


def _micro_batches_to_fit(plan, traced: Traced, cluster: Cluster, axis_names, opts: PlanOptions) -> int:
    """The fewest gradient-accumulation micro-batches whose activations (1/m of the batch's) let the fastest
    one-pass sharding fit, from ``plan``'s solve (``free_memory_rows_bytes``, ``free_activation_bytes``), among the
    counts dividing the batch into parts that still split over the plan's batch shards; 1 if none would. Without a
    plan (nothing fits in one pass), the most: one sample per data-parallel rank (the axes with role "dp")."""
    from autopart.pipelining import _batch_of, _batch_shards, _whole_grad_bytes

    if not any(needs_grad_map(traced).values()):
        return 1
    batch = _batch_of(traced)
    if plan is None:
        ways = math.prod(cluster.mesh_shape[axis_names.index(a)] for a, r in opts.roles.items() if r == "dp")
        return batch // ways if batch % ways == 0 else 1
    sol = plan.solver
    limit = plan.options["memory_limit"]
    rows, act = sol.get("free_memory_rows_bytes"), sol.get("free_activation_bytes", 0.0)
    # accumulating, each forward after the first runs beside the gradients so far (ZeRO-2's whole: the end-of-forward
    # row's ``held_grad_memory``), which the one-pass row did not hold
    held = sum(_whole_grad_bytes(r) for r in plan.nodes.values() if r["op"] == "param")
    if not rows or max(rows[1:]) > limit or rows[0] - act + held >= limit or act <= 0:
        return 1  # states, gradients or the optimizer step bind, or nothing is left for activations
    need = act / (limit - (rows[0] - act + held))
    ways = _batch_shards(plan, traced, cluster.mesh_shape)
    return next((d for d in range(2, batch + 1) if batch % d == 0 and d >= need and (batch // d) % ways == 0), 1)


def _sharding_plan(traced: Traced, cluster: Cluster, axis_names: tuple[str, ...], opts: PlanOptions):
    """Price every option, solve, and return the ``Plan`` (raises ``ValueError`` if no plan fits)."""
    from autopart.solver import InfeasibleError, SolverOptions, solve
    from autopart.solver import Problem as IlpProblem
    from autopart.solver.ilp import SolverCutoff, SolverTimeout, cutoff_threshold, forest_bound

    timings = {}
    t0 = time.perf_counter()
    prob = build_problem(traced, cluster, axis_names, opts)
    if opts.micro_batches > 1:
        prob = one_micro_batch(prob, opts.micro_batches)
    timings["strategies_and_costs_s"] = time.perf_counter() - t0
    if opts.objective_cutoff is not None:
        # no plan of this problem is cheaper than every node's and every edge's cheapest option, chosen apart; for a
        # pipeline stage's problem, than a spanning forest of it solved exactly, each other edge at its cheapest
        # (``forest_bound``): the pipeline search skips stage meshes whose bound already loses to a candidate it
        # has. Every variant solved below only adds to these costs (recompute, offload, the optimizer step). Not the
        # forest for the plan without stages: solved on the 2-block graph, its gradient reduction and ZeRO-1/2
        # gather are exposed behind 2 blocks of compute where the whole model hides them behind all of its blocks
        # (``grad_reduction_shares``), so its objective can exceed the whole graph's by 1.4x and more (Megatron's
        # 16B on 192 H100s: 0.948 s on 2 blocks, 0.698 s on the whole graph): it bounds that plan only loosely
        edge_list = [(u, v, m) for (u, v), m in prob.edges.items()]
        floor = forest_bound(prob.node_cost, edge_list) if opts.stage else \
            sum(float(np.min(c)) for c in prob.node_cost) + sum(float(np.min(m)) for _, _, m in edge_list)
        if floor >= opts.objective_cutoff:
            raise Pruned(floor)
    info, groups = prob.info, prob.groups
    names = [",".join(g[:2]) + (f",+{len(g) - 2}" if len(g) > 2 else "") for g in groups]
    limit = opts.memory_limit if opts.memory_limit is not None else cluster.memory_budget
    edge_list = [(u, v, m) for (u, v), m in prob.edges.items() if u != v]
    edge_keys = [(u, v) for (u, v) in prob.edges if u != v]
    self_edges = [(u, np.diag(m)) for (u, v), m in prob.edges.items() if u == v]
    # the parameter groups' ZeRO-1/2 options, where the planner chooses the ZeRO level (nothing forced)
    zero12_options = {} if opts.zero is not None else {
        gid: np.array([o.tag in ("zero1", "zero2") for o in info.options[members[0]]])
        for gid, members in enumerate(groups) if info.kind[members[0]] == "param" and
        any(o.tag in ("zero1", "zero2") for o in info.options[members[0]])}
    self_keys = [(u, v) for (u, v) in prob.edges if u == v and (u, v) in prob.edge_saved]

    linear_buckets = bucket_rows(prob, cluster)

    def buckets_of(choice) -> tuple[float, float]:
        """The end-of-backward buckets of ``choice`` beyond what the rows hold: (starting bound, exact need)."""
        if linear_buckets is not None:
            return 0.0, 0.0
        flat, extra = reduction_bucket_bytes(prob, choice, cluster)
        return flat, flat + extra

    def memory_model(modes: dict[str, str], offload: frozenset, mem: list[np.ndarray]):
        """The ILP's node memory rows (self-edges' terms on their diagonal) and edge memory for these modes."""
        rows = memory_rows(prob, mem, optimizer_temporaries(prob, opts, offload, cluster), linear_buckets)
        for key, em in zip(self_keys, edge_memory_rows(prob, self_keys, modes, offload, cluster), strict=True):
            rows[key[0]] = rows[key[0]] + em[np.arange(len(em)), np.arange(len(em))]
        return rows, edge_memory_rows(prob, edge_keys, modes, offload, cluster)

    def edge_bytes(emem: list[np.ndarray | None], choice) -> np.ndarray:
        """Edge memory of a choice on every row."""
        return sum((em[choice[u], choice[v]] for (u, v, _), em in zip(edge_list, emem, strict=True)
                    if em is not None), np.zeros(len(MEMORY_ROWS)))
    layers = sorted({lay for lay in info.layer.values() if lay})
    forced = _forced_checkpoint(opts, info)
    forced_off = _forced_offload(opts)
    base_modes = forced if opts.checkpoint is not None else {}
    base_off = forced_off if forced_off is not None else frozenset()
    sopts = SolverOptions(time_limit_s=opts.time_limit_s, seed=opts.seed, backend=opts.backend,
                          relative_gap=opts.relative_gap, explain=opts.explain_infeasible)
    results: dict[str, Any] = {}
    pruned: dict[str, float] = {}
    errors: dict[str, InfeasibleError] = {}

    attempted: dict[str, int] = {}  # each variant's place in the order they were first tried

    def best() -> float:
        """The best variant's objective so far (inf: none solved)."""
        return min((r[0].objective for r in results.values()), default=math.inf)

    def bar() -> float | None:
        """What a variant must beat to matter: the best variant so far, and the caller's cutoff."""
        cut = min(best(), math.inf if opts.objective_cutoff is None else opts.objective_cutoff)
        return cut if math.isfinite(cut) else None

    # variants pruned by the caller's cutoff alone (below every variant solved so far): the variants after them
    # (the offload gate, their warm starts) may then differ from a solve without the cutoff, so the plan is not
    # stored as the problem's (``_Session``)
    by_caller: set[str] = set()

    def by_caller_cut() -> bool:
        return opts.objective_cutoff is not None and opts.objective_cutoff < best()
    timeouts: dict[str, SolverTimeout] = {}

    # forward-only (serving): nothing is saved for backward, so neither recompute nor activation offload frees
    # anything; the K/V cache a decoding step holds stays on the device (the runtime keeps it there)
    training = any(info.needs_grad.values())
    # forward-only: the largest op's working set under the chosen options (nothing is saved), per option
    wvec = None if training else working_vectors(prob, cluster.mesh_shape)

    def working(choice) -> float:
        return working_of(wvec, choice) if wvec is not None and choice is not None else 0.0
    if not training:  # (recompute or activation offload forced: refused before, ``_check_forward_only``)
        assert not any(m != "none" for m in base_modes.values()) and "activations" not in base_off
    warm_hint = warm_start_choice(opts.warm_start, prob)

    def recompute_bytes(modes: dict[str, str], ckpt_mem: list[np.ndarray], choice) -> float:
        """During backward one checkpointed layer is recomputed at a time: its activations come back."""
        if not modes:
            return 0.0
        n_ckpt = max(1, sum(1 for m in modes.values() if m != "none"))
        return sum(float((m0 - m1)[c]) for m0, m1, c in zip(prob.node_memory, ckpt_mem, choice)) / n_ckpt

    def run(label: str, modes: dict[str, str], offload: frozenset = frozenset(), bounded: bool = True,
            sliced_states: bool = True, above: float | None = None, compete: bool = True,
            repair: bool = False, gap: float | None = None, start: list[int] | None = None) -> None:
        """Solve one variant (checkpoint modes, offload) into ``results`` (``errors``, ``timeouts``). A memory-
        bounded variant must beat ``above`` to matter (default: the best variant so far and the caller's
        ``objective_cutoff``; none where it does not ``compete``): where its LP relaxation bounds it above that, its
        MIP is not solved (``pruned``: the bound). ``repair``: start from the free optimum repaired into the
        budget, not from the best plan so far (which need not fit a variant that recomputes less); ``start``: from
        this choice. ``gap``: solved to this relative gap where it is looser than the plan's (screening)."""
        attempted.setdefault(label, len(attempted))
        cost, ckpt_mem = apply_checkpoint(prob, modes)

        def recompute_of(choice) -> float:
            return recompute_bytes(modes, ckpt_mem, choice)

        recompute = min(float((m0 - m1).min()) for m0, m1 in zip(prob.node_memory, ckpt_mem)) if modes else 0.0
        cost, mem = apply_offload(prob, cost, ckpt_mem, offload, cluster, opts)
        step = optimizer_step_costs(prob, offload, cluster, opts)  # solved with the nodes, recorded apart
        with_self = [c + t for c, t in zip(cost, step, strict=True)]
        for u, d in self_edges:  # an edge between two members of one tied group: both ends take one option
            with_self[u] = with_self[u] + d
        if not sliced_states:  # ZeRO-1/2 ruled out: forbidden options (infinite cost), which presolve removes.
            # Not priced out with a large finite cost: the MIP scales its objective by its largest coefficient, and
            # next to 1e6 s the plans' milliseconds fell below HiGHS's tolerances (it returned "optimal" plans 3x
            # slower than the optimum; CP-SAT rounded them to zero)
            for gid, sliced in zero12_options.items():
                if not sliced.all():
                    with_self[gid] = np.where(sliced, np.inf, with_self[gid])
        try:
            # three memory rows, the moments the plan's peak is the largest of: the end of forward (states,
            # gathered parameters, saved activations, one recomputed layer), the end of backward (states,
            # gradients, one reduction bucket) and the optimizer step (states, gradients, the step's temporaries;
            # after it ZeRO-1/2's gather buckets)
            rows, emem = memory_model(modes, offload, mem)
            temps = optimizer_temporaries(prob, opts, offload, cluster)
            base = np.array([recompute_of(sol0.choice) if sol0 is not None else max(0.0, recompute), bucket0,
                             0.0 if sol0 is None else optimizer_row_base(prob, sol0.choice, temps, cluster)])
            base[0] += working(sol0.choice if sol0 is not None else None)  # forward-only: the largest op's set
            hint = None
            if results and not repair:  # the best plan so far fits this variant too (recompute and offload only
                # free memory: the variants run in that order)
                hint = list(min(results.values(), key=lambda r: r[0].objective)[0].choice)
                if not sliced_states:  # its ZeRO-1/2 slices are forbidden here: the nearest plan without them
                    hint = unsliced_hint(hint, with_self, edge_list, zero12_options)
                    if bounded:
                        hint = repair_to_budget(hint, with_self, rows, edge_list, limit - base, edge_memory=emem)
            elif bounded and sol0 is not None:  # repair the free optimum greedily into the budget
                hint = repair_to_budget(list(sol0.choice), with_self, rows, edge_list, limit - base,
                                        edge_memory=emem)
            if start is not None:
                hint = start
            if hint is None:
                hint = warm_hint
            so = sopts if gap is None else dataclasses.replace(sopts, relative_gap=max(sopts.relative_gap, gap))

            def problem(base: np.ndarray) -> IlpProblem:
                return IlpProblem(names=names, node_cost=with_self, node_memory=rows, edges=edge_list,
                                  memory_limit=float(limit) if bounded else None, memory_base=base, hint=hint,
                                  memory_labels=list(MEMORY_ROWS), edge_memory=emem)

            cut = None
            if bounded:
                cut = above if above is not None else bar() if compete else None
            for _ in range(3 if bounded else 1):
                sol = solve(problem(base), so if cut is None else dataclasses.replace(so, cutoff=cut))
                need = np.array([recompute_of(sol.choice) + working(sol.choice), buckets_of(sol.choice)[1],
                                 optimizer_row_base(prob, sol.choice, temps, cluster)])
                if (need <= base * (1 + 1e-9)).all():
                    break
                base = np.maximum(base, need)
                # a larger base only removes plans: one solved under the smaller base that still fits under the
                # larger is the answer there too (its bound holds), without solving again
                if float(problem(base).peaks(sol.choice).max()) <= limit:
                    break
            lean = prefer_smaller_on_ties(list(sol.choice), with_self, rows, edge_list, emem)
            if tuple(lean) != sol.choice:
                sol = dataclasses.replace(sol, choice=tuple(lean))
            results[label] = (sol, modes, cost, mem, offload, ckpt_mem, edge_bytes(emem, sol.choice), step)
        except InfeasibleError as exc:
            errors[label] = exc
        except SolverCutoff as exc:
            pruned[label] = exc.bound
            if above is None and by_caller_cut():
                by_caller.add(label)
        except SolverTimeout as exc:
            if not bounded:
                raise
            # one variant not solved in time leaves the others (a recompute or offload variant may still be the
            # plan); raised only if no variant gives a plan. It had dropped them all (Llama-70B on 16x4 H100s:
            # "selective" at the 30 s limit, before the row minima proved it infeasible in 0.2 s)
            timeouts[label] = exc

    t0 = time.perf_counter()
    first = "none" if not base_modes else "forced"
    bucket0, sol0 = 0.0, None
    run(first, base_modes, base_off, bounded=False)  # the fastest plan, memory aside: does memory bind at all?
    if first not in results:  # not even without a memory limit: some node has no option its neighbours accept
        exc = errors[first]
        unsupported = sorted({str(n.target) for n in info.nodes if not info.known[n.name]})
        raise ValueError(
            f"no sharding of this graph satisfies the pinned roles {dict(opts.roles)} on mesh {cluster.mesh_shape}: "
            f"{exc}" + (f" Ops without a sharding rule (they can only run replicated, which a 'dp' axis forbids "
                        f"for batch-sharded values): {', '.join(unsupported)}; register one with "
                        f"autopart.register_op(op, sharding=...), or leave that axis's role to the solver."
                        if unsupported else "")) from exc
    sol0, modes0, _, mem0, off0, ckpt0, ebytes0, _ = results[first]
    # the bounded solves start from the free optimum's flat buckets: a plan reduce-scattering more adds its share
    # through the base's iteration (``need``), one with fewer replicated gradients keeps this bound
    bucket0 = buckets_of(sol0.choice)[0]
    rows0 = (sum(r[c] for r, c in zip(memory_model(modes0, off0, mem0)[0], sol0.choice)) + ebytes0 +
             np.array([recompute_bytes(modes0, ckpt0, sol0.choice) + working(sol0.choice), buckets_of(sol0.choice)[1],
                       optimizer_row_base(prob, sol0.choice, optimizer_temporaries(prob, opts, off0, cluster),
                                          cluster)]))
    row0 = max(rows0)
    binds = row0 > limit
    timings["free_memory_row_bytes"] = row0  # the memory row of the fastest plan, memory ignored
    # its rows, and the activations in its end-of-forward row (what gradient accumulation divides: _accumulated_plan)
    timings["free_memory_rows_bytes"] = [float(x) for x in rows0]
    timings["free_activation_bytes"] = float(ebytes0[0]) + sum(
        float(mem0[g][c]) for g, c in enumerate(sol0.choice) if info.kind[groups[g][0]] == "op")
    recompute_variants = opts.checkpoint is None and bool(layers) and training
    if binds:
        del results[first]
        # where the recompute variants will run (memory costs over 2%: ``tight``) anyway, as the LP relaxation of
        # this one already proves (its bound over 1.02x the free optimum), it is solved after them, and only if
        # that bound is below the best of them: proving its optimum can take seconds of MIP (Llama-70B on 16x8
        # H100s: 6 s, the optimum 26% slower than selective recompute's)
        run(first, base_modes, base_off, above=1.02 * sol0.objective if recompute_variants else None)

    def tight() -> bool:
        """Memory binds and costs: no plan fits yet, or fitting made the best one over 2% slower than free."""
        return binds and best() > 1.02 * sol0.objective

    if recompute_variants and tight():
        # memory binds: recompute may buy a cheaper sharding or make the model fit at all
        run("selective", {lay: "selective" for lay in layers}, base_off)
        run("full", {lay: "full" for lay in layers}, base_off)
        if first in pruned:  # deferred above: its bound against the best variant (the same problem, the same LP)
            bound, cut = pruned.pop(first), bar()
            if cut is not None and bound > cutoff_threshold(cut):
                pruned[first] = bound
                if by_caller_cut():
                    by_caller.add(first)
            else:
                run(first, base_modes, base_off, repair=True)
    if forced_off is None and cluster.device.name != "cpu" and binds and training and (
            best() > 1.3 * sol0.objective):
        # still binding: host memory (offload never pays on a CPU cluster, where host memory is device memory)
        full = base_modes or {lay: "full" for lay in layers}
        run("offload-optimizer", base_modes, frozenset({"optimizer"}))
        run("full+offload-optimizer", full, frozenset({"optimizer"}))
        run("offload-optimizer+activations", base_modes, frozenset({"optimizer", "activations"}))
    timings["solve_s"] = time.perf_counter() - t0
    timings["checkpoint_variants"] = sorted(set(results) | set(errors) | set(timeouts) | set(pruned))
    if pruned:  # variants not solved: their LP bound is above a variant's plan (or the caller's cutoff)
        timings["pruned_variants"] = dict(pruned)
    if by_caller:
        timings["pruned_by_cutoff"] = sorted(by_caller)
    if timeouts:
        timings["unsolved_variants"] = {label: str(exc) for label, exc in timeouts.items()}
        if not results:
            raise next(iter(timeouts.values()))
    if pruned and min(pruned.values()) < best():
        # a variant pruned by the caller's cutoff alone might have been the plan: none is below the cutoff
        raise Pruned(min(*pruned.values(), best()))
    if not results:
        from autopart.plan import _fmt_bytes

        exc = min(errors.values(), key=lambda e: e.min_memory)
        first_of = {name: groups[g][0] for g, name in enumerate(names)}
        target_of = {n.name: n.target for n in info.nodes}

        def what(n: str) -> str:
            if info.kind.get(first_of.get(n)) == "param":
                return "model states (parameter, gradient, optimizer)" if training else "weights"
            if opts.kv_cache_tokens:  # decoding: what the node holds between steps (``kv_cache_bytes``)
                target = target_of.get(first_of.get(n))
                if target == aten.scaled_dot_product_attention.default:
                    return "K/V cache"
                if target in ssm_rules.SCAN_OPS or target in ssm_rules.CONV_OPS:
                    return "recurrent state"
            return "activations"
        terms = [(what(n), n, float(b)) for n, b in exc.contributors]
        contrib = ", ".join(f"{kind} of {n} {_fmt_bytes(b)}" for kind, n, b in terms)
        tried = ", ".join(timings["checkpoint_variants"])
        keep = 1 - opts.memory_margin
        given = (f"{_fmt_bytes(limit / keep)} less the memory model's {opts.memory_margin:.0%} margin, "
                 f"{_fmt_bytes(limit)}," if opts.memory_margin else _fmt_bytes(limit))
        raise NoPlanFits(
            f"no plan fits in {given} per device on {cluster.name} mesh {cluster.mesh_shape} "
            f"(activation checkpointing tried: {tried}). Memory binds at the {exc.binding or 'peak'}: the smallest "
            f"per-device peak any plan reaches is {_fmt_bytes(exc.min_memory)}, largest terms there: {contrib}. "
            f"Raise memory_budget to at least {_fmt_bytes(exc.min_memory / keep)}, add devices (if every term "
            f"shrank with the mesh, about "
            f"{math.ceil(cluster.world_size * exc.min_memory / limit) if math.isfinite(exc.min_memory) else '?'} "
            f"instead of {cluster.world_size}; replicated terms do not shrink, so that is a lower bound), or pin "
            f"roles that shard more (zero=3, a tensor-parallel axis).",
            min_memory=exc.min_memory, limit=limit, binding=exc.binding, terms=terms) from exc
    # exact ties go to the variant tried first, which recomputes and offloads least (the plan without recompute may
    # be solved after the others: ``pruned``)
    label = min(results, key=lambda k: (results[k][0].objective, attempted[k]))

    def record(label: str):
        sol, modes, cost, mem, offload, ckpt_mem, ebytes, step = results[label]
        chosen: dict[str, OpOption] = {}
        for gid, members in enumerate(groups):
            for name in members:
                chosen[name] = info.options[name][sol.choice[gid]]
        recompute = sum(float((m0 - m1)[c]) for m0, m1, c in zip(prob.node_memory, ckpt_mem, sol.choice)) \
            / max(1, sum(1 for m in modes.values() if m != "none"))
        solved = dataclasses.replace(prob, node_cost=cost, node_memory=mem,
                                     compute_cost=[c + (cost[g] - prob.node_cost[g])
                                                   for g, c in enumerate(prob.compute_cost)])
        timings["checkpoint_choice"] = label
        timings["regathered_bytes"] = float(ebytes[0])  # edge memory: shards kept for backward less nodes count
        return _record(traced, cluster, axis_names, opts, solved, sol, chosen, limit, dict(timings), modes, offload,
                       recompute, step, wvec)

    plan = record(label)
    sol, modes, _, _, offload, *_ = results[label]
    if not opts.stage and not opts.virtual_layers and any(zero12[sol.choice[g]]
                                                          for g, zero12 in zero12_options.items()):
        # ZeRO-1/2 chosen with nothing forcing it: the ILP prices each parameter's slice of the step, reduction and
        # gather apart, the record the buckets as they run (their latency chains, the backward that hides them).
        # On long rings the two disagree (Mamba 2.8B on 4096 GPUs: the ILP's ZeRO-1 choices made the step 4% slower
        # than none, by the record): the same variant without sliced states, kept if the record says it is faster.
        # Not for a pipeline's stage plans, nor for any 2-block graph standing for the whole model
        # (``virtual_layers``): the search prices such a plan for the whole model and needs the two to choose alike
        # (a record's pick between near-equal variants broke that: Llama 70B, 64 GPUs; a 2-block GPT on 4 CPU
        # ranks, whose 2-block record counted its buckets' latency for 2 blocks, kept no ZeRO where the whole graph
        # keeps ZeRO-2)
        # A check of the ILP's ZeRO pricing, judged by the record: solved where its objective may still be below
        # the plan's step by the factor the two differ by (``OBJECTIVE_OVER_RECORD``), and screened to a looser gap
        # (``NO_ZERO_SCREEN_GAP``); where it wins, solved again to the plan's gap from the screened answer
        nz = label + "/no-zero"
        run(nz, modes, offload, sliced_states=False, above=plan.predicted["step_time_s"] * OBJECTIVE_OVER_RECORD,
            gap=NO_ZERO_SCREEN_GAP)
        if nz in results:
            other = record(nz)
            gap = results[nz][0].gap
            # where it wins, or loses by less than the gap its screen left (the exact answer might win)
            if gap > opts.relative_gap and other.predicted["step_time_s"] * (1 - gap) < plan.predicted["step_time_s"]:
                start = list(results.pop(nz)[0].choice)
                run(nz, modes, offload, sliced_states=False, compete=False, start=start)
                other = record(nz) if nz in results else None
            if other is not None and other.predicted["step_time_s"] < plan.predicted["step_time_s"]:
                plan = other
        if nz in pruned:
            plan.solver["pruned_variants"] = {**plan.solver.get("pruned_variants", {}), nz: pruned[nz]}
    return plan


def _record(traced, cluster, axis_names, opts, prob, sol, chosen, limit, timings, checkpoint, offload, recompute,
            step_cost=None, working: list[np.ndarray] | None = None):
    from autopart.plan import Plan

    info, mesh = prob.info, cluster.mesh_shape
    if prob.passes > 1:  # the ILP's price of the micro-batches' latency; the record prices them from its own terms
        prob = dataclasses.replace(prob, node_cost=[c - (prob.passes - 1) * lat for c, lat in
                                                    zip(prob.node_cost, prob.node_latency)], passes=1)
    nodes, params, inputs, reduced, zero, param_tags = {}, {}, {}, {}, {}, {}
    compute = 0.0
    memory = defaultdict(float)
    temporaries = {"plain": 0.0, "zero": 0.0}
    zero_grads = 0.0  # gradients of ZeRO-1/2 parameters, freed before their gather after the step
    node_by_name = {n.name: n for n in info.nodes}
    for gid, members in enumerate(prob.groups):
        a = sol.choice[gid]
        compute += float(prob.compute_cost[gid][a])
        kind = info.kind[members[0]]
        m = float(prob.node_memory[gid][a])
        if kind == "param":  # split the model states the way the memory row summed them
            chosen_opt = info.options[members[0]][a]
            local, opt_states = param_state_bytes(value_of(node_by_name[members[0]]), chosen_opt.output, mesh, opts,
                                                  chosen_opt.tag, info.needs_grad[members[0]])
            n = prob.scale[gid] if prob.scale else len(members)  # a tied group stands for this many nodes
            local, opt_states = local * n, opt_states * n
            if "optimizer" in offload and cluster.device.name != "cpu":
                opt_states = 0.0
            # the optimizer step's temporaries, per runtime parameter group (runtime/zero1.py: plain, ZeRO-1/2)
            group = "zero" if chosen_opt.tag in ("zero1", "zero2") else "plain"
            temporaries[group] += opt_states * OPTIMIZER_STEP_TEMPORARY if info.needs_grad[members[0]] else 0.0
            if group == "zero":
                zero_grads += float(prob.grad_memory[gid][a])
            memory["parameters"] += local
            memory["optimizer_states"] += opt_states
            memory["gathered_parameters"] += m - local - opt_states
            memory["gradients"] += float(prob.grad_memory[gid][a])
            if prob.held_grad_memory:
                memory["accumulated_gradients"] = memory.get("accumulated_gradients", 0.0) + float(
                    prob.held_grad_memory[gid][a])
        else:
            memory["activations" if kind == "op" else "buffers"] += m
    comm_total = 0.0
    collectives = []
    seen_conversions: dict = {}
    zero_gathers: list = []  # ZeRO-1/2 parameters' (node, zero1_gather_entry, bandwidth, ILP price), graph order
    users = _saving_users(info)
    offloaded = "activations" in offload and cluster.device.name != "cpu"
    overlap = tp_overlap_on(opts, cluster)
    tp_hidden = 0.0  # conversion seconds collective matmuls hide (``tp_overlap_hidden``), out of comm_total

    def fwd_of(name: str) -> float:
        gid = prob.group_of[name]
        return float(prob.fwd_compute[gid][sol.choice[gid]]) / (prob.scale[gid] if prob.scale else
                                                                len(prob.groups[gid]))

    for n in info.nodes:
        o = chosen[n.name]
        gid = prob.group_of[n.name]
        a, k = sol.choice[gid], prob.scale[gid] if prob.scale else len(prob.groups[gid])
        rec = {"op": regions.describe(n) if n.target is regions.OP else
               str(n.target) if n.op == "call_function" else info.kind[n.name],
               "inputs": [spec_str(s) for s in o.inputs],
               "output": [spec_str(s) for s in _outs(o)] if isinstance(o.output[0], tuple) else spec_str(o.output),
               "layer": info.layer[n.name], "group": gid,
               "compute_s": float(prob.compute_cost[gid][a]) / k,
               # this node's share of its tied group: time (compute, internal and output collectives), forward
               # compute (what recomputing it costs), bytes it holds (states of a parameter; saved activations)
               "time_s": float(prob.node_cost[gid][a]) / k, "fwd_s": float(prob.fwd_compute[gid][a]) / k,
               "memory_bytes": float(prob.node_memory[gid][a]) / k, "region": prob.region[gid]}
        if o.tag and info.kind[n.name] == "op":  # e.g. context parallelism's strategy, read by passes.context
            rec["tag"] = o.tag
        if info.kind[n.name] == "op":
            # its parameters' bytes at the layouts it reads them in: read (and, training, read again and their
            # gradient written in backward) by every micro-batch whatever its size (``pipelining.Unit.floor_s``)
            # (an embedding reads only the rows it gathers, and writes, training, its dense table's gradient)
            passes = (1 if n.target == aten.embedding.default else 3) if info.needs_grad[n.name] else \
                (0 if n.target == aten.embedding.default else 1)
            read = sum(_local_bytes(value_of(a), p, mesh) for a, p in zip(tensor_inputs(n), o.inputs)
                       if info.kind.get(a.name) == "param" and isinstance(value_of(a), torch.Tensor))
            if read * passes:
                rec["param_read_s"] = read * passes / cluster.device.mem_bandwidth
        if prob.node_latency and prob.node_latency[gid][a] > 0:  # paid by every micro-batch, whatever its size
            rec["comm_latency_s"] = float(prob.node_latency[gid][a]) / k
        ep = ep_axes(n, o.inputs) if n.target is regions.OP else ()
        if ep:  # expert parallel: what the plan prints
            rec["ep_axes"], rec["experts"] = list(ep), regions.region(n.args[0]).num_experts
            for i in regions.region(n.args[0]).expert_inputs:  # its stacked expert weights (``Plan.axis_role``)
                w, _ = _producer(n.args[1][i])
                if w.name in nodes and info.kind.get(w.name) == "param":
                    nodes[w.name]["expert"] = True
        if o.tag in CP_TAGS:  # the axis it splits the sequence over (``Plan.axis_role``)
            rec["cp_axis"] = cp_axis(o) if n.target == aten.scaled_dot_product_attention.default else seq_axis(o)
        kv = kv_cache_bytes(n, o, mesh, opts.kv_cache_tokens) if info.kind[n.name] == "op" else 0.0
        if kv:  # in its memory_bytes: the cache of every sequence of the batch, held between steps
            rec["kv_cache_bytes"] = kv
        if info.kind[n.name] == "op" and info.needs_grad[n.name]:
            rec["transient_bytes"] = transient_bytes(n, o, mesh)
            if prob.keep_full:
                rec["keep_bytes"] = float(prob.keep_full[gid][a]) / k  # kept under full recompute
        if info.kind[n.name] == "param":
            rec["param"], rec["numel"] = traced.params[n.name], value_of(n).numel()  # ``Plan.axis_role`` weighs
            if value_of(n).dim() >= 3 and not any("conv" in str(u.target) for u in n.users):
                rec["stacked"] = True  # [E, d, f] expert weights stacked (``autopart.models.moe``), not a kernel
            rec["grad_bytes"] = float(prob.grad_memory[gid][a]) / k
            if o.tag == "zero2" and info.needs_grad[n.name]:
                # the whole local gradient: what its reduce-scatter moves, and what a pipeline holds until the
                # parameter's last accumulation (``pipelining.block_units``)
                rec["grad_whole_bytes"] = param_grad_bytes(value_of(n), o.output, mesh, "", opts.grad_dtype)
            rec["optimizer_step_s"] = float(step_cost[gid][a]) / k if step_cost is not None else 0.0
            if o.tag in ("zero1", "zero2") and info.needs_grad[n.name]:  # gathered after the step, bucketed
                entry = zero1_gather_entry(value_of(n), o.output, mesh)
                # its bandwidth; the node's time holds the ILP's price of it (``zero1_gather_shares``)
                rec["gather_s"] = zero1_gather_time(value_of(n), o.output, cluster, latency=False)
                zero_gathers += [(n.name, entry, rec["gather_s"], rec["time_s"] - rec["compute_s"])] * max(
                    1, round(k / len(prob.groups[gid])))  # a tied group's stand-ins
        nodes[n.name] = rec
        if info.kind[n.name] == "param":
            fqn = traced.params[n.name]
            params[fqn] = spec_str(o.output)
            for alias in traced.aliases.get(fqn, []):  # tied names share the one parameter's placement
                params[alias] = spec_str(o.output)
            if o.tag:  # the variant of that placement (a ZeRO level): ``Plan.param_pins``
                for alias in (fqn, *traced.aliases.get(fqn, [])):
                    param_tags[alias] = o.tag
            gathered = [i for i in range(len(mesh)) if is_shard(o.output[i]) and n.users and all(
                isinstance(chosen[u.name].inputs[tensor_inputs(u).index(n)][i], Replicate) for u in n.users)]
            rec["gathered_axes"] = gathered  # sharded there only to be stored (ZeRO-3): ``Plan.axis_role``
            if gathered and o.tag == "zero3":
                zero[fqn] = 3
            elif o.tag in ("zero1", "zero2") and not gathered:
                zero[fqn] = int(o.tag[-1])
            axes = param_reduced_axes(n, chosen, info, mesh)
            if any(axes):
                reduced[fqn] = [i for i, x in enumerate(axes) if x]
        elif info.kind[n.name] == "input":
            inputs[n.name] = spec_str(o.output)
        if info.kind[n.name] != "op":
            continue
        split = split_axes(o, len(mesh))
        for j, a in enumerate(tensor_inputs(n)):
            u, idx = _producer(a)
            if u.name not in chosen:
                continue
            src = output_spec(chosen[u.name], idx)
            pr = param_reduced_axes(u, chosen, info, mesh) if info.kind[u.name] == "param" else ()
            g = info.needs_grad[u.name]
            key = (a.name, spec_str(o.inputs[j]), split if g else None)
            kept = regather_spec(src, o.inputs[j], split, g, mesh) if regathered_input(n, j, info) else None
            if kept is not None:  # n keeps the shard; its backward gathers again (priced apart from the record)
                share = max(1, users.get(a.name, 1))
                rg_t = regather_time(value_of(a), kept, o.inputs[j], cluster) / share
                comm_total += rg_t
                held = _local_bytes(value_of(a), kept, mesh) / share
                counted = _local_bytes(value_of(a), o.inputs[j], mesh) / share
                mode, reg = checkpoint.get(info.layer[n.name]), prob.region[gid]
                if (mode == "full" and reg not in ("", "layer_output")) or (mode == "selective" and reg == "attention"):
                    ureg = prob.region[prob.group_of[u.name]]
                    held, counted = (held, counted) if info.layer[u.name] != info.layer[n.name] or (
                        mode == "selective" and ureg != "attention") else (0.0, 0.0)
                nodes[n.name]["memory_bytes"] += held - (0.0 if offloaded else counted)
            if key in seen_conversions:  # the runtime converts a value once per distinct target and reuses it
                if kept is not None:
                    seen_conversions[key]["regather"] = seen_conversions[key].get("regather", 0) + 1
                    seen_conversions[key]["regather_s"] = seen_conversions[key].get("regather_s", 0.0) + rg_t
                continue
            seen_conversions[key] = {}
            steps = conversion_steps(src, o.inputs[j], split, g, mesh, pr)
            zero3 = chosen[u.name].tag == "zero3"
            conversion = functools.partial(transition_time, src=src, dst=o.inputs[j], split=split, needs_grad=g,
                                           cluster=cluster, param_reduced=pr, regather=zero3 and saves_input(n, j),
                                           chained=zero3, reduce_dtype=opts.reduce_dtype)
            t = conversion(value_of(a))
            hid, fused_step = 0.0, 0  # seconds a collective matmul hides, of which of ``steps``
            if overlap and j == 0 and linear_input_fused(a):  # one gather for the users converting it alike
                lin_fwd = sum(fwd_of(w.name) for w in a.users if chosen[w.name].inputs[0] == o.inputs[j] and
                              split_axes(chosen[w.name], len(mesh)) == split)
                hid = tp_overlap_hidden(value_of(a), src, o.inputs[j], split, g, cluster, lin_fwd, True)
                fused_step = max((i for i, st in enumerate(steps or ()) if st.fwd != "none"), default=0)
            elif overlap and a is u and linear_output_fused(u):
                hid = tp_overlap_hidden(value_of(a), src, o.inputs[j], split, g, cluster, fwd_of(u.name), False)
            hid = min(hid, t)  # hidden whole: 0 left, not a rounding's negative
            t -= hid
            tp_hidden += hid
            comm_total += t
            if steps:
                # its latency, what a micro-batch pays whatever its size (``per_micro_batch_s``): the same
                # conversion of no bytes, at most what is exposed of it
                lat = conversion(_no_bytes(value_of(a)))
                collectives.append({"value": a.name, "user": n.name, "layer": info.layer[n.name],
                                    "steps": [[s.axis, s.fwd, s.bwd] for s in steps], "time_s": t,
                                    "latency_s": min(lat, t)})
                if hid:  # run as a collective matmul: time_s is what it leaves exposed
                    collectives[-1] |= {"tp_overlap_hidden_s": hid, "tp_overlap_step": fused_step}
                seen_conversions[key] = collectives[-1]
                if kept is not None:  # how many users keep the shard and gather it again in backward, and the time
                    collectives[-1] |= {"regather": 1, "regather_s": rg_t}
    # collectives inside nodes' own lowerings and on graph outputs (vocab-parallel cross-entropy's all-reduces,
    # ZeRO-1's parameter all-gather after the step, gathering outputs): node cost less its compute
    internal_comm = sum(float(prob.node_cost[g][a] - prob.compute_cost[g][a]) for g, a in enumerate(sol.choice))
    comm_total += internal_comm
    # ZeRO-1/2's all-gather after the step: the node costs above hold the ILP's price of it per parameter (its
    # bandwidth, or the share of it forward does not hide); the step pays the part the next forward does not hide
    # of the bucketed gather as the runtime runs it (``param_gather``: bandwidth, latency per bucket per axis)
    position = {n.name: i for i, n in enumerate(info.nodes)}
    zero_gathers.sort(key=lambda g: min((position[u.name] for u in node_by_name[g[0]].users if u.name in position),
                                        default=len(position)))  # the runtime's bucket order: forward's first use
    # the buckets' sizes, per set of axes, for the bytes reduced (else gathered) over them: what the runtime fills
    red_totals = reduction_totals(traced, nodes, reduced, mesh, opts.reduce_dtype)
    totals = dict(red_totals)
    for axes, _, gathered in [g[1] for g in zero_gathers]:
        if axes not in red_totals:
            totals[axes] = totals.get(axes, 0.0) + gathered
    # a pipeline stage's reduction runs from the schedule's last micro-batches, which its own record does not see
    # (the pipeline model prices it, ``pipelining``): the links' sizes there; elsewhere the step's best
    sizes = plan_bucket_bytes(totals, cluster) if opts.stage else choose_bucket_bytes(
        traced, nodes, reduced, zero, [g[:3] for g in zero_gathers], totals, cluster, opts.micro_batches,
        opts.reduce_dtype)
    gather_latency = zero1_gather_latency([g[1] for g in zero_gathers], cluster, sizes)
    # each parameter's share of its bucket's latency, what pipeline units sum (a stand-in's mean: one instance's)
    latency_of: dict[str, list[float]] = defaultdict(list)
    for g, lat in zip(zero_gathers, zero1_latency_shares([g[1] for g in zero_gathers], cluster, sizes)):
        latency_of[g[0]].append(lat)
    for name, lats in latency_of.items():
        nodes[name]["gather_latency_s"] = sum(lats) / len(lats)
    gather_total, gather_exposed = param_gather(traced, nodes, [g[:3] for g in zero_gathers], cluster, 1, sizes)
    gather_priced = sum(g[3] for g in zero_gathers)
    comm_total += gather_exposed - gather_priced
    # data-parallel gradient reduction (all-reduce; reduce-scatter for ZeRO-1/2), overlapped with backward where the
    # device overlaps communication: ``hidden`` of it runs behind backward compute; ``comm_s`` (in the step) holds
    # the exposed part, ``grad_reduction_s`` all of it
    reduction, exposed = gradient_reduction(traced, nodes, reduced, zero, cluster, 1, sizes, opts.reduce_dtype)
    comm_total += exposed
    hidden = reduction - exposed
    out_specs = {}
    for o in traced.graph.find_nodes(op="output"):
        for a in torch.utils._pytree.tree_leaves(o.args):
            if isinstance(a, fx.Node):
                u, idx = _producer(a)
                if u.name in chosen:
                    out_specs[a.name] = spec_str(output_spec(chosen[u.name], idx))
    alternatives = {}
    for gid, members in enumerate(prob.groups):
        opts_r = info.options[members[0]]
        alternatives[str(gid)] = {
            "members": members,
            "options": [str(o) for o in opts_r],
            "cost_s": [float(x) for x in prob.node_cost[gid]],
            "memory_bytes": [float(x) for x in prob.node_memory[gid]],
            "chosen": int(sol.choice[gid]),
        }
    unsupported = sorted({str(n.target) for n in info.nodes if not info.known[n.name]})
    # three candidate peaks (MEMORY_ROWS): end of forward (activations saved, no gradient yet unless micro-batches
    # accumulate them, plus the loss's backward temporaries, counted in the activations), end of backward
    # (gradients, one reduction bucket, no activation) and the optimizer step (below)
    states = memory["parameters"] + memory["optimizer_states"] + memory["buffers"]
    if opts.kv_cache_tokens:  # the K/V cache, counted with the attention nodes' memory, reported apart
        memory["kv_cache"] = sum(r.get("kv_cache_bytes", 0.0) for r in nodes.values())
        memory["activations"] -= memory["kv_cache"]
    if working is not None:  # forward-only: the largest op's working set (nothing is saved; ``working_vectors``)
        wvec = working
        memory["activations"] += working_of(wvec, sol.choice)
        for g, members in enumerate(prob.groups):  # per node, for pipeline stages (``pipelining.block_units``)
            for name in members:
                if name in nodes and wvec[g][sol.choice[g]]:
                    nodes[name]["working_bytes"] = float(wvec[g][sol.choice[g]])
        # the model's outputs (logits) stay until the call returns: a pipeline's last stage holds every
        # micro-batch's (``pipelining.block_units``)
        by_name = {n.name: n for n in info.nodes}
        for name in traced.outputs:
            n, g = by_name.get(name), prob.group_of.get(name)
            v = value_of(n) if n is not None else None
            if g is not None and name in nodes and isinstance(v, torch.Tensor):
                spec = _outs(info.options[name][sol.choice[g]])[0]
                nodes[name]["output_bytes"] = _local_bytes(v, spec, cluster.mesh_shape)
    # shards kept for backward in place of the gathered activations the node terms count (the ILP's edge memory)
    memory["activations"] += timings.get("regathered_bytes", 0.0)
    memory["peak_forward"] = states + memory["gathered_parameters"] + memory["activations"] + \
        memory.get("kv_cache", 0.0)
    memory["peak_forward"] += recompute
    # gradient accumulation: every micro-batch but the first runs forward beside the gradients accumulated so far
    memory["peak_forward"] += memory.get("accumulated_gradients", 0.0)
    memory["peak_backward"] = states + memory["gradients"] + sum(reduction_bucket_bytes(
        prob, sol.choice, cluster, max([BUCKET_BYTES, *sizes.values()])))
    # the optimizer step: states, every gradient and the temporaries of the group being stepped; after it the
    # ZeRO-1/2 gradients are freed and their gather buckets are in flight (``optimizer_row_base``)
    memory["optimizer_temporaries"] = max(temporaries.values())
    memory["gather_in_flight"] = zero1_gather_bytes([g[1] for g in zero_gathers], cluster, sizes)
    memory["peak_optimizer"] = states + memory["gradients"] + max(memory["optimizer_temporaries"],
                                                                  memory["gather_in_flight"] - zero_grads)
    memory["total"] = max(memory["peak_forward"], memory["peak_backward"], memory["peak_optimizer"])
    # the optimizer step, after the reduction and before ZeRO-1/2's gather (the stand-ins of a tied group: its sum)
    opt_step = sum(float(step_cost[g][a]) for g, a in enumerate(sol.choice)) if step_cost is not None else 0.0
    predicted = {"step_time_s": compute + comm_total + opt_step, "compute_s": compute, "comm_s": comm_total,
                 "optimizer_step_s": opt_step,
                 "internal_comm_s": internal_comm, "grad_reduction_s": reduction, "hidden_comm_s": hidden,
                 "param_gather_s": gather_exposed, "param_gather_total_s": gather_total,
                 "param_gather_latency_s": gather_latency, "param_gather_priced_s": gather_priced,
                 "tp_overlap_hidden_s": tp_hidden,
                 "memory_bytes": dict(memory)}
    accumulation = {}
    if opts.micro_batches > 1:
        from autopart.pipelining import _batch_of

        m, batch = opts.micro_batches, _batch_of(traced)
        accumulation = {"micro_batches": m, "micro_batch_size": batch // m, "batch": batch}
        predicted = accumulated(predicted, m, traced, nodes, collectives, reduced, zero,
                                [g[:3] for g in zero_gathers], cluster, sizes, opts.reduce_dtype)
    plan = Plan(
        fingerprint=traced.fingerprint,
        mesh_shape=tuple(mesh),
        axis_names=tuple(axis_names),
        cluster=cluster.to_json(),
        options={"roles": dict(opts.roles), "pins": dict(opts.pins), "local_batch": opts.local_batch,
                 "memory_limit": limit, "tp_comm_overlap": overlap,
                 "bucket_bytes": sizes, "reduce_dtype": opts.reduce_dtype, "grad_dtype": opts.grad_dtype,
                 "param_tags": param_tags},
        nodes=nodes,
        params=params,
        inputs=inputs,
        outputs=out_specs,
        reduced=reduced,
        collectives=collectives,
        alternatives=alternatives,
        solver=sol.to_json() | {"groups": len(prob.groups), "tied_layers": prob.tied_layers,
                                "graph_nodes": len(info.nodes)} | timings,
        predicted=predicted,
        unsupported_ops=unsupported,
        checkpoint={lay: m for lay, m in checkpoint.items() if m != "none"},
        zero=zero,
        offload=sorted(offload),
        accumulation=accumulation,
    )
    from autopart.pipelining import batch_axes

    plan.options["batch_axes"] = sorted(batch_axes(plan, traced))  # ``Plan.axis_role``
    return plan


def per_micro_batch_s(nodes: dict, collectives: list[dict], device: Device) -> tuple[float, float]:
    """(compute, communication) seconds of a plan's records (``nodes``, ``collectives``) that every micro-batch
    pays whatever its size, as the pipeline's blocks count them (``pipelining.block_units``): the framework's time
    per op (``Device.op_latency``), the runtime's work per parameter (a parameter node's ``compute_s``:
    ``Device.param_latency``), the conversions of parameters (ZeRO-3's gathers, once per forward) and the latency
    of the other collectives (``latency_s``: tensor parallelism's all-reduces run once per micro-batch, each paying
    its links' latency, whatever the micro-batch's bytes), and of those inside ops' lowerings and on the graph's
    outputs (a node's ``comm_latency_s``: vocab-parallel cross-entropy's all-reduces, expert parallelism's
    all-to-alls)."""
    comp = sum(min(device.op_latency, r["time_s"]) for r in nodes.values()
               if r["op"] not in ("param", "buffer", "constant", "input"))
    comp += sum(r["compute_s"] for r in nodes.values() if r["op"] == "param")
    comm = sum(c["time_s"] if nodes.get(c["value"], {}).get("op") == "param" else c.get("latency_s", 0.0)
               for c in collectives)
    comm += sum(r.get("comm_latency_s", 0.0) for r in nodes.values())  # inside lowerings (vocab-parallel loss)
    return comp, comm


def fixed_op_s(rec: dict, device: Device) -> float:
    """Of an op's record, the seconds every micro-batch pays whatever its size: the framework's time per op
    (``Device.op_latency``) and the latency of the collectives inside its lowering (``comm_latency_s``: a
    vocab-parallel loss's), at most its time."""
    return min(device.op_latency + rec.get("comm_latency_s", 0.0), rec["time_s"])


def weight_reread_s(nodes: dict, m: int, device: Device) -> float:
    """What ``m`` micro-batches add to the traced batch's compute by reading the weights again each: per block (the
    nodes of one layer; the rest as one), a micro-batch takes at least its ops' parameter reads at the memory
    bandwidth (``param_read_s``: forward's read, and backward's read and gradient write), capped at the whole
    batch's time of those ops, as ``pipelining.Unit.cost`` prices a pipeline's micro-batches (the other ops, such as
    attention over the K/V cache, split with the batch). Zero where each micro-batch's share of the compute stays
    above it (large micro-batches: GEMMs are compute-bound)."""
    blocks: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in nodes.values():
        if r["op"] in ("param", "buffer", "constant", "input") or not r.get("param_read_s"):
            continue
        b = blocks[r["layer"]]
        b[0] += r["time_s"] - fixed_op_s(r, device)
        b[1] += r.get("param_read_s", 0.0)
    return sum(max(0.0, m * min(floor, t) - t) for t, floor in blocks.values())


def accumulated(predicted: dict, m: int, traced: Traced, nodes: dict, collectives: list[dict], reduced: dict,
                zero: dict, gathered: list, cluster: Cluster, sizes: dict[str, int] | None = None,
                reduce_dtype: str | None = None) -> dict:
    """``predicted`` (a one-pass record of the traced batch, its memory already one micro-batch's:
    ``one_micro_batch``) for ``m`` gradient-accumulation micro-batches run one after another, as the runtime runs
    them (``ParallelModule.forward_backward``): the batch-proportional time is the same in all, what each
    micro-batch pays whatever its size (``per_micro_batch_s``) is paid ``m`` times, each reads the weights again
    (``weight_reread_s``, where that binds); the data-parallel reduction,
    launched from the last micro-batch's backward, is hidden only by that backward, and ZeRO-1/2's after-step
    gather only by the first micro-batch's forward (``gradient_reduction`` / ``param_gather`` with
    ``micro_batches``). On GPU presets (no per-op latency) accumulation costs only that less-hidden communication.
    ``predicted["accumulation"]`` says how the step is made up."""
    comp, comm = per_micro_batch_s(nodes, collectives, cluster.device)
    reread = weight_reread_s(nodes, m, cluster.device)
    reduction, exposed = gradient_reduction(traced, nodes, reduced, zero, cluster, m, sizes, reduce_dtype)
    _, gather = param_gather(traced, nodes, gathered, cluster, m, sizes)
    exposed_1 = predicted["grad_reduction_s"] - predicted["hidden_comm_s"]
    extra_comm = (m - 1) * comm + (exposed - exposed_1) + (gather - predicted["param_gather_s"])
    out = dict(predicted)
    out.update({"step_time_s": predicted["step_time_s"] + (m - 1) * comp + reread + extra_comm,
                "compute_s": predicted["compute_s"] + (m - 1) * comp + reread,
                "comm_s": predicted["comm_s"] + extra_comm,
                "hidden_comm_s": reduction - exposed, "param_gather_s": gather})
    out["accumulation"] = {
        "micro_batches": m, "one_pass_step_time_s": predicted["step_time_s"],
        "per_micro_batch_s": comp + comm, "weight_reread_s": reread, "grad_reduction_exposed_s": exposed,
        "one_pass_grad_reduction_exposed_s": exposed_1, "param_gather_exposed_s": gather,
        "one_pass_param_gather_exposed_s": predicted["param_gather_s"],
        "activations_bytes": predicted["memory_bytes"]["activations"]}
    return out


def unsliced_hint(choice: list[int], cost: list[np.ndarray], edges: list[tuple[int, int, np.ndarray]],
                  sliced: dict[int, np.ndarray]) -> list[int]:
    """``choice`` with every group whose option is a ZeRO-1/2 slice (``sliced[g]``: a mask over g's options)
    switched to its cheapest other option, node cost and incident edges with the neighbours held: the warm start
    of the solve that rules those slices out. Handed the plan with them, which that solve forbids, HiGHS searched
    cold (Llama-7B on (8, 2, 4): 30 s at the time limit, gap 0.9%)."""
    choice = list(choice)
    adj = _incident(edges)
    for g, mask in sliced.items():
        if not mask[choice[g]] or mask.all():
            continue
        choice[g] = int(np.argmin(np.where(mask, np.inf, _local_costs(g, cost, adj, choice))))
    return choice


def _incident(edges: list[tuple[int, int, np.ndarray]]) -> dict[int, list[tuple[int, np.ndarray, bool]]]:
    """Group -> (other end, cost matrix, whether the group is its rows) of every edge at it."""
    adj: dict[int, list[tuple[int, np.ndarray, bool]]] = defaultdict(list)
    for u, v, m in edges:
        adj[u].append((v, m, True))
        adj[v].append((u, m, False))
    return adj


def _local_costs(g: int, cost: list[np.ndarray], adj: dict, choice: list[int]) -> np.ndarray:
    """(K_g,): each option's node cost plus its edges' (``_incident``), the neighbours as chosen."""
    t = np.array(cost[g], dtype=float)
    for other, m, rows in adj[g]:
        t = t + (m[:, choice[other]] if rows else m[choice[other], :])
    return t


def _incident_memory(edges: list[tuple[int, int, np.ndarray]], edge_memory: list[np.ndarray | None] | None
                     ) -> dict[int, list[tuple[int, np.ndarray]]]:
    """Group -> (other end, (K_group, K_other, R) bytes) of every edge at it with a memory term (``edge_memory``,
    one per edge, (Ka, Kb) or (Ka, Kb, R) or None)."""
    madj: dict[int, list[tuple[int, np.ndarray]]] = defaultdict(list)
    for e, (u, v, _) in enumerate(edges):
        em = edge_memory[e] if edge_memory is not None else None
        if em is not None:
            em = em[:, :, None] if em.ndim == 2 else em
            madj[u].append((v, em))
            madj[v].append((u, em.transpose(1, 0, 2)))
    return madj


def _local_memory(g: int, mem: list[np.ndarray], madj: dict, choice: list[int]) -> np.ndarray:
    """(K_g, R): each option's memory rows plus its edges' (``_incident_memory``), the neighbours as chosen."""
    full = mem[g]
    for other, em in madj[g]:
        full = full + em[:, choice[other]]
    return full


def prefer_smaller_on_ties(choice: list[int], cost: list[np.ndarray], mem: list[np.ndarray],
                           edges: list[tuple[int, int, np.ndarray]],
                           edge_memory: list[np.ndarray | None] | None = None, passes: int = 4) -> list[int]:
    """Among options that cost the same, the one that holds less: from the solver's ``choice``, switch a group to
    the option of least memory whose node and incident edge costs (neighbours as chosen, ``_local_costs``) are no
    higher and whose memory rows are none higher and one lower. The solver breaks exact ties arbitrarily; this is
    where they are real: a frozen weight (serving) kept whole that its matmul reads a slice of costs what the slice
    costs, no gradient to reduce, and holds all of it (Llama-70B decoding over 8 GPUs held 47.5 GiB of weights a
    GPU where the same step shards them to 17.5). The step does not change, memory only falls; passes repeat while
    a switch opens another."""
    mem = [m[:, None] if m.ndim == 1 else m for m in mem]
    adj = _incident(edges)
    madj = _incident_memory(edges, edge_memory)
    choice = list(choice)
    for _ in range(passes):
        changed = False
        for g in range(len(choice)):
            if len(cost[g]) < 2:
                continue
            full = _local_memory(g, mem, madj, choice)
            cur = choice[g]
            delta = full - full[cur]  # (K, R)
            smaller = np.nonzero((delta <= 0).all(axis=1) & (delta < 0).any(axis=1))[0]
            if not len(smaller):
                continue
            local = _local_costs(g, cost, adj, choice)
            tol = 1e-12 * max(1.0, abs(float(local[cur]))) if math.isfinite(local[cur]) else 0.0
            ok = [int(a) for a in smaller if local[a] <= local[cur] + tol]
            if ok:
                choice[g] = min(ok, key=lambda a: (float(full[a].sum()), a))
                changed = True
        if not changed:
            break
    return choice


def repair_to_budget(choice: list[int], cost: list[np.ndarray], mem: list[np.ndarray],
                     edges: list[tuple[int, int, np.ndarray]], limit, max_steps: int = 10_000,
                     edge_memory: list[np.ndarray | None] | None = None) -> list[int] | None:
    """A feasible warm start for the memory-bounded solve: from ``choice``, repeatedly switch the one group whose
    switch removes excess memory at the least added time per byte (node cost and incident edges), until every
    memory row fits. ``mem`` entries are (K,) or (K, R); ``limit`` a number or one per row; ``edge_memory`` (one
    per edge, (Ka, Kb, R) or None) the bytes that depend on an edge's pair of options, which a switch changes with
    the neighbours' options held. Returns None when it gets stuck (the solver then starts cold)."""
    mem = [m[:, None] if m.ndim == 1 else m for m in mem]
    limit = np.broadcast_to(np.asarray(limit, dtype=float), (mem[0].shape[1],)) if mem else np.zeros(1)
    adj = _incident(edges)
    madj = _incident_memory(edges, edge_memory)

    def excess(used: np.ndarray) -> float:
        return float(np.maximum(used - limit, 0.0).sum())

    used = sum(m[c] for m, c in zip(mem, choice))
    for u, v, em in ((u, v, em) for (u, v, _), em in zip(edges, edge_memory or [None] * len(edges)) if em is not None):
        used = used + (em[:, :, None] if em.ndim == 2 else em)[choice[u], choice[v]]
    for _ in range(max_steps):
        over = excess(used)
        if over <= 0:
            return choice
        best = None
        for g in range(len(choice)):
            full = _local_memory(g, mem, madj, choice)
            delta = full - full[choice[g]]  # (K, R): the change of every row if g switched
            gain = over - np.maximum(used + delta - limit, 0.0).sum(axis=1)
            better = np.nonzero(gain > 0)[0]
            if not len(better):
                continue
            local = _local_costs(g, cost, adj, choice)
            for a in better:
                dt = float(local[a]) - float(local[choice[g]])  # inf - inf: nan, skipped below (no numpy warning)
                if not math.isfinite(dt):
                    continue
                ratio = max(dt, 0.0) / gain[a]
                if best is None or ratio < best[0]:
                    best = (ratio, g, int(a))
        if best is None:
            return None
        _, g, a = best
        full = _local_memory(g, mem, madj, choice)
        used = used + full[a] - full[choice[g]]
        choice[g] = a
    return None


def _forced_checkpoint(opts: PlanOptions, info: Graphinfo) -> dict[str, str]:
    """Layers the user asked to checkpoint (``PlanOptions.checkpoint``)."""
    if not opts.checkpoint:
        return {}
    layers = sorted({lay for lay in info.layer.values() if lay})
    _check_checkpoint_modes(opts.checkpoint)
    want = {lay: opts.checkpoint for lay in layers} if isinstance(opts.checkpoint, str) else dict(opts.checkpoint)
    for lay in want:
        if lay not in layers:
            raise ValueError(f"checkpoint asked for layer {lay!r}; the model's layers are {layers[:8]}...")
    return {lay: m for lay, m in want.items() if m != "none"}
