r"""Pipeline planning: contiguous stage boundaries, per-layer checkpointing, micro-batches and schedule.

Pure numpy; the solver sees per-layer numbers only. A later pass wires it to the cost model and the runtime.

Schedule model (N21 = Narayanan et al. 2021, GPipe = Huang et al. 2019; see shared/REFERENCE.md)
-------------------------------------------------------------------------------------------------
Stages :math:`k = 0..p-1`, micro-batches :math:`m`, interleaved chunks :math:`v`. The time of stage (or chunk)
:math:`k` for one micro-batch, forward plus backward, is

.. math:: t_k = \sum_{l \in k} (f_l + b_l) + \sum_{l \in k,\ \mathrm{ckpt}} f_l + \pi

with :math:`\pi` = ``p2p_s`` charged once per stage when :math:`p v > 1` (the send of its boundary activation or
gradient), and the recomputed forward :math:`f_l` for checkpointed layers. Bottleneck model of the step:

* GPipe, 1F1B: :math:`T = (m + p - 1)\,\max_k t_k`; bubble :math:`(p-1)/(m+p-1)` of the step, i.e.
  :math:`(p-1)/m` of the ideal time :math:`m \max_k t_k` (N21 §2.2.1; 1F1B has GPipe's time, less memory).
* Interleaved (N21 §2.2.2): the :math:`p v` chunks are the DP's stages; rank :math:`r` owns chunks
  :math:`r, r+p, \dots`. With :math:`\tau = \max_c t_c` the per-chunk bottleneck,
  :math:`T = (m v + p - 1)\,\tau`, which for balanced chunks (:math:`\tau = t/v`) is
  :math:`(m + (p-1)/v)\,t`: bubble :math:`(p-1)/(v m)` of the ideal time, :math:`(p-1)/(v m + p - 1)` of the step.
  That count is the runtime's critical path for :math:`m \ge p`; with fewer micro-batches than stages (torch
  runs them in one round of m) the schedule idles more: :math:`T = (v p + m - 1)\,\tau` for :math:`m < p`
  (``schedule_units``); one micro-batch on p = 2, v = 2 passes its 4 chunks in turn, :math:`4\tau`, not
  :math:`3\tau`.

Memory of a stage: :math:`S + n_k A'` with :math:`S = \sum_l s_l` the states (gradients included), :math:`A' =
\sum_l a'_l` the activation bytes (``recompute_act_bytes`` if the layer is checkpointed, else ``act_bytes``) and
:math:`n_k` micro-batches in flight:

* GPipe: :math:`n_k = m`, but its peak comes as backward starts, when all :math:`m` micro-batches' activations are
  held and the gradients :math:`G` (``grad_bytes``) are not yet allocated; after the first micro-batch's backward
  the gradients exist and :math:`m - 1` micro-batches remain: :math:`S + \max(m A' + R - G, (m-1) A')`. (1F1B and
  interleaved reach their in-flight count again after the first backward, gradients allocated: :math:`S + n_k A'
  + R`.) :math:`R` (``transient_bytes``: the loss's temporaries as its backward starts; a forward-only layer's
  working set, its largest op's inputs and outputs) is held once: the largest of the stage's layers.
* 1F1B: :math:`n_k = \min(p - k, m)` (stage 0 holds :math:`p`; N21 §2.2.1).
* Interleaved: Megatron's warm-up count plus one, :math:`W_r = \min(m v,\ 2(p-r-1) + (v-1)g + 1)`
  chunk-micro-batches (:math:`g = p` micro-batches a round, as Megatron runs it, or :math:`g = m` when
  :math:`m < p`, as torch's ``ScheduleInterleaved1F1B`` does) in flight on rank :math:`r`, spread evenly over its
  chunks: :math:`n_c = \min(m, \lceil W_r / v \rceil)`; rank 0 then holds about :math:`(1 + (p-1)/(p v))` times
  1F1B's activations, as N21 states. Each chunk must fit in ``memory_limit / v`` (a sufficient condition for its
  rank to fit; it keeps the DP contiguous). ``stage_memory`` reports per rank, the sum of its chunks.

Optimisation (``partition``)
----------------------------
.. math::

    \min_{0 = j_0 < j_1 < \dots < j_K = L} \; \max_k \; c_k(j_k, j_{k+1}),
    \qquad c_k(i, j) = \min_{C \subseteq [i, j)} \Big\{ t(i,j) + \sum_{l \in C} f_l \;:\;
    \mathrm{mem}_k(i, j, C) \le M_k \Big\}

(:math:`c_k = \infty` if no :math:`C` fits). Exact DP over (stage, layer):
:math:`D_k(j) = \min_{i<j} \max(D_{k-1}(i), c_k(i, j))`, :math:`D_0(0) = 0`, answer :math:`D_K(L)`;
:math:`O(K L^2)` vectorised (PLATFORM.md: 384 layers x 16 stages in tens of ms).

Checkpointing inside a stage is a covering knapsack: choose :math:`C` with savings
:math:`\sum_{l \in C} (a_l - r_l) \ge (\sum s + n \sum a - M)/n` at least added time :math:`\sum_{l\in C} f_l`.
It is solved exactly by a Pareto-front DP: adding layers one at a time, keep every (added time, saving) pair
not dominated (no other pair with no more time and no less saving). An optimal :math:`C` can be replaced by one
whose pair is on the front without losing feasibility or gaining time, so the query "least time with saving
:math:`\ge` need" over the front is exact. The front of :math:`q` identical layers has :math:`q+1` points, so
repeated transformer blocks stay cheap; distinct random costs can grow it (at most :math:`2^q`). Layers with
:math:`r_l \ge a_l` or ``recompute_act_bytes=None`` are never checkpointed (no saving).

Pruning keeps this fast and exact: a first DP prices unfit segments at full checkpointing (an upper bound on
:math:`c_k`) and yields a feasible bottleneck :math:`U \ge` optimum; segments whose checkpoint-free time, a lower
bound on :math:`c_k`, exceeds :math:`U` cannot be in an optimal plan and are skipped; the knapsack runs only on the
rest. Memory is compared with a relative tolerance of ``1e-9``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "interleaved")
_RTOL = 1e-9


@dataclass(frozen=True)
class LayerCost:
    """One layer on one stage's devices, per micro-batch (seconds, bytes per device)."""

    fwd_s: float
    bwd_s: float
    act_bytes: float
    state_bytes: float  # parameters, optimizer states and gradients
    recompute_act_bytes: float | None = None
    grad_bytes: float = 0.0  # the gradients' part of state_bytes (GPipe's peak comes before most of them exist)
    # allocated once (the loss's temporaries as backward starts; forward-only, the layer's working set), not per in
    # flight; a stage holds its layers' largest
    transient_bytes: float = 0.0

    def __post_init__(self) -> None:
        vals = (self.fwd_s, self.bwd_s, self.act_bytes, self.state_bytes, self.grad_bytes, self.transient_bytes)
        if any(not math.isfinite(x) or x < 0 for x in vals):
            raise ValueError(f"LayerCost fields must be finite and >= 0, got {self}")
        if self.grad_bytes > self.state_bytes:
            raise ValueError(f"grad_bytes is part of state_bytes and cannot exceed it, got {self}")
        if self.recompute_act_bytes is not None and not (self.recompute_act_bytes >= 0):
            raise ValueError(f"recompute_act_bytes must be >= 0 or None, got {self.recompute_act_bytes}")


@dataclass(frozen=True)
class CoreSharing:
    """Ranks sharing a host's cores (gloo ranks on a CPU host with more ranks than cores). Stage times are priced
    at the rate a rank computes with every rank of its host busy; in a schedule slot where only ``b`` of the host's
    ``host_ranks`` ranks compute, each runs faster, up to ``alone_speedup`` (a rank alone over all busy,
    ``Device.alone_speedup``). With ``C`` cores a rank computes at ``min(1, C/b)`` of a core and
    ``alone_speedup = host_ranks / C``, so the slot takes ``max(1 / alone_speedup, b / host_ranks)`` of its
    all-busy time. The pipeline's stages lie on the host in order, ``stage_ranks`` ranks each."""

    stage_ranks: int
    host_ranks: int
    alone_speedup: float

    def __post_init__(self) -> None:
        if self.stage_ranks < 1 or self.host_ranks < 1 or not self.alone_speedup >= 1:
            raise ValueError(f"CoreSharing needs stage_ranks >= 1, host_ranks >= 1 and alone_speedup >= 1, got "
                             f"{self}")

    def slot_time(self, busy: Sequence[bool]) -> float:
        """A slot's time relative to all ranks busy, ``busy[k]``: whether stage ``k`` computes in it; the slowest
        host's (stages fill hosts in order, at least one stage per host)."""
        per_host = max(1, self.host_ranks // self.stage_ranks)
        worst = 0.0
        for h in range(0, len(busy), per_host):
            ranks = min(self.host_ranks, self.stage_ranks * sum(busy[h:h + per_host]))
            if ranks:
                worst = max(worst, max(1 / self.alone_speedup, ranks / self.host_ranks))
        return worst


@dataclass(frozen=True)
class PipelineOptions:
    stages: int
    micro_batches: int
    schedule: str
    virtual: int = 1
    p2p_s: float = 0.0
    sharing: CoreSharing | None = None  # ranks sharing cores: slots priced by the ranks busy in them
    # serving (forward only, a K/V cache held between steps: decoding, or a prefill chunk over a cached context)
    # runs continuously: the pipeline never drains. As a micro-batch's token leaves the last stage its next step
    # enters the first (vLLM's and TensorRT-LLM's pipeline parallel serving keep as many batches in flight), so a
    # step of every micro-batch is ``v max(m, p)`` chunk times, with no fill or drain; it is also the time between
    # a sequence's tokens
    steady: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} is not one of {SCHEDULES}")
        if self.stages < 1 or self.micro_batches < 1 or self.virtual < 1:
            raise ValueError(f"stages({self.stages}), micro_batches({self.micro_batches}) and virtual({self.virtual}) "
                             "must all be >= 1")
        if self.schedule != "interleaved" and self.virtual != 1:
            raise ValueError(f"virtual({self.virtual}) > 1 needs schedule='interleaved', got {self.schedule!r}")
        if self.p2p_s < 0:
            raise ValueError(f"p2p_s must be >= 0, got {self.p2p_s}")

    def __str__(self) -> str:
        v = f"v{self.virtual}" if self.schedule == "interleaved" else ""
        return f"{self.schedule}{v}(p={self.stages}, m={self.micro_batches}{', steady' if self.steady else ''})"

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def in_flight(self, chunk: int) -> int:
        """Micro-batches whose activations chunk (= stage when v = 1) holds at peak; see the module docstring."""
        p, m, v = self.stages, self.micro_batches, self.virtual
        if self.schedule == "gpipe":
            return m
        if self.schedule == "1f1b":
            return min(p - chunk, m)
        r = chunk % p
        w = min(m * v, 2 * (p - r - 1) + (v - 1) * _round(p, m) + 1)
        return min(m, -(-w // v))


@dataclass(frozen=True)
class PipelinePlan:
    boundaries: tuple[int, ...]
    checkpointed: tuple[bool, ...]
    step_s: float
    bubble_fraction: float
    stage_time_s: tuple[float, ...]
    stage_memory: tuple[float, ...]
    options: PipelineOptions = field(repr=False, default=PipelineOptions(1, 1, "gpipe"))

    def __str__(self) -> str:
        return (f"{self.options}: boundaries={list(self.boundaries)} ckpt={sum(self.checkpointed)} "
                f"step={self.step_s:.4g}s bubble={self.bubble_fraction:.3f}")

    def grid(self, forward_only: bool = False) -> str:
        """The schedule as a step-by-rank text grid, one unit slot per action ('.' idle); ``forward_only``: as the
        runtime runs a plan without gradients."""
        return schedule_grid(self.options, forward_only)


def bubble_fraction(opts: PipelineOptions) -> float:
    """Idle share of the step: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m + p - 1) interleaved (N21) with m a
    multiple of p; in general 1 - m v / ``schedule_units``."""
    units = schedule_units(opts)
    return (units - opts.micro_batches * opts.virtual) / units


def bubble_over_ideal(opts: PipelineOptions) -> float:
    """Bubble relative to the ideal time m * t: (p-1)/m for GPipe and 1F1B, (p-1)/(v m) interleaved (N21)."""
    return (opts.stages - 1) / (opts.virtual * opts.micro_batches)


def schedule_step_time(stage_times: Sequence[float], opts: PipelineOptions) -> float:
    """Bottleneck step time: ``slot_units`` (``schedule_units``, less where ranks share cores) times the largest
    per-stage (per-chunk) time."""
    if len(stage_times) != opts.chunks:
        raise ValueError(f"got {len(stage_times)} stage times for {opts.chunks} stages x chunks")
    return slot_units(opts) * max(stage_times)


def schedule_units(opts: PipelineOptions) -> float:
    """How many bottleneck chunk times a step lasts: v max(m, p) + min(m, p) - 1 (v = 1 outside interleaved).

    That is N21's m v + p - 1 for GPipe, 1F1B, and interleaved with m >= p. With fewer micro-batches than stages,
    which torch's ``ScheduleInterleaved1F1B`` runs in one round of m, the interleaved schedule idles more than that
    count says: one micro-batch on p = 2, v = 2 passes its 4 chunks in turn (4 chunk times, not 3), and in general
    the first micro-batch crosses all v p chunks before the last of the m enters the last one: v p + m - 1. The
    count is the critical path of the runtime's action order (``_actions``, as torch orders it) whatever the
    forward's share of a chunk's time (forward-only included), checked against an event simulation in
    ``tests/unit/test_pipeline_dp.py``."""
    p, m, v = opts.stages, opts.micro_batches, opts.virtual
    if opts.steady:  # kept full: no fill, no drain (``PipelineOptions.steady``)
        return float(v * max(m, p))
    return float(v * max(m, p) + min(m, p) - 1)


def slot_units(opts: PipelineOptions) -> float:
    """How many bottleneck stage times a step lasts: ``schedule_units`` (m v + p - 1 for m >= p), less where ranks
    sharing cores run faster in the fill and drain (``PipelineOptions.sharing``)."""
    nominal = schedule_units(opts)
    sh = opts.sharing
    if sh is None or sh.alone_speedup <= 1 or opts.stages == 1 or opts.steady:  # steady: every slot busy
        return nominal
    rows = _simulate(opts)
    slots = [sh.slot_time([row[s] != "." for row in rows]) for s in range(len(rows[0]))]
    return nominal * sum(slots) / len(slots)


def gather_exposed(pl: PipelinePlan, layers: Sequence[LayerCost], gather_s: Sequence[float], overlap: bool) -> float:
    """Seconds ZeRO-1/2's parameter all-gather after the optimizer step (``gather_s[l]``: layer ``l``'s, run by the
    rank holding it) adds to a pipelined step.

    Without ``overlap`` the slowest rank's whole gather. With it (``Device.comm_overlap``), as the runtime runs it
    (``runtime/zero1.py``): every rank launches its gathers after the step, in module order, one after the other,
    and its stages' forward waits for a layer's parameters before the layer. The first forward to reach a layer is
    the first micro-batch's, which runs the chunks in order, a ``p2p_s / 2`` send between chunks: the stall that
    chain takes waiting for gathers is exposed (the whole schedule starts from it); the first layer's gather always
    is, a later stage's hides behind the stages before it. A layer's gather is waited for as the layer starts (its
    buckets are not split over its forward), and as if all of a rank's were launched at once (the runtime keeps
    ``GATHER_IN_FLIGHT`` in flight, which keeps the link as busy while forward waits). It is ``reduction_tail``
    with nothing to reduce: every rank starts its gathers as the schedule ends."""
    return reduction_tail(pl, layers, [0.0] * len(layers), overlap, gather_s, after_schedule=True)


def reduction_tail(pl: PipelinePlan, layers: Sequence[LayerCost], reduce_s: Sequence[float], overlap: bool,
                   gather_s: Sequence[float] | None = None, after_schedule: bool = False,
                   late_s: Sequence[float] | None = None, step_s: Sequence[float] | None = None) -> float:
    """Seconds the data-parallel gradient reduction, and ZeRO-1's parameter all-gather after the optimizer step
    (``gather_s``, per layer), add to the pipelined step: how late the next step's first micro-batch gets through
    the stages, each rank having reduced, stepped and gathered on its own clock.

    ``reduce_s[l]`` is layer ``l``'s reduction, run by the rank holding it. Without ``overlap`` a rank reduces and
    gathers after its last backward: the largest per-rank sum (the slack of ranks that finish early is not counted).
    With overlap (NCCL: ``Device.comm_overlap``) the step is priced on the critical path, rank by rank (times from
    the end of the last micro-batch's backward on chunk 0, which ends the schedule):

    * the reduction. The last micro-batch's backward runs the chunks from the last to the first, each layer in
      reverse (a checkpointed layer's forward recomputed first), a ``p2p_s / 2`` send between chunks. Launched from
      backward (``after_schedule`` False: the runtime's pipelines, ``runtime.grads.OVERLAP_IN_PIPELINE``), a
      layer's gradients are final once that backward passed it and its reduction starts then, concurrently with
      the rest of it, one collective after the other per rank (``autopart.cost.comm.exposed_after``): a later
      stage's runs in 1F1B's cool-down, while rank 0 still computes. A rank steps once its reduction is done and
      the schedule has ended (the loss broadcast over the stages after the schedule makes every rank wait for rank
      0's last backward): what runs past that end is exposed. Reduced after the schedule (``after_schedule``),
      every rank reduces all of its share from the end, not overlapped. ``late_s[l]`` (a parameter several stages
      hold, which they sum first) is reduced after the rest of the rank's reduction, from the schedule's end;
    * then its optimizer step (``step_s[l]``, per layer: the step of the parameters the layer holds) and its
      after-step gathers, back to back from its reduction's end (``runtime/zero1.py``, as ``gather_exposed`` prices
      them: a layer waited for as it starts, all of a rank's in flight at once);
    * the next step's first micro-batch runs the chunks in order; a rank's chunk starts once its own reduction is
      done and the previous chunk's output arrived, each layer once its gather is. What that chain ends later than
      without any of this is the tail: rank 0's reduction and gather delay it all, while a later stage's hide in
      its cool-down and in its fill (it idles until the first micro-batch reaches it)."""
    gather_s = [0.0] * len(layers) if gather_s is None else gather_s
    late_s = [0.0] * len(layers) if late_s is None else late_s
    step_s = [0.0] * len(layers) if step_s is None else step_s
    if not len(reduce_s) == len(gather_s) == len(late_s) == len(step_s) == len(layers):
        raise ValueError(f"reduction_tail: {len(reduce_s)} reduction, {len(late_s)} late reduction, {len(step_s)} "
                         f"optimizer step and {len(gather_s)} gather times for {len(layers)} layers")
    o = pl.options
    ends = list(pl.boundaries[1:]) + [len(layers)]
    chunk_of = [c for c, (i, j) in enumerate(zip(pl.boundaries, ends)) for _ in range(i, j)]
    ranks = [chunk_of[lay] % o.stages for lay in range(len(layers))]
    if not overlap:
        per = [0.0] * o.stages
        for lay, r in enumerate(ranks):
            per[r] += reduce_s[lay] + late_s[lay] + step_s[lay] + gather_s[lay]
        return max(per)
    hop = o.p2p_s / 2 if o.chunks > 1 else 0.0
    ready, clock = [0.0] * len(layers), 0.0
    for lay in reversed(range(len(layers))):  # the last micro-batch's backward, last layer first
        if lay + 1 < len(layers) and chunk_of[lay + 1] != chunk_of[lay]:
            clock += hop
        x = layers[lay]
        clock += x.bwd_s + (x.fwd_s if pl.checkpointed[lay] else 0.0)
        ready[lay] = clock
    done = [0.0] * o.stages  # each rank's reduction end (then its step), from the schedule's end
    for r in range(o.stages):
        mine = sorted((ready[lay], reduce_s[lay]) for lay in range(len(layers)) if ranks[lay] == r)
        late = sum(late_s[lay] for lay in range(len(layers)) if ranks[lay] == r)
        step = sum(step_s[lay] for lay in range(len(layers)) if ranks[lay] == r)
        if after_schedule:
            done[r] = sum(c for _, c in mine) + late + step
            continue
        end = 0.0
        for t, c in mine:  # launched as its gradients are final, one after the other (exposed_after's chain)
            end = max(end, t) + c
        done[r] = max(end, clock) - clock + late + step
    start = list(done)
    fwd = free = 0.0  # the next step's first micro-batch through the chunks, and without any of this
    for lay, c in enumerate(chunk_of):
        r = c % o.stages
        if lay == 0 or c != chunk_of[lay - 1]:
            hop_in = hop if lay else 0.0
            fwd, free = max(fwd + hop_in, start[r]), free + hop_in
        if gather_s[lay]:
            done[r] += gather_s[lay]
            fwd = max(fwd, done[r])
        fwd, free = fwd + layers[lay].fwd_s, free + layers[lay].fwd_s
    return max(0.0, fwd - free)


def _front_add(t: np.ndarray, s: np.ndarray, dt: float, ds: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Add one optional item to a Pareto front (times ascending, savings strictly ascending); return keep-order too."""
    nt, ns = np.concatenate([t, t + dt]), np.concatenate([s, s + ds])
    order = np.lexsort((-ns, nt))
    nt, ns = nt[order], ns[order]
    prev = np.concatenate([[-np.inf], np.maximum.accumulate(ns)[:-1]])
    keep = ns > prev
    return nt[keep], ns[keep], order[keep]


def _knapsack(dts: np.ndarray, dss: np.ndarray, need: float) -> tuple[float, list[int]]:
    """Least sum(dts[C]) with sum(dss[C]) >= need, exactly (Pareto front with members); inf if impossible."""
    t, s, members = np.zeros(1), np.zeros(1), [()]
    for i, (dt, ds) in enumerate(zip(dts, dss)):
        if ds <= 0:
            continue
        allm = members + [mm + (i,) for mm in members]
        t, s, order = _front_add(t, s, dt, ds)
        members = [allm[o] for o in order]
    idx = int(np.searchsorted(s, need, side="left"))
    if idx == len(s):
        return math.inf, []
    return float(t[idx]), list(members[idx])


class _Arrays:
    def __init__(self, layers: Sequence[LayerCost]) -> None:
        self.fwd = np.array([x.fwd_s for x in layers], float)
        self.time = np.array([x.fwd_s + x.bwd_s for x in layers], float)
        self.act = np.array([x.act_bytes for x in layers], float)
        self.state = np.array([x.state_bytes for x in layers], float)
        self.grad = np.array([x.grad_bytes for x in layers], float)
        self.transient = np.array([x.transient_bytes for x in layers], float)
        rec = np.array([x.act_bytes if x.recompute_act_bytes is None else x.recompute_act_bytes for x in layers])
        self.save = np.maximum(self.act - rec, 0.0)
        self.ckpt_fwd = np.where(self.save > 0, self.fwd, 0.0)
        n = len(layers)
        pre = {k: np.concatenate([[0.0], np.cumsum(a)]) for k, a in
               (("time", self.time), ("act", self.act), ("state", self.state), ("save", self.save),
                ("ckpt_fwd", self.ckpt_fwd), ("grad", self.grad))}
        seg = {k: v[None, :] - v[:, None] for k, v in pre.items()}
        self.valid = np.arange(n + 1)[None, :] > np.arange(n + 1)[:, None]
        self.T, self.A, self.S, self.SAVE, self.CF, self.G = (
            seg[k] for k in ("time", "act", "state", "save", "ckpt_fwd", "grad"))
        # a segment's transient: its layers' largest (held one at a time), not their sum
        self.TR = np.zeros((n + 1, n + 1))
        for i in range(n):
            self.TR[i, i + 1:] = np.maximum.accumulate(self.transient[i:])

    def allowed_act(self, f: int, lim: float, gpipe: bool) -> np.ndarray:
        """Per segment, the most activation bytes per micro-batch that fit ``lim`` with ``f`` in flight."""
        free = lim - self.S
        if not gpipe:
            return (free - self.TR) / f
        after_first = np.where(free >= 0, free / (f - 1) if f > 1 else np.inf, -np.inf)
        return np.minimum((free + self.G - self.TR) / f, after_first)

    def memory(self, f: int, act: np.ndarray | float, gpipe: bool, i=slice(None), j=slice(None)):
        """Peak bytes of segments with ``f`` in flight and ``act`` activation bytes per micro-batch."""
        return stage_peak(self.S[i, j], self.G[i, j], act, self.TR[i, j], f, gpipe)


def stage_peak(states, grads, act, transient, in_flight: int, gpipe: bool):
    """A stage's peak bytes (the module docstring): ``states`` include ``grads``; ``act`` per micro-batch held
    ``in_flight`` times; ``transient`` once. GPipe peaks as backward starts, before the gradients exist, or just
    after the first micro-batch's backward. Works on numbers and on numpy arrays."""
    if not gpipe:
        return states + in_flight * act + transient
    return states + np.maximum(in_flight * act + transient - grads, (in_flight - 1) * act)


def _bottleneck_dp(costs: list[np.ndarray]) -> tuple[float, list[int]]:
    """min over boundaries of max_k costs[k][j_k, j_{k+1}]; returns (value, boundaries incl. 0, excl. L)."""
    n = costs[0].shape[0] - 1
    dp = np.full(n + 1, np.inf)
    dp[0] = 0.0
    parents = []
    for c in costs:
        cand = np.maximum(dp[:, None], c)
        parents.append(np.argmin(cand, axis=0))
        dp = cand[parents[-1], np.arange(n + 1)]
    if not np.isfinite(dp[n]):
        return math.inf, []
    bounds, j = [], n
    for par in reversed(parents):
        j = int(par[j])
        bounds.append(j)
    return float(dp[n]), bounds[::-1]


def partition(layers: Sequence[LayerCost], opts: PipelineOptions, memory_limit: float) -> PipelinePlan:
    """Exact least-bottleneck contiguous partition with per-layer checkpointing (see the module docstring)."""
    n, K = len(layers), opts.chunks
    if n < K:
        raise ValueError(f"{n} layers cannot fill {K} pipeline stages (stages {opts.stages} x virtual "
                         f"{opts.virtual}); use fewer stages or chunks")
    ar = _Arrays(layers)
    p2p = opts.p2p_s if K > 1 else 0.0
    share = opts.virtual
    flights = [opts.in_flight(k) for k in range(K)]
    lim = memory_limit / share * (1 + _RTOL)
    gpipe = opts.schedule == "gpipe"
    need = {f: ar.A - ar.allowed_act(f, lim, gpipe) for f in set(flights)}  # saving needed, per in-flight count
    fits_plain = {f: ar.valid & (nd <= 0) for f, nd in need.items()}
    fits_full = {f: ar.valid & (ar.SAVE >= nd) for f, nd in need.items()}

    ub_cost = {f: np.where(fits_plain[f], ar.T + p2p, np.where(fits_full[f], ar.T + ar.CF + p2p, np.inf))
               for f in need}
    ub, _ = _bottleneck_dp([ub_cost[f] for f in flights])
    if not math.isfinite(ub):
        _raise_infeasible(ar, opts, flights, memory_limit, n)

    exact = {}
    todo: dict[int, set[int]] = {}
    for f in need:
        c = np.where(fits_plain[f], ar.T + p2p, np.inf)
        hard = fits_full[f] & ~fits_plain[f] & (ar.T + p2p <= ub * (1 + 1e-12))
        for i, j in zip(*np.nonzero(hard)):
            todo.setdefault(int(i), set()).add(int(j))
        exact[f] = c
    # the front of layers i..j-1 depends only on their (fwd, save) items in order: segments whose layers repeat
    # (a Transformer's identical blocks, from any start) share theirs, each front built once, from its prefix's
    fronts: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(1), np.zeros(1))]
    ids: dict[tuple[int, float, float], int] = {}
    fwd, save = ar.fwd.tolist(), ar.save.tolist()
    for i, js in todo.items():
        fid = 0
        t, s = fronts[0]
        jmax = max(js)
        for j in range(i + 1, jmax + 1):
            if save[j - 1] > 0:
                key = (fid, fwd[j - 1], save[j - 1])
                fid = ids.get(key, -1)
                if fid < 0:
                    t, s, _ = _front_add(t, s, fwd[j - 1], save[j - 1])
                    fid = ids[key] = len(fronts)
                    fronts.append((t, s))
                else:
                    t, s = fronts[fid]
            if j in js:
                for f, c in exact.items():
                    if fits_full[f][i, j] and not fits_plain[f][i, j]:
                        idx = int(s.searchsorted(need[f][i, j]))  # side "left"
                        if idx < len(s):
                            c[i, j] = ar.T[i, j] + t[idx] + p2p
    best, bounds = _bottleneck_dp([exact[f] for f in flights])
    assert math.isfinite(best) and best <= ub * (1 + 1e-9), (best, ub)

    ends = bounds[1:] + [n]
    ckpt = [False] * n
    times, mems = [], [0.0] * opts.stages
    for k, (i, j) in enumerate(zip(bounds, ends)):
        f = flights[k]
        extra, chosen = 0.0, []
        if not fits_plain[f][i, j]:
            extra, chosen = _knapsack(ar.fwd[i:j], ar.save[i:j], need[f][i, j])
        for c in chosen:
            ckpt[i + c] = True
        times.append(float(ar.T[i, j] + extra + p2p))
        saved = float(sum(ar.save[i + c] for c in chosen))
        mems[k % opts.stages] += float(ar.memory(f, ar.A[i, j] - saved, gpipe, i, j))
    return PipelinePlan(tuple(bounds), tuple(ckpt), schedule_step_time(times, opts), bubble_fraction(opts),
                        tuple(times), tuple(mems), opts)


class StageMemoryError(ValueError):
    """No partition of the layers into stages fits the memory limit. Beside the message, what callers read without
    parsing it: ``need`` the least per-device peak a partition reaches (every allowed layer checkpointed), ``limit``,
    ``where`` its binding stage ("stage k" or "chunk k (rank r)"), ``layers`` that stage's (first, last) layer,
    ``states`` its model states' bytes and ``activations`` the rest of its peak (what its micro-batches in flight
    keep, and the transients; ``stage_peak``)."""

    def __init__(self, message: str, need: float, limit: float, where: str, layers: tuple[int, int],
                 states: float, activations: float):
        super().__init__(message)
        self.need, self.limit, self.where, self.layers = need, limit, where, layers
        self.states, self.activations = states, activations


def _raise_infeasible(ar: _Arrays, opts: PipelineOptions, flights: list[int], limit: float, n: int) -> None:
    """Find the partition of least peak memory (full checkpointing) and report its binding stage."""
    gpipe = opts.schedule == "gpipe"
    mem = {f: np.where(ar.valid, ar.memory(f, ar.A - ar.SAVE, gpipe) * opts.virtual, np.inf) for f in set(flights)}
    need, bounds = _bottleneck_dp([mem[f] for f in flights])
    ends = bounds[1:] + [n]
    per = [mem[flights[k]][i, j] for k, (i, j) in enumerate(zip(bounds, ends))]
    k = int(np.argmax(per))
    i, j = bounds[k], ends[k]
    act = float(ar.A[i, j] - ar.SAVE[i, j])
    where = f"stage {k}" if opts.virtual == 1 else f"chunk {k} (rank {k % opts.stages})"
    raise StageMemoryError(
        f"no partition of {n} layers into {opts} fits memory_limit={limit:.4g} bytes per device: even the "
        f"least-memory partition, with every allowed layer checkpointed, needs {need:.4g} bytes on {where} "
        f"(layers {i}..{j - 1}: states {float(ar.S[i, j]):.4g} + activations {act:.4g} x {flights[k]} micro-batches "
        f"in flight). Fix: raise memory_limit to >= {need:.4g}, use more stages or devices per stage (shard states), "
        f"more micro-batches of a smaller size, the 1f1b schedule (fewer in flight than gpipe), or allow "
        f"checkpointing (recompute_act_bytes).",
        float(need), float(limit), where, (int(i), int(j - 1)), float(ar.S[i, j]), max(0.0, float(need - ar.S[i, j])))


def best_pipeline(
    layers: Sequence[LayerCost],
    memory_limit: float,
    stage_counts: Iterable[int],
    micro_batch_counts: Iterable[int],
    schedules: Iterable[str | tuple[str, int]],
    p2p_s: float = 0.0,
    sharing: CoreSharing | None = None,
    steady: bool = False,
) -> PipelinePlan:
    """Search stage counts x micro-batch counts x schedules; least time per micro-batch (step_s / m) wins.

    Layer costs are per micro-batch of a fixed size, so comparing m compares throughput. A schedule is a name or
    ``("interleaved", v)``; plain "interleaved" means v = 2. Ties go to lower peak memory. ``sharing``: ranks
    sharing a host's cores (``CoreSharing``), ``stage_ranks`` per stage. ``steady``: decoding served continuously,
    the pipeline kept full (``PipelineOptions.steady``).
    """
    best, errors, least, least_line = None, [], None, ""
    for p, m, sch in itertools.product(list(stage_counts), list(micro_batch_counts), list(schedules)):
        name, v = (sch, 1) if isinstance(sch, str) else sch
        if name == "interleaved" and isinstance(sch, str):
            v = 2
        opts = PipelineOptions(p, m, name, v, p2p_s, sharing, steady)
        try:
            plan = partition(layers, opts, memory_limit)
        except ValueError as e:
            errors.append(f"  {opts}: {e}")
            if isinstance(e, StageMemoryError) and (least is None or e.need < least.need):
                least, least_line = e, f"  closest: {opts}: {e}"
            continue
        key = (plan.step_s / m, max(plan.stage_memory))
        if best is None or key < (best.step_s / best.options.micro_batches, max(best.stage_memory)):
            best = plan
    if best is None:
        message = "no pipeline configuration fits:\n" + "\n".join(errors)
        if least is not None:  # the figures of the configuration closest to fitting, its line last
            raise StageMemoryError(message + "\n" + least_line, least.need, least.limit, least.where, least.layers,
                                   least.states, least.activations)
        raise ValueError(message)
    return best


def _round(p: int, m: int) -> int:
    """Micro-batches per round of the interleaved schedule, as torch's ``ScheduleInterleaved1F1B`` (and Megatron,
    which needs m a multiple of p) runs it: p where m is a multiple of p, m where m < p (one round)."""
    return m // max(1, m // p)


def _actions(opts: PipelineOptions, rank: int, forward_only: bool = False) -> list[tuple[str, int, int]]:
    """Ordered (kind, micro-batch, chunk) actions of a rank. ``forward_only``: the order the runtime runs a plan
    without gradients in (``runtime.pipeline``: GPipe's, breadth-first over a rank's chunks, torch's
    ``ScheduleLoopedBFS``), whatever schedule the plan names."""
    p, m, v = opts.stages, opts.micro_batches, opts.virtual
    if forward_only:
        return [("F", i, c) for c in range(v) for i in range(m)]
    if opts.schedule == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if opts.schedule == "1f1b":
        fw, bw = [("F", i, 0) for i in range(m)], [("B", i, 0) for i in range(m)]
        warm = min(p - rank - 1, m)
    else:
        g = _round(p, m)  # torch's ScheduleInterleaved1F1B: rounds of g micro-batches through each chunk in turn
        order = [(i, c) for s in range(0, m, g) for c in range(v) for i in range(s, min(s + g, m))]
        fw = [("F", i, c) for i, c in order]
        bw = [("B", i, v - 1 - c) for i, c in order]
        warm = min(m * v, 2 * (p - rank - 1) + (v - 1) * g)
    out = fw[:warm]
    for f, b in itertools.zip_longest(fw[warm:], bw):
        out += [a for a in (f, b) if a is not None]
    return out


def schedule_grid(opts: PipelineOptions, forward_only: bool = False) -> str:
    """Simulate the schedule in unit slots (each action one slot) and draw it, one line per rank."""
    return _draw(_simulate(opts, forward_only))


def _simulate(opts: PipelineOptions, forward_only: bool = False) -> list[list[str]]:
    """The schedule in unit slots (each action one slot): per rank, per slot, its action or '.' (idle)."""
    p, v = opts.stages, opts.virtual
    queues = [_actions(opts, r, forward_only) for r in range(p)]
    done: dict[tuple[str, int, int, int], int] = {}
    rows: list[list[str]] = [[] for _ in range(p)]

    step = 0
    while any(queues):
        ran = []
        for r in range(p):
            if not queues[r]:
                rows[r].append(".")
                continue
            kind, i, c = queues[r][0]
            d = _dependency(kind, i, c, r, p, v)
            if d is None or done.get(d, step) < step:
                ran.append((kind, i, c, r))
                queues[r].pop(0)
                rows[r].append(f"{kind}{i}" + (f"c{c}" if v > 1 else ""))
            else:
                rows[r].append(".")
        if not ran:
            raise RuntimeError(f"schedule {opts} deadlocked at step {step}:\n" + _draw(rows))
        for a in ran:
            done[a] = step
        step += 1
    return rows


def _dependency(kind: str, i: int, c: int, r: int, p: int, v: int) -> tuple[str, int, int, int] | None:
    """The action (kind, micro-batch, chunk, rank) that action ``kind`` of micro-batch ``i`` on chunk ``c`` of rank
    ``r`` waits for: the previous stage's forward (the last rank's previous chunk on rank 0), the next stage's
    backward (the first rank's next chunk on the last rank), or its own forward for the last chunk's backward."""
    if kind == "F":
        if r > 0:
            return ("F", i, c, r - 1)
        return ("F", i, c - 1, p - 1) if c > 0 else None
    if r < p - 1:
        return ("B", i, c, r + 1)
    return ("B", i, c + 1, 0) if c < v - 1 else ("F", i, c, r)


def _draw(rows: list[list[str]]) -> str:
    width = max((len(x) for row in rows for x in row), default=1)
    return "\n".join(f"rank {r}: " + " ".join(x.ljust(width) for x in row).rstrip() for r, row in enumerate(rows))
