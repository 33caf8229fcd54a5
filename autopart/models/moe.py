"""A reference mixture-of-experts decoder: Llama blocks (RMSNorm, RoPE, grouped-query attention) whose MLP is a
mixture of SwiGLU experts behind a top-k softmax router, with a load-balancing auxiliary loss.

Routing is written in the dense GShard formulation (Lepikhin et al. 2020, "GShard", section 2.2 and its algorithm
1), not as a dispatch by index. ``torch.export`` needs static shapes: gathering each expert's tokens with
``nonzero`` or a boolean mask gives a data-dependent count and fails export (``GuardOnDataDependentSymNode``,
shared/PLATFORM.md). Here every shape is fixed by the configuration:

* tokens are grouped per sequence (group dim ``g`` = the batch dim), so a data-parallel split of the batch splits
  the groups and routing never looks across ranks;
* every expert has a fixed *capacity* ``C = ceil(capacity_factor * k * S / E)`` slots per group; a token's slot in
  an expert is its rank among the group's tokens routed there (``one_hot`` + ``cumsum``; all first choices before
  all second choices, then sequence order), and a token whose slot would be ``>= C`` is dropped for that expert
  (deterministically: it contributes zero there and the residual connection carries it);
* the dispatch mask ``[g, s, e, c]`` (0/1) and the combine weights (the same mask times the token's gate) are dense
  tensors; expert inputs are ``einsum('gsec,gsd->egcd')``, the experts are batched matmuls over ``e`` with weights
  stacked ``[E, d, f]`` / ``[E, f, d]``, and the outputs are combined by ``einsum('gsec,egcd->gsd')``.

Under expert parallelism the expert input ``[E, G, C, d]`` is produced split on ``g`` (the batch) and consumed
split on ``e`` (the experts' weights): the Shard(1) -> Shard(0) conversion is the all-to-all dispatch, and the
expert output's Shard(0) -> Shard(1) before the combine is the all-to-all combine. Each expert computes ``C`` slots
per group whether they are filled or not, so the FLOPs (and the cost model's price) are those of capacity: the
capacity factor is the allowance for load imbalance, paid in compute and all-to-all bytes.

The auxiliary loss is the Switch/GShard load-balancing loss per group, ``E * sum_e f_ge * P_ge`` with ``f_ge`` the
fraction of the group's tokens whose first choice is expert ``e`` and ``P_ge`` the mean router probability of
``e``, averaged over groups and summed over layers; ``forward(ids, labels)`` returns the cross-entropy plus
``aux_loss_coef`` times it. Top-k gates are renormalised to sum to 1 when ``k > 1`` (GShard top-2, Mixtral); with
``k = 1`` the gate is the raw probability (Switch), so the router still gets a gradient from the LM loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopart.models.llama import Attention, RMSNorm, rope_tables


@dataclass(frozen=True)
class MoEConfig:
    vocab_size: int = 256
    max_seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    d_model: int = 64
    d_ff: int = 128  # hidden size of each expert
    n_expert: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01
    rope_theta: float = 10000.0
    eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d_model % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(
                f"need d_model ({self.d_model}) % n_head ({self.n_head}) == 0 and "
                f"n_head % n_kv_head ({self.n_kv_head}) == 0"
            )
        if not 1 <= self.top_k <= self.n_expert:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and n_expert ({self.n_expert})")
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor ({self.capacity_factor}) must be > 0")

    def capacity(self, seq_len: int) -> int:
        """Slots per expert per group (sequence): ceil(capacity_factor * k * S / E), at least 1."""
        return max(1, math.ceil(self.capacity_factor * self.top_k * seq_len / self.n_expert))

    @staticmethod
    def preset(name: str) -> MoEConfig:
        presets = {
            "tiny": MoEConfig(),
            # Mixtral-8x7B-like (8 experts, top-2) and a many-expert model (64 experts, top-2)
            "moe-8x7b": MoEConfig(vocab_size=32000, max_seq_len=4096, n_layer=32, n_head=32, n_kv_head=8,
                                  d_model=4096, d_ff=14336, n_expert=8, top_k=2),
            "moe-64e": MoEConfig(vocab_size=32000, max_seq_len=4096, n_layer=16, n_head=16, n_kv_head=4,
                                 d_model=2048, d_ff=5632, n_expert=64, top_k=2),
        }
        if name not in presets:
            raise ValueError(f"unknown MoE preset {name!r}; choose one of {sorted(presets)}")
        return presets[name]


DISPATCH = "gsec,gsd->egcd"  # tokens [G, S, d] -> expert inputs [E, G, C, d]
EXPERT_IN = "egcd,edf->egcf"  # gate and up projections of every expert
EXPERT_OUT = "egcf,efd->egcd"  # down projection
COMBINE = "gsec,egcd->gsd"  # expert outputs -> tokens, weighted by the gates


def expert_nodes(graph: torch.fx.Graph) -> dict[str, list[str]]:
    """Names of the ``aten.einsum`` nodes of a traced MoE by role: ``dispatch`` (output [E, G, C, d]), ``experts``
    (the three expert products, output [E, G, C, f or d]) and ``combine`` (output [G, S, d]), in graph order; for
    pinning placements (``pins={name: "S(0)"}``) or inspecting a plan's choices."""
    roles = {DISPATCH: "dispatch", EXPERT_IN: "experts", EXPERT_OUT: "experts", COMBINE: "combine"}
    out: dict[str, list[str]] = {"dispatch": [], "experts": [], "combine": []}
    for n in graph.nodes:
        if n.op == "call_function" and n.target == torch.ops.aten.einsum.default and n.args[0] in roles:
            out[roles[n.args[0]]].append(n.name)
    return out


class MoELayer(nn.Module):
    """Top-k router and ``E`` SwiGLU experts stored as stacked weights; returns (output, auxiliary loss)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e, d, f = cfg.n_expert, cfg.d_model, cfg.d_ff
        self.router = nn.Linear(d, e, bias=False)
        self.w_gate = nn.Parameter(torch.randn(e, d, f) * 0.02)
        self.w_up = nn.Parameter(torch.randn(e, d, f) * 0.02)
        self.w_down = nn.Parameter(torch.randn(e, f, d) * 0.02)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dispatch mask [G, S, E, C] (0/1), combine weights [G, S, E, C] and the auxiliary loss of ``x``."""
        cfg = self.cfg
        g, s, _ = x.shape
        e, k, c = cfg.n_expert, cfg.top_k, cfg.capacity(s)
        probs = F.softmax(self.router(x), dim=-1)  # [G, S, E]
        top_p, top_i = probs.topk(k, dim=-1)  # [G, S, k]
        gates = top_p / top_p.sum(dim=-1, keepdim=True) if k > 1 else top_p
        choice = F.one_hot(top_i, e)  # [G, S, k, E] int64
        # slot of each (token, choice) in its expert: all first choices of the group, then all second choices, ...
        order = choice.transpose(1, 2).reshape(g, k * s, e)  # [G, kS, E], choice-major
        slot = (torch.cumsum(order, dim=1) - 1) * order  # [G, kS, E]
        slot = slot.sum(dim=-1).reshape(g, k, s).transpose(1, 2)  # [G, S, k]: the slot in the chosen expert
        kept = (slot < c).to(x.dtype)  # over capacity: dropped for that expert
        slot_1h = F.one_hot(slot.clamp(max=c - 1), c).to(x.dtype)  # [G, S, k, C]
        pick = choice.to(x.dtype) * kept.unsqueeze(-1)  # [G, S, k, E]
        dispatch = torch.einsum("gske,gskc->gsec", pick, slot_1h)
        combine = torch.einsum("gske,gskc->gsec", pick * gates.unsqueeze(-1), slot_1h)
        # load balance (Switch eq. 4, per group as GShard): E * sum_e f_e * P_e
        f = choice[:, :, 0, :].to(x.dtype).mean(dim=1)  # [G, E] fraction of first choices
        p = probs.mean(dim=1)  # [G, E] mean router probability
        aux = e * (f * p).sum(dim=-1).mean()
        return dispatch, combine, aux

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dispatch, combine, aux = self.route(x)
        xe = torch.einsum(DISPATCH, dispatch, x)  # [E, G, C, d]: split on g, then (all-to-all) on e under EP
        h = F.silu(torch.einsum(EXPERT_IN, xe, self.w_gate)) * torch.einsum(EXPERT_IN, xe, self.w_up)
        ye = torch.einsum(EXPERT_OUT, h, self.w_down)  # [E, G, C, d]
        return torch.einsum(COMBINE, combine, ye), aux


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.eps)
        self.attn = Attention(cfg)  # reads n_head, n_kv_head, d_model: the Llama attention
        self.moe_norm = RMSNorm(cfg.d_model, cfg.eps)
        self.moe = MoELayer(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        y, aux = self.moe(self.moe_norm(x))
        return x + y, aux


class MoE(nn.Module):
    """``forward(ids)`` gives logits; ``forward(ids, labels)`` the LM loss plus ``aux_loss_coef`` times the summed
    load-balancing losses of the layers."""

    def __init__(self, cfg: MoEConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or MoEConfig()
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
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        aux = None
        for block in self.blocks:
            x, a = block(x, cos, sin)
            aux = a if aux is None else aux + a
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        lm = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
        return lm + self.cfg.aux_loss_coef * aux
