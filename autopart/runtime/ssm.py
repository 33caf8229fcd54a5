"""Context parallelism for state-space sequence ops: Mamba's scan and causal convolution with the sequence split
over one mesh axis, contiguous rows (rank i holds the i-th n-th of the sequence).

* ``context_conv1d``: each rank receives the previous rank's last ``d_conv - 1`` tokens (the first rank: zeros)
  and convolves them with its own; backward sends the halo's gradient back to its owner, which adds it to the
  gradient of its last tokens. One send/recv of ``d_conv - 1`` tokens each way.
* ``context_scan`` (state passing): each rank scans its chunk from a zero state (``selective_scan``), and from its
  own tokens computes its chunk's final state ``S_r = sum_t exp(L_r - cum_t) dt_t x_t b_tᵀ`` (cum_t: the
  inclusive cumulative log-decay, L_r its total). One all-gather of every rank's ``(S_q, L_q)`` gives the state
  entering rank r, ``h_r = sum_{q<r} exp(L_{q+1} + ... + L_{r-1}) S_q`` (a running ``h = exp(L_q) h + S_q``),
  whose contribution ``exp(cum_t) h_r c_t`` is added to the local outputs: exact, since the recurrence is linear
  in the state. Backward recomputes the local scan (as the op's own backward does), takes the gradients of the
  gathered states and decays from every rank's contribution, and reduce-scatters them (sums them back to the
  rank that produced each state). Communication: b·h·(p·n + 1) values per rank each way, independent of the
  sequence length.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopart.runtime import collectives as C

STATS = {"state_gathers": 0, "halo_hops": 0}  # exchanges this process ran (tests count them)


def _shift(buf: torch.Tensor, ax: C.Ax, forward: bool) -> torch.Tensor:
    """``buf`` of the previous rank on the axis (``forward``) or of the next one; zeros at the end of the line.
    Posted as one batch of a send and a receive around the ring (the wrapped-around message is dropped)."""
    dst, src = (1, -1) if forward else (-1, 1)
    recv = torch.empty_like(buf, memory_format=torch.contiguous_format)  # buf may be a strided slice
    STATS["halo_hops"] += 1
    ops = [dist.P2POp(dist.isend, buf.contiguous(), dist.get_global_rank(ax.group, (ax.coord + dst) % ax.n),
                      ax.group),
           dist.P2POp(dist.irecv, recv, dist.get_global_rank(ax.group, (ax.coord + src) % ax.n), ax.group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    first = ax.coord == 0 if forward else ax.coord == ax.n - 1
    return torch.zeros_like(recv) if first else recv


class _Halo(torch.autograd.Function):
    """``x`` (b, s, d) -> the previous rank's last ``k`` tokens (b, k, d); backward returns their gradient to
    their owner, added to the gradient of its last ``k`` tokens."""

    @staticmethod
    def forward(ctx, x, axis, k):
        ctx.ax, ctx.k, ctx.shape = C.Ax(axis), k, x.shape
        return _shift(x[:, x.shape[1] - k:], ctx.ax, forward=True)

    @staticmethod
    def backward(ctx, g):
        dx = g.new_zeros(ctx.shape)
        dx[:, ctx.shape[1] - ctx.k:] = _shift(g, ctx.ax, forward=False)
        return dx, None, None


def context_conv1d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, axis: int) -> torch.Tensor:
    """``causal_conv1d`` of this rank's tokens, the halo from the previous rank on mesh axis ``axis``."""
    from autopart.models.mamba import causal_conv1d

    k = w.shape[1] - 1
    if k == 0:
        return causal_conv1d(x, w, bias)
    if x.shape[1] < k:
        raise ValueError(f"context-parallel causal convolution: each rank needs at least d_conv - 1 = {k} tokens "
                         f"for its successor's halo, this one holds {x.shape[1]}; split the sequence fewer ways")
    return causal_conv1d(x, w, bias, _Halo.apply(x, axis, k))


def _local(x, dt, a, b, c, chunk_size):
    """This chunk's scan from a zero state, its final state (b, h, p, n), inclusive cumulative log-decays
    (b, s, h) and total log-decay (b, h)."""
    from autopart.models.mamba import selective_scan

    y = selective_scan(x, dt, a, b, c, chunk_size)
    cum = torch.cumsum(dt * a, dim=1)
    total = cum[:, -1]
    state = torch.einsum("bsh,bshp,bsn->bhpn", torch.exp(total.unsqueeze(1) - cum) * dt, x, b)
    return y, state, cum, total


def _entering(states: torch.Tensor, totals: torch.Tensor, coord: int) -> torch.Tensor:
    """The state entering rank ``coord``'s chunk from the gathered states (c, b, h, p, n) and log-decays (c, b, h)."""
    h = torch.zeros_like(states[0])
    for q in range(coord):
        h = torch.exp(totals[q])[..., None, None] * h + states[q]
    return h


def _with_entering(y, cum, c, states, totals, coord):
    h = _entering(states, totals, coord)
    return y + torch.einsum("bhpn,bsn->bshp", h, c) * torch.exp(cum).unsqueeze(-1)


class _ContextScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, a, b, c, chunk_size, axis):
        ax = C.Ax(axis)
        y, state, cum, total = _local(x, dt, a, b, c, chunk_size)
        packed = torch.cat([state.flatten(2), total.unsqueeze(-1)], dim=-1)  # (b, h, p·n + 1)
        STATS["state_gathers"] += 1
        gathered = C._gather(packed.unsqueeze(0), ax, 0)  # (c, b, h, p·n + 1)
        ctx.save_for_backward(x, dt, a, b, c, gathered)
        ctx.ax, ctx.chunk_size, ctx.state_shape = ax, chunk_size, state.shape
        return _with_entering(y, cum, c, *_unpack(gathered, state.shape), ax.coord)

    @staticmethod
    def backward(ctx, dy):
        x, dt, a, b, c, gathered = ctx.saved_tensors
        ax = ctx.ax
        inputs = [t.detach().requires_grad_() for t in (x, dt, a, b, c)]
        gathered = gathered.detach().requires_grad_()
        with torch.enable_grad():
            y, state, cum, total = _local(*inputs, ctx.chunk_size)
            out = _with_entering(y, cum, inputs[4], *_unpack(gathered, ctx.state_shape), ax.coord)
            (d_gathered,) = torch.autograd.grad(out, gathered, dy, retain_graph=True, allow_unused=True)
            if d_gathered is None:  # the first rank enters from zero: it uses no other rank's state
                d_gathered = torch.zeros_like(gathered)
            d_packed = C._reduce_scatter(d_gathered, ax, 0)[0]  # every rank's use of this rank's state, summed
            d_state, d_total = d_packed[..., :-1].view_as(state), d_packed[..., -1]
            grads = torch.autograd.grad((out, state, total), inputs, (dy, d_state, d_total), allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs)]
        return (*grads, None, None)


def _unpack(gathered: torch.Tensor, state_shape) -> tuple[torch.Tensor, torch.Tensor]:
    return gathered[..., :-1].unflatten(-1, state_shape[2:]), gathered[..., -1]


def context_scan(x, dt, a, b, c, chunk_size: int, axis: int) -> torch.Tensor:
    """``selective_scan`` of this rank's tokens with the state passed from the earlier ranks on mesh axis
    ``axis`` (see the module docstring)."""
    return _ContextScan.apply(x, dt, a, b, c, chunk_size, axis)
