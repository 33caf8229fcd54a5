"""Context-parallel attention: ``scaled_dot_product_attention`` with the sequence split over one mesh axis.

q, k, v and the output are ``Shard(2)`` (``[batch, heads, seq, head_dim]``) on the axis; every rank holds the rows
of ``positions(layout, coord, n, s_local)`` of the global sequence:

* ``"contiguous"``: rank i holds positions ``[i·s_local, (i+1)·s_local)``;
* ``"balanced"``: the sequence cut in 2n chunks, rank i holds chunks i and 2n−1−i (causal work equal on every rank;
  Llama 3, Megatron-LM's context parallelism).

Two strategies, both exact (the same softmax as one process, up to float rounding):

* ``allgather_attention`` (Llama 3): all-gather K and V along the sequence, attend the local queries to every
  rank's block with the causal mask of the global positions, merged as the ring merges them; backward gathers K
  and V again (only the local shards are kept from forward) and reduce-scatters dK and dV.
* ``ring_attention`` (Liu et al. 2023): K/V blocks travel around the ring in n−1 send/recv steps, each step's
  transfer posted before the step's block is computed (so it overlaps); partial outputs are merged by their
  log-sum-exp (online softmax) into fp32 accumulators. Backward visits the blocks in the same order, dK/dV
  accumulators travelling with their block and sent one step further to return to the block's owner. Under a
  causal mask the chunk pairs no query sees are skipped, so a balanced rank computes half of each off-diagonal
  step, as priced (``strategy.context.cp_comm_time``, the merges ``ring_merge_time``).

Each block is one call of the fused CPU flash kernel (``_torch_private.flash_attention_cpu``: output and
log-sum-exp, causal on the diagonal block; its backward recomputes the block's probabilities from the final output
and log-sum-exp), so no ``[s_local, s_local]`` score matrix is held, as the memory model assumes; on other devices
blocks run in plain torch with the scores materialised. An explicit boolean mask (Hugging Face's, built from the
positions) comes split on its query rows with every key column; each block takes the columns of its keys'
positions, and a block it masks wholly is skipped (contiguous layout only).

Grouped-query attention: K/V keep their ``hk`` heads on the wire; blocks are expanded to the query heads
(``repeat_interleave``, as SDPA's ``enable_gqa``) for the arithmetic and their gradients summed back per group.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopart import _torch_private as P
from autopart.runtime import collectives as C

LAYOUTS = ("contiguous", "balanced")
STATS = {"ring_hops": 0, "kv_gathers": 0}  # messages this process sent (tests count them)


def positions(layout: str, coord: int, n: int, s_local: int, device=None) -> torch.Tensor:
    """Global sequence positions of the ``s_local`` rows rank ``coord`` of ``n`` holds under ``layout``."""
    if layout == "contiguous":
        return coord * s_local + torch.arange(s_local, device=device)
    if layout == "balanced":
        if s_local % 2:
            raise ValueError(f"balanced context parallelism needs an even local sequence, got {s_local} rows "
                             f"per rank: make the sequence a multiple of {2 * n}")
        half = s_local // 2
        ar = torch.arange(half, device=device)
        return torch.cat([coord * half + ar, (2 * n - 1 - coord) * half + ar])
    raise ValueError(f"unknown context-parallel layout {layout!r}; choose one of {LAYOUTS}")


def balanced_permutation(s: int, n: int, device=None) -> torch.Tensor:
    """The global order of the balanced layout: ``x[..., perm, ...]`` split in n contiguous pieces gives rank i
    chunks i and 2n−1−i; ``argsort(perm)`` undoes it."""
    if s % (2 * n):
        raise ValueError(f"balanced context parallelism over {n} ranks needs the sequence ({s}) divisible by {2 * n}")
    return torch.cat([positions("balanced", i, n, s // n, device) for i in range(n)])


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    hk = kv.shape[1]
    return kv if hk == heads else kv.repeat_interleave(heads // hk, dim=1)


def _fold(g: torch.Tensor, hk: int) -> torch.Tensor:
    b, h, t, d = g.shape
    return g if h == hk else g.view(b, hk, h // hk, t, d).sum(2)


CAUSAL = "causal"  # a block mask: the diagonal block, q and k at the same (ascending) positions


def _block_mask(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool) -> tuple[bool, torch.Tensor | str | None]:
    """(whether any query of the block sees any key, its mask: None when every pair attends, ``CAUSAL`` on the
    diagonal, else the boolean ``[s, t]`` mask)."""
    if not causal:
        return True, None
    if int(kpos.min()) > int(qpos.max()):
        return False, None
    if int(kpos.max()) <= int(qpos.min()):
        return True, None
    if torch.equal(qpos, kpos):  # positions ascend in both layouts: top-left causal is exact
        return True, CAUSAL
    return True, qpos[:, None] >= kpos[None, :]


def _bias(mask: torch.Tensor, dtype) -> torch.Tensor:
    """A boolean mask as the additive one the fused kernel takes (0 where attended, −inf elsewhere)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _materialised_forward(q, k, v, mask, scale):
    sc = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        sc = sc.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(sc, dim=-1)
    return torch.exp(sc - _finite(lse).unsqueeze(-1)) @ v, lse


def _materialised_backward(q, k, v, mask, scale, out, lse, do):
    sc = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        sc = sc.masked_fill(~mask, float("-inf"))
    p = torch.exp(sc - _finite(lse).unsqueeze(-1))
    dv = p.transpose(-2, -1) @ do
    ds = p * (do @ v.transpose(-2, -1) - (do * out).sum(-1, keepdim=True))
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, dv


def _diagonal(q, k, mask):
    return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril() if mask is CAUSAL \
        else mask


def block_forward(q, k, v, mask, scale):
    """Attention of q [b, h, s, d] to one block k, v [b, h, t, d] (``mask``: see ``_block_mask``; a boolean
    tensor broadcasts to ``[b, h, s, t]``): (output normalised within the block, its log-sum-exp [b, h, s]; −inf
    and a zero output for rows that see no key of the block). On CPU the fused flash kernel
    (``_torch_private.flash_attention_cpu``), so no ``[s, t]`` score matrix is held; elsewhere plain torch with the
    scores materialised."""
    if q.device.type != "cpu":
        return _materialised_forward(q, k, v, _diagonal(q, k, mask), scale)
    explicit = isinstance(mask, torch.Tensor)
    out, lse = P.flash_attention_cpu(q, k, v, mask is CAUSAL, _bias(mask, q.dtype) if explicit else None, scale)
    if explicit:  # the kernel gives a row masked wholly lse 0: the merge must weigh it 0
        lse = lse.masked_fill(~mask.any(-1).expand(lse.shape), float("-inf"))
    return out, lse


def merge(out, lse, bout, blse):
    """Online-softmax merge of two partial attentions over disjoint key sets."""
    new = torch.logaddexp(lse, blse)
    safe = _finite(new)
    return out * torch.exp(lse - safe).unsqueeze(-1) + bout * torch.exp(blse - safe).unsqueeze(-1), new


def block_backward(q, k, v, mask, scale, out, lse, do):
    """Gradients of one block (dq, dk, dv) given the final output and log-sum-exp of q's rows: the block's
    probabilities are recomputed from them, and ``rowsum(dO · O)`` from the final output (fused kernel on CPU,
    as ``block_forward``)."""
    if q.device.type != "cpu":
        return _materialised_backward(q, k, v, _diagonal(q, k, mask), scale, out, lse, do)
    explicit = isinstance(mask, torch.Tensor)
    return P.flash_attention_cpu_backward(do, q, k, v, out, lse, mask is CAUSAL,
                                          _bias(mask, q.dtype) if explicit else None, scale)


class _Ring:
    """This rank's neighbours on the axis' ring: sends go to coord+1, receives come from coord−1."""

    def __init__(self, ax: C.Ax) -> None:
        self.ax = ax
        self.next = dist.get_global_rank(ax.group, (ax.coord + 1) % ax.n)
        self.prev = dist.get_global_rank(ax.group, (ax.coord - 1) % ax.n)

    def start(self, buf: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Post the send of ``buf`` to the next rank and the receive of the previous rank's, as one batch (NCCL
        would deadlock on every rank sending first, one op at a time); wait on the works."""
        recv = torch.empty_like(buf)
        STATS["ring_hops"] += 1
        ops = [dist.P2POp(dist.isend, buf, self.next, self.ax.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.ax.group)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works: list) -> None:
        for w in works:
            w.wait()


def _pairs(layout: str, qpos: torch.Tensor, kpos: torch.Tensor, causal: bool, attn_mask=None):
    """(query rows, key rows, mask) of the sub-blocks of a step that some query sees: a rank's rows are one
    contiguous run (``"contiguous"``) or two (``"balanced"``), and a pair of runs is either wholly visible, wholly
    masked (skipped) or the causal diagonal. An explicit boolean ``attn_mask`` (this rank's query rows, every key
    column in natural order: contiguous layout only) is cut to the block's rows and key positions, and a block it
    masks wholly is skipped."""
    s = qpos.numel()
    runs = [slice(0, s)] if layout == "contiguous" else [slice(0, s // 2), slice(s // 2, s)]
    for qs in runs:
        for ks in runs:
            seen, mask = _block_mask(qpos[qs], kpos[ks], causal)
            if attn_mask is not None:  # not causal too (SDPA takes one or the other): every pair was seen
                mask = attn_mask[..., qs, :].index_select(-1, kpos[ks])
                seen = bool(mask.any())
            if seen:
                yield qs, ks, mask


def _attend(qf, kv, h, blocks, scale, out, lse) -> None:
    """Merge into ``out``, ``lse`` the attention of ``qf``'s rows to the K/V block ``kv`` over ``blocks``."""
    kb, vb = _expand(kv[0], h), _expand(kv[1], h)
    for qs, ks, mask in blocks:
        bout, blse = block_forward(qf[:, :, qs], kb[:, :, ks], vb[:, :, ks], mask, scale)
        out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], bout, blse)


def _attend_backward(qf, kv, h, blocks, scale, out, lse, do, dq, dkv) -> None:
    """Add to ``dq`` and to the block's ``dkv`` the gradients of ``_attend`` (the final ``out`` and ``lse``)."""
    kb, vb = _expand(kv[0], h), _expand(kv[1], h)
    hk = kv.shape[2]
    for qs, ks, mask in blocks:
        bq, bk, bv = block_backward(qf[:, :, qs], kb[:, :, ks], vb[:, :, ks], mask, scale, out[:, :, qs],
                                    lse[:, :, qs], do[:, :, qs])
        dq[:, :, qs] += bq
        dkv[0, :, :, ks] += _fold(bk, hk)
        dkv[1, :, :, ks] += _fold(bv, hk)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, axis, causal, scale, layout, attn_mask):
        ax = C.Ax(axis)
        ring = _Ring(ax)
        dtype, h, s = q.dtype, q.shape[1], q.shape[2]
        qf = q.float()
        qpos = positions(layout, ax.coord, ax.n, s, q.device)
        kv = torch.stack([k, v]).float().contiguous()
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
        for t in range(ax.n):
            src = (ax.coord - t) % ax.n
            works = []
            if t < ax.n - 1:
                nxt, works = ring.start(kv)
            kpos = positions(layout, src, ax.n, s, q.device)
            _attend(qf, kv, h, _pairs(layout, qpos, kpos, causal, attn_mask), scale, out, lse)
            if works:
                ring.wait(works)
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse, attn_mask)
        ctx.ax, ctx.causal, ctx.scale, ctx.layout = ax, causal, scale, layout  # backward runs outside axis_groups
        return out.to(dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, attn_mask = ctx.saved_tensors
        ax = ctx.ax
        ring = _Ring(ax)
        h, s = q.shape[1], q.shape[2]
        qf, do = q.float(), dout.float()
        qpos = positions(ctx.layout, ax.coord, ax.n, s, q.device)
        kv = torch.stack([k, v]).float().contiguous()
        dkv = torch.zeros_like(kv)
        dq = torch.zeros_like(qf)
        for t in range(ax.n):
            src = (ax.coord - t) % ax.n
            works = []
            if t < ax.n - 1:
                nxt, works = ring.start(kv)
            kpos = positions(ctx.layout, src, ax.n, s, q.device)
            _attend_backward(qf, kv, h, _pairs(ctx.layout, qpos, kpos, ctx.causal, attn_mask), ctx.scale, out, lse,
                             do, dq, dkv)
            sent = dkv  # the accumulators follow their block; the n-th send returns them to the block's owner
            dkv, dworks = ring.start(sent)
            ring.wait(works + dworks)
            if works:
                kv = nxt
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def _check(q, k, v, axis: int, layout: str, attn_mask=None, is_causal: bool = False) -> float:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"context-parallel attention needs 4-d q, k, v [batch, heads, seq, head_dim], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"context-parallel attention splits one sequence: q has {q.shape[2]} rows, k "
                         f"{k.shape[2]} (cross-attention is not supported)")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown context-parallel layout {layout!r}; choose one of {LAYOUTS}")
    if attn_mask is not None:
        if is_causal:
            raise ValueError("context-parallel attention takes a mask tensor or is_causal, not both (as SDPA)")
        cols = C.Ax(axis).n * q.shape[2]
        if attn_mask.dtype != torch.bool or attn_mask.dim() > 4 or tuple(attn_mask.shape[-2:]) != (q.shape[2], cols):
            raise ValueError(f"context-parallel attention takes a boolean mask [..., {q.shape[2]} local queries, "
                             f"{cols} keys], got {attn_mask.dtype} {tuple(attn_mask.shape)}: a mask split on its "
                             f"query rows only, every key column present")
        if layout != "contiguous":
            raise ValueError("an explicit attention mask needs the contiguous layout (its columns are the keys' "
                             "natural positions); strategy.context.balance_blockers keeps such programs contiguous")
    return 1.0 / math.sqrt(q.shape[-1])


def ring_attention(q, k, v, axis: int, is_causal: bool = True, scale: float | None = None,
                   layout: str = "contiguous", attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Ring attention over mesh axis ``axis`` (see the module docstring)."""
    default = _check(q, k, v, axis, layout, attn_mask, is_causal)
    return _RingAttention.apply(q, k, v, axis, bool(is_causal), default if scale is None else scale, layout,
                                attn_mask)


def _gathered_kv(k, v, ax: C.Ax) -> torch.Tensor:
    """K and V of the whole sequence, stacked ``[2, b, hk, n·s, d]``, in one all-gather (rank order)."""
    STATS["kv_gathers"] += 1
    return C._gather(torch.stack([k, v]).float(), ax, 3)


class _AllGatherAttention(torch.autograd.Function):
    """Forward: gather K/V, attend the local queries to every rank's block (``_pairs``: masked blocks skipped, the
    diagonal causal), keep the output's log-sum-exp. Only the local q, k, v, output and log-sum-exp are saved (the
    gathered K/V would be c times the local ones): backward gathers them again, computes dq and the whole dK/dV of
    the local queries, and reduce-scatters dK/dV to their owners."""

    @staticmethod
    def forward(ctx, q, k, v, axis, causal, scale, layout, attn_mask):
        ax = C.Ax(axis)
        h, s = q.shape[1], q.shape[2]
        kv, qf = _gathered_kv(k, v, ax), q.float()
        qpos = positions(layout, ax.coord, ax.n, s, q.device)
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
        for src in range(ax.n):
            kpos = positions(layout, src, ax.n, s, q.device)
            _attend(qf, kv[..., src * s:(src + 1) * s, :], h, _pairs(layout, qpos, kpos, causal, attn_mask), scale,
                    out, lse)
        ctx.save_for_backward(q, k, v, out, lse, attn_mask)
        ctx.ax, ctx.causal, ctx.scale, ctx.layout = ax, causal, scale, layout
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, attn_mask = ctx.saved_tensors
        ax, h, s = ctx.ax, q.shape[1], q.shape[2]
        kv, qf, do = _gathered_kv(k, v, ax), q.float(), dout.float()
        qpos = positions(ctx.layout, ax.coord, ax.n, s, q.device)
        dq, dkv = torch.zeros_like(qf), torch.zeros_like(kv)
        for src in range(ax.n):
            kpos = positions(ctx.layout, src, ax.n, s, q.device)
            rows = slice(src * s, (src + 1) * s)
            _attend_backward(qf, kv[..., rows, :], h, _pairs(ctx.layout, qpos, kpos, ctx.causal, attn_mask),
                             ctx.scale, out, lse, do, dq, dkv[..., rows, :])
        dkv = C._reduce_scatter(dkv, ax, 3)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def allgather_attention(q, k, v, axis: int, is_causal: bool = True, scale: float | None = None,
                        layout: str = "contiguous", attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Llama 3's context parallelism over mesh axis ``axis``: K and V gathered, local queries against all keys."""
    default = _check(q, k, v, axis, layout, attn_mask, is_causal)
    return _AllGatherAttention.apply(q, k, v, axis, bool(is_causal), default if scale is None else scale, layout,
                                     attn_mask)


STRATEGIES = {"cp_ring": ring_attention, "cp_allgather": allgather_attention}


def context_attention(q, k, v, axis: int, strategy: str, is_causal: bool, scale: float | None,
                      layout: str, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The call ``autopart.passes.context`` writes in place of a context-parallel SDPA node."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown context-parallel strategy {strategy!r}; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[strategy](q, k, v, axis, is_causal, scale, layout, attn_mask)


def kv_heads_for_rank(x: torch.Tensor, axis: int) -> torch.Tensor:
    """The one K/V head (dim 1 of ``x``, the K/V heads this rank holds whole on mesh axis ``axis``) that this
    rank's query heads share when grouped-query attention splits its heads over more devices of the axis than
    ``x`` has heads (``strategy.context.gqa_split``): devices ``c·n/hk ... (c+1)·n/hk - 1`` of the axis use head
    ``c``. Its gradient is zero on the other heads; the conversion before it sums the axis' gradients."""
    hk, ax = x.shape[1], C.Ax(axis)
    if hk == 1:
        return x
    if ax.n % hk:
        raise ValueError(f"grouped-query attention: {hk} K/V heads held whole over {ax.n} devices of mesh axis "
                         f"{axis}; the split needs the devices to divide by the heads (a plan from another mesh?)")
    return x.narrow(1, ax.coord // (ax.n // hk), 1)


def sequence_positions(s: int, n: int, dtype=None, device=None, **_) -> torch.Tensor:
    """What ``arange(s)`` becomes in a balanced program: the positions of the permuted global sequence."""
    return balanced_permutation(s, n, device).to(dtype or torch.int64)


def permuted_causal_attention(q, k, v, n: int, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """Causal SDPA on a whole (not split) permuted sequence of a balanced program: the mask by positions."""
    pos = balanced_permutation(q.shape[2], n, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=pos[:, None] >= pos[None, :], scale=scale,
                                          enable_gqa=enable_gqa)


def _seq_dim(t: torch.Tensor, s: int, what: str) -> int | None:
    dims = [d for d, m in enumerate(t.shape) if m == s]
    if len(dims) > 1:
        raise ValueError(f"{what} of shape {tuple(t.shape)} has several dims of the sequence length {s}: the "
                         f"balanced context-parallel layout cannot tell which to permute; use another length")
    return dims[0] if dims else None


def to_layout(t: torch.Tensor, ctx: dict | None, what: str = "input") -> torch.Tensor:
    """A user input in the program's sequence order (balanced programs permute the sequence dim)."""
    if not ctx or not isinstance(t, torch.Tensor):
        return t
    d = _seq_dim(t, ctx["s"], what)
    return t if d is None else t.index_select(d, balanced_permutation(ctx["s"], ctx["n"], t.device))


def from_layout(out, ctx: dict | None):
    """Outputs back in the natural sequence order (undoes ``to_layout``; differentiable)."""
    if not ctx:
        return out

    def undo(t):
        if not isinstance(t, torch.Tensor):
            return t
        d = _seq_dim(t, ctx["s"], "output")
        if d is None:
            return t
        return t.index_select(d, torch.argsort(balanced_permutation(ctx["s"], ctx["n"], t.device)))

    return torch.utils._pytree.tree_map(undo, out)
