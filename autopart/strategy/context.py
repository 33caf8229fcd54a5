"""Context parallelism: ``scaled_dot_product_attention`` with the sequence split over one mesh axis.

Legal (``sequence_split_ok``): self-attention (q and k of one length) without dropout, causal or not, grouped-query or
not, with no mask tensor or a boolean one over (queries, keys) whole (Hugging Face builds the causal mask from the
positions as such a tensor): it is split with the queries' rows and each block is cut from its key columns by position
(contiguous layout only: a mask tensor blocks the balanced one). The ``_sdpa`` rule (``strategy/nn.py``) offers q, k, v
and the output ``Shard(2)`` on an axis; ``cp_variants`` turns each such option into its two strategies, told apart by
``OpOption.tag``:

* ``"cp_allgather"``: K and V all-gathered along the sequence on the axis, reduce-scattered in backward (Llama 3);
* ``"cp_ring"``: K/V blocks passed around the axis' ring in n−1 send/recv steps, online-softmax merge.

``cp_comm_time`` prices them (``planner.internal_comm_time`` calls it); ``autopart.passes.context`` lowers them to
``autopart.runtime.context``.

Sequence ops of state-space models (``register_sequence_op``: Mamba's ``autopart::ssd_scan`` and
``autopart::causal_conv1d``, rules in ``strategy/ssm.py``) split the sequence too, one strategy each:
``"cp_state"`` (each rank scans its chunk from a zero state; the chunks' final states and total decays are
all-gathered and each rank adds its entering state's contribution) and ``"cp_halo"`` (each rank receives the
previous rank's last ``d_conv - 1`` tokens). Both exchange O(state) or O(d_conv) bytes per rank, not activations;
lowered to ``autopart.runtime.ssm``. They run on contiguous rows only (their work is linear in the sequence: no
imbalance to correct, and they read the sequence in order, so they block the balanced layout).

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
from typing import NamedTuple

import torch
import torch.fx as fx

from autopart.placement import Replicate, Shard
from autopart.strategy.registry import COMBO_CHECKS, NodeInfo, OpOption, tensor_inputs

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
ATTENTION_TAGS = ("cp_ring", "cp_allgather")
SSM_TAGS = ("cp_state", "cp_halo")
CP_TAGS = ATTENTION_TAGS + SSM_TAGS
SEQUENCE_OPS: dict = {}  # op -> its context-parallel tag (register_sequence_op); the sequence is dim 1


def register_sequence_op(op, tag: str) -> None:
    """Mark ``op`` as a state-space sequence op whose ``Shard(1)`` option is context parallelism by ``tag``."""
    if tag not in SSM_TAGS:
        raise ValueError(f"unknown sequence-op strategy {tag!r}; choose one of {SSM_TAGS}")
    SEQUENCE_OPS[op] = tag


def _sdpa_args(node: fx.Node) -> dict:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    out = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    out.update(dict(zip(names, node.args)))
    out.update(node.kwargs)
    return out


class GqaSplit(NamedTuple):
    """``gqa_split``'s answer: the mesh axis, the K/V heads a device holds whole there (it reads one), and the
    indices of K and V among the node's tensor inputs."""

    axis: int
    kv_heads: int
    key: int
    value: int


def _heads_split(p) -> bool:
    return isinstance(p, Shard) and p.dim % 4 == 1


def gqa_split(node: fx.Node, inputs: list[fx.Node], specs: tuple, mesh_shape: tuple[int, ...]):
    """Grouped-query attention's heads split over more devices than it has K/V heads.

    With H query heads and ``hk`` K/V heads (``enable_gqa``), query head i attends with K/V head i // (H / hk).
    Splitting the heads over an axis of n devices splits K and V alike only where hk divides by n. Where instead n
    divides by the K/V heads a device has (``hk_l``: hk less what earlier axes split off), each device's H_l / n
    query heads share one K/V head, number ``coord // (n / hk_l)`` of its ``hk_l``: K and V stay whole on that axis
    (``Replicate``) and each device reads its one head (``runtime.context.kv_heads_for_rank``; their gradients
    are summed over the axis, the table's "R -> R, split user"). This is how vLLM runs tensor parallelism wider
    than the K/V heads (each K/V head replicated over n / hk devices). One axis reads one head so: a later axis may
    split the query heads further with K/V whole (a device's query heads still share its head), not K/V too (the
    heads read would not be those held). Where earlier axes leave one K/V head (``hk_l`` 1), the query heads split
    with K/V whole is the plain rule.

    ``specs``: the option's input placements, one per tensor input (a placement per mesh axis). Returns ``None``
    where no axis does this, a ``GqaSplit`` where one does legally, ``False`` where the combination is illegal (the
    option must be dropped: ``gqa_combo_ok``)."""
    a = _sdpa_args(node)
    if not a["enable_gqa"]:
        return None
    try:
        qi, ki, vi = (inputs.index(a[k]) for k in ("query", "key", "value"))
    except ValueError:  # q, k or v not a tensor input: no such split
        return None
    if node.meta["val"].dim() != 4 or inputs[ki].meta["val"].dim() != 4:
        return None
    hq, hk = node.meta["val"].shape[1], inputs[ki].meta["val"].shape[1]
    found = None
    for i, n in enumerate(mesh_shape):
        q, k, v = specs[qi][i], specs[ki][i], specs[vi][i]
        if n == 1 or not (_heads_split(q) or _heads_split(k) or _heads_split(v)):
            continue
        alike = _heads_split(q) and _heads_split(k) and _heads_split(v)  # groups stay whole
        if not alike and not (_heads_split(q) and isinstance(k, Replicate) and isinstance(v, Replicate)):
            return False  # K or V split without the query heads (or one without the other)
        if hq % n or (alike and (found is not None or hk % n)):  # K/V read one head each: not the heads held
            return False
        if alike:
            hk //= n
        elif hk > 1 and found is None:  # (one K/V head left, or read already: a device's query heads share it)
            if n % hk or hk % n == 0:
                return False
            found = GqaSplit(i, hk, ki, vi)
        hq //= n
    return found


def gqa_combo_ok(node: fx.Node, inputs: list[fx.Node], specs: tuple, mesh_shape: tuple[int, ...]) -> bool:
    """``registry.COMBO_CHECKS`` of SDPA: a grouped-query heads split with K/V whole (``gqa_split``) is legal."""
    return gqa_split(node, inputs, specs, mesh_shape) is not False


COMBO_CHECKS[SDPA] = gqa_combo_ok


def sequence_split_ok(info: NodeInfo) -> bool:
    """Whether the sequence split is legal for this SDPA call (see the module docstring)."""
    a = _sdpa_args(info.node)
    mask = a["attn_mask"] is not None
    if a["dropout_p"] or len(info.inputs) != 3 + mask:
        return False
    if [info.index(a[k]) for k in ("query", "key", "value", "attn_mask")[:3 + mask]] != list(range(3 + mask)):
        return False
    shapes = [info.shape(i) for i in range(3)]
    if not (all(len(s) == 4 for s in shapes) and shapes[0][2] == shapes[1][2] == shapes[2][2] > 1):
        return False
    return not mask or _mask_splits(a["attn_mask"].meta["val"], shapes[0][2])


def _mask_splits(mask, s: int) -> bool:
    """A mask the ring and all-gather strategies take: boolean, [..., s queries, s keys] (rows split with the
    queries, each step's block cut from the key columns by position: ``runtime.context._pairs``)."""
    return mask.dtype == torch.bool and 2 <= mask.dim() <= 4 and tuple(mask.shape[-2:]) == (s, s)


def sequence_split_inputs(info: NodeInfo) -> tuple:
    """The input placements of the sequence split on one axis: q, k, v ``Shard(2)``, a mask split on its query
    rows (every key column kept)."""
    extra = (Shard(len(info.shape(3)) - 2),) if len(info.inputs) == 4 else ()
    return (Shard(2),) * 3 + extra


def cp_axis(option: OpOption) -> int | None:
    """The mesh axis an SDPA option splits the sequence over (``Shard(2)`` output), or None."""
    out = option.output
    axes = [i for i, p in enumerate(out) if p == Shard(2)]
    return axes[0] if axes else None


def cp_variants(node: fx.Node, options: list[OpOption]) -> list[OpOption]:
    """``options`` of an SDPA node with each sequence-split option replaced by its tagged strategies; those of a
    sequence op tagged with its one strategy."""
    if node.target in SEQUENCE_OPS:
        tag = SEQUENCE_OPS[node.target]
        return [OpOption(o.inputs, o.output, tag=tag) if seq_axis(o) is not None and not o.tag else o
                for o in options]
    if node.target != SDPA:
        return options
    out = []
    for o in options:
        if cp_axis(o) is None or o.tag:
            out.append(o)
        else:
            out += [OpOption(o.inputs, o.output, tag=t) for t in ATTENTION_TAGS]
    return out


def seq_axis(option: OpOption) -> int | None:
    """The mesh axis a sequence op's option splits the sequence over (``Shard(1)`` output), or None."""
    axes = [i for i, p in enumerate(option.output) if p == Shard(1)]
    return axes[0] if axes else None


def ssm_comm_time(node: fx.Node, option: OpOption, cluster) -> float:
    """Seconds a context-parallel sequence op adds to its compute (forward and backward), c ranks on the axis.

    * ``"cp_state"``: forward all-gathers each rank's final state and total log-decay (b·h·(p·n + 1) values of its
      batch and heads shard), backward reduce-scatters their gradients: (c−1) α + (c−1)/c · cS β each, exposed
      (the next step needs them). Plus the work the split adds: each rank's final state from its own tokens and
      its entering state's contribution to its outputs (2 x 2 b s h p n FLOPs on the local shard, 3x in backward:
      recomputed).
    * ``"cp_halo"``: one send/recv of the last ``d_conv - 1`` tokens of the local shard forward, of their gradient
      backward.
    """
    from autopart.cost import collective_time, roofline_time, send_recv_time

    axis = seq_axis(option)
    mesh = cluster.mesh_shape
    c = mesh[axis] if axis is not None else 1
    if c == 1:
        return 0.0
    link = cluster.link(axis)
    x = node.args[0].meta["val"]
    spec = option.inputs[0]
    split = [math.prod(n for i, n in enumerate(mesh) if spec[i] == Shard(d)) for d in range(x.dim())]
    if option.tag == "cp_halo":
        k = node.args[1].meta["val"].shape[1]
        halo = x.shape[0] / split[0] * (k - 1) * x.shape[2] / split[2] * x.element_size()
        return 2 * send_recv_time(halo, link)
    bsz, s, h, p = (x.shape[d] / split[d] for d in range(4))
    d = node.args[3].meta["val"].shape[-1]
    state = bsz * h * (p * d + 1) * x.element_size()
    t = collective_time("all_gather", c * state, c, link) + collective_time("reduce_scatter", c * state, c, link)
    return t + roofline_time(4 * (4 * bsz * s * h * p * d), 0.0, cluster.device)


def cp_comm_time(node: fx.Node, option: OpOption, cluster) -> float:
    """Seconds a context-parallel option adds to its compute (forward and backward), on the axis' link; sequence
    ops: ``ssm_comm_time``; SDPA below.

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
    * ring, the passes one fused kernel does not make (``ring_merge_time``): per step the partial output merged
      into an fp32 accumulator by log-sum-exp, the partial dq, dK and dV added into theirs, the accumulators cast
      back at the end;
    * causal mask, contiguous rows: the last rank attends (2c−1)/c of the average, so the step waits
      (c−1)/c of the rank's attention time (forward and backward) longer.
    """
    if option.tag in SSM_TAGS:
        return ssm_comm_time(node, option, cluster)
    axis = cp_axis(option)
    if axis is None or option.tag not in ATTENTION_TAGS:
        return 0.0
    from autopart.cost import collective_time, node_flops, send_recv_time
    from autopart.cost.compute import attention_time

    mesh = cluster.mesh_shape
    c = mesh[axis]
    if c == 1:
        return 0.0
    a = _sdpa_args(node)
    q, k, v = (x.meta["val"] for x in (a["query"], a["key"], a["value"]))
    split = math.prod(n for i, n in enumerate(mesh) if any(not _is_rep(s[i]) for s in option.inputs))
    ins = tensor_inputs(node)
    kv_spec = option.inputs[ins.index(a["key"])]  # K's spec (the query may be the same node: sdpa(x, x, x))
    gqa = gqa_split(node, ins, option.inputs, tuple(mesh))  # K/V whole there: one head passed on
    local = (k.numel() + v.numel()) * k.element_size() / math.prod(
        n for i, n in enumerate(mesh) if isinstance(kv_spec[i], Shard)) / (gqa.kv_heads if gqa else 1)
    link = cluster.link(axis)
    flops = node_flops(SDPA, (q, k, v), {}, node.meta["val"])  # the whole attention, no causal halving
    rank = flops / split
    if option.tag == "cp_allgather":
        t = 2 * collective_time("all_gather", c * local, c, link) + collective_time("reduce_scatter", c * local, c,
                                                                                    link)
    else:
        # one step's block: 1/c of the rank's attention, half of it under a causal mask (on average)
        step = attention_time(rank / c * (0.5 if a["is_causal"] else 1.0), cluster.device, dtype=q.dtype)
        hop = send_recv_time(local, link)
        t = (c - 1) * max(0.0, hop - step) + (c - 1) * max(0.0, 2 * hop - 2.5 * step) + hop
        balanced = a["is_causal"] and balanced_ok(node.graph, q.shape[2], c)
        t += ring_merge_time(q.numel() * q.element_size() / split, local, q.element_size(), c, cluster.device,
                             balanced)
    if a["is_causal"] and not balanced_ok(node.graph, q.shape[2], c):
        t += (c - 1) / c * attention_time(3.5 * rank / 2, cluster.device, dtype=q.dtype)
    return t


def ring_merge_time(q_bytes: float, kv_bytes: float, e: int, c: int, device, balanced: bool = False) -> float:
    """Seconds of the memory-bound passes ring attention adds to one fused attention kernel on the busiest rank
    (forward and backward), at the device's memory bandwidth; ``q_bytes`` and ``kv_bytes`` the rank's q (= output)
    and K+V shards in the activations' dtype of ``e`` bytes, so Nq = q_bytes/e and Nkv = kv_bytes/e elements.

    One kernel over all the keys keeps its running softmax in registers and writes its output once; the ring runs
    one kernel per step and combines their results in memory, as this runtime, TransformerEngine's P2P context
    parallelism and ``torch.distributed.tensor.experimental.context_parallel`` (its ``_SDPAMerger``, fp32) do.
    Only the passes outside the step's kernels count: a block's kernel is compute-bound, its own reads of q, O,
    dO and writes of partial results hide under its arithmetic (roofline). Per step after the first, on the
    busiest rank (contiguous rows: the last, every block whole; the balanced layout: a step attends all the
    rank's queries to half of the block's keys, or half its queries to all the keys, and rank c−1 runs only the
    first kind, rank 0 only the second, so the dearer of the two counts):

    * forward: the online-softmax merge reads the fp32 accumulator and the step's partial output and writes the
      accumulator back: (8 + e)·Nq;
    * backward: flash backward's rowsum(dO∘O) pass, run per call, reads O and dO (2e·Nq); the partial dq is added
      into its fp32 accumulator ((8 + e)·Nq), the partial dK, dV into the travelling fp32 accumulators
      ((8 + e)·Nkv);

    and once, the three accumulators cast back to the activations' dtype ((4 + e)·(2Nq + Nkv)). Each step
    launches four more kernels (the merge; the rowsum pass and two adds): 4(c−1) op latencies (0 unless
    calibrated). The log-sum-exp's own passes, 1/head_dim of these, are left out.

    Bytes: (c−1)·((16 + 4e)·Nq + (8 + e)·Nkv) + (4 + e)·(2Nq + Nkv), balanced (c−1)·max((16 + 4e)·Nq +
    (8 + e)·Nkv/2, (16 + 4e)·Nq/2 + (8 + e)·Nkv) + the casts; time = bytes / mem_bandwidth.
    """
    nq, nkv = q_bytes / e, kv_bytes / e
    step = max((16 + 4 * e) * nq + (8 + e) * nkv / 2, (16 + 4 * e) * nq / 2 + (8 + e) * nkv) if balanced else \
        (16 + 4 * e) * nq + (8 + e) * nkv
    nbytes = (c - 1) * step + (4 + e) * (2 * nq + nkv)
    return nbytes / device.mem_bandwidth + 4 * (c - 1) * device.op_latency


_DIM_ARG = {aten.slice.Tensor: 1, aten.select.int: 1, aten.narrow.default: 1, aten.index_select.default: 1,
            aten.gather.default: 1, aten.cumsum.default: 1, aten.cumprod.default: 1, aten.unbind.int: 1,
            aten.cat.default: 1, aten.chunk.default: 2, aten.split.Tensor: 2, aten.split_with_sizes.default: 2,
            aten.tensor_split.indices: 2, aten.tensor_split.sections: 2, aten.roll.default: 2, aten.flip.default: 1}
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
        elif n.target in _ORDERED or n.target in SEQUENCE_OPS:
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
