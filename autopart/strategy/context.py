"""Context parallelism: ``scaled_dot_product_attention`` with the sequence split over one mesh axis.

Legal (``sequence_split_ok``): self-attention (q and k of one length) without a mask tensor or dropout, causal or
not, grouped-query or not. The ``_sdpa`` rule (``strategy/nn.py``) offers q, k, v and the output ``Shard(2)`` on
an axis; ``cp_variants`` turns each such option into its two strategies, told apart by ``OpOption.tag``:

* ``"cp_allgather"``: K and V all-gathered along the sequence on the axis, reduce-scattered in backward (Llama 3);
* ``"cp_ring"``: K/V blocks passed around the axis' ring in n−1 send/recv steps, online-softmax merge.

``cp_comm_time`` prices them (``planner.internal_comm_time`` calls it); ``autopart.passes.context`` lowers them to
``autopart.runtime.context``.

Causal load balancing. With contiguous rows the last of n ranks attends (2n−1)/n of the average (priced). The
balanced layout cuts the sequence in 2n chunks and gives rank i chunks i and 2n−1−i: the program then runs on the
*permuted* global sequence (the runtime permutes user inputs along their sequence dim before slicing them and
undoes it on outputs), so every sharding and collective stays the contiguous one; what depends on positions is
rewritten by the pass: the sequence's ``arange`` (RoPE tables, position embeddings, masks built from it) becomes the
permuted positions, causal attention masks by those positions. ``balance_blockers`` lists the ops that would
break under the permutation (an op working along the sequence dim in order: slices, cumsum, convolutions, tril,
masks given as tensors, other ``arange`` of that length); the layout is balanced when there are none
(``balanced_ok``), and then no imbalance is priced.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.fx as fx

from autopart.placement import Shard
from autopart.strategy.registry import NodeInfo, OpOption

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
CP_TAGS = ("cp_ring", "cp_allgather")


def _sdpa_args(node: fx.Node) -> dict:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    out = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    out.update(dict(zip(names, node.args)))
    out.update(node.kwargs)
    return out


def sequence_split_ok(info: NodeInfo) -> bool:
    """Whether the sequence split is legal for this SDPA call (see the module docstring)."""
    a = _sdpa_args(info.node)
    if a["attn_mask"] is not None or a["dropout_p"] or len(info.inputs) != 3:
        return False
    if [info.index(a[k]) for k in ("query", "key", "value")] != [0, 1, 2]:
        return False
    shapes = [info.shape(i) for i in range(3)]
    return all(len(s) == 4 for s in shapes) and shapes[0][2] == shapes[1][2] == shapes[2][2] > 1


def cp_axis(option: OpOption) -> int | None:
    """The mesh axis an SDPA option splits the sequence over (``Shard(2)`` output), or None."""
    out = option.output
    axes = [i for i, p in enumerate(out) if p == Shard(2)]
    return axes[0] if axes else None


def cp_variants(node: fx.Node, options: list[OpOption]) -> list[OpOption]:
    """``options`` of an SDPA node with each sequence-split option replaced by its tagged strategies."""
    if node.target != SDPA:
        return options
    out = []
    for o in options:
        if cp_axis(o) is None or o.tag:
            out.append(o)
        else:
            out += [OpOption(o.inputs, o.output, tag=t) for t in CP_TAGS]
    return out


def cp_comm_time(node: fx.Node, option: OpOption, cluster) -> float:
    """Seconds a context-parallel SDPA option adds to its compute (forward and backward), on the axis' link.

    With c ranks on the axis, B the bytes of this rank's K block plus V block (the local shard), T the forward
    time of one ring step on this rank (its queries against one block: 1/c of its attention, halved on average
    under a causal mask) and 2.5 T its backward (``backward_flops``):

    * all-gather: all-gather K and V (gathered size cB) forward, again in backward (only the local shards are
      saved, so the attention's saved activations shrink by c like the ring's), reduce-scatter dK and dV, exposed:
      two all-gathers and one reduce-scatter of the pair, each (c−1) α + (c−1)/c · cB β;
    * ring: c−1 steps of one send/recv of B forward, each overlapped with one block's compute (REFERENCE.md: the
      transfer hides when the block holds at least F/B tokens), exposed (c−1) · max(0, t − T) with t = α + Bβ;
      backward sends K/V and the dK/dV accumulators (2B) per step, hidden behind 2.5 T, plus the final return of
      the accumulators to their owner: (c−1) · max(0, 2t − 2.5 T) + t;
    * causal mask, contiguous rows: the last rank attends (2c−1)/c of the average, so the step waits
      (c−1)/c of the rank's attention time (forward and backward) longer.
    """
    axis = cp_axis(option)
    if axis is None or option.tag not in CP_TAGS:
        return 0.0
    from autopart.cost import collective_time, node_flops, roofline_time, send_recv_time

    mesh = cluster.mesh_shape
    c = mesh[axis]
    if c == 1:
        return 0.0
    a = _sdpa_args(node)
    q, k, v = (x.meta["val"] for x in (a["query"], a["key"], a["value"]))
    split = math.prod(n for i, n in enumerate(mesh) if any(not _is_rep(s[i]) for s in option.inputs))
    kv_spec = option.inputs[1]
    local = (k.numel() + v.numel()) * k.element_size() / math.prod(
        n for i, n in enumerate(mesh) if isinstance(kv_spec[i], Shard))
    link = cluster.link(axis)
    flops = node_flops(SDPA, (q, k, v), {}, node.meta["val"])  # the whole attention, no causal halving
    rank = flops / split
    if option.tag == "cp_allgather":
        t = 2 * collective_time("all_gather", c * local, c, link) + collective_time("reduce_scatter", c * local, c,
                                                                                    link)
    else:
        # one step's block: 1/c of the rank's attention, half of it under a causal mask (on average)
        step = roofline_time(rank / c * (0.5 if a["is_causal"] else 1.0), 0.0, cluster.device)
        hop = send_recv_time(local, link)
        t = (c - 1) * max(0.0, hop - step) + (c - 1) * max(0.0, 2 * hop - 2.5 * step) + hop
    if a["is_causal"] and not balanced_ok(node.graph, q.shape[2], c):
        t += (c - 1) / c * roofline_time(3.5 * rank / 2, 0.0, cluster.device)
    return t


_DIM_ARG = {aten.slice.Tensor: 1, aten.select.int: 1, aten.narrow.default: 1, aten.index_select.default: 1,
            aten.gather.default: 1, aten.cumsum.default: 1, aten.cumprod.default: 1, aten.unbind.int: 1,
            aten.cat.default: 1, aten.chunk.default: 2, aten.split.Tensor: 2, aten.split_with_sizes.default: 2,
            aten.roll.default: 2, aten.flip.default: 1}
_ORDERED = {aten.tril.default, aten.triu.default, aten.convolution.default, aten.conv1d.default,
            aten.constant_pad_nd.default, aten.pad.default, aten.index.Tensor, aten.scatter.src,
            aten.scatter_add.default, aten.index_put.default, aten.diagonal.default, aten.unfold.default}
_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
_BLOCKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def position_source(node: fx.Node, s: int) -> bool:
    """Whether ``node`` is ``arange(s)`` (start 0, step 1): the positions of a length-``s`` sequence."""
    if node.op != "call_function" or node.target not in _ARANGES:
        return False
    args = list(node.args)
    if node.target == aten.arange.default:
        args = [0] + args
    args += [1] * (3 - len(args))
    return args[0] == 0 and args[1] == s and args[2] == 1


def _dims_of_size(v, s: int) -> list[int]:
    return [d for d, n in enumerate(v.shape) if n == s] if isinstance(v, torch.Tensor) else []


def balance_blockers(graph: fx.Graph, s: int) -> list[str]:
    """Nodes that would compute something else on a permuted length-``s`` sequence (see the module docstring)."""
    memo = _BLOCKERS.setdefault(graph, {})
    if s in memo:
        return memo[s]
    bad = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        ins = [a.meta.get("val") for a in n.all_input_nodes]
        if n.target in _ARANGES:
            if not position_source(n, s) and _dims_of_size(n.meta.get("val"), s):
                bad.append(n.name)
        elif n.target in _DIM_ARG:
            args = list(n.args) + [n.kwargs.get("dim", 0)] * 3
            dim = args[_DIM_ARG[n.target]]
            x = ins[0] if ins else None
            dims = dim if isinstance(dim, (list, tuple)) else [dim]
            if n.target == aten.cat.default and ins:
                x = ins[0]
            if isinstance(x, torch.Tensor) and any(isinstance(d, int) and x.shape[d] == s for d in dims):
                bad.append(n.name)
        elif n.target in _ORDERED:
            if any(_dims_of_size(v, s) for v in ins):
                bad.append(n.name)
        elif n.target == SDPA:
            a = _sdpa_args(n)
            if a["attn_mask"] is not None and any(_dims_of_size(v, s) for v in ins):
                bad.append(n.name)
    memo[s] = bad
    return bad


def balanced_ok(graph: fx.Graph, s: int, c: int) -> bool:
    """Whether context parallelism over ``c`` ranks of a length-``s`` sequence runs the balanced layout."""
    return c > 1 and s % (2 * c) == 0 and not balance_blockers(graph, s)


def _is_rep(p) -> bool:
    from autopart.placement import Replicate

    return isinstance(p, Replicate)
