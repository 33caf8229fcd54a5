"""A reference Llama-style decoder: RMSNorm, rotary positions (RoPE), SwiGLU MLP, grouped-query attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    max_seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    d_model: int = 64
    d_ff: int = 128
    rope_theta: float = 10000.0
    eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d_model % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(
                f"need d_model ({self.d_model}) % n_head ({self.n_head}) == 0 and "
                f"n_head % n_kv_head ({self.n_kv_head}) == 0"
            )

    @staticmethod
    def preset(name: str) -> LlamaConfig:
        presets = {
            "tiny": LlamaConfig(),
            "llama-7b": LlamaConfig(32000, 4096, 32, 32, 32, 4096, 11008),
            "llama-70b": LlamaConfig(32000, 4096, 80, 64, 8, 8192, 28672),
        }
        if name not in presets:
            raise ValueError(f"unknown Llama preset {name!r}; choose one of {sorted(presets)}")
        return presets[name]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv = cfg.n_head, cfg.n_kv_head
        self.hd = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.n_head * self.hd, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.n_kv_head * self.hd, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.n_kv_head * self.hd, bias=False)
        self.o = nn.Linear(cfg.n_head * self.hd, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.n_head, self.hd).transpose(1, 2)
        k = self.k(x).view(b, s, self.n_kv, self.hd).transpose(1, 2)
        v = self.v(x).view(b, s, self.n_kv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_head)
        return self.o(y.transpose(1, 2).reshape(b, s, self.n_head * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or LlamaConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        s = ids.shape[1]
        cos, sin = rope_tables(s, self.cfg.d_model // self.cfg.n_head, self.cfg.rope_theta, ids.device)
        x = self.embed(ids)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # a bf16 model keeps q, k, v in bf16
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
