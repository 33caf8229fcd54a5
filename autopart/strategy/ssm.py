"""Rules for Mamba's two sequence ops, ``autopart::ssd_scan`` and ``autopart::causal_conv1d`` (custom ops defined
with the model, ``autopart.models.mamba``, which the planner sees whole), and for the ATen ops a plain-torch scan
builds (causal masks, zero states).

Per mesh axis each op may be replicated or split on

* the batch: every sequence input and the output ``Shard(0)``, the per-head / per-channel parameters whole;
* the heads (scan) or channels (conv), tensor parallelism over the inner dimension: x, dt, A, D / the conv's x,
  weight and bias split on heads or channels, B and C (shared by all heads) replicated; no collective;
* the sequence, context parallelism: every sequence input and the output ``Shard(1)``. Running the op on the
  local chunk alone would be wrong (a chunk's outputs depend on every earlier token), so
  ``strategy.context.cp_variants`` tags the option (``"cp_state"`` for the scan, ``"cp_halo"`` for the conv),
  ``strategy.context.cp_comm_time`` prices its exchange and ``passes.context`` lowers it to
  ``autopart.runtime.ssm``: the scan passes each chunk's final recurrent state on, the conv receives the previous
  rank's last ``d_conv - 1`` tokens.

FLOPs are those of fused chunked kernels (Mamba-2's SSD): per chunk of Q tokens the C·Bᵀ and decay-matrix
products, each chunk's final state, its entering state's contribution, and a state pass between chunks that is
linear in their number (the plain-torch reference computes the chunk-to-chunk segment-sum, quadratic in chunks;
kernels pass the state). Backward recomputes the forward and differentiates it: priced 3x the forward.
"""

from __future__ import annotations

import torch

from autopart.placement import Shard
from autopart.strategy.registry import NodeInfo, Option1D, P, R, register, replicate_only

BACKWARD_RATIO = 3.0  # recompute (1x) plus the forward's backward (~2x: its products are matmuls)

aten = torch.ops.aten


@register(aten.ones.default, aten.zeros.default, aten.full.default)
def _constant(info: NodeInfo, n: int) -> list[Option1D]:
    """A tensor built from sizes alone (a causal mask): replicated; sharding it would need per-rank sizes."""
    return replicate_only(info, n)


@register(aten.tril.default, aten.triu.default)
def _triangle(info: NodeInfo, n: int) -> list[Option1D]:
    """Masks the last two dims: any leading (batch) dim may be split; linear, so Partial passes."""
    shape = info.shape(0)
    opts = [Option1D((R,), R)]
    if info.val.dtype.is_floating_point:
        opts.append(Option1D((P,), P))
    return opts + [Option1D((Shard(d),), Shard(d)) for d in range(len(shape) - 2) if shape[d] > 1]


@register(aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default,
          aten.fill.Scalar, aten.fill.Tensor)
def _like(info: NodeInfo, n: int) -> list[Option1D]:
    """A new tensor with the input's shape (``zeros_like``; ``fill``, a functionalized ``fill_``): it takes the
    input's split, or is whole when the input is (Partial input: the values do not matter, the local shape is the
    whole shape). A tensor fill value is one element, whole."""
    shape = info.shape(0)
    rest = tuple(R for _ in info.inputs[1:])
    opts = [Option1D((R, *rest), R), Option1D((P, *rest), R)]
    return opts + [Option1D((Shard(d), *rest), Shard(d)) for d in range(len(shape)) if shape[d] > 1]


@register(aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default)
def _new(info: NodeInfo, n: int) -> list[Option1D]:
    """A new tensor of a given size (``x.new_zeros(size)``): x gives only its dtype and device, so it may stay as
    it is; the output is whole or split on any dim (a constant: each rank makes its part; ``passes.lower`` gives
    the local size)."""
    shape = info.shape(0)
    mine = [R] + [Shard(d) for d in range(len(shape)) if shape[d] > 1]
    if info.inputs[0].meta["val"].dtype.is_floating_point:
        mine.append(P)
    outs = [R] + [Shard(d) for d in range(len(info.out_shape)) if info.out_shape[d] > 1]
    return [Option1D((a,), b) for a in mine for b in outs]


def ssd_scan_rule(info: NodeInfo, n: int) -> list[Option1D]:
    """``ssd_scan(x [b, s, h, p], dt [b, s, h], a [h], b [b, s, n], c [b, s, n], chunk_size)``: batch, heads,
    head channels (x alone) or sequence (see the module docstring)."""
    if len(info.inputs) != 5:  # B and C one tensor: not the model's scan, keep it whole
        return replicate_only(info, n)
    x = info.shape(0)
    opts = [Option1D((R,) * 5, R)]
    if x[0] > 1:
        opts.append(Option1D((Shard(0), Shard(0), R, Shard(0), Shard(0)), Shard(0)))
    if x[2] > 1:
        opts.append(Option1D((Shard(2), Shard(2), Shard(0), R, R), Shard(2)))
    if x[3] > 1:
        opts.append(Option1D((Shard(3), R, R, R, R), Shard(3)))
    if x[1] > 1:
        opts.append(Option1D((Shard(1), Shard(1), R, Shard(1), Shard(1)), Shard(1)))
    return opts


def causal_conv1d_rule(info: NodeInfo, n: int) -> list[Option1D]:
    """``causal_conv1d(x [b, s, d], weight [d, k], bias [d])``: batch, channels, or sequence when every rank holds
    at least the ``k - 1`` tokens its successor needs."""
    if len(info.inputs) != 3:
        return replicate_only(info, n)
    x, k = info.shape(0), info.shape(1)[1]
    opts = [Option1D((R,) * 3, R)]
    if x[0] > 1:
        opts.append(Option1D((Shard(0), R, R), Shard(0)))
    if x[2] > 1:
        opts.append(Option1D((Shard(2), Shard(0), Shard(0)), Shard(2)))
    if x[1] > 1 and x[1] // n >= k - 1:
        opts.append(Option1D((Shard(1), R, R), Shard(1)))
    return opts


def ssd_scan_flops(args: tuple, kwargs: dict, out) -> int:
    """A fused chunked scan (module docstring): with chunks of Q tokens over a padded length S, per head of p
    channels and n states: C·Bᵀ (2 S Q n, shared by the heads), the masked decay matrix (3 h S Q: cumsum, exp,
    product), its product with x (2 h S Q p), the chunks' final states and the entering states' contribution
    (2 x 2 h S p n) and the state pass between chunks (2 h (S/Q) p n)."""
    x, b = args[0], args[3]
    chunk = args[5] if len(args) > 5 else kwargs["chunk_size"]
    bsz, seq, h, p = x.shape
    d = b.shape[-1]
    q = min(chunk, seq)
    s = -(-seq // q) * q
    return bsz * (2 * s * q * d + 3 * h * s * q + 2 * h * s * q * p + 4 * h * s * p * d + 2 * h * (s // q) * p * d)


def causal_conv1d_flops(args: tuple, kwargs: dict, out) -> int:
    """A multiply-add per tap per output element."""
    return 2 * out.numel() * args[1].shape[1]


# the registered scan and convolution ops: what a decoding step holds per sequence between steps (``planner
# .decode_state_bytes``: the scan's state, heads x headdim x d_state; the convolution's last d_conv - 1 inputs)
SCAN_OPS: set = set()
CONV_OPS: set = set()


def register_ssm_ops(scan, conv) -> None:
    """Rules, FLOPs and backward cost of the model's custom ops, and their context-parallel tags (called where
    ``autopart.models.mamba`` defines them)."""
    from autopart.cost.compute import BACKWARD_RATIO as ratios
    from autopart.extend import register_op
    from autopart.strategy.context import register_sequence_op

    SCAN_OPS.add(scan)
    CONV_OPS.add(conv)

    register_op(scan, sharding=ssd_scan_rule, flops=ssd_scan_flops)
    register_op(conv, sharding=causal_conv1d_rule, flops=causal_conv1d_flops)
    for op, tag in ((scan, "cp_state"), (conv, "cp_halo")):
        register_sequence_op(op, tag)
        ratios[op] = BACKWARD_RATIO
