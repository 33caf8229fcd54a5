"""A reference Mamba language model and a hybrid (mostly Mamba blocks, a few attention blocks), in plain torch.

Block: RMSNorm, then the mixer, added to the residual. Mixer (Gu & Dao 2023, "Mamba"):

    x, z  = in_proj(u)                       d_model -> 2 * d_inner, rows interleaved (x_0, z_0, x_1, z_1, ...)
                                             so that a column split keeps each channel's x and z on one rank
    x     = silu(causal depthwise conv1d(x)) kernel d_conv over the sequence, one filter per channel
    dt, B, C = x_proj(x)                     d_inner -> dt_rank + 2 * d_state
    dt    = softplus(dt_proj(dt))            dt_rank -> n_heads
    y     = selective_scan(x, dt, A, B, C) + D * x
    out   = out_proj(y * silu(z))            d_inner -> d_model

**Decay per head, not per (channel, state).** Mamba-1 decays each (channel, state) pair by its own
``exp(dt[c] * A[c, n])``. Written loop-free, that is either a segment-sum tensor of shape
(batch, chunks, d_inner, d_state, Q, Q) -- d_state * Q (16 * 64 = 1024) times the activations -- or the
"cumsum then divide" form, which takes ``exp`` of positive numbers and overflows in fp32 within a few dozen tokens.
So this model uses Mamba-2's scalar decay per head (Dao & Gu 2024): the d_inner channels form ``n_heads`` heads of
``headdim`` channels sharing ``dt`` and ``A``; B and C are shared by all heads (one group). Then the scan is
Mamba-2's state-space duality (``ssd_minimal_discrete``): inside a chunk of ``chunk_size`` tokens a masked
segment-sum of log-decays (cumulative sums of non-positive numbers, so ``exp`` only ever sees numbers <= 0) gives
the decay matrix and the output is a few batched matmuls; across chunks the same segment-sum over the chunks' final
states. The traced graph has the same nodes at any sequence length (4K or 128K tokens plan on the ``meta`` device).
Its largest tensors are the in-chunk decays, (batch, heads, seq, chunk_size) -- chunk_size / headdim times x --
and the chunk-to-chunk decays, (batch, heads, chunks + 1, chunks + 1): at 128K tokens use chunks of 256.
Everything else is Mamba-1's block (x_proj producing dt, B, C from the convolved x; per-channel D; no inner norm),
so tensor parallelism over d_inner needs Mamba-1's two all-reduces per block forward: after x_proj (dt, B, C are
sums over channels) and after out_proj.

The causal depthwise convolution is a sum of ``d_conv`` shifted slices of the left-padded input times per-channel
weights, not ``F.conv1d(groups=d_inner)``: the result is the same, and a channel-sharded rank runs the same program
on its channels (a grouped convolution would need its ``groups`` argument rewritten per rank).

**Two custom ops.** The mixer calls the scan and the convolution as ``torch.library.custom_op``s,
``autopart::ssd_scan`` and ``autopart::causal_conv1d``: one graph node each, which the planner sees whole (rules,
FLOPs and context-parallel tags in ``autopart.strategy.ssm``). Like Mamba's fused kernels they save only their
inputs and recompute in backward (the plain-torch functions below, differentiated). Whole ops let the sequence be
split across ranks (context parallelism, ``autopart.runtime.ssm``): each rank scans its chunk from a zero state and
the chunks' final states are passed on; the convolution receives the previous rank's last ``d_conv - 1`` tokens.
As ATen ops a sequence split would gather the whole input before the convolution's shifted slices (no rule
expresses a halo) and, at best, the chunks' states before the scan's chunk-to-chunk segment-sum; as whole ops the
exchange is explicit, priced (``strategy.context.ssm_comm_time``) and state-sized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopart.models.llama import Block as AttentionBlock
from autopart.models.llama import LlamaConfig, RMSNorm, rope_tables
from autopart.strategy.ssm import register_ssm_ops


@dataclass(frozen=True)
class MambaConfig:
    vocab_size: int = 256
    n_layer: int = 2
    d_model: int = 64
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    headdim: int = 16  # channels per decay head: n_heads = expand * d_model / headdim
    dt_rank: int = 0  # 0: ceil(d_model / 16), as Mamba
    chunk_size: int = 64  # tokens per chunk of the scan
    tie_embeddings: bool = True
    eps: float = 1e-5
    dt_min: float = 1e-3
    dt_max: float = 1e-1

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "d_model", "d_state", "d_conv", "expand", "headdim", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"MambaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.dt_rank < 0:
            raise ValueError(f"MambaConfig.dt_rank must be >= 0 (0: ceil(d_model / 16)), got {self.dt_rank}")
        if self.d_inner % self.headdim:
            raise ValueError(f"d_inner = expand * d_model = {self.d_inner} must be divisible by headdim "
                             f"({self.headdim})")
        if not 0 < self.dt_min <= self.dt_max:
            raise ValueError(f"need 0 < dt_min ({self.dt_min}) <= dt_max ({self.dt_max})")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def n_heads(self) -> int:
        return self.d_inner // self.headdim

    @property
    def rank(self) -> int:
        return self.dt_rank or math.ceil(self.d_model / 16)

    @staticmethod
    def preset(name: str) -> MambaConfig:
        presets = {
            "tiny": MambaConfig(),
            "mamba-130m": MambaConfig(50280, 24, 768, headdim=64),
            "mamba-1.4b": MambaConfig(50280, 48, 2048, headdim=64),
            "mamba-2.8b": MambaConfig(50280, 64, 2560, headdim=64),
        }
        if name not in presets:
            raise ValueError(f"unknown Mamba preset {name!r}; choose one of {sorted(presets)}")
        return presets[name]


def segsum(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = a[..., j+1] + ... + a[..., i]`` for ``j <= i`` (0 on the diagonal), ``-inf`` above it.

    Sums of the masked entries by ``cumsum`` rather than differences of one long cumulative sum: with ``a <= 0``
    every finite entry is <= 0, so ``exp`` of the result is a decay in [0, 1] with no cancellation."""
    t = a.shape[-1]
    x = a.unsqueeze(-1).expand(*a.shape, t)  # x[..., i, j] = a[..., i]
    below = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(-1)
    x = torch.cumsum(x.masked_fill(~below, 0.0), dim=-2)
    on_or_below = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(0)
    return x.masked_fill(~on_or_below, -math.inf)


def selective_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   chunk_size: int) -> torch.Tensor:
    """The selective scan with scalar decay per head, loop-free (Mamba-2's ``ssd_minimal_discrete``).

    ``x`` (batch, seq, heads, headdim), ``dt`` (batch, seq, heads) > 0, ``a`` (heads,) < 0, ``b`` and ``c``
    (batch, seq, d_state). With ``h_0 = 0``, per head: ``h_t = exp(dt_t a) h_{t-1} + dt_t x_t b_t^T`` (headdim x
    d_state) and ``y_t = h_t c_t``. Returns ``y`` shaped like ``x``. A sequence that is not a multiple of
    ``chunk_size`` is padded at the end with ``dt = 0`` (no effect on the earlier outputs)."""
    bsz, seq, heads, hd = x.shape
    pad = (-seq) % chunk_size
    if pad:  # along the sequence only (moved last), so every other dim keeps its sharding
        x, dt, b, c = (F.pad(t.transpose(1, -1), (0, pad)).transpose(1, -1) for t in (x, dt, b, c))
    n, q = (seq + pad) // chunk_size, chunk_size
    d = b.shape[-1]
    # Heads are a batch dim, or the outer part of a merged (head, channel) dim, of every product below; B and C
    # (shared by the heads) are never expanded over them. So a split of the heads stays local.
    xs = (x * dt.unsqueeze(-1)).view(bsz, n, q, heads, hd)
    la = (dt * a).view(bsz, n, q, heads).transpose(2, 3)  # log-decays (b, n, h, q), all <= 0
    la_cum = torch.cumsum(la, dim=-1)
    b, c = b.view(bsz, n, q, d), c.view(bsz, n, q, d)
    # 1. within each chunk: y_l = sum_{s <= l} (c_l . b_s) exp(la_{s+1} + ... + la_l) xs_s
    mix = torch.matmul(c, b.transpose(-1, -2)).unsqueeze(2) * torch.exp(segsum(la))  # (b, n, h, l, s)
    y = torch.matmul(mix, xs.transpose(2, 3)).transpose(2, 3)  # (b, n, q, h, p)
    # 2. each chunk's final state from its own tokens, decayed to the chunk's end (exponents <= 0)
    to_end = torch.exp(la_cum[..., -1:] - la_cum).transpose(2, 3).unsqueeze(-1)  # (b, n, q, h, 1)
    states = torch.matmul((xs * to_end).reshape(bsz, n, q, heads * hd).transpose(-1, -2), b)  # (b, n, h*p, d)
    # 3. the state entering each chunk: a segment-sum over the chunks' total log-decays
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1).view(bsz, n + 1, heads, hd * d)
    chunk_decay = torch.exp(segsum(F.pad(la_cum[..., -1].transpose(1, 2), (1, 0))))  # (b, h, n+1, n+1)
    states = torch.matmul(chunk_decay[:, :, :-1], states.transpose(1, 2))  # entering chunks 0..n-1: (b, h, n, p*d)
    # 4. the entering state's contribution to every token of the chunk
    states = states.view(bsz, heads, n, hd, d).permute(0, 2, 4, 1, 3).reshape(bsz, n, d, heads * hd)
    y_off = torch.matmul(c, states).view(bsz, n, q, heads, hd) * torch.exp(la_cum).transpose(2, 3).unsqueeze(-1)
    y = (y + y_off).reshape(bsz, n * q, heads, hd)
    return y[:, :seq] if pad else y


def selective_scan_reference(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                             c: torch.Tensor) -> torch.Tensor:
    """The same recurrence token by token (a Python loop): the definition ``selective_scan`` is tested against."""
    bsz, seq, heads, hd = x.shape
    h = x.new_zeros(bsz, heads, hd, b.shape[-1])
    ys = []
    for t in range(seq):
        da = torch.exp(dt[:, t] * a)  # (b, h)
        h = da[:, :, None, None] * h + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, None, None, :]
        ys.append(torch.einsum("bhpd,bd->bhp", h, c[:, t]))
    return torch.stack(ys, dim=1)


def causal_conv1d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor,
                  halo: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise convolution along the sequence: ``x`` (batch, seq, channels), ``w`` (channels, d_conv),
    ``bias`` (channels). Output t of channel d is ``bias[d] + sum_k w[d, k] x[t - d_conv + 1 + k, d]``, the
    positions before the sequence being ``halo`` (batch, d_conv - 1, channels) -- the previous rank's last tokens
    under context parallelism -- or zeros."""
    k, seq = w.shape[1], x.shape[1]
    xp = torch.cat([halo, x], dim=1) if halo is not None else F.pad(x, (0, 0, k - 1, 0))
    out = bias + xp[:, :seq] * w[:, 0]
    for j in range(1, k):
        out = out + xp[:, j:j + seq] * w[:, j]
    return out


def _recompute_backward(fn, ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The backward of a custom op below: run ``fn`` again on the saved inputs under autograd and differentiate
    (Mamba's fused kernels also recompute in backward rather than keep the scan's intermediates)."""
    inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
    with torch.enable_grad():
        out = fn(*inputs, *ctx.consts)
    return torch.autograd.grad(out, inputs, grad)


def _save_inputs(n_tensors: int):
    def setup(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs[:n_tensors])
        ctx.consts = tuple(inputs[n_tensors:])

    return setup


@torch.library.custom_op("autopart::causal_conv1d", mutates_args=())
def causal_conv1d_op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``causal_conv1d`` as one graph node the planner sees whole (rules: ``autopart.strategy.ssm``)."""
    return causal_conv1d(x, w, bias)


@causal_conv1d_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


causal_conv1d_op.register_autograd(lambda ctx, g: _recompute_backward(causal_conv1d, ctx, g),
                                   setup_context=_save_inputs(3))


@torch.library.custom_op("autopart::ssd_scan", mutates_args=())
def ssd_scan_op(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                chunk_size: int) -> torch.Tensor:
    """``selective_scan`` as one graph node the planner sees whole (rules: ``autopart.strategy.ssm``)."""
    return selective_scan(x, dt, a, b, c, chunk_size)


@ssd_scan_op.register_fake
def _(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
      chunk_size: int) -> torch.Tensor:
    return torch.empty_like(x)


ssd_scan_op.register_autograd(lambda ctx, g: (*_recompute_backward(selective_scan, ctx, g), None),
                              setup_context=_save_inputs(5))
SSD_SCAN = torch.ops.autopart.ssd_scan.default
CAUSAL_CONV1D = torch.ops.autopart.causal_conv1d.default
register_ssm_ops(SSD_SCAN, CAUSAL_CONV1D)


class MambaMixer(nn.Module):
    def __init__(self, cfg: MambaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        di, r = cfg.d_inner, cfg.rank
        self.in_proj = nn.Linear(cfg.d_model, 2 * di, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(di, cfg.d_conv).uniform_(-1 / math.sqrt(cfg.d_conv),
                                                                              1 / math.sqrt(cfg.d_conv)))
        self.conv_bias = nn.Parameter(torch.zeros(di))
        self.x_proj = nn.Linear(di, r + 2 * cfg.d_state, bias=False)
        self.dt_proj = nn.Linear(r, cfg.n_heads, bias=True)
        self.A_log = nn.Parameter(torch.empty(cfg.n_heads).uniform_(1, 16).log())
        self.D = nn.Parameter(torch.ones(di))
        self.out_proj = nn.Linear(di, cfg.d_model, bias=False)
        with torch.no_grad():  # Mamba's dt init: softplus(bias) log-uniform in [dt_min, dt_max]
            nn.init.uniform_(self.dt_proj.weight, -r**-0.5, r**-0.5)
            dt = torch.exp(torch.rand(cfg.n_heads) * (math.log(cfg.dt_max) - math.log(cfg.dt_min))
                           + math.log(cfg.dt_min))
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        bsz, seq, _ = u.shape
        x, z = self.in_proj(u).view(bsz, seq, cfg.d_inner, 2).unbind(-1)
        x = F.silu(causal_conv1d_op(x, self.conv_weight, self.conv_bias))
        dt, b, c = self.x_proj(x).split([cfg.rank, cfg.d_state, cfg.d_state], dim=-1)
        dt = F.softplus(self.dt_proj(dt))
        y = ssd_scan_op(x.view(bsz, seq, cfg.n_heads, cfg.headdim), dt, -torch.exp(self.A_log), b, c,
                        cfg.chunk_size)
        y = y.reshape(bsz, seq, cfg.d_inner) + x * self.D
        return self.out_proj(y * F.silu(z))


class MambaBlock(nn.Module):
    def __init__(self, cfg: MambaConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.eps)
        self.mixer = MambaMixer(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))


class _LM(nn.Module):
    """Embedding, blocks, final norm, tied or untied head; cross-entropy when ``labels`` are given."""

    def __init__(self, cfg: MambaConfig, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(blocks)
        self.norm = RMSNorm(cfg.d_model, cfg.eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        else:
            nn.init.normal_(self.lm_head.weight, std=0.02)

    def _head(self, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


class Mamba(_LM):
    def __init__(self, cfg: MambaConfig | None = None) -> None:
        cfg = cfg or MambaConfig()
        super().__init__(cfg, [MambaBlock(cfg) for _ in range(cfg.n_layer)])
        self.cfg = cfg

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self._head(x, labels)


@dataclass(frozen=True)
class HybridConfig:
    """Mamba blocks with Llama attention blocks (grouped-query attention with RoPE, then a SwiGLU MLP) at the
    layer indices ``attn_layers``."""

    mamba: MambaConfig = field(default_factory=MambaConfig)
    attn_layers: tuple[int, ...] = (1,)
    n_head: int = 4
    n_kv_head: int = 2
    d_ff: int = 128
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        bad = [i for i in self.attn_layers if not 0 <= i < self.mamba.n_layer]
        if bad or len(set(self.attn_layers)) != len(self.attn_layers):
            raise ValueError(f"attn_layers {self.attn_layers} must be distinct layer indices in "
                             f"[0, n_layer={self.mamba.n_layer})")
        self.llama()  # validates heads against d_model

    def llama(self) -> LlamaConfig:
        m = self.mamba
        return LlamaConfig(vocab_size=m.vocab_size, n_layer=len(self.attn_layers), n_head=self.n_head,
                           n_kv_head=self.n_kv_head, d_model=m.d_model, d_ff=self.d_ff, rope_theta=self.rope_theta,
                           eps=m.eps)


class Hybrid(_LM):
    def __init__(self, cfg: HybridConfig | None = None) -> None:
        cfg = cfg or HybridConfig()
        m, lc = cfg.mamba, cfg.llama()
        blocks = [AttentionBlock(lc) if i in cfg.attn_layers else MambaBlock(m) for i in range(m.n_layer)]
        super().__init__(m, blocks)
        for blk in blocks:
            if isinstance(blk, AttentionBlock):
                for mod in blk.modules():
                    if isinstance(mod, nn.Linear):
                        nn.init.normal_(mod.weight, std=0.02)
        self.cfg = cfg

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = rope_tables(ids.shape[1], self.cfg.mamba.d_model // self.cfg.n_head, self.cfg.rope_theta,
                               ids.device)
        x = self.embed(ids)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # a bf16 model keeps q, k, v in bf16
        for block in self.blocks:
            x = block(x, cos, sin) if isinstance(block, AttentionBlock) else block(x)
        return self._head(x, labels)
