"""FLOPs, bytes and roofline time of single ATen op calls, from shapes only (fake and meta tensors welcome).

FLOP formulas come from ``torch.utils.flop_counter.flop_registry`` (mm, addmm, bmm, baddbmm, convolution, the fused
attention kernels, ...) and, for ops a high-level export keeps but the registry lacks, from ``_FORMULAS`` below
(linear, matmul, scaled_dot_product_attention, ...). Multiply-adds count 2 FLOPs. Attention with ``is_causal`` counts
half, as flash kernels skip the masked blocks; the registry itself ignores the mask. Every other op counts 0 FLOPs:
it is priced by the bytes it moves (``node_bytes``) in ``roofline_time``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import flop_counter

from autopart._torch_private import op_schema
from autopart.cost.cluster import Device

aten = torch.ops.aten

_FORMULAS: dict[Any, Callable[[tuple, dict, Any], int]] = {}


def _formula(*packets: Any) -> Callable:
    def register(fn: Callable[[tuple, dict, Any], int]) -> Callable[[tuple, dict, Any], int]:
        for packet in packets:
            _FORMULAS[packet] = fn
        return fn

    return register


def _packet(target: Any) -> Any:
    return getattr(target, "overloadpacket", target)


def _arg(target: Any, args: tuple, kwargs: dict, name: str, default: Any) -> Any:
    """Argument ``name`` of a call, found by keyword or by its position in the op's schema."""
    if name in kwargs:
        return kwargs[name]
    schema = op_schema(target if isinstance(target, torch._ops.OpOverload) else getattr(target, "default", None))
    if schema is None:
        return default
    for i, argument in enumerate(schema.arguments):
        if argument.name == name:
            return args[i] if i < len(args) and not argument.kwarg_only else default
    return default


def _numel(shape: Any) -> int:
    return math.prod(int(x) for x in shape)


def matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs of an (m, k) @ (k, n) product: 2mnk."""
    return 2 * m * n * k


def _sdpa_forward_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """QKᵀ and PV: 2·BH·s·t·d + 2·BH·s·t·d_v with BH the query's batch×heads (GQA: query heads)."""
    *batch_heads, s, d = query.shape
    t, d_v = key.shape[-2], value.shape[-1]
    return 2 * _numel(batch_heads) * int(s) * int(t) * (int(d) + int(d_v))


@_formula(aten.linear)
def _linear_flops(args: tuple, kwargs: dict, out: Any) -> int:
    """input [..., k] @ weightᵀ [k, n] (+ bias): 2·M·n·k (+ M·n)."""
    x, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    k = int(x.shape[-1])
    m = _numel(x.shape) // k if k else 0
    n = int(weight.shape[0]) if weight.dim() == 2 else 1
    return matmul_flops(m, n, k) + (m * n if bias is not None else 0)


@_formula(aten.matmul)
def _matmul_flops(args: tuple, kwargs: dict, out: Any) -> int:
    """Broadcast batched matmul: 2·batch·m·n·k (1-D operands count as m = 1 or n = 1)."""
    a, b = args[0], args[1]
    m = int(a.shape[-2]) if a.dim() > 1 else 1
    n = int(b.shape[-1]) if b.dim() > 1 else 1
    batch_a, batch_b = list(a.shape[:-2]), list(b.shape[:-2])
    rank = max(len(batch_a), len(batch_b))
    batch_a, batch_b = [1] * (rank - len(batch_a)) + batch_a, [1] * (rank - len(batch_b)) + batch_b
    batch = _numel(max(x, y) for x, y in zip(batch_a, batch_b, strict=True))
    return batch * matmul_flops(m, n, int(a.shape[-1]))


@_formula(aten.einsum)
def _einsum_flops(args: tuple, kwargs: dict, out: Any) -> int:
    """Explicit equations, operands contracted left to right as ``torch.einsum`` does without a path: each pairwise
    product costs 2 x the product of the sizes of every letter either side holds (``"egcd,edf->egcf"``: 2·E·G·C·d·f,
    so MoE experts are priced at their capacity C); a single operand (a sum or a permutation) costs its numel."""
    equation, operands = args[0].replace(" ", ""), list(args[1])
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    if "..." in equation:  # broadcast dims, aligned from the right, as the digits "0".."9"
        nb = max(x.dim() - len(t) + 3 for t, x in zip(terms, operands) if "..." in t)
        terms = [t.replace("...", "0123456789"[nb - (x.dim() - len(t) + 3):nb]) for t, x in zip(terms, operands)]
        rhs = rhs.replace("...", "0123456789"[:nb])
    if not arrow:
        rhs = "".join(c for c in "".join(terms) if "".join(terms).count(c) == 1)
    size: dict[str, int] = {}
    for t, x in zip(terms, operands):
        for c, n in zip(t, x.shape):
            size[c] = max(size.get(c, 1), int(n))
    if len(terms) == 1:
        return _numel(operands[0].shape)
    flops, held = 0, terms[0]
    for i in range(1, len(terms)):
        letters = set(held) | set(terms[i])
        flops += 2 * math.prod(size[c] for c in letters)
        later = set(rhs).union(*terms[i + 1:])
        held = "".join(c for c in letters if c in later)
    return flops


@_formula(aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention_for_cpu)
def _sdpa_flops(args: tuple, kwargs: dict, out: Any) -> int:
    """q [b, h, s, d], k/v [b, hk, t, d]: 4·b·h·s·t·d (halved for causal masks by ``node_flops``)."""
    return _sdpa_forward_flops(args[0], args[1], args[2])


@_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _sdpa_cpu_backward_flops(args: tuple, kwargs: dict, out: Any) -> int:
    """Flash backward recomputes QKᵀ and runs four more products: 2.5× the forward."""
    return _sdpa_forward_flops(args[1], args[2], args[3]) * 5 // 2


@_formula(aten.embedding)
def _embedding_flops(args: tuple, kwargs: dict, out: Any) -> int:
    """A gather: no arithmetic."""
    return 0


@_formula(aten.cross_entropy_loss)
def _cross_entropy_flops(args: tuple, kwargs: dict, out: Any) -> int:
    """max, subtract, exp, sum, log-and-pick over the logits: ~5 FLOPs per logit."""
    return 5 * _numel(args[0].shape)


_MATMUL_FAMILY = frozenset(
    [
        aten.mm,
        aten.addmm,
        aten.bmm,
        aten.baddbmm,
        aten._scaled_mm,
        aten.linear,
        aten.matmul,
        aten.convolution,
        aten._convolution,
        aten.conv1d,
        aten.conv2d,
        aten.conv3d,
        aten.einsum,
    ]
)
_SDPA_FORWARD = frozenset(
    [
        aten.scaled_dot_product_attention,
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_cudnn_attention,
        aten._flash_attention_forward,
        aten._efficient_attention_forward,
    ]
)
_SDPA_BACKWARD = frozenset(
    [
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
        aten._scaled_dot_product_flash_attention_backward,
        aten._scaled_dot_product_efficient_attention_backward,
        aten._scaled_dot_product_cudnn_attention_backward,
        aten._flash_attention_backward,
        aten._efficient_attention_backward,
    ]
)


def node_flops(target: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one call ``target(*args, **kwargs) -> out`` (an ATen OpOverload or OpOverloadPacket).

    Tensors are read through ``.shape`` only. Ops without a formula (pointwise, views, reductions, ...) return 0.
    """
    kwargs = kwargs or {}
    packet = _packet(target)
    try:
        if packet in _FORMULAS:
            flops = _FORMULAS[packet](tuple(args), kwargs, out)
        elif packet in flop_counter.flop_registry:
            flops = flop_counter.flop_registry[packet](*args, **kwargs, out_val=out)
        else:
            return 0
    except (AssertionError, AttributeError, IndexError, TypeError, ValueError) as e:
        shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args]
        raise ValueError(
            f"cannot count FLOPs of {target} with arguments {shapes}: {e}. The op was called with arguments its "
            f"formula does not expect; check the graph node, or add a formula to autopart.cost.compute._FORMULAS"
        ) from e
    if (packet in _SDPA_FORWARD or packet in _SDPA_BACKWARD) and _arg(target, args, kwargs, "is_causal", False):
        flops //= 2
    return int(flops)


# custom ops whose backward is not the rule below: their own forward-to-backward FLOP ratio (Mamba's scan
# recomputes its forward in backward: ``autopart.strategy.ssm``), or a function of the call's arguments giving it
# (a token-local module's, measured at trace time: ``autopart.regions``)
BACKWARD_RATIO: dict[Any, float | Callable[[tuple], float]] = {}


def backward_flops(target: Any, fwd_flops: int, args: tuple = ()) -> int:
    """FLOPs of the backward of a call whose forward took ``fwd_flops`` (``args``: the call's arguments, for a
    ``BACKWARD_RATIO`` that depends on them).

    Matmul family 2× (grad input and grad weight are one product each); attention 2.5× (flash backward: QKᵀ
    recomputed plus dV, dP, dQ, dK); everything else 1× (N21 counts backward as 2× forward overall).
    """
    packet = _packet(target)
    if target in BACKWARD_RATIO:
        ratio = BACKWARD_RATIO[target]
        return int(fwd_flops * (ratio(args) if callable(ratio) else ratio))
    if packet in _SDPA_FORWARD or packet is torch.ops.higher_order.flex_attention:
        return fwd_flops * 5 // 2
    if packet in _MATMUL_FAMILY:
        return 2 * fwd_flops
    return fwd_flops


# ops whose kernels write and read back an intermediate as large as their first argument, which neither their
# arguments nor their output show: cross-entropy is log_softmax then nll_loss, so its (tokens, vocab) log-probabilities
# are written in forward and read by the backward (priced as twice the forward's bytes: nll_loss_backward writes a
# dense gradient of them, log_softmax_backward reads it and them and writes the logits' gradient)
_INTERMEDIATE = frozenset([aten.cross_entropy_loss])


# ops that return a view of their input (new sizes and strides over the same storage): no kernel, no bytes
_VIEWS = frozenset([aten.view, aten._unsafe_view, aten.transpose, aten.t, aten.permute, aten.unsqueeze, aten.squeeze,
                    aten.expand, aten.alias, aten.slice, aten.select, aten.split, aten.split_with_sizes, aten.chunk,
                    aten.tensor_split, aten.unbind, aten.as_strided, aten.detach, aten.view_as, aten.unflatten,
                    aten.narrow, aten.diagonal])
# ops that are a view when their input's strides allow it and copy it otherwise
_VIEW_OR_COPY = frozenset([aten.reshape, aten.contiguous, aten.flatten])


def is_free_view(target: Any, args: Any) -> bool:
    """The call moves no bytes: a view op (``_VIEWS``), ``reshape``/``contiguous``/``flatten`` of a contiguous
    tensor (the traced values carry strides: a transposed attention output is not contiguous and its reshape
    copies, as on the device), or a dropout that drops nothing (p = 0 or not training: ATen's ``dropout`` returns
    its input, no kernel)."""
    packet = _packet(target)
    if packet in _VIEWS:
        return True
    if packet is aten.dropout and args is not None and len(args) >= 3:
        return float(args[1]) == 0.0 or not args[2]
    if packet in _VIEW_OR_COPY and args and isinstance(args[0], torch.Tensor):
        return args[0].is_contiguous()
    return False


def node_bytes(args: Any, out: Any, target: Any = None) -> int:
    """Bytes read plus written: numel·element_size of every tensor in ``args`` and ``out`` (lists, tuples, dicts),
    plus, with the op ``target`` given, the intermediate its kernels write (``_INTERMEDIATE``); none for a view
    (``is_free_view``, with ``target`` given)."""
    if target is not None and is_free_view(target, args):
        return 0

    def size(x: Any) -> int:
        if isinstance(x, torch.Tensor):
            return _numel(x.shape) * x.element_size()
        if isinstance(x, (list, tuple)):
            return sum(size(y) for y in x)
        if isinstance(x, dict):
            return sum(size(y) for y in x.values())
        return 0

    extra = size(args[0]) if target is not None and _packet(target) in _INTERMEDIATE and args else 0
    return size(args) + size(out) + extra


_TRANSCENDENTAL = frozenset(
    [
        aten.gelu,
        aten.gelu_backward,
        aten.silu,
        aten.silu_backward,
        aten.sigmoid,
        aten.tanh,
        aten.exp,
        aten.log,
        aten.erf,
        aten.softmax,
        aten._softmax,
        aten.log_softmax,
        aten._log_softmax,
        aten.cross_entropy_loss,
        aten.mish,
        aten.softplus,
        aten.elu,
    ]
)


_CONVOLUTIONS = frozenset([aten.convolution, aten._convolution, aten.conv1d, aten.conv2d, aten.conv3d])


def compute_dtype(args: Any, out: Any = None) -> torch.dtype | None:
    """The dtype a call computes in, which picks its matmul rate (``dtype_peak_flops``): that of its first
    floating-point tensor argument (lists and tuples searched in order), else of its output's first; None where
    neither has one. The arguments first: a fused attention kernel also returns fp32 log-sum-exps beside its bf16
    output. Callers pass the fx node's argument values and ``meta["val"]``."""
    def first(x: Any) -> torch.dtype | None:
        if isinstance(x, torch.Tensor):
            return x.dtype if x.dtype.is_floating_point else None
        if isinstance(x, (list, tuple)):
            return next((d for d in map(first, x) if d is not None), None)
        return None

    return first(args) or first(out)


def dtype_peak_flops(device: Device, dtype: torch.dtype | None, target: Any = None) -> float:
    """Dense peak FLOP/s of a matmul (or, ``target`` a convolution, a convolution) computing in ``dtype``: the
    device's ``peak_flops`` (its training dtype's: bf16 and fp16 on the GPU presets), but for float32 its
    ``fp32_flops`` (PyTorch's matmuls run fp32 without TF32 by default) and for a float32 convolution its
    ``tf32_flops`` (cuDNN's TF32 default), each where the device gives one. ``dtype`` None: ``peak_flops``."""
    if dtype is not torch.float32 or not device.fp32_flops:
        return device.peak_flops
    if device.tf32_flops and _packet(target) in _CONVOLUTIONS:
        return device.tf32_flops
    return device.fp32_flops


def attention_time(flops: float, device: Device, dtype: torch.dtype | None = None) -> float:
    """Seconds of ``flops`` of fused attention arithmetic alone (no bytes, no per-op latency), at the rate
    ``roofline_time`` prices an attention op at: the device's ``attention_flops``, else its matmul rate, either
    scaled to ``dtype``'s peak (``dtype_peak_flops``; None: the training dtype's). For what context parallelism
    adds around the attention op (a ring step's compute that hides a transfer, the causal imbalance's wait), so that
    those terms and the op itself use one rate."""
    rate = device.attention_flops or device.achievable_flops
    peak = dtype_peak_flops(device, dtype)
    return flops / (rate if peak == device.peak_flops else rate * peak / device.peak_flops)


def math_variant(target: Any, kwargs: dict | None) -> str | None:
    """The key of ``Device.math_variants`` a call of a transcendental op is priced by, None for the op's default
    math: ``"gelu:tanh"`` for gelu (and its backward) with ``approximate="tanh"``, whose tanh polynomial ran
    2.1-2.8x slower than erf's gelu per element on this repository's CPU (1 thread, 256K-4M elements)."""
    if _packet(target) in (aten.gelu, aten.gelu_backward) and (kwargs or {}).get("approximate", "none") != "none":
        return f"gelu:{kwargs['approximate']}"
    return None


def gemm_kernels(target: Any, with_backward: bool) -> int:
    """GEMM kernels one call of ``target`` launches: 1 for the matmul family (3 with its backward: grad input and
    grad weight are one product each, as ``backward_flops`` counts them), 0 for every other op."""
    if _packet(target) not in _MATMUL_FAMILY:
        return 0
    return 3 if with_backward else 1


def roofline_time(flops: float, nbytes: float, device: Device, target: Any = None,
                  kwargs: dict | None = None, with_backward: bool = False, dtype: torch.dtype | None = None) -> float:
    """Roofline: max(flops / (peak_flops · mfu), nbytes / mem_bandwidth) seconds.

    A matmul, convolution or fused attention op computing in ``dtype`` (``compute_dtype`` of the call; None: the
    device's training dtype) runs at that dtype's peak (``dtype_peak_flops``: an fp32 GEMM on a GPU preset at the
    CUDA cores' fp32 rate, ~15x below bf16's) times ``mfu``, attention at ``attention_flops`` scaled by the same
    ratio; bf16 and fp16 at ``peak_flops``.

    With the op ``target`` given, a matmul adds the device's ``gemm_latency`` per GEMM kernel (``gemm_kernels``;
    ``with_backward``: ``flops`` and ``nbytes`` include the call's backward), the time a kernel takes beyond its
    FLOPs at the large-matmul rate, which a small GEMM cannot amortise. The latency is per kernel, so a GEMM sharded
    over more devices runs at a lower rate. Below ``gemm_min_flops`` per kernel (the smallest GEMM a calibration
    measured) the form is not extrapolated: the GEMM runs at the rate of a GEMM of that size.

    With the op ``target`` given, fused attention runs at the device's ``attention_flops`` where it has one (measured
    by ``autopart.calibrate``; a published kernel's on the GPU presets: slower than their GEMMs), and, on a device
    calibrated (``autopart.calibrate``), elementwise ops with transcendental math (gelu, silu, exp, softmax,
    cross-entropy, ...) move their bytes at the measured ``math_bandwidth``: on a CPU these are compute-bound and
    ran 4-6x slower than the matmul rate or a plain add's bandwidth predict (a 4-layer GPT, one rank); a variant of
    such an op (``math_variant`` of the call's ``kwargs``) at its own measured rate where the device has one. Each
    op call adds the device's ``op_latency`` (framework time per graph op; 0 unless calibrated)."""
    packet = _packet(target) if target is not None else None
    rate = device.peak_flops * device.mfu
    attention = packet in _SDPA_FORWARD or packet in _SDPA_BACKWARD
    if device.attention_flops and attention:
        rate = device.attention_flops
    if dtype is not None and (attention or packet in _MATMUL_FAMILY):
        peak = dtype_peak_flops(device, dtype, target)
        if peak != device.peak_flops:
            rate *= peak / device.peak_flops
    bandwidth = device.math_bandwidth if device.math_bandwidth and packet in _TRANSCENDENTAL else \
        device.mem_bandwidth
    if device.math_variants and packet in _TRANSCENDENTAL:
        bandwidth = dict(device.math_variants).get(math_variant(target, kwargs), bandwidth)
    kernels = gemm_kernels(target, with_backward) if target is not None else 0
    gemm = kernels * device.gemm_latency
    if gemm and flops < kernels * device.gemm_min_flops:  # below the smallest GEMM measured: that size's rate
        gemm = flops * device.gemm_latency / device.gemm_min_flops
    return max(flops / rate, nbytes / bandwidth) + gemm + (device.op_latency if target is not None else 0.0)
