"""Closed-form memory and FLOP counts of transformer training, from the papers the plans are checked against.

Bytes throughout. Sources: Rajbhandari et al. 2020, "ZeRO" (Z20); Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models" (K22); Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters" (N21). See /work/shared/REFERENCE.md for the tables these reproduce.
"""

from __future__ import annotations

RECOMPUTE_MODES = ("none", "selective", "full")


def model_state_bytes(
    num_params: float,
    d: int,
    zero_level: int,
    bytes_param: float = 2,
    bytes_grad: float = 2,
    bytes_optim: float = 12,
) -> float:
    """Parameters, gradients and optimizer states per device under ZeRO over ``d`` data-parallel ranks (Z20 §5).

    With Ψ = ``num_params`` and the mixed-precision Adam defaults (2 + 2 + 12 = 16 bytes per parameter):

        level 0 (plain DP)      (2 + 2 + 12) Ψ
        level 1 (P_os)          (2 + 2) Ψ + 12 Ψ / d
        level 2 (P_os+g)        2 Ψ + (2 + 12) Ψ / d
        level 3 (P_os+g+p)      (2 + 2 + 12) Ψ / d

    Z20 Figure 1: Ψ = 7.5e9, d = 64 gives 120, 31.4, 16.6, 1.88 GB. Megatron (bf16 weights, fp32 grads, 18 bytes
    per parameter) is ``bytes_grad=4``; its distributed optimizer is level 1 with ``bytes_param=2, bytes_grad=4``.
    """
    if zero_level not in (0, 1, 2, 3):
        raise ValueError(f"zero_level must be 0, 1, 2 or 3, got {zero_level}")
    if d < 1:
        raise ValueError(f"data-parallel degree d must be >= 1, got {d}")
    sharded = {0: 0.0, 1: bytes_optim, 2: bytes_optim + bytes_grad, 3: bytes_optim + bytes_grad + bytes_param}
    total = bytes_param + bytes_grad + bytes_optim
    return num_params * ((total - sharded[zero_level]) + sharded[zero_level] / d)


def megatron_activation_bytes_per_layer(
    s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none"
) -> float:
    """Activation bytes one transformer layer keeps for backward, 16-bit activations (K22 §4, Table 2).

    s sequence, b micro-batch, h hidden, a heads, t tensor-parallel degree, sp sequence parallelism:

        recompute "none", no SP          sbh (10 + 24/t + 5as/(ht))      (t = 1: sbh (34 + 5as/h))
        recompute "none", SP             sbh (34/t + 5as/(ht))
        recompute "selective", no SP     sbh (10 + 24/t)
        recompute "selective", SP        34 sbh / t
        recompute "full"                 2 sbh  (the layer input only; 2 sbh / t when SP shards it)

    Attention keeps 11sbh + 5as²b, the MLP 19sbh, the two LayerNorms 4sbh; of these 10sbh (LayerNorm and dropout
    inputs outside the TP region) are replicated unless SP shards them; the 5as²b of softmax and its dropout mask
    is what selective recompute drops. K22 worked values at s = 2048, b = 1, t = 8 (GB per layer): 22B model
    1.770 / 0.331 / 0.221 / 0.053 / 0.025, 175B model 2.869 / 0.579 / 0.359 / 0.107 / 0.050.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if min(s, b, h, a, t) < 1:
        raise ValueError(f"s, b, h, a, t must all be >= 1, got s={s} b={b} h={h} a={a} t={t}")
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / t if sp else 2 * sbh
    replicated = 34 / t if sp else 10 + 24 / t
    attention_scores = 5 * a * s / (h * t) if recompute == "none" else 0.0
    return sbh * (replicated + attention_scores)


def gpt_params(L: int, h: int, V: int, s: int) -> float:
    """Parameters of a GPT (N21 §5.1): 12Lh² (1 + 13/(12h) + (V + s)/(12Lh)) = 12Lh² + 13Lh + (V + s)h.

    GPT-3 175B (L 96, h 12288, V 51200, s 2048): 174.6e9.
    """
    return 12 * L * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))


def gpt_train_flops(B: int, s: int, L: int, h: int, V: int, recompute: bool = False) -> float:
    """FLOPs of one training iteration of a GPT on a batch of B sequences of length s (N21 §5.1).

    No recompute: 72 B s L h² (1 + s/(6h) + V/(12Lh)) (forward once, backward twice).
    Full recompute: 96 B s L h² (1 + s/(6h) + V/(16Lh)) (the transformer forward runs twice; the logits once).
    """
    if recompute:
        return 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    return 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
