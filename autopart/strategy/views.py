"""Layout ops: view/reshape, transpose/permute, (un)squeeze, expand, slice, split/chunk, cat, select.

A sharded dimension survives a layout op when it maps to one output dimension that holds its elements as
contiguous equal blocks: for ``view`` that is the outermost dimension of a merged or split group. ``Partial``
passes through every layout op (they are linear).

A fused projection's output ([q | k | v] of GPT-2's ``c_attn``; of unequal lengths in Phi-3-medium's grouped-query
``qkv_proj``) that one split or its slices cut into blocks, maybe after views that keep that dim whole or move dims,
may be ``Strided(dim, blocks)``: each rank holds its piece of every block, so the
split leaves it its own part of each block (``fused_blocks``; the matmul rules offer the layout, the views carry
it, the split turns it into ``Shard`` of each block).
"""

from __future__ import annotations

import math
import operator
import weakref

import torch

from autopart.placement import Shard, Strided
from autopart.strategy.registry import NodeInfo, Option1D, P, R, register, rule_for

aten = torch.ops.aten


def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of ``src`` dims with runs of ``dst`` dims of equal element count (size-1 dims ride along)."""
    dst = tuple(dst)
    if -1 in dst:
        known = math.prod(d for d in dst if d != -1)
        dst = tuple(math.prod(src) // known if d == -1 else d for d in dst)
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi = pj = 1
        while True:
            if i < len(src) and (pi <= pj or j >= len(dst)) and (not gi or pi != pj or src[i] == 1):
                pi *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst) and (not gj or pi != pj or dst[j] == 1):
                pj *= dst[j]
                gj.append(j)
                j += 1
            else:
                break
            if pi == pj and gi and gj and (i >= len(src) or src[i] != 1) and (j >= len(dst) or dst[j] != 1):
                break
        groups.append((gi, gj))
    return groups


_SPLITS = frozenset([aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.tensor_split.indices,
                     aten.tensor_split.sections])
_SAME_VIEWS = frozenset([aten.view.default, aten.reshape.default, aten._unsafe_view.default])
# ops that move dims without touching their elements: a dim's blocks ride along (HF Mamba's ``in_proj(u).transpose(1,
# 2).chunk(2, dim=1)``)
_PERMUTES = frozenset([aten.transpose.int, aten.permute.default, aten.t.default, aten.numpy_T.default,
                       aten.mT.default])


def _kept_dim(src: tuple[int, ...], dst: tuple[int, ...], d: int) -> int | None:
    """The output dim of a view ``src -> dst`` that holds input dim ``d`` whole (merged or split only with size-1
    dims), None if the view merges or splits it."""
    for gi, gj in view_groups(src, dst):
        if d in gi:
            big_i, big_j = [x for x in gi if src[x] > 1], [x for x in gj if dst[x] > 1]
            return big_j[0] if big_i == [d] and len(big_j) == 1 and dst[big_j[0]] == src[d] else None
    return None


def split_dim(node) -> int | None:
    """The dim a split/chunk node cuts."""
    if node.target in _SPLITS:
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        return dim % node.args[0].meta["val"].dim()
    return None


def split_blocks(node):
    """The blocks a split/chunk node cuts its input into: their count when equal, their lengths when not (a
    grouped-query [q | k | v] split with sizes); None for one part."""
    d, outs = split_dim(node), node.meta.get("val")
    if d is None or not isinstance(outs, (list, tuple)) or len(outs) < 2:
        return None
    sizes = tuple(int(o.shape[d]) for o in outs)
    return len(sizes) if len(set(sizes)) == 1 else sizes if UNEQUAL else None


def block_bounds(blocks, length: int) -> list[tuple[int, int]]:
    """(start, length) of each block of a dim of ``length`` cut into ``blocks`` (a count or the lengths)."""
    sizes = [length // blocks] * blocks if isinstance(blocks, int) else list(blocks)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return list(zip(starts, sizes))


# whether rules offer ``Strided`` layouts at all, and of blocks of unequal lengths (``benchmarks/bench_fused_qkv.py``
# plans with them off to compare)
STRIDED = True
UNEQUAL = True


def slice_block(node) -> tuple[int, int, int] | None:
    """(dim, start, length) of a ``slice`` node with step 1, its bounds clamped to the dim."""
    if node.target != aten.slice.Tensor:
        return None
    size = node.args[0].meta["val"].shape
    args = list(node.args) + [None, 0, None, None, 1][len(node.args):]
    d, start, end, step = args[1] % len(size), args[2] or 0, args[3], args[4]
    if node.kwargs or not all(isinstance(x, int) for x in (start, step)) or not isinstance(end, (int, type(None))):
        return None
    n = int(size[d])
    start = max(0, min(n, start + n if start < 0 else start))
    end = n if end is None else max(0, min(n, end + n if end < 0 else end))
    return (d, start, end - start) if step == 1 and end > start else None


def _sliced_blocks(node, d: int):
    """The blocks the slices that are all of ``node``'s users cut its dim ``d`` into, each slice one block
    (Phi-3's ``qkv[..., :h]``, ``qkv[..., h:h + kv]``, ``qkv[..., h + kv:]``): their count when the slices have one
    length and tile the dim in blocks of it (some blocks may go unused), their lengths when the slices tile the dim
    exactly; None if they are not such slices."""
    users = _data_users(node)
    if len(users) < 2 or any(u.args[0] is not node for u in users):
        return None
    blocks = [slice_block(u) for u in users]
    if any(b is None or b[0] != d for b in blocks):
        return None
    size = int(node.meta["val"].shape[d])
    length = blocks[0][2]
    if all(b[2] == length and b[1] % length == 0 for b in blocks) and size % length == 0 and size != length:
        return size // length
    tiles = sorted({(b[1], b[2]) for b in blocks})
    if not UNEQUAL or len(tiles) < 2 or tiles[0][0] != 0 or sum(t[1] for t in tiles) != size or \
            any(a[0] + a[1] != b[0] for a, b in zip(tiles, tiles[1:])):
        return None
    return tuple(t[1] for t in tiles)


def _dim_map(node) -> dict[int, int]:
    """Input dim -> output dim of an op that moves dims without touching their elements: transpose, permute,
    ``t``/``T`` (every dim reversed), ``mT``/``mH``/``adjoint`` (the last two swapped; conjugated too,
    elementwise), unsqueeze, squeeze (its dims larger than 1)."""
    nd = node.args[0].meta["val"].dim()
    if node.target == aten.unsqueeze.default:
        u = node.args[1] % (nd + 1)
        return {d: d if d < u else d + 1 for d in range(nd)}
    if node.target in _SQUEEZES:
        src, dst = tuple(node.args[0].meta["val"].shape), tuple(node.meta["val"].shape)
        return _squeeze_map(src, dst)
    perm = list(range(nd))
    if node.target == aten.transpose.int:
        a, b = node.args[1] % nd, node.args[2] % nd
        perm[a], perm[b] = perm[b], perm[a]
    elif node.target == aten.permute.default:
        perm = [d % nd for d in node.args[1]]
    elif node.target in (aten.mT.default, aten.mH.default, aten.adjoint.default):
        perm[-1], perm[-2] = perm[-2], perm[-1]
    else:  # t, numpy_T
        perm.reverse()
    return {perm[e]: e for e in range(nd)}


def _squeeze_map(src: tuple[int, ...], dst: tuple[int, ...]) -> dict[int, int]:
    """Input dim -> output dim of a squeeze ``src -> dst`` (its dims larger than 1)."""
    kept = [d for d in range(len(src)) if not (src[d] == 1 and len(dst) < len(src))]
    if len(kept) != len(dst):
        kept = [d for d in range(len(src)) if src[d] != 1]
    return {d: e for e, d in enumerate(kept) if src[d] > 1}


_SQUEEZES = frozenset([aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default])
_DIM_MAPS = _PERMUTES | _SQUEEZES | {aten.unsqueeze.default}


def _elementwise(u, cur) -> bool:
    """``u`` computes elementwise on ``cur``, keeping its shape: an op whose rule splits any dim of the output with
    the inputs that span it (``strategy.pointwise.ELEMENTWISE_RULES``: pointwise ops, casts, copies, dropout)."""
    from autopart.strategy.pointwise import ELEMENTWISE_RULES

    val, src = u.meta.get("val"), cur.meta.get("val")
    if not isinstance(val, torch.Tensor) or tuple(val.shape) != tuple(src.shape):
        return False
    return rule_for(u.target) in ELEMENTWISE_RULES


def _depthwise(conv) -> bool:
    """A ``conv1d`` with one input channel per output channel (HF Mamba's): each channel convolved alone."""
    w = conv.args[1].meta["val"].shape
    groups = conv.args[6] if len(conv.args) > 6 else conv.kwargs.get("groups", 1)
    return w[1] == 1 and groups == w[0] == conv.args[0].meta["val"].shape[1]


def _next_dim(cur, u, d: int) -> int | None:
    """The dim of ``u``'s output that holds ``cur``'s dim ``d`` element for element (channel for channel), or
    None: the dim the walk of ``fused_blocks`` goes on with."""
    if u.target in _DIM_MAPS and u.args[0] is cur:
        return _dim_map(u).get(d)
    if u.target in _SAME_VIEWS and u.args[0] is cur:
        return _kept_dim(tuple(cur.meta["val"].shape), tuple(u.meta["val"].shape), d)
    if u.target == aten.slice.Tensor and u.args[0] is cur:  # along another dim (a length trimmed after a conv)
        nd = cur.meta["val"].dim()
        return d if (u.args[1] if len(u.args) > 1 else 0) % nd != d else None
    if u.target == aten.conv1d.default and _depthwise(u):  # input channels, weight rows, bias: output channels
        args = list(u.args) + [None] * (3 - len(u.args))
        roles = [a is cur for a in (args[0], args[1], args[2] if args[2] is not None else u.kwargs.get("bias"))]
        if sum(roles) != 1:
            return None
        return 1 if (roles[0] and d == 1) or ((roles[1] or roles[2]) and d == 0) else None
    if _elementwise(u, cur):
        return d
    return None


def _normal(sizes):
    """Block lengths as ``fused_blocks`` gives them: a count when equal, the lengths when not; empty blocks (they
    hold nothing on any rank) left out; None for fewer than two blocks, or unequal ones switched off."""
    if sizes is None or isinstance(sizes, int):
        return sizes
    sizes = [b for b in sizes if b]
    if len(sizes) < 2:
        return None
    if len(set(sizes)) == 1:
        return len(sizes)
    return tuple(sizes) if UNEQUAL else None


def fused_blocks(node, dim: int, _depth: int = 0):
    """The blocks the consumers of ``node``'s output cut its dim ``dim`` into -- their count when equal, their
    lengths when not (``split_blocks``): one split or chunk along it, or slices that are each one block, after
    ops that hold the dim element for element: views that keep it whole or move dims, casts and pointwise ops,
    slices along other dims, a depthwise convolution's channels (GPT-2's ``addmm -> view -> split``, Phi-3's
    ``linear -> slice, slice, slice``, HF Mamba's ``linear -> transpose -> chunk``). A part of the split that its
    own consumers cut again counts as those blocks (Mamba-2's ``in_proj`` -> [z | xBC | dt], xBC convolved, then
    cut into [x | B | C]: five blocks). None where an output on the way has other users or nothing cuts it so."""
    if not STRIDED:
        return None
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return None
    d = dim % val.dim()
    # memoised per graph (the planner asks for every node's dims, the walks overlap); a graph that gained or lost
    # nodes since is walked afresh (the passes rewrite copies)
    graph = node.graph
    memo = _MEMO.get(graph)
    if memo is None or memo[0] != len(graph.nodes):
        memo = _MEMO[graph] = (len(graph.nodes), {})
    key = (node.name, d, UNEQUAL, _depth)  # names, not nodes: the memo must not keep its graph alive
    if key not in memo[1]:
        memo[1][key] = _normal(_walk(node, d, _depth))
    return memo[1][key]


_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _walk(cur, d: int, _depth: int):
    while True:
        users = _data_users(cur)
        if users and all(u.target == aten.slice.Tensor and (b := slice_block(u)) and b[0] == d for u in users):
            return _sliced_blocks(cur, d)
        if len(users) != 1 or not users[0].args:
            return None
        u = users[0]
        if u.target in _SPLITS and u.args[0] is cur:
            return _refined(u, d, _depth) if split_dim(u) == d else None
        d = _next_dim(cur, u, d)
        if d is None:
            return None
        cur = u


def _data_users(node) -> list:
    """``node``'s users but the checks that read nothing of its values (export's ``_assert_tensor_metadata`` after a
    cast: no output, no users)."""
    return [u for u in node.users if not (u.op == "call_function" and u.meta.get("val") is None and not u.users)]


def _refined(split, d: int, depth: int):
    """The blocks of a split's input: its parts, each cut into the blocks its own consumers cut it into."""
    parts = split_blocks(split)
    if parts is None or depth >= 3:
        return parts
    size = int(split.args[0].meta["val"].shape[d])
    items = {u.args[1]: u for u in split.users if u.target is operator.getitem}
    sizes, refined = [], False
    for i, (_, length) in enumerate(block_bounds(parts, size)):
        sub = fused_blocks(items[i], d, depth + 1) if i in items and length else None
        inner = [b for _, b in block_bounds(sub, length)] if sub else []
        if len(inner) > 1 and sum(inner) == length:
            sizes += inner
            refined = True
        else:
            sizes.append(length)
    return (_normal(sizes) or parts) if refined else parts


def parts_blocks(blocks, length: int, parts) -> list | None:
    """For each of a split's ``parts`` (a count or lengths) of a dim of ``length`` in ``blocks``: the blocks
    inside it (a count or lengths; 1 when it is one block), or None when a block straddles two parts. Empty blocks
    hold nothing on any rank: left out."""
    bounds = [b for _, b in block_bounds(blocks, length) if b]
    out, i = [], 0
    for _, size in block_bounds(parts, length):
        inner, total = [], 0
        while i < len(bounds) and total < size:
            inner.append(bounds[i])
            total += bounds[i]
            i += 1
        if total != size:
            return None
        out.append(_normal(inner) if len(inner) > 1 else 1)
    return out


def _view_rule(info: NodeInfo, n: int) -> list[Option1D]:
    src, dst = info.shape(0), info.out_shape
    opts = [Option1D((R,), R), Option1D((P,), P)]
    for gi, gj in view_groups(src, dst):
        a = next((d for d in gi if src[d] > 1), None)
        b = next((d for d in gj if dst[d] > 1), None)
        if a is None or b is None:
            continue
        if src[a] % n == 0 and dst[b] % n == 0:
            opts.append(Option1D((Shard(a),), Shard(b)))
        if _kept_dim(src, dst, a) == b and info.node.target in _SAME_VIEWS:
            k = fused_blocks(info.node, b)
            if k and Strided.of(b, k).fits(dst[b], n):
                opts.append(Option1D((Strided.of(a, k),), Strided.of(b, k)))
    return opts


register(aten.view.default, aten.reshape.default, aten._unsafe_view.default)(_view_rule)
# x.flatten(start, end): a view that merges dims, with no size argument to make local (the local merge is right)
register(aten.flatten.using_ints)(_view_rule)


def _dim_map_rule(info: NodeInfo, mapping: dict[int, int], n: int = 0) -> list[Option1D]:
    """Output dim ``mapping[d]`` holds input dim ``d`` unchanged (and its blocks, where a fused projection's
    consumers cut it in blocks: ``fused_blocks``)."""
    opts = [Option1D((R,), R), Option1D((P,), P)]
    src = info.shape(0)
    for d, e in mapping.items():
        if src[d] > 1:
            opts.append(Option1D((Shard(d),), Shard(e)))
            k = fused_blocks(info.node, e) if info.node is not None and info.node.target in _DIM_MAPS else None
            if n and k and Strided.of(d, k).fits(src[d], n):
                opts.append(Option1D((Strided.of(d, k),), Strided.of(e, k)))
    return opts


@register(aten.transpose.int, aten.permute.default, aten.t.default, aten.numpy_T.default, aten.mT.default,
          aten.mH.default, aten.adjoint.default, aten.unsqueeze.default, *_SQUEEZES)
def _moved_dims(info: NodeInfo, n: int) -> list[Option1D]:
    return _dim_map_rule(info, _dim_map(info.node), n)


@register(aten.expand.default)
def _expand(info: NodeInfo, n: int) -> list[Option1D]:
    src, dst = info.shape(0), info.out_shape
    off = len(dst) - len(src)
    opts = [Option1D((R,), R)]
    for e in range(len(dst)):
        d = e - off
        if d >= 0 and src[d] == dst[e] and src[d] > 1:
            opts.append(Option1D((Shard(d),), Shard(e)))
        elif dst[e] > 1 and (d < 0 or src[d] == 1):
            opts.append(Option1D((R,), Shard(e)))
    return opts


def _other_dims(info: NodeInfo, dim: int, multi: int | None = None) -> list[Option1D]:
    """Ops acting along ``dim`` only: any other dim may be sharded; Partial passes (linear)."""
    src = info.shape(0)
    nd = len(src)
    dim %= nd
    k = len(info.inputs)

    def out(p):
        return tuple(p for _ in range(multi)) if multi is not None else p

    opts = [Option1D(tuple(R for _ in range(k)), out(R))]
    if info.val is not None and (multi or info.val.dtype.is_floating_point):
        opts.append(Option1D(tuple(P if i == 0 else R for i in range(k)), out(P)))
    for d in range(nd):
        if d != dim and src[d] > 1:
            opts.append(Option1D(tuple(Shard(d) if i == 0 else R for i in range(k)), out(Shard(d))))
            b = fused_blocks(info.node, d) if multi is None and info.node is not None else None
            if b:  # a block layout passes along (a trimmed length)
                opts.append(Option1D(tuple(Strided.of(d, b) if i == 0 else R for i in range(k)), Strided.of(d, b)))
    return opts


@register(aten.slice.Tensor)
def _slice(info: NodeInfo, n: int) -> list[Option1D]:
    opts = _other_dims(info, info.args[1] if len(info.args) > 1 else 0)
    block = slice_block(info.node)
    if block and len(info.inputs) == 1:  # one block of a fused projection split in blocks: this rank's piece of it
        d, start, length = block
        k = fused_blocks(info.inputs[0], d)
        size = info.shape(0)[d]
        if k and (start, length) in block_bounds(k, size) and Strided.of(d, k).fits(size, n):
            opts.append(Option1D((Strided.of(d, k),), Shard(d)))
    return opts


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int,
          aten.tensor_split.indices, aten.tensor_split.sections)
def _split(info: NodeInfo, n: int) -> list[Option1D]:
    if info.node.target == aten.unbind.int:
        dim = info.args[1] if len(info.args) > 1 else 0
    else:
        dim = info.args[2] if len(info.args) > 2 else info.kwargs.get("dim", 0)
    opts = _other_dims(info, dim, multi=len(info.val))
    d = dim % len(info.shape(0))
    parts = split_blocks(info.node) if info.node.target in _SPLITS and STRIDED else None
    # the input's blocks: the parts, each maybe cut again by its own consumers (``fused_blocks``)
    k = (fused_blocks(info.inputs[0], d) or _normal(parts)) if parts else None
    size = info.shape(0)[d]
    inner = parts_blocks(k, size, parts) if k else None
    if inner and Strided.of(d, k).fits(size, n) and len(info.inputs) == 1:
        # a fused projection's blocks, each rank holding its piece of each: its piece of every part (a part of
        # several blocks in those blocks)
        opts.append(Option1D((Strided.of(d, k),), tuple(Shard(d) if b == 1 else Strided.of(d, b) for b in inner)))
    return opts


@register(aten.select.int)
def _select(info: NodeInfo, n: int) -> list[Option1D]:
    nd = len(info.shape(0))
    dim = info.args[1] % nd
    opts = [Option1D((R,), R), Option1D((P,), P)]
    for d in range(nd):
        if d != dim and info.shape(0)[d] > 1:
            opts.append(Option1D((Shard(d),), Shard(d if d < dim else d - 1)))
    return opts


@register(aten.cat.default)
def _cat(info: NodeInfo, n: int) -> list[Option1D]:
    nd = len(info.out_shape)
    dim = (info.args[1] if len(info.args) > 1 else info.kwargs.get("dim", 0)) % nd
    k = len(info.inputs)
    opts = [Option1D(tuple(R for _ in range(k)), R), Option1D(tuple(P for _ in range(k)), P)]
    for d in range(nd):
        if d != dim and info.out_shape[d] > 1:
            opts.append(Option1D(tuple(Shard(d) for _ in range(k)), Shard(d)))
    return opts


@register(aten.stack.default)
def _stack(info: NodeInfo, n: int) -> list[Option1D]:
    """Inputs of one shape stacked along a new dim ``dim``: a dim split in all of them stays split."""
    nd = len(info.out_shape)
    dim = (info.args[1] if len(info.args) > 1 else info.kwargs.get("dim", 0)) % nd
    k = len(info.inputs)
    src = info.shape(0)
    opts = [Option1D(tuple(R for _ in range(k)), R)]
    if info.val.dtype.is_floating_point and len(info.args[0]) == k:  # each input once: linear in each
        opts.append(Option1D(tuple(P for _ in range(k)), P))
    for d in range(len(src)):
        if src[d] > 1:
            opts.append(Option1D(tuple(Shard(d) for _ in range(k)), Shard(d if d < dim else d + 1)))
    return opts


@register(aten.repeat_interleave.self_int)
def _repeat_interleave(info: NodeInfo, n: int) -> list[Option1D]:
    """Each element repeated ``repeats`` times along ``dim``, in place: a split dim, that one included, keeps each
    rank's elements together (None: the tensor flattened first, kept whole)."""
    dim = info.args[2] if len(info.args) > 2 else info.kwargs.get("dim")
    opts = [Option1D((R,), R)]
    if dim is None:
        return opts
    if info.val.dtype.is_floating_point:
        opts.append(Option1D((P,), P))
    src = info.shape(0)
    return opts + [Option1D((Shard(d),), Shard(d)) for d in range(len(src)) if src[d] > 1]


@register(aten.index.Tensor)
def _index(info: NodeInfo, n: int) -> list[Option1D]:
    """``x[..., idx, ...]`` with one index tensor at dim k (the others ``None``, ``:``): out is ``x.shape[:k] +
    idx.shape + x.shape[k + 1:]``. Another dim of x passes its split; a split of ``idx`` selects the rows of its
    part (x whole, as an embedding); Partial x passes (a gather is linear). Several index tensors: whole."""
    indices = list(info.args[1])
    picks = [i for i, t in enumerate(indices) if t is not None]
    xi = info.index(info.args[0])
    k = len(info.inputs)
    opts = [Option1D(tuple(R for _ in range(k)), R)]
    if len(picks) != 1 or xi != 0 or k != 2:
        return opts
    at = picks[0]
    src, idx = info.shape(0), info.shape(1)
    if info.val.dtype.is_floating_point:
        opts.append(Option1D((P, R), P))
    for d in range(len(src)):
        if d != at and src[d] > 1:
            opts.append(Option1D((Shard(d), R), Shard(d if d < at else d - 1 + len(idx))))
    for j in range(len(idx)):
        if idx[j] > 1:
            opts.append(Option1D((R, Shard(j)), Shard(at + j)))
    return opts


@register(aten.gather.default)
def _gather(info: NodeInfo, n: int) -> list[Option1D]:
    """``gather(x, dim, index)``: out[..., i, ...] = x[..., index[..., i, ...], ...] along ``dim``; out has
    index's shape. A dim other than ``dim`` of the same size in both splits in both alike; Partial x passes."""
    k = len(info.inputs)
    opts = [Option1D(tuple(R for _ in range(k)), R)]
    if k != 2 or info.index(info.args[0]) != 0:
        return opts
    src, idx = info.shape(0), info.shape(1)
    dim = info.args[1] % len(src)
    if info.val.dtype.is_floating_point:
        opts.append(Option1D((P, R), P))
    for d in range(len(idx)):
        if d != dim and idx[d] > 1 and src[d] == idx[d]:
            opts.append(Option1D((Shard(d), Shard(d)), Shard(d)))
    return opts


@register(aten.cumsum.default)
def _cumsum(info: NodeInfo, n: int) -> list[Option1D]:
    return _other_dims(info, info.args[1])


@register(aten.pad.default, aten.constant_pad_nd.default)
def _pad(info: NodeInfo, n: int) -> list[Option1D]:
    nd = len(info.shape(0))
    pad = list(info.args[1])
    padded = {nd - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]}  # (0, 0) pads nothing
    src = info.shape(0)
    opts = [Option1D((R,), R)]
    for d in range(nd):
        if d not in padded and src[d] > 1:
            opts.append(Option1D((Shard(d),), Shard(d)))
    return opts


def _scatter_rule(info: NodeInfo, dim: int, src_dim) -> list[Option1D]:
    """``slice_scatter`` / ``select_scatter`` (``input`` with ``src`` written into a slice of ``dim``; what an
    in-place write into a view becomes once the graph is functionalized, ``trace._functionalize``): any other dim
    splits in both alike (``src_dim(d)``: where ``src`` holds input dim ``d``); linear in the pair, so Partial
    passes when both are."""
    src = info.shape(0)
    nd = len(src)
    dim %= nd
    k = len(info.inputs)
    opts = [Option1D(tuple(R for _ in range(k)), R)]
    if k == 2 and info.val.dtype.is_floating_point:
        opts.append(Option1D((P, P), P))
    for d in range(nd):
        if d != dim and src[d] > 1 and k == 2 and info.shape(1)[src_dim(d)] == src[d]:
            opts.append(Option1D((Shard(d), Shard(src_dim(d))), Shard(d)))
    return opts


@register(aten.slice_scatter.default)
def _slice_scatter(info: NodeInfo, n: int) -> list[Option1D]:
    dim = info.args[2] if len(info.args) > 2 else info.kwargs.get("dim", 0)
    return _scatter_rule(info, dim, lambda d: d)


@register(aten.select_scatter.default)
def _select_scatter(info: NodeInfo, n: int) -> list[Option1D]:
    nd = len(info.shape(0))
    dim = info.args[2] % nd
    return _scatter_rule(info, dim, lambda d: d if d < dim else d - 1)
