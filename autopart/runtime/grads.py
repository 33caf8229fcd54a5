"""Data-parallel gradient reduction: flat buckets launched from backward, overlapped with the rest of it.

The gradients the plan marks as reduced (``plan.reduced``: a parameter replicated on a mesh axis whose users split
the batch there) are summed over those axes in flat buckets of at most ``BUCKET_BYTES`` (DDP's 25 MiB), or the
plan's larger size for axes whose links would make a bucket that size latency-bound (``bucket_limit``: a 48-rank
ring across nodes pays 47 hops of latency a bucket; ``planner.bucket_bytes``). Buckets follow backward
order (the reverse of each parameter's first use in forward) and hold parameters reduced over the same axes the
same way. Outside pipelines a bucket is launched (``async_op=True``) from the post-accumulate-grad hook of its last
parameter, so it runs while backward computes the rest; the end of backward waits for all of them (a callback
queued on the autograd engine), so ``loss.backward()`` returns with reduced gradients. The reductions run on
process groups of their own, one per set of mesh axes: forward and backward issue their collectives on the mesh's
groups, and two threads issuing on one gloo group aborted a run.

ZeRO-1 / ZeRO-2 parameters (``plan.zero`` 1 or 2) whose optimizer is ``ParallelModule.optimizer`` (which slices
their optimizer states, ``runtime/zero1.py``) are reduce-scattered instead: each rank receives only the sum of its
flat slice (``zero1.zero1_slice``). ZeRO-1 keeps the whole gradient buffer (``.grad``, valid on the rank's slice
after reduction); ZeRO-2 frees ``.grad`` as soon as it is copied into its bucket and accumulates the slice into the
optimizer's slice leaf, so only gradient slices (plus the buckets in flight) remain at the end of backward. With
any other optimizer those parameters' gradients are all-reduced whole, which every optimizer can step.

Gradient accumulation without stages (``plan.accumulation``, ``ParallelModule.forward_backward``) runs the
micro-batches' backwards with launches suppressed but the last (``accumulating``): its hooks fire on the accumulated
gradients and launch the buckets as above, once per step, hidden only by that last backward.

Pipelined modules (``runtime/pipeline.py``) launch the same buckets from the schedule's backward, as Megatron-LM's
--overlap-grad-reduce does: a schedule runs every micro-batch's backward through each of the rank's chunks, so a
parameter's gradient is final only at its last accumulation of the step (``begin_schedule`` counts them); the
bucket launches then, in bucket order as above, and runs while the schedule computes the backward left (the rank's
earlier layers and chunks, and the cool-down), on groups created over every stage (``stage_axes_groups``). The end
of the step waits for them (``end_schedule``). A parameter held by several stages (a tied embedding and head) sums
its stages' gradients first: its buckets are reduced after the schedule (``post_backward(deferred=True)``), on the
mesh's groups, not overlapped.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from autopart import _torch_private as P
from autopart.runtime.collectives import all_gather_single, reduce_scatter_single

BUCKET_BYTES = 25 * 2**20  # at most this many gradient bytes per flat reduction, as DDP's default

# What the runtime overlaps, for the cost model: outside pipelines, bucket k (buckets in backward order, at most
# BUCKET_BYTES each) starts when its last gradient is produced and runs concurrently with the rest of backward; the
# step waits for all of them at the end of backward. Pipelined modules launch bucket k when its last gradient of the
# step is produced (the last micro-batch's backward through its chunk) and wait for all of them after the schedule.
OVERLAP_WITH_BACKWARD = True
OVERLAP_IN_PIPELINE = True
# Buckets whose flat buffer may be alive at once in backward: launching one finishes (waits for, copies back and
# frees) the oldest beyond this many, so the end of backward holds at most this many flats beside the gradients
# (the planner's end-of-backward memory row prices them). Two let a bucket's collective run while the next one fills;
# under NCCL a wait only orders the compute stream after the oldest, which has long finished.
REDUCE_IN_FLIGHT = 2

# reductions launched from gradient hooks while backward (a pipeline: the schedule) was still running / at the end of
# backward (of the schedule) or after it
STATS = {"launched_in_backward": 0, "launched_at_end": 0}


@dataclass
class _Entry:
    """One reduced parameter."""

    key: str
    param: nn.Parameter
    axes: tuple[int, ...]  # mesh axes its gradient is summed over
    order: int  # position in backward order
    slice: object = None  # zero1._Slice when reduce-scattered into this rank's slice (an attached ZeRO optimizer)
    level: int = 0  # plan.zero level


@dataclass
class _Bucket:
    entries: list[_Entry]
    axes: tuple[int, ...]
    scatter: bool
    deferred: bool = False  # reduced after the schedule (a parameter several pipeline stages hold)
    ready: set[str] = field(default_factory=set)
    launched: bool = False
    work: object = None
    flat: torch.Tensor | None = None
    out: torch.Tensor | None = None
    grads: list = field(default_factory=list)  # (entry, local gradient) as copied into ``flat``
    done: bool = False  # finished: results copied back, buffers freed

    def reset(self) -> None:
        """Before a backward (or an after-backward reduction): nothing ready, launched or held."""
        self.ready, self.launched, self.work, self.flat, self.out, self.grads, self.done = \
            set(), False, None, None, None, [], False


def axes_groups(dm, axes_sets) -> dict[tuple[int, ...], object]:
    """A new process group per set of mesh axes (this rank's), over the ranks that differ only on those axes,
    ordered as the mixed-radix index over them (outer axis first). Every rank calls ``new_group`` for every group
    of every set, in the same order, as torch requires."""
    return _groups_over([dm.mesh], axes_sets)


def stage_axes_groups(layout: torch.Tensor, axes_sets) -> dict[tuple[int, ...], object]:
    """``axes_groups`` for a pipelined module: ``layout`` holds the global ranks as (pp, *stage mesh). Every rank
    creates every stage's groups, stage by stage (``new_group`` is collective over the world), for every set in
    ``axes_sets`` (the same on every rank: a stage whose parameters reduce over fewer axes still creates the
    others' groups); it keeps its own stage's."""
    return _groups_over(list(layout), axes_sets)


# the gradient groups made so far in this process, by their ranks in order, for the default group they were made
# under: every module parallelized in a process shares them (a gloo group keeps threads, and those of the groups
# one module no longer uses wake idle ~100 times a second). Every rank makes every group in the same order, so every
# rank finds the same ones here.
_GROUPS: tuple[object, dict[tuple[int, ...], object]] = (None, {})


def _group(ranks: list[int]):
    global _GROUPS
    if _GROUPS[0] is not dist.group.WORLD:  # a new default group: the old one's subgroups are gone with it
        _GROUPS = (dist.group.WORLD, {})
    groups = _GROUPS[1]
    key = tuple(ranks)
    if key not in groups:
        groups[key] = dist.new_group(ranks)
    return groups[key]


def _groups_over(meshes: list[torch.Tensor], axes_sets) -> dict[tuple[int, ...], object]:
    me = dist.get_rank()
    out = {}
    for mesh in meshes:
        for axes in sorted(set(axes_sets)):
            rest = [i for i in range(mesh.dim()) if i not in axes]
            cells = mesh.permute(*rest, *axes).reshape(-1, math.prod(mesh.shape[i] for i in axes))
            for row in cells.tolist():
                g = _group(row)
                if me in row:
                    if dist.get_group_rank(g, me) != row.index(me):  # torch orders a group's ranks by global rank
                        raise RuntimeError(f"gradient group {row} does not rank its members in mesh order; the "
                                           f"device mesh must list ranks row-major (init_device_mesh does)")
                    out[axes] = g
    return out


def bucket_key(axes) -> str:
    """The key of a set of mesh axes in ``plan.options["bucket_bytes"]``: ``"0,1"``."""
    return ",".join(map(str, sorted(axes)))


def bucket_limit(axes, sizes: dict[str, int]) -> int:
    """Bytes a bucket over mesh ``axes`` holds at most: the plan's size for them (``plan.options["bucket_bytes"]``,
    keyed by ``bucket_key``: larger where the links make a collective latency-bound, ``planner.bucket_bytes``), else
    ``BUCKET_BYTES``."""
    return int(sizes.get(bucket_key(axes), BUCKET_BYTES))


class GradReducer:
    """The reduction of one module's gradients (see the module docstring). ``overlap``: launch from backward on
    dedicated groups; otherwise ``post_backward`` reduces on ``groups`` (the mesh's, one per axis)."""

    def __init__(self, params: dict[str, nn.Parameter], reduced: dict[str, tuple[int, ...]], zero: dict[str, int],
                 first_use: list[str], groups: list, coords: list[int], sizes: list[int], dm=None,
                 overlap: bool = True, bucket_bytes: dict[str, int] | None = None,
                 reduce_dtype: str | torch.dtype | None = None) -> None:
        self._groups, self._coords, self._sizes = groups, coords, sizes
        # the dtype the buckets sum in (``PlanOptions.reduce_dtype``: fp32 for bf16 gradients, as Megatron-LM and
        # FSDP2's ``reduce_dtype``); the sums are cast back to each gradient's dtype. None: the gradients' own
        self._reduce_dtype = getattr(torch, reduce_dtype) if isinstance(reduce_dtype, str) else reduce_dtype
        self.bucket_bytes = dict(bucket_bytes or {})  # the plan's sizes per set of axes (``bucket_limit``)
        order = {k: i for i, k in enumerate(reversed(first_use))}  # backward order: reverse of first use
        # ZeRO-2 parameters whose gradient needs no sum (the graph reduced it already) only keep their slice
        keys = [k for k in params if (k in reduced or zero.get(k) == 2) and params[k].requires_grad]
        keys.sort(key=lambda k: order.get(k, len(order)))
        self._entries = {k: _Entry(k, params[k], tuple(reduced.get(k, ())), i, level=zero.get(k, 0))
                         for i, k in enumerate(keys)}
        self._buckets: list[_Bucket] | None = None
        self._bucket_of: dict[str, _Bucket] = {}
        self.overlap = overlap and bool(self._entries) and dm is not None
        self._own = axes_groups(dm, [e.axes for e in self._entries.values() if e.axes]) if self.overlap else {}
        self._in_backward = False
        self._held: dict[str, torch.Tensor] = {}
        # gradient accumulation (``accumulating``): a backward that only accumulates (an earlier micro-batch), and
        # whether a backward holds the gradients already there aside (reducing only its own)
        self._skip = False
        self._hold = True
        # pipelines (``in_schedule``): accumulations per step that make a gradient final, and those seen so far;
        # keys reduced after the schedule; the chunk whose backward finalises each (a bucket holds one chunk's)
        self._uses: dict[str, int] | None = None
        self._seen: dict[str, int] = {}
        self._deferred: set[str] = set()
        self._chunk_of: dict[str, int] = {}
        for k, e in self._entries.items():
            e.param.register_post_accumulate_grad_hook(lambda p, k=k: self._on_grad(k))

    # ---- ZeRO ----------------------------------------------------------------------------------------------
    def attach(self, slices: dict[str, object]) -> None:
        """The ZeRO optimizer's slices (parameter key -> ``zero1._Slice``): those parameters' gradients are
        reduce-scattered into the slices from now on."""
        for k, s in slices.items():
            e = self._entries.get(k)
            if e is None:
                continue
            if not set(e.axes) <= set(s.axes):
                raise RuntimeError(f"parameter {k} is reduced over mesh axes {e.axes} but sliced over {s.axes}: "
                                   f"a ZeRO parameter must be replicated where its gradient is summed")
            e.slice = s
        self._buckets = None

    def scattered(self, key: str) -> bool:
        """Whether ``key``'s gradient lands in its optimizer slice leaf (ZeRO-2) rather than in ``.grad``."""
        e = self._entries.get(key)
        return e is not None and e.slice is not None and e.level == 2

    def sliced(self, key: str) -> bool:
        """Whether ``key``'s gradient is reduced only on this rank's slice (ZeRO-1 and ZeRO-2 with their
        optimizer): ``.grad`` outside the slice is not the sum."""
        e = self._entries.get(key)
        return e is not None and e.slice is not None

    # ---- pipelines -----------------------------------------------------------------------------------------
    def in_schedule(self, layout: torch.Tensor, axes_sets, deferred: set[str], chunk_of: dict[str, int]) -> None:
        """Launch from a pipeline schedule's backward from now on (the module docstring). ``layout``: the global
        ranks as (pp, *stage mesh); ``axes_sets``: every set of mesh axes any stage reduces over (the same on every
        rank, every rank creates every stage's groups); ``deferred``: keys reduced after the schedule
        (``post_backward(deferred=True)``); ``chunk_of``: the chunk whose backward finalises each key (buckets do
        not mix chunks: a bucket of the rank's later chunk launches before its earlier chunk's backward)."""
        self._own = stage_axes_groups(layout, [a for a in axes_sets if a])
        self._deferred, self._chunk_of = set(deferred), dict(chunk_of)
        self._uses = {}
        self._buckets = None

    def begin_schedule(self, uses: dict[str, int]) -> None:
        """Before a pipelined step: ``uses[key]`` is how many times the schedule accumulates ``key``'s gradient
        (micro-batches x this rank's chunks using it); the last makes it final and ready to reduce."""
        for b in self.buckets():
            b.reset()
        self._uses, self._seen, self._held = dict(uses), {}, {}
        self._in_backward = True

    def end_schedule(self) -> None:
        """After a pipelined step: launch the buckets whose gradients never became final in it (in bucket order),
        then wait for all but the deferred ones."""
        if not self._in_backward:
            return
        try:
            for b in self._buckets:
                if not b.launched and not b.deferred:
                    self._launch(b, async_op=True)
                    STATS["launched_at_end"] += 1
                    self._drain()
            for b in self._buckets:
                if not b.deferred:
                    self._finish(b)
        finally:
            self._in_backward = False

    # ---- buckets -------------------------------------------------------------------------------------------
    def _build(self) -> list[_Bucket]:
        """Buckets in the order their last gradient arrives; each entry joins the open bucket of its kind (axes,
        all-reduce or reduce-scatter over the same slice axes), closed when the next would pass its axes'
        ``bucket_limit``."""
        open_: dict[tuple, _Bucket] = {}
        done: list[tuple[int, _Bucket]] = []
        size: dict[tuple, int] = {}
        for e in sorted(self._entries.values(), key=lambda e: e.order):
            kind = (e.axes, tuple(e.slice.axes) if e.slice is not None else None, e.key in self._deferred,
                    self._chunk_of.get(e.key))
            nbytes = _local(e.param).nbytes
            b = open_.get(kind)
            if b is not None and size[kind] + nbytes > bucket_limit(e.axes, self.bucket_bytes):
                done.append((b.entries[-1].order, b))
                b = None
            if b is None:
                b = open_[kind] = _Bucket([], e.axes, e.slice is not None, e.key in self._deferred)
                size[kind] = 0
            b.entries.append(e)
            size[kind] += nbytes
        done += [(b.entries[-1].order, b) for b in open_.values()]
        buckets = [b for _, b in sorted(done, key=lambda x: x[0])]
        self._bucket_of = {e.key: b for b in buckets for e in b.entries}
        return buckets

    def buckets(self) -> list[_Bucket]:
        if self._buckets is None:
            self._buckets = self._build()
        return self._buckets

    # ---- backward ------------------------------------------------------------------------------------------
    def mark(self, outs):
        """``outs`` (the program's outputs) through an identity whose backward starts the reduction: it runs
        before any parameter's gradient is accumulated."""
        if not self.overlap or not torch.is_grad_enabled():
            return outs
        flat = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        idx = [i for i, o in enumerate(flat) if isinstance(o, torch.Tensor) and o.requires_grad]
        if not idx:
            return outs
        marked = _BackwardStart.apply(self, *(flat[i] for i in idx))
        for i, m in zip(idx, marked):
            flat[i] = m
        return type(outs)(flat) if isinstance(outs, (tuple, list)) else flat[0]

    @contextmanager
    def accumulating(self, last: bool):
        """One micro-batch of gradient accumulation (``ParallelModule.forward_backward``). Before the last, its
        backward launches nothing: the gradients add up in ``.grad``. In the last, the buckets launch from its
        backward as usual, each once its parameters' gradients are final, and reduce the whole accumulated sum
        (nothing is held aside: the caller held what was there before the step)."""
        self._skip, self._hold = not last, False
        try:
            yield
        finally:
            self._skip, self._hold = False, True

    def begin_backward(self) -> None:
        if self._in_backward or self._skip:  # several outputs of one backward; an earlier micro-batch's backward
            return
        self._in_backward = True
        for b in self.buckets():
            b.reset()
        self._held = {}
        for k, e in self._entries.items():  # reduce only this backward's gradients; add the earlier ones after
            if self._hold and e.param.grad is not None:
                self._held[k], e.param.grad = e.param.grad, None
        P.queue_backward_callback(self._end_backward)

    def _on_grad(self, key: str) -> None:
        if not self._in_backward:
            return
        if self._uses is not None:  # a pipeline: final at the step's last accumulation
            self._seen[key] = self._seen.get(key, 0) + 1
            if self._seen[key] < self._uses.get(key, 1):
                return
        b = self._bucket_of[key]
        b.ready.add(key)
        for nb in self._buckets:  # launch in bucket order on every rank: the collectives must match
            if nb.launched or nb.deferred:
                continue
            if len(nb.ready) < len(nb.entries):
                break
            self._launch(nb, async_op=True)
            STATS["launched_in_backward"] += 1
            self._drain()

    def _drain(self) -> None:
        """Finish the oldest launched buckets beyond ``REDUCE_IN_FLIGHT`` (their flats freed)."""
        pending = [b for b in self._buckets if b.launched and not b.done]
        for b in pending[: max(0, len(pending) - REDUCE_IN_FLIGHT)]:
            self._finish(b)

    def _end_backward(self) -> None:
        try:
            for b in self._buckets:
                if not b.launched:
                    self._launch(b, async_op=True)
                    STATS["launched_at_end"] += 1
                    self._drain()
            for b in self._buckets:
                self._finish(b)
            for k, g in self._held.items():
                p = self._entries[k].param
                p.grad = g if p.grad is None else p.grad + g
        finally:
            self._held = {}
            self._in_backward = False

    def post_backward(self, deferred: bool = False) -> None:
        """Reduce the gradients there now, on the mesh's groups, axis by axis: all of them, or (``deferred``, after
        a pipeline's schedule) those of the parameters several stages hold."""
        for b in self.buckets():
            if deferred and not b.deferred:
                continue
            b.reset()
            self._launch(b, async_op=False)
            self._finish(b)

    # ---- one bucket ----------------------------------------------------------------------------------------
    def _launch(self, b: _Bucket, async_op: bool) -> None:
        b.launched = True
        entries = [e for e in b.entries if e.param.grad is not None]
        if not entries or not (b.axes or b.scatter):  # nothing to sum, nothing to slice
            return
        if not b.scatter:
            grads = [P.dtensor_local(e.param.grad) for e in entries]
            rd = self._reduce_dtype
            b.flat = torch.cat([g.reshape(-1) if rd is None or not g.is_floating_point() else g.reshape(-1).to(rd)
                                for g in grads])
            b.grads = list(zip(entries, grads))
            if async_op:
                b.work = dist.all_reduce(b.flat, group=self._own[b.axes], async_op=True)
            else:
                hierarchical_all_reduce(b.flat, sorted(b.axes), self._groups, self._sizes)
            return
        # reduce-scatter: block r of the flat (r the mixed-radix index over the reduced axes, outer first) holds,
        # per entry, the slice of the rank whose coordinates are r on those axes and this rank's elsewhere
        s0 = b.entries[0].slice
        red = list(b.axes)
        n_red = math.prod(self._sizes[a] for a in red)
        per = sum(e.slice.size for e in entries)
        gdt = P.dtensor_local(entries[0].param.grad).dtype  # the gradients' (PlanOptions.grad_dtype)
        b.flat = flat = torch.zeros(n_red * per, dtype=self._reduce_dtype or gdt,
                                    device=_local(entries[0].param).device)
        ranks = []  # per block r: the slice index (mixed radix over the slice axes) it holds
        for r in range(n_red):
            coords, rem = list(self._coords), r
            for a in reversed(red):
                coords[a] = rem % self._sizes[a]
                rem //= self._sizes[a]
            ranks.append(_mixed_radix(coords, self._sizes, s0.axes))
        off = 0
        for e in entries:
            g = P.dtensor_local(e.param.grad).reshape(-1)
            for r, rank in enumerate(ranks):
                start = min(rank * e.slice.size, g.numel())
                end = min(start + e.slice.size, g.numel())
                flat[r * per + off: r * per + off + end - start].copy_(g[start:end])
            off += e.slice.size
            if e.level == 2:  # ZeRO-2: only the slice stays; the whole gradient is in the bucket now
                e.param.grad = None
        b.grads = [(e, None) for e in entries]
        if not red:  # sliced only
            b.out = flat
            return
        if async_op:
            b.out = torch.empty(per, dtype=flat.dtype, device=flat.device)
            b.work = reduce_scatter_single(b.out, flat, group=self._own[b.axes], async_op=True)
            return
        # axis by axis, innermost first (the outer, slower links carry the smallest share: hierarchical_time):
        # the blocks reordered so that the innermost axis' coordinate leads
        k = len(red)
        cur = flat.view(*[self._sizes[a] for a in red], per).permute(*range(k - 1, -1, -1), k).reshape(-1)
        for a in reversed(red):
            out = torch.empty(cur.numel() // self._sizes[a], dtype=cur.dtype, device=cur.device)
            reduce_scatter_single(out, cur, group=self._groups[a])
            cur = out
        b.out = cur

    def _finish(self, b: _Bucket) -> None:
        if b.work is not None:
            b.work.wait()
        if not b.scatter:
            off = 0
            for _, g in b.grads:
                g.copy_(b.flat[off: off + g.numel()].view_as(g))
                off += g.numel()
        else:
            off = 0
            for e, _ in b.grads:
                s = e.slice
                part = b.out[off: off + s.end - s.start]
                off += s.size
                if e.level == 2:  # (the sum cast back from the reduction's dtype to the gradient's)
                    part = part.to(grad_dtype_of(s.leaf))
                    s.leaf.grad = part.clone() if s.leaf.grad is None else s.leaf.grad.add_(part)
                else:  # ZeRO-1: the reduced slice back into the whole gradient buffer
                    P.dtensor_local(e.param.grad).view(-1)[s.start:s.end].copy_(part)
        b.work, b.flat, b.out, b.grads, b.done = None, None, None, [], True


def hierarchical_all_reduce(flat: torch.Tensor, axes: list[int], groups: list, sizes: list[int]) -> None:
    """Sum the 1-D ``flat`` in place over mesh ``axes`` (outer first) on the mesh's per-axis ``groups``, as
    ``cost.comm.hierarchical_time`` prices it: reduce-scatter over every axis but the outermost, innermost first;
    all-reduce what is left (1/n of the bytes per inner axis) over the outermost; all-gather back. One axis: one
    all-reduce."""
    inner = list(reversed(axes[1:]))
    if not inner:
        if axes:
            dist.all_reduce(flat, group=groups[axes[0]])
        return
    ways = math.prod(sizes[a] for a in inner)
    pad = -flat.numel() % ways
    cur = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
    for a in inner:
        out = cur.new_empty(cur.numel() // sizes[a])
        reduce_scatter_single(out, cur, group=groups[a])
        cur = out
    dist.all_reduce(cur, group=groups[axes[0]])
    for a in reversed(inner):
        out = cur.new_empty(cur.numel() * sizes[a])
        all_gather_single(out, cur, group=groups[a])
        cur = out
    flat.copy_(cur[: flat.numel()])


def _mixed_radix(coords: list[int], sizes: list[int], axes) -> int:
    rank = 0
    for a in axes:
        rank = rank * sizes[a] + coords[a]
    return rank


def grad_dtype_of(t: torch.Tensor) -> torch.dtype:
    """The dtype ``t``'s gradient is kept in: its ``grad_dtype`` (``PlanOptions.grad_dtype``; torch has the
    attribute from 2.13 on, autopart allows older), else its own dtype."""
    return getattr(t, "grad_dtype", None) or t.dtype


def _local(p: torch.Tensor) -> torch.Tensor:
    return P.dtensor_local(p) if hasattr(p, "placements") else p


class _BackwardStart(torch.autograd.Function):
    """Identity on the program's outputs; its backward runs first in backward and starts the reduction."""

    @staticmethod
    def forward(ctx, reducer: GradReducer, *outs: torch.Tensor):
        ctx.reducer = reducer
        ctx.set_materialize_grads(False)
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.reducer.begin_backward()
        return (None, *grads)
