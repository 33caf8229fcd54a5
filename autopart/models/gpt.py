"""A reference GPT-2-style decoder: learned positions, pre-LayerNorm blocks, causal SDPA, GELU MLP, tied LM head
(untied with ``tie_embeddings=False``, as Megatron-LM's ``--untie-embeddings-and-output-weights``).

Written as plain modules so that ``torch.export`` gives a clean ATen graph; attention uses separate q/k/v
projections so that Megatron's split-by-heads tensor parallelism is a plain column sharding of each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    max_seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    dropout: float = 0.0
    bias: bool = True
    # the loss on fp32 logits, as Megatron computes it (``fp16_lm_cross_entropy`` off, its default: the logits are
    # cast with ``.float()`` before the vocab-parallel cross-entropy) and Hugging Face's causal LMs upcast them
    fp32_loss: bool = False
    # the LM head shares the token embedding's weight (GPT-2); False: its own V x h weight, as Megatron-LM's models
    # with --untie-embeddings-and-output-weights (its H100 table's sizes count both: 1.7B is 1.21B in the blocks and
    # 2 x 0.27B of embedding and head)
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")

    @staticmethod
    def preset(name: str) -> GPTConfig:
        presets = {
            "tiny": GPTConfig(),
            "gpt2-124m": GPTConfig(vocab_size=50304, max_seq_len=1024, n_layer=12, n_head=12, d_model=768),
            "gpt-1.3b": GPTConfig(vocab_size=50304, max_seq_len=2048, n_layer=24, n_head=32, d_model=2048),
            "gpt-13b": GPTConfig(vocab_size=50304, max_seq_len=2048, n_layer=40, n_head=40, d_model=5120),
        }
        if name not in presets:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(presets)}")
        return presets[name]


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        h = cfg.d_model
        self.n_head = cfg.n_head
        self.q = nn.Linear(h, h, bias=cfg.bias)
        self.k = nn.Linear(h, h, bias=cfg.bias)
        self.v = nn.Linear(h, h, bias=cfg.bias)
        self.proj = nn.Linear(h, h, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        hd = h // self.n_head
        q = self.q(x).view(b, s, self.n_head, hd).transpose(1, 2)
        k = self.k(x).view(b, s, self.n_head, hd).transpose(1, 2)
        v = self.v(x).view(b, s, self.n_head, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        s = ids.shape[1]
        pos = torch.arange(s, device=ids.device)
        x = self.drop(self.wte(ids) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        if self.cfg.fp32_loss:
            logits = logits.float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
