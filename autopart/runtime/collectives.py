"""Autograd-aware collectives on one mesh axis, the targets the collectives pass writes into per-rank graphs.

Each forward collective has the backward that keeps gradients in the dual placement (see ``autopart.planner``):
all-gather's backward is a reduce-scatter (or taking one's own shard), the tensor-parallel copy's backward an
all-reduce, reduce-scatter's backward an all-gather. The process group of each axis comes from ``axis_groups``,
which the runtime sets before running a graph.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch
import torch.distributed as dist


class _State(threading.local):
    groups: list = []
    coords: list[int] = []
    sizes: list[int] = []


_STATE = _State()


@contextlib.contextmanager
def axis_groups(groups: list, coords: list[int], sizes: list[int]):
    """Make ``groups[i]`` the process group of mesh axis ``i`` while graphs run."""
    old = (_STATE.groups, _STATE.coords, _STATE.sizes)
    _STATE.groups, _STATE.coords, _STATE.sizes = list(groups), list(coords), list(sizes)
    try:
        yield
    finally:
        _STATE.groups, _STATE.coords, _STATE.sizes = old


# torch 2.13 renames the single-tensor collectives (the old names warn); older releases only have the
# *_into_tensor / *_tensor names. Every runtime module calls them through these two
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Ax:
    """One mesh axis as seen by this rank: its process group, size and this rank's coordinate."""

    __slots__ = ("group", "n", "coord")

    def __init__(self, axis: int) -> None:
        self.group, self.n, self.coord = _STATE.groups[axis], _STATE.sizes[axis], _STATE.coords[axis]


def _gather_buffer(x: torch.Tensor, ax: Ax, dim: int) -> torch.Tensor:
    """The gathered pieces stacked along dim 0 of a fresh contiguous buffer (``_gather`` moves the dim back)."""
    xt = x.movedim(dim, 0).contiguous()
    out = xt.new_empty((xt.shape[0] * ax.n, *xt.shape[1:]))
    all_gather_single(out, xt, group=ax.group)
    return out


def _gather(x: torch.Tensor, ax: Ax, dim: int) -> torch.Tensor:
    # contiguous: a view after a gather on another dim than 0 (a sequence-split [b, s] flattened) needs it
    return _gather_buffer(x, ax, dim).movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, ax: Ax, dim: int) -> torch.Tensor:
    xt = x.movedim(dim, 0).contiguous()
    out = xt.new_empty((xt.shape[0] // ax.n, *xt.shape[1:]))
    reduce_scatter_single(out, xt, group=ax.group)
    return out.movedim(0, dim)


def _all_reduce(x: torch.Tensor, ax: Ax) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=ax.group)
    return out


def _own(x: torch.Tensor, ax: Ax, dim: int) -> torch.Tensor:
    return x.chunk(ax.n, dim=dim)[ax.coord].contiguous()


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim, bwd, reduce_dtype):
        ctx.ax, ctx.dim, ctx.bwd, ctx.rdt = Ax(axis), dim, bwd, reduce_dtype
        return _gather(x, ctx.ax, dim)

    @staticmethod
    def backward(ctx, g):
        if ctx.bwd == "reduce_scatter":
            rdt = getattr(torch, ctx.rdt) if ctx.rdt and g.is_floating_point() else g.dtype
            # summed in reduce_dtype (a ZeRO-3 gradient: PlanOptions.reduce_dtype), handed on in the gradient's own
            return _reduce_scatter(g.to(rdt), ctx.ax, ctx.dim).to(g.dtype), None, None, None, None
        return _own(g, ctx.ax, ctx.dim), None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, bwd):
        ctx.ax, ctx.bwd = Ax(axis), bwd
        return _all_reduce(x, ctx.ax)

    @staticmethod
    def backward(ctx, g):
        return (_all_reduce(g, ctx.ax) if ctx.bwd == "all_reduce" else g), None, None


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.ax, ctx.dim = Ax(axis), dim
        return _own(x, ctx.ax, dim)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.ax, ctx.dim), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.ax, ctx.dim = Ax(axis), dim
        return _reduce_scatter(x, ctx.ax, dim)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.ax, ctx.dim), None, None


def _all_to_all(x: torch.Tensor, ax: Ax, src: int, dst: int) -> torch.Tensor:
    """Shard(src) -> Shard(dst): block j of ``dst`` goes to rank j; the blocks received are concatenated along
    ``src`` in rank order. Each rank sends (n-1)/n of its shard (an all-gather would move n times more)."""
    send = torch.stack(x.chunk(ax.n, dim=dst)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ax.group)
    return torch.cat(recv.unbind(0), dim=src)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, src, dst):
        ctx.ax, ctx.src, ctx.dst = Ax(axis), src, dst
        return _all_to_all(x, ctx.ax, src, dst)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.ax, ctx.dst, ctx.src), None, None, None


def _all_to_all_rows(x: torch.Tensor, ax: Ax, send: list[int], recv: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=ax.group)
    return out


class _AllToAllRows(torch.autograd.Function):
    """Rows ``send[j]`` of ``x`` (in rank order) to rank j; the rows received from each rank, in rank order.
    Backward: the same exchange the other way."""

    @staticmethod
    def forward(ctx, x, axis, send, recv):
        ctx.ax, ctx.send, ctx.recv = Ax(axis), send, recv
        return _all_to_all_rows(x, ctx.ax, send, recv)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all_rows(g, ctx.ax, ctx.recv, ctx.send), None, None, None


def all_to_all_rows(x: torch.Tensor, axis: int, send: list[int], recv: list[int]) -> torch.Tensor:
    """Uneven all-to-all of rows on mesh axis ``axis`` (expert parallelism's token dispatch and return)."""
    return _AllToAllRows.apply(x, axis, list(send), list(recv))


def exchange_counts(send: torch.Tensor, axis: int) -> torch.Tensor:
    """Each rank's ``send[j]`` to rank j: the counts every rank of the axis sends this one (no gradient)."""
    one = [1] * len(send)
    return _all_to_all_rows(send, Ax(axis), one, one)


def exchange_rows(x: torch.Tensor, axis: int, send: list[int], recv: list[int]) -> torch.Tensor:
    """``all_to_all_rows`` without a gradient (integer ids)."""
    return _all_to_all_rows(x, Ax(axis), list(send), list(recv))


def axis_size(axis: int) -> int:
    return _STATE.sizes[axis]


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        ctx.ax = Ax(axis)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.ax), None


class _Mask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        return x.clone() if Ax(axis).coord == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


def all_gather(x: torch.Tensor, axis: int, dim: int, bwd: str) -> torch.Tensor:
    """Shard(dim) -> Replicate; backward ``"reduce_scatter"`` (user split on the axis) or ``"shard"``."""
    return _AllGather.apply(x, axis, dim, bwd, None)


class _Kept:
    """The shard of one gathered tensor, shared by every saved use of it. Activations (``shared``) are gathered
    once in backward for all their saved uses (Q, K and V projections of one input): the first unpack gathers, the
    gathered tensor is held until the last of the ``uses`` packed is unpacked (a use never unpacked keeps it until
    the graph is freed)."""

    __slots__ = ("shard", "ax", "dim", "stat", "shared", "uses", "full")

    def __init__(self, shard, ax, dim, stat, shared) -> None:
        self.shard, self.ax, self.dim, self.stat, self.shared = shard, ax, dim, stat, shared
        self.uses, self.full = 0, None


_REGATHER: dict[int, _Kept] = {}  # storage of a gathered tensor -> its shard, while the gathered tensor lives


def _regathered(x: torch.Tensor, axis: int, dim: int, bwd: str, stat: str, reduce_dtype: str | None = None
                ) -> torch.Tensor:
    """``all_gather`` whose output, if autograd saves it (or a view of it) for backward, ``saved_tensor_hooks``
    keeps as the shard ``x`` and gathers again when backward needs it."""
    out = _AllGather.apply(x, axis, dim, bwd, reduce_dtype)
    if torch.is_grad_enabled():
        key = out.untyped_storage().data_ptr()  # views of it (a transposed weight) share the storage
        _REGATHER[key] = _Kept(x.detach(), Ax(axis), dim, stat, shared=stat == "activations")
        weakref.finalize(out, _REGATHER.pop, key, None)
    return out


def all_gather_param(x: torch.Tensor, axis: int, dim: int, bwd: str, reduce_dtype: str | None = None
                     ) -> torch.Tensor:
    """``all_gather`` of a ZeRO-3 parameter shard: when autograd saves the gathered tensor for backward,
    ``saved_tensor_hooks`` keeps the shard instead and gathers again when backward needs it. Backward's
    reduce-scatter of the gradient sums in ``reduce_dtype`` (``PlanOptions.reduce_dtype``, e.g. "float32" for bf16
    weights, as FSDP2's ``MixedPrecisionPolicy.reduce_dtype``) and casts the shard back; None: the gradient's own."""
    return _regathered(x, axis, dim, bwd, "packed", reduce_dtype)


def all_gather_activation(x: torch.Tensor, axis: int, dim: int, bwd: str) -> torch.Tensor:
    """``all_gather`` of an activation shard (Megatron sequence parallelism, K22 §4.2.2: the input of a
    column-parallel matmul, split along the sequence): a user that saves the gathered tensor for backward keeps
    the shard instead, gathered again in backward (``autopart.planner.regather_spec`` prices both)."""
    return _regathered(x, axis, dim, bwd, "activations")


class _Regathered:
    """A saved ZeRO-3 parameter or gathered activation (or a view of one, e.g. the transposed weight a matmul
    saves) held as its shard."""

    __slots__ = ("kept", "view")

    def __init__(self, kept: _Kept, view) -> None:
        self.kept, self.view = kept, view


# saved tensors held as parameter / activation shards; all-gathers backward ran for activations; offloaded tensors
REGATHER_STATS = {"packed": 0, "activations": 0, "activation_gathers": 0, "offloaded": 0}


class _OnHost:
    __slots__ = ("t", "device")

    def __init__(self, t, device) -> None:
        self.t, self.device = t, device


def _pack(t: torch.Tensor):
    rec = _REGATHER.get(t.untyped_storage().data_ptr()) if _REGATHER and t.device.type != "meta" else None
    if rec is not None:
        REGATHER_STATS[rec.stat] += 1
        rec.uses += 1
        return _Regathered(rec, (tuple(t.shape), t.stride(), t.storage_offset()))
    if _STATE_OFFLOAD.on and t.dtype.is_floating_point:
        REGATHER_STATS["offloaded"] += 1
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=t.is_cuda)
        host.copy_(t, non_blocking=t.is_cuda)
        return _OnHost(host, t.device)
    return t


def _unpack(obj):
    if isinstance(obj, _Regathered):
        k = obj.kept
        if not k.shared:
            return _gather(k.shard, k.ax, k.dim).as_strided(*obj.view)  # the layout forward gathered into
        if k.full is None:
            REGATHER_STATS["activation_gathers"] += 1
            k.full = _gather(k.shard, k.ax, k.dim)
        full = k.full
        k.uses -= 1
        if k.uses <= 0:  # the last saved use: drop the gathered tensor once its backward is done with it
            k.full = None
        return full.as_strided(*obj.view)
    if isinstance(obj, _OnHost):
        return obj.t.to(obj.device, non_blocking=obj.t.is_pinned())
    return obj


class _Offload(threading.local):
    on: bool = False


_STATE_OFFLOAD = _Offload()


@contextlib.contextmanager
def saved_tensor_hooks(offload_activations: bool = False):
    """Saved-tensor hooks: ZeRO-3 parameters and sequence-parallel activations are kept as their shards and
    gathered again for backward; with
    ``offload_activations`` every other floating-point tensor saved for backward goes to host memory (pinned on
    CUDA) and comes back for backward, as ``torch.autograd.graph.save_on_cpu`` does."""
    old = _STATE_OFFLOAD.on
    _STATE_OFFLOAD.on = offload_activations
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _STATE_OFFLOAD.on = old
        # packing happens only in forward: drop the registry (and its process-group references) now, so that
        # nothing global outlives the graph or the process group (a stale one aborted a process at teardown)
        _REGATHER.clear()


def all_reduce(x: torch.Tensor, axis: int, bwd: str) -> torch.Tensor:
    """Partial -> Replicate; backward ``"all_reduce"`` (user split on the axis) or identity."""
    return _AllReduce.apply(x, axis, bwd)


def shard(x: torch.Tensor, axis: int, dim: int) -> torch.Tensor:
    """Replicate -> Shard(dim): keep this rank's chunk; backward all-gather."""
    return _Shard.apply(x, axis, dim)


def reduce_scatter(x: torch.Tensor, axis: int, dim: int) -> torch.Tensor:
    """Partial -> Shard(dim); backward all-gather."""
    return _ReduceScatter.apply(x, axis, dim)


def all_to_all(x: torch.Tensor, axis: int, src: int, dst: int) -> torch.Tensor:
    """Shard(src) -> Shard(dst)."""
    return _AllToAll.apply(x, axis, src, dst)


def grad_all_reduce(x: torch.Tensor, axis: int) -> torch.Tensor:
    """Identity forward, all-reduce backward: a replicated value used by computation split on the axis."""
    return _GradAllReduce.apply(x, axis)


def mask_partial(x: torch.Tensor, axis: int) -> torch.Tensor:
    """Replicate -> Partial: the value on the axis' first rank, zeros elsewhere; backward identity."""
    return _Mask.apply(x, axis)


def count_all_reduce(x: torch.Tensor, axis: int) -> torch.Tensor:
    """Sum over the axis with no gradient (global counts)."""
    return _all_reduce(x.detach(), Ax(axis))


# ---- collective matmul (Wang et al., ASPLOS'23; Megatron's --tp-comm-overlap): the sequence-parallel all-gather
# before a column-parallel linear and the reduce-scatter after a row-parallel one, decomposed into ring steps whose
# exchange with the axis' neighbours runs while the step before's chunk is multiplied (``passes.tp_overlap``)


def _exchange(send: torch.Tensor, recv: torch.Tensor, ax: Ax) -> list:
    """Start sending ``send`` to the next coordinate of the axis' ring and receiving ``recv`` from the previous one.
    One batch: NCCL would deadlock on a ring of separately posted blocking-order sends."""
    nxt = dist.get_global_rank(ax.group, (ax.coord + 1) % ax.n)
    prv = dist.get_global_rank(ax.group, (ax.coord - 1) % ax.n)
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, ax.group),
                                   dist.P2POp(dist.irecv, recv, prv, ax.group)])


def _ring_gather_map(x: torch.Tensor, ax: Ax, fn) -> None:
    """``fn(c, piece)`` for every piece of the all-gather of ``x`` over the axis, ``c`` the coordinate holding it:
    at step t this rank applies ``fn`` to the piece of coordinate ``coord - t`` while it passes that piece on to the
    next coordinate and receives the one of ``coord - t - 1``. ``fn`` of a piece is what it would be of that piece
    of the gathered tensor: nothing is summed across pieces."""
    cur = x.contiguous()
    for t in range(ax.n):
        nxt = works = None
        if t < ax.n - 1:
            nxt = torch.empty_like(cur)
            works = _exchange(cur, nxt, ax)
        fn((ax.coord - t) % ax.n, cur)
        for w in works or ():
            w.wait()
        cur = nxt


def _ring_reduce_scatter(ax: Ax, part) -> torch.Tensor:
    """This rank's piece of the sum over the axis of every rank's ``part(c)`` (its contribution to piece ``c``): at
    step t this rank computes its contribution to piece ``coord - t - 1``, adds the running sum received from the
    previous coordinate and passes it on while it computes the next step's contribution; the last step's piece is
    its own."""
    recv = works = None
    for t in range(ax.n):
        acc = part((ax.coord - t - 1) % ax.n)
        if works is not None:
            for w in works:
                w.wait()
            acc = acc + recv
        if t == ax.n - 1:
            return acc
        acc = acc.contiguous()
        recv = torch.empty_like(acc)
        works = _exchange(acc, recv, ax)
    raise AssertionError("unreachable")


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _weight_grads(g: torch.Tensor, x: torch.Tensor, w_needs: bool, b_needs: bool):
    """Gradients of ``linear(x, W, b)``'s weight and bias from its output gradient ``g``."""
    return (_rows(g).t() @ _rows(x) if w_needs else None), (_rows(g).sum(0) if b_needs else None)


class _AllGatherLinear(torch.autograd.Function):
    """``[linear(all_gather(x), W_i, b_i) for i]``, the gather decomposed into ring steps behind the matmuls of the
    pieces already here. Saves the shard ``x``, not the gathered input (as ``all_gather_activation`` does), and
    gathers it again in backward for the weight gradients; the input gradient's reduce-scatter is decomposed the
    same way behind the matmuls ``grad_i @ W_i`` of each piece."""

    @staticmethod
    def forward(ctx, x, axis, dim, bwd, k, *wb):
        ctx.ax, ctx.dim, ctx.bwd, ctx.k = Ax(axis), dim, bwd, k
        ws, bs = wb[:k], wb[k:]
        step = x.shape[dim]
        shape = list(x.shape)
        shape[dim] *= ctx.ax.n
        outs = tuple(x.new_empty((*shape[:-1], w.shape[0])) for w in ws)

        def run(c: int, piece: torch.Tensor) -> None:  # each piece's products written in place: no full-size copy
            for out, w, b in zip(outs, ws, bs):
                out.narrow(dim, c * step, step).copy_(torch.nn.functional.linear(piece, w, b))

        _ring_gather_map(x, ctx.ax, run)
        ctx.save_for_backward(x, *ws)
        if torch.is_grad_enabled():
            REGATHER_STATS["activations"] += k  # each linear's saved input is held as the shard
        return outs

    @staticmethod
    def backward(ctx, *grads):
        x, *ws = ctx.saved_tensors
        ax, dim, k = ctx.ax, ctx.dim, ctx.k
        live = [(g, w) for g, w in zip(grads, ws) if g is not None]
        gx = None
        if ctx.needs_input_grad[0] and live:
            def part(c: int) -> torch.Tensor:
                out = None
                for g, w in live:
                    y = g.narrow(dim, c * x.shape[dim], x.shape[dim]) @ w
                    out = y if out is None else out + y
                return out

            # "shard": every rank holds the gathered value's whole gradient, its own piece is its shard's
            gx = _ring_reduce_scatter(ax, part) if ctx.bwd == "reduce_scatter" else part(ax.coord)
        wgrads, bgrads = [None] * k, [None] * k
        if any(ctx.needs_input_grad[5:]):
            REGATHER_STATS["activation_gathers"] += 1
            full = _gather(x, ax, dim)
            for i, g in enumerate(grads):
                if g is not None:
                    wgrads[i], bgrads[i] = _weight_grads(g, full, ctx.needs_input_grad[5 + i],
                                                         ctx.needs_input_grad[5 + k + i])
        return (gx, None, None, None, None, *wgrads, *bgrads)


def all_gather_linear(x: torch.Tensor, axis: int, dim: int, bwd: str, weights: tuple, biases: tuple) -> tuple:
    """``tuple(linear(all_gather(x, axis, dim, bwd), w, b) for w, b in zip(weights, biases))`` as a collective
    matmul (``_AllGatherLinear``); ``dim`` is not the last (the contracted) one."""
    return _AllGatherLinear.apply(x, axis, dim, bwd, len(weights), *weights, *biases)


class _LinearReduceScatter(torch.autograd.Function):
    """``reduce_scatter(linear(x, W, b), axis, dim)``, each rank's contribution to every piece multiplied while the
    running sum of the piece before travels the ring. Backward: the output gradient's all-gather decomposed the
    same way behind the input gradient's matmuls ``grad @ W`` of the pieces already here; the weight gradient from
    the gathered output gradient and the saved input, as the linear's own backward."""

    @staticmethod
    def forward(ctx, x, w, b, axis, dim):
        ctx.ax, ctx.dim, ctx.has_bias = Ax(axis), dim, b is not None
        step = x.shape[dim] // ctx.ax.n
        out = _ring_reduce_scatter(
            ctx.ax, lambda c: torch.nn.functional.linear(x.narrow(dim, c * step, step), w, b))
        ctx.save_for_backward(x, w)
        return out

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        ax, dim = ctx.ax, ctx.dim
        gx = None
        if ctx.needs_input_grad[0]:
            step = g.shape[dim]
            full = g.new_empty(x.shape[:-1] + g.shape[-1:])
            gx = torch.empty_like(x)

            def run(c: int, piece: torch.Tensor) -> None:
                full.narrow(dim, c * step, step).copy_(piece)
                gx.narrow(dim, c * step, step).copy_(piece @ w)

            _ring_gather_map(g, ax, run)
        else:
            full = _gather(g, ax, dim)
        gw, gb = _weight_grads(full, x, ctx.needs_input_grad[1], ctx.needs_input_grad[2] and ctx.has_bias)
        return gx, gw, gb, None, None


def linear_reduce_scatter(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, axis: int, dim: int
                          ) -> torch.Tensor:
    """``reduce_scatter(linear(x, w, b), axis, dim)`` as a collective matmul (``_LinearReduceScatter``); ``dim``
    is not the last one."""
    return _LinearReduceScatter.apply(x, w, b, axis, dim)



def vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor, axis: int, padding_idx: int = -1,
                             scale_grad_by_freq: bool = False, sparse: bool = False) -> torch.Tensor:
    """Embedding with rows sharded over ``axis``: ids outside this rank's rows give zeros (a Partial sum). The
    row ``padding_idx`` (global; -1: none) gets no gradient, on the rank that holds it. ``aten.embedding``'s
    arguments; the embedding rule never splits the rows of one with ``scale_grad_by_freq``."""
    rows = weight.shape[0]
    lo = _STATE.coords[axis] * rows
    inside = (ids >= lo) & (ids < lo + rows)
    local = torch.where(inside, ids - lo, torch.zeros_like(ids))
    # the ids of other ranks' rows look up local row 0 and are zeroed below, so they give it no gradient either
    pad = padding_idx - lo if padding_idx is not None and lo <= padding_idx < lo + rows else None
    out = torch.nn.functional.embedding(local, weight, padding_idx=pad, sparse=sparse)
    return out * inside.unsqueeze(-1).to(out.dtype)


class _VocabParallelNLL(torch.autograd.Function):
    """Per-token cross-entropy of logits whose vocabulary is sharded over one axis (Megatron): global max,
    global sum of exponentials and the target's logit by three all-reduces of one value per token."""

    @staticmethod
    def forward(ctx, logits, target, axis, ignore_index):
        ax = Ax(axis)
        rows = logits.shape[-1]
        lo = ax.coord * rows
        m = logits.detach().amax(dim=-1)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ax.group)
        z = logits - m.unsqueeze(-1)
        e = z.exp()
        sumexp = e.sum(dim=-1)
        dist.all_reduce(sumexp, group=ax.group)
        inside = (target >= lo) & (target < lo + rows)
        local_t = torch.where(inside, target - lo, torch.zeros_like(target))
        picked = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * inside.to(z.dtype)
        dist.all_reduce(picked, group=ax.group)
        valid = target != ignore_index
        loss = (sumexp.log() - picked) * valid.to(z.dtype)
        ctx.save_for_backward(e / sumexp.unsqueeze(-1), local_t, inside, valid)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, local_t, inside, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -inside.to(grad.dtype).unsqueeze(-1))
        return grad * (g * valid.to(g.dtype)).unsqueeze(-1), None, None, None


def sharded_cross_entropy(logits: torch.Tensor, target: torch.Tensor, batch_axes: tuple[int, ...],
                          vocab_axis: int | None = None, reduction: int = 1, ignore_index: int = -100
                          ) -> torch.Tensor:
    """Cross-entropy with the batch sharded over ``batch_axes`` (a Partial result: local sum / global count of
    non-ignored targets for ``mean``) and/or the vocabulary sharded over ``vocab_axis``."""
    if vocab_axis is None:
        per = torch.ops.aten.cross_entropy_loss.default(logits, target, None, 0, ignore_index, 0.0)
    else:
        per = _VocabParallelNLL.apply(logits, target, vocab_axis, ignore_index)
    if reduction == 0:
        return per
    s = per.sum()
    if reduction == 2:
        return s
    count = (target != ignore_index).sum().to(s.dtype)
    for a in batch_axes:
        count = count_all_reduce(count, a)
    return s / count
