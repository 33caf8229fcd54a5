"""ZeRO-1 and ZeRO-2: optimizer states (and, for ZeRO-2, gradients) sharded over the ranks holding a parameter
replicated (Megatron-LM's distributed optimizer, DeepSpeed stages 1 and 2).

A parameter the plan marks ZeRO-1 or ZeRO-2 (``plan.zero[fqn]`` 1 or 2) stays replicated for forward and backward;
its gradient is reduce-scattered so that each rank receives the sum of its slice only (``runtime/grads.py``):
ZeRO-1 keeps the whole gradient buffer (valid on the slice), ZeRO-2 frees it and keeps the slice in the slice
leaf's ``.grad``. Its optimizer state covers only this rank's slice of the flat local tensor: with ``D`` ranks
over the mesh axes it is replicated on (``planner.zero1_ways``) and ``N`` elements, rank ``r`` (its mixed-radix
index over those axes, outer axis first) owns elements ``[r*S, min((r+1)*S, N))`` with ``S = ceil(N / D)``. Any
``N`` works: no tensor dimension has to divide by ``D``, which is what lets a 4096-wide
layer be sharded 48 ways.

The optimizer is the user's class itself (``torch.optim.AdamW``...), built over the parameters that are not ZeRO-1
plus one leaf per ZeRO-1 slice, in a second parameter group. A slice leaf is a view of the parameter's local
storage, so the optimizer updates the parameter in place; no copy of the weights is kept. Two optimizer hooks
(torch's ``register_step_pre_hook`` / ``register_step_post_hook``) do the rest:

* before ``step``: each slice leaf's gradient is the matching view of the (reduced) parameter gradient (ZeRO-2:
  the reduce-scatter already put it there);
* after ``step``: the slices are all-gathered back, axis by axis, innermost first, into the whole parameters, in
  flat buckets (``gather_bucket``); the ZeRO-1/2 parameters' gradients are released first (the step has used them,
  and ``opt.zero_grad`` does not see them), so that the gathered buffer does not add to them. The gathers run
  behind the next forward (``ParamGather``, below).

The after-step gather runs in buckets as Megatron's distributed optimizer does: parameters replicated over the same
mesh axes (and of one dtype) are packed, in the order forward first uses them (not the module's: a tied embedding
registered as the head would hold every bucket back), into flat buckets of at most ``grads.bucket_limit``
*gathered* bytes (``grads.BUCKET_BYTES``, or the plan's larger size for axes whose links make it latency-bound),
and each bucket takes one ``all_gather_into_tensor`` per axis instead of one per parameter: the
latency is paid per bucket (on 48 ranks 47 ring steps per collective). The size counts the gathered parameters,
not the slices, because that is the buffer the gather allocates: one bucket in flight stays at most
that limit whatever the number of ranks, as the gradient's reduce-scatter bucket (measured on the whole
gradients it reduces, ``runtime/grads.py``). The slice layout (``zero1_slice``) is the per-parameter one; packing
only concatenates the padded slices, so state_dicts and the reduce-scatter agree with it.

The gathers overlap the next forward, as Megatron's ``--overlap-param-gather``: the step only launches the first
``GATHER_IN_FLIGHT`` buckets (``async_op=True``); the module's forward runs its graph with a ``param_ready`` node
before the first use of each ZeRO parameter (``mark_param_uses``), which waits for that parameter's bucket (and the
buckets before it: they complete in order), copies it into the parameters and launches the next one, so bucket
``k`` is gathered while forward computes up to the first use of its parameters. A bucket gathered over several
axes launches its innermost axis's gather and runs the others when it is waited for. The asynchronous gathers run
on the gradient reduction's dedicated process groups (``grads.axes_groups``: forward issues its own collectives on
the mesh's groups); a pipelined module, whose reduction has none, uses the mesh's groups, all its collectives being
issued from one thread. Whatever reads the parameters outside forward first finishes the gathers
(``ParallelModule._finish_param_gathers``: ``param``, ``parameters``, ``state_dict``, ``full_state_dict``,
``clip_grad_norm_``, the next ``step``).

Because it is a genuine ``torch.optim.Optimizer``, LR schedulers, ``state_dict`` and ``load_state_dict`` (of this
rank's slices) work unchanged. Gradient clipping goes through the module (``pm.clip_grad_norm_``) before ``step``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from autopart.runtime import grads as _grads
from autopart.runtime.collectives import all_gather_single

# collectives issued by the after-step gather (all_gather_into_tensor calls), and buckets gathered
STATS = {"all_gathers": 0, "buckets": 0}

# after-step gather buckets outstanding at once: each holds its gathered buffer (at most grads.BUCKET_BYTES) until
# forward waits for it (the planner's optimizer-step memory moment prices this many). Two keep the link busy: the
# next bucket is queued while forward waits for the current one.
GATHER_IN_FLIGHT = 2


@dataclass
class _Slice:
    param: nn.Parameter  # the module's DTensor parameter
    leaf: nn.Parameter  # the optimizer's view of this rank's slice of the flat local tensor
    start: int
    end: int
    size: int  # S: the padded slice length every rank sends
    axes: list[int]  # mesh axes the parameter is replicated on (sharded over here), outer first


def zero1_slice(numel: int, coords: list[int], sizes: list[int], axes: list[int]) -> tuple[int, int, int]:
    """(start, end, padded size) of this rank's slice of a flat parameter of ``numel`` elements."""
    ways = math.prod(sizes[a] for a in axes)
    rank = 0
    for a in axes:
        rank = rank * sizes[a] + coords[a]
    size = -(-numel // ways)
    start = min(rank * size, numel)
    return start, min(start + size, numel), size


def gather_bucket(packed: torch.Tensor, widths: list[int], ways: list[int], all_gather) -> list[torch.Tensor]:
    """Whole flat parameters from this rank's bucket ``packed``: its padded slices (``widths[i]`` = ``S_i`` elements
    each) concatenated, gathered over axes of ``ways`` ranks, innermost first.

    ``all_gather(flat, i)`` returns the ``ways[i] * flat.numel()`` elements of the ranks' ``flat`` on axis ``i``, in
    rank order. After the gather over ``n`` ranks the result is ``(n, bucket)``, rank ``j``'s packed bucket in row
    ``j``, so parameter ``i``'s pieces are the column block ``(n, w_i)`` at its offset, which read row by row is
    what gathering that parameter alone would give (the mixed-radix order of ``zero1_slice``). The blocks are
    re-packed, ``n * w_i`` wide, for the next axis. Returned: per parameter its block of the last gather, a view of
    the gathered buffer (``unpack_into`` copies it into the parameter without a contiguous copy of its own)."""
    blocks = [packed]
    cur = packed
    for i, n in enumerate(ways):
        blocks = list(all_gather(cur, i).view(n, -1).split(widths, dim=1))
        widths = [w * n for w in widths]
        if i + 1 < len(ways):
            cur = torch.cat([b.reshape(-1) for b in blocks])
    return blocks


def unpack_into(flat: torch.Tensor, block: torch.Tensor) -> None:
    """Copy the gathered ``(n, w)`` ``block`` (row by row: the padded flat parameter) into the 1-D ``flat``: whole
    rows through one strided copy, then the part of the last row that is not padding."""
    w = block.shape[1]
    rows, rem = divmod(flat.numel(), w)
    flat[: rows * w].view(rows, w).copy_(block[:rows])
    if rem:
        flat[rows * w:].copy_(block[rows, :rem])


def _buckets(slices: list[_Slice], sizes: list[int], limits: dict[str, int]) -> list[list[_Slice]]:
    """The slices in gather buckets: per set of axes and dtype, in the given order, closed when the next parameter
    would take the bucket's gathered bytes past its axes' ``grads.bucket_limit`` (the plan's ``limits``; a larger
    parameter gets a bucket of its own). Every rank
    of a group holds the same parameters with the same local shapes (replicated over its axes), so the ranks
    agree."""
    out: list[list[_Slice]] = []
    open_: dict[tuple, tuple[list[_Slice], int]] = {}
    for s in slices:
        key = (tuple(s.axes), s.leaf.dtype)
        nbytes = s.size * math.prod(sizes[a] for a in s.axes) * s.leaf.element_size()
        b, used = open_.get(key, (None, 0))
        if b is None or used + nbytes > _grads.bucket_limit(s.axes, limits):
            b, used = [], 0
            out.append(b)
        b.append(s)
        open_[key] = (b, used + nbytes)
    return out


class ParamGather:
    """The after-step all-gather of one optimizer's buckets, run behind the next forward (module docstring).

    ``start`` (after the step) launches the first ``GATHER_IN_FLIGHT`` buckets; ``ready(k)`` completes the buckets
    up to ``k`` in order (wait, the later axes' gathers, copy into the parameters), each completion launching the
    next bucket; ``finish`` completes them all. Every rank of a group completes the same buckets in the same order
    (forward runs the same graph), so the collectives match."""

    def __init__(self, buckets: list[list[_Slice]], bucket_of: dict[str, int], sizes: list[int],
                 groups: dict[int, Any]) -> None:
        self.buckets = buckets
        self.bucket_of = bucket_of  # parameter key -> its bucket
        self._sizes = sizes
        self._groups = groups  # mesh axis -> process group of the gathers over it
        self._launched = self._done = len(buckets)  # nothing pending
        self._work: dict[int, tuple] = {}  # bucket -> (work, gathered buffer, packed slices kept alive)

    @property
    def pending(self) -> bool:
        return self._done < len(self.buckets)

    def start(self) -> None:
        assert not self.pending, "the previous step's gathers were not finished"
        self._launched = self._done = 0
        self._launch_ahead()

    def ready(self, k: int) -> None:
        """Bucket ``k`` (and those before it) gathered into the parameters."""
        while self._done <= k:
            self._complete(self._done)
            self._done += 1
            self._launch_ahead()

    def finish(self) -> None:
        self.ready(len(self.buckets) - 1)

    def _inner(self, bucket: list[_Slice]) -> list[int]:
        return list(reversed(bucket[0].axes))  # innermost axis first: blocks come out in mixed-radix order

    def _all_gather(self, cur: torch.Tensor, axis: int, async_op: bool):
        out = torch.empty(cur.numel() * self._sizes[axis], dtype=cur.dtype, device=cur.device)
        work = all_gather_single(out, cur, group=self._groups[axis], async_op=async_op)
        STATS["all_gathers"] += 1
        return out, work

    def _launch_ahead(self) -> None:
        while self._launched < len(self.buckets) and self._launched - self._done < GATHER_IN_FLIGHT:
            bucket = self.buckets[self._launched]
            widths = [s.size for s in bucket]
            packed = bucket[0].leaf.new_zeros(sum(widths))
            for s, off in zip(bucket, itertools.accumulate([0] + widths)):
                packed[off: off + s.end - s.start].copy_(s.leaf.detach())
            out, work = self._all_gather(packed, self._inner(bucket)[0], async_op=True)
            self._work[self._launched] = (work, out, packed)
            self._launched += 1

    @torch.no_grad()
    def _complete(self, k: int) -> None:
        work, first, _ = self._work.pop(k)
        work.wait()
        bucket = self.buckets[k]
        inner = self._inner(bucket)

        def all_gather(cur: torch.Tensor, i: int) -> torch.Tensor:
            return first if i == 0 else self._all_gather(cur, inner[i], async_op=False)[0]

        blocks = gather_bucket(None, [s.size for s in bucket], [self._sizes[a] for a in inner], all_gather)
        STATS["buckets"] += 1
        for s, block in zip(bucket, blocks):
            # through ``.data``: no version bump on the local tensor forward already fed (as a view) to the graph
            local = s.param.data._local_tensor if isinstance(s.param.data, DTensor) else s.param.data
            unpack_into(local.data.view(-1), block)


_ACTIVE: list[ParamGather] = []  # the gather of the forward running (``ParallelModule._call``)


def param_ready(x: torch.Tensor, key: str) -> torch.Tensor:
    """``x`` (parameter ``key``'s local tensor), once its after-step gather is complete: the node
    ``mark_param_uses`` puts before the first use of a ZeRO parameter."""
    if _ACTIVE:
        k = _ACTIVE[-1].bucket_of.get(key)
        if k is not None:
            _ACTIVE[-1].ready(k)
    return x


def mark_param_uses(gm: fx.GraphModule, key_of_placeholder: dict[str, str]) -> fx.GraphModule:
    """A copy of ``gm`` in which each placeholder of ``key_of_placeholder`` (placeholder name -> parameter key) feeds
    its users through ``param_ready(x, key)``, inserted just before its first user: forward waits for a
    parameter's gather where it needs it, not at its start. ``gm`` itself is left as it is."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    g.output(g.graph_copy(gm.graph, env))
    g._codegen = gm.graph._codegen
    order = {n: i for i, n in enumerate(g.nodes)}
    for ph in list(g.find_nodes(op="placeholder")):
        key = key_of_placeholder.get(ph.name)
        if key is None or not ph.users:
            continue
        with g.inserting_before(min(ph.users, key=order.__getitem__)):
            ready = g.call_function(param_ready, (ph, key))
        ph.replace_all_uses_with(ready, delete_user_cb=lambda u, ready=ready: u is not ready)
    return fx.GraphModule(gm, g)


def sharded_state_optimizer(module, cls: type, host: bool = False, master_dtype: torch.dtype | None = None,
                            **kwargs) -> torch.optim.Optimizer:
    """``cls`` over ``module``'s parameters with the plan's ZeRO-1/2 parameters replaced by this rank's slices;
    the module's gradient reduction reduce-scatters their gradients into the slices from then on. ``host``: the
    optimizer states live in host memory (``HostOffloadOptimizer``, the plan's ``offload`` "optimizer"): each step
    moves only this rank's gradient slices to the host and the updated slices back, which the after-step gather
    then spreads (DeepSpeed's ZeRO-Offload with stages 1 and 2). ``master_dtype``: the optimizer updates copies
    of this rank's parameters and slices in that dtype (``ShadowOptimizer``; Megatron's distributed optimizer
    keeps the fp32 copies of its shard only)."""
    zero = module.plan.zero
    groups = module._groups
    coords, sizes = module._coords, module._sizes
    plain: list[nn.Parameter] = []
    slices: list[_Slice] = []
    by_key: dict[str, _Slice] = {}
    for fqn, key in module._key_of.items():
        p = module._params[key]
        if zero.get(fqn) not in (1, 2) or not p.requires_grad:
            plain.append(p)
            continue
        local = p.data._local_tensor if isinstance(p.data, DTensor) else p.data
        if not local.is_contiguous():
            raise RuntimeError(f"ZeRO-1 parameter {fqn}: its local tensor is not contiguous; report this")
        placements = p.placements if isinstance(p, DTensor) else ()
        axes = [i for i, pl in enumerate(placements) if isinstance(pl, Replicate) and sizes[i] > 1]
        start, end, size = zero1_slice(local.numel(), coords, sizes, axes)
        leaf = nn.Parameter(local.view(-1)[start:end])  # aliases the parameter's storage
        if leaf.dtype != _grads.grad_dtype_of(p):  # the gradient's dtype (PlanOptions.grad_dtype), not the weight's
            leaf.grad_dtype = _grads.grad_dtype_of(p)
        slices.append(_Slice(p, leaf, start, end, size, axes))
        by_key[key] = slices[-1]
    param_groups: list[dict[str, Any]] = []
    if plain:
        param_groups.append({"params": plain})
    if slices:  # a group of its own: foreach kernels do not mix DTensor and plain tensors
        param_groups.append({"params": [s.leaf for s in slices]})
    from autopart.runtime.module import build_optimizer

    # kwargs as ParallelModule.optimizer defaults them (foreach; fused on host copies)
    opt = build_optimizer(param_groups, cls, host, master_dtype, **kwargs)
    if not slices:
        return opt
    module._grads.attach(by_key)
    scattered = {id(s) for k, s in by_key.items() if module._grads.scattered(k)}
    first = {k: i for i, k in enumerate(module._first_use)}
    order = sorted(by_key, key=lambda k: first.get(k, len(first)))  # forward's order: a tied embedding first
    buckets = _buckets([by_key[k] for k in order], sizes, module._grads.bucket_bytes)
    axes = sorted({a for s in slices for a in s.axes})
    if module._grads.overlap:  # the reduction's dedicated groups, plus any axis it does not reduce over
        own = dict(module._grads._own)
        own.update(_grads.axes_groups(module._dm, [(a,) for a in axes if (a,) not in own]))
        gather_groups = {a: own[(a,)] for a in axes}
    else:
        gather_groups = {a: groups[a] for a in axes}
    key_of = {id(s): k for k, s in by_key.items()}
    gather = ParamGather(buckets, {key_of[id(s)]: i for i, b in enumerate(buckets) for s in b}, sizes,
                         gather_groups)
    module._param_gather = gather
    module._marked.clear()  # graphs marked for another optimizer's buckets

    def pre_step(optimizer, args, kw) -> None:
        gather.finish()  # a step without a forward since the last one: the parameters must be whole
        for s in slices:
            if id(s) in scattered:  # ZeRO-2: the reduce-scatter accumulated the slice into the leaf
                continue
            g = s.param.grad
            if g is None:
                s.leaf.grad = None
                continue
            g = g._local_tensor if isinstance(g, DTensor) else g
            s.leaf.grad = g.reshape(-1)[s.start:s.end]

    @torch.no_grad()
    def post_step(optimizer, args, kw) -> None:
        for s in slices:  # the step has consumed the gradients: free them before the gathers allocate
            s.param.grad = None
            s.leaf.grad = None
        gather.start()  # completed by the next forward (module._call) or whatever reads the parameters first

    opt.register_step_pre_hook(pre_step)
    opt.register_step_post_hook(post_step)
    opt.autopart_zero1_slices = slices  # this rank's slices (runtime/optim_state.py names their states)
    opt.autopart_zero1_buckets = [(tuple(b[0].axes), len(b)) for b in buckets]  # (axes, parameters) per bucket
    return opt
