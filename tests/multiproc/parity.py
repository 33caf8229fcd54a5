"""The parity check shared by multi-process tests: one process vs autopart on N ranks, 3 AdamW steps."""

from __future__ import annotations

import torch

import autopart

STEPS = 3
# Adam divides by sqrt(v) + eps: an entry whose gradient is about eps moves by ~lr * noise / (4 eps), so float
# noise from summing in another order (micro-batches, shards) is amplified most where gradients are small (a key
# bias that softmax ignores gets ~1e-11 gradients; an embedding row first used at step 2). Measured: 1.05e-5 on a
# pipelined 4-layer GPT at eps=1e-6; 1.19e-5 on HF Mamba-2 (2 groups, tp2, transformers 5.25) at eps=1e-4, whose
# first-step gradients agree to 6e-7 relative. eps=1e-3 caps the gain at lr / (4 eps) = 2.5 and makes the check
# more sensitive to a wrongly scaled gradient, not less: an entry with |g| ~ eps moves in proportion to g.
OPT = {"lr": 1e-2, "eps": 1e-3}


def make_model(name: str, layers: int = 2):
    torch.manual_seed(0)
    if name == "gpt":
        from autopart.models import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=128, max_seq_len=32, n_layer=layers, n_head=4, d_model=32))
    if name == "llama":
        from autopart.models import Llama, LlamaConfig

        return Llama(LlamaConfig(vocab_size=128, max_seq_len=32, n_layer=layers, n_head=4, n_kv_head=2, d_model=32,
                                 d_ff=64))
    if name == "hf-gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=layers, n_head=4, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg)
    if name == "hf-llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
        return LlamaForCausalLM(cfg)
    if name == "hf-gemma":  # RMSNorm's type_as
        from transformers import GemmaConfig, GemmaForCausalLM

        return GemmaForCausalLM(GemmaConfig(head_dim=8, **_HF_LLAMALIKE, num_hidden_layers=layers))
    if name == "hf-phi3":  # fused qkv_proj sliced into q, k, v and gate_up_proj chunked: split in blocks (Strided)
        from transformers import Phi3Config, Phi3ForCausalLM

        return Phi3ForCausalLM(Phi3Config(**{**_HF_LLAMALIKE, "num_key_value_heads": 4}, num_hidden_layers=layers,
                                          resid_pdrop=0.0, embd_pdrop=0.0))
    if name == "hf-phi3-gqa":  # grouped-query: qkv_proj's blocks of unequal lengths (q 32, k 16, v 16)
        from transformers import Phi3Config, Phi3ForCausalLM

        return Phi3ForCausalLM(Phi3Config(**_HF_LLAMALIKE, num_hidden_layers=layers, resid_pdrop=0.0,
                                          embd_pdrop=0.0))
    if name == "hf-falcon":  # FalconLinear's weight.T (numpy_T), fused_qkv[:, :, [-2]] (index.Tensor)
        from transformers import FalconConfig, FalconForCausalLM

        return FalconForCausalLM(FalconConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                              hidden_dropout=0.0, attention_dropout=0.0, **_HF_COMMON))
    if name == "hf-t5":  # labels shifted right by in-place writes into new_zeros (functionalized by trace)
        from transformers import T5Config, T5ForConditionalGeneration

        return T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=layers,
                                                   num_decoder_layers=layers, num_heads=4, dropout_rate=0.0,
                                                   use_cache=False, pad_token_id=0, eos_token_id=1,
                                                   decoder_start_token_id=0))
    if name == "hf-mamba":  # in_proj(u).transpose(1, 2).chunk(2, dim=1), a depthwise nn.Conv1d, a scan loop
        from transformers import MambaConfig, MambaForCausalLM

        return MambaForCausalLM(MambaConfig(hidden_size=32, state_size=8, num_hidden_layers=layers, expand=2,
                                            conv_kernel=4, **_HF_COMMON))
    if name == "hf-mamba2":  # the slow path's conv1d, zero pads, repeat_interleave
        from transformers import Mamba2Config, Mamba2ForCausalLM

        return Mamba2ForCausalLM(Mamba2Config(hidden_size=32, state_size=8, num_hidden_layers=layers, expand=2,
                                              num_heads=8, head_dim=8, n_groups=1, conv_kernel=4, chunk_size=8,
                                              use_cache=False, vocab_size=128, bos_token_id=0, eos_token_id=0,
                                              pad_token_id=0))
    if name == "hf-mamba2-g2":  # 2 groups of B and C: in_proj's xBC cut again into x, B, C after the convolution
        from transformers import Mamba2Config, Mamba2ForCausalLM

        return Mamba2ForCausalLM(Mamba2Config(hidden_size=32, state_size=8, num_hidden_layers=layers, expand=2,
                                              num_heads=8, head_dim=8, n_groups=2, conv_kernel=4, chunk_size=8,
                                              **_HF_COMMON))
    if name == "hf-mixtral":  # experts dispatched by sort/histc/grouped_mm over all tokens: a token-local node
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
                                                num_hidden_layers=layers, **_HF_LLAMALIKE))
    if name == "hf-deepseek-v3":  # group-limited routing, a shared expert, MLA attention
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        return DeepseekV3ForCausalLM(DeepseekV3Config(
            n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
            n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, num_hidden_layers=layers, **{**_HF_LLAMALIKE, "num_key_value_heads": 4}))
    if name == "routed":
        return _Routed(layers)
    if name == "inplace":
        return _InPlace(layers)
    if name == "unruled":
        return _Unruled(layers)
    if name == "moe":
        from autopart.models.moe import MoE, MoEConfig

        return MoE(MoEConfig(vocab_size=128, max_seq_len=32, n_layer=layers, n_head=4, n_kv_head=2, d_model=32,
                             d_ff=64, n_expert=8, top_k=2))
    raise ValueError(name)


_HF_COMMON = dict(vocab_size=128, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_HF_LLAMALIKE = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=32, attention_dropout=0.0, **_HF_COMMON)


class _InPlace(torch.nn.Module):
    """A language model writing into a view of a value it computed (``buf[:, 1:] = h[:, :-1]``, a shift as T5's
    ``_shift_right``) and into a buffer (a step counter): the in-place writes that ``trace`` functionalizes."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(128, 32)
        self.up = torch.nn.ModuleList(torch.nn.Linear(32, 64) for _ in range(layers))
        self.down = torch.nn.ModuleList(torch.nn.Linear(64, 32) for _ in range(layers))
        self.head = torch.nn.Linear(32, 128)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, ids, labels=None):
        x = self.emb(ids)
        for up, down in zip(self.up, self.down):
            h = torch.relu(up(x))
            shifted = torch.zeros_like(h)
            shifted[:, 1:] = h[:, :-1]  # each position also sees the previous one's features
            x = x + down(h + shifted)
        self.calls += 1
        logits = self.head(x)
        if labels is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class _Unruled(torch.nn.Module):
    """A language model with an op autopart has no sharding rule for (``cumprod``) on its batch path: under a
    data-parallel role its input is gathered, it runs whole on every rank, and its output is split again."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(128, 32)
        self.mix = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(layers))
        self.head = torch.nn.Linear(32, 128)

    def forward(self, ids, labels=None):
        x = self.emb(ids)
        for mix in self.mix:
            gate = torch.cumprod(torch.sigmoid(mix(x)), dim=1)  # a decaying gate along the sequence
            x = x + gate * x
        logits = self.head(x)
        if labels is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class LoopExperts(torch.nn.Module):
    """Top-1 experts dispatched by a Python loop over the experts, each gathering its tokens with ``nonzero``: a
    data-dependent shape ``torch.export`` cannot trace, declared token-local (``autopart.register_token_local``) so
    that it runs as one node, on each rank's own tokens under data parallelism."""

    def __init__(self, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.router = torch.nn.Linear(d, n, bias=False)
        self.w = torch.nn.Parameter(torch.randn(n, d, d) / d ** 0.5)

    def forward(self, x):
        probs = torch.softmax(self.router(x), dim=-1)
        gate, choice = probs.max(dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.w.shape[0]):
            idx = (choice == e).nonzero().squeeze(-1)
            out = out.index_add(0, idx, (x[idx] @ self.w[e]) * gate[idx, None])
        return out


class _Routed(torch.nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(128, 32)
        self.experts = torch.nn.ModuleList(LoopExperts() for _ in range(layers))
        self.head = torch.nn.Linear(32, 128)

    def forward(self, ids, labels=None):
        x = self.emb(ids)
        for experts in self.experts:
            x = x + experts(x.flatten(0, 1)).view_as(x)
        logits = self.head(x)
        if labels is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


autopart.register_token_local(LoopExperts)  # every process that imports this module (the spawned ranks too)


def forward_only_kwargs(name: str, ids: torch.Tensor) -> dict:
    """What the forward-only call needs beside the ids (an encoder-decoder's decoder inputs)."""
    return {"decoder_input_ids": ids} if name == "hf-t5" else {}


def batches(steps: int = STEPS, b: int = 4, s: int = 16, vocab: int = 128):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (b, s), generator=g) for _ in range(steps)]


def loss_of(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def reference(name: str, layers: int = 2):
    model = make_model(name, layers)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    losses = []
    for ids in batches():
        loss = loss_of(model(ids, labels=ids))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        out = model(batches()[0], **forward_only_kwargs(name, batches()[0]))
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}, logits


def logits_of(out) -> torch.Tensor:
    """The logits of a forward's output: itself, a ModelOutput's ``logits``, or a tuple's first element."""
    return out if isinstance(out, torch.Tensor) else out.logits if hasattr(out, "logits") else out[0]


def reference_clipped(name: str, layers: int = 2, max_norm: float = 0.5,
                      norm_type: float = 2.0) -> tuple[list[float], torch.nn.Module]:
    """One process, gradients clipped to ``max_norm``: per step the loss then the global gradient norm (of
    ``norm_type``) before clipping, and the trained model."""
    model = make_model(name, layers)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    out = []
    for ids in batches():
        loss = loss_of(model(ids, labels=ids))
        loss.backward()
        out.append(loss.item())
        out.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm,
                                                                norm_type=norm_type)))
        opt.step()
        opt.zero_grad()
    return out, model


def reference_master(name: str, dtype: torch.dtype, layers: int = 2, from_step: int = 0):
    """``reference`` with the optimizer stepping ``dtype`` copies of the weights (master weights), cast back; from
    step ``from_step`` on, the steps before stepping the weights themselves (a run that resumed with master weights
    from a checkpoint saved without)."""
    model = make_model(name, layers)
    params = list(model.parameters())
    first = torch.optim.AdamW(params, **OPT)
    losses = []
    for step, ids in enumerate(batches()):
        loss = loss_of(model(ids, labels=ids))
        loss.backward()
        losses.append(loss.item())
        if step < from_step:
            first.step()
            first.zero_grad()
            continue
        if step == from_step:  # the master copies start from the weights, Adam's state from the plain optimizer's
            master = [p.detach().to(dtype).requires_grad_() for p in params]
            opt = torch.optim.AdamW(master, **OPT)
            opt.load_state_dict(first.state_dict())
        with torch.no_grad():
            for p, m in zip(params, master):
                m.grad = p.grad.to(dtype)
            opt.step()
            for p, m in zip(params, master):
                p.copy_(m)
                p.grad = None
    with torch.no_grad():
        out = model(batches()[0])
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}, logits


def train(pm, opt) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``STEPS`` steps of ``pm`` with ``opt`` on ``batches()``: the losses, then the gathered parameters."""
    losses = []
    for ids in batches():
        losses.append(pm.forward_backward(ids, labels=ids).item())
        opt.step()
        opt.zero_grad()
    return losses, {k: v.clone() for k, v in pm.full_state_dict().items()}


def distributed(name: str, shape: tuple, names: tuple, roles: dict, local_batch: bool = False,
                checkpoint: dict[str, str] | str | None = None, pipeline: dict | str | None = None,
                layers: int = 2, pins: dict[str, str] | None = None, zero: int | None = None):
    model = make_model(name, layers)
    model.train()
    mesh = autopart.mesh(shape, names)
    ids0 = batches()[0]
    pm = autopart.parallelize(model, mesh, (ids0,), {"labels": ids0}, roles=roles, local_batch=False,
                              checkpoint=checkpoint, pipeline=pipeline, pins=pins, zero=zero)
    losses, full = train(pm, torch.optim.AdamW(pm.parameters(), **OPT))
    # forward only, a signature the plan was not traced for: planned on first use
    out = pm(batches()[0], **forward_only_kwargs(name, batches()[0]))
    logits = logits_of(out)
    return losses, full, str(pm.plan), pm.plan.to_json(), logits.detach()


def check(name: str, results, ref) -> None:
    ref_losses, ref_params, ref_logits = ref
    for rank, (losses, params, plan_text, _, logits) in enumerate(results):
        out = logits if isinstance(logits, torch.Tensor) else logits[0]
        # logits are O(1)-O(10) values summed in another order; the 1e-5 spec is on loss and parameters (above)
        torch.testing.assert_close(out, ref_logits, rtol=1e-5, atol=5e-5,
                                   msg=lambda m, r=rank, t=plan_text: f"{name} rank {r}: forward-only logits: {m}\n{t}")
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= 1e-5, f"{name} rank {rank} step {step}: loss {a} vs single-process {b}\n{plan_text}"
        for k, v in ref_params.items():
            assert k in params, f"{name}: parameter {k} missing from full_state_dict"
            err = (params[k] - v).abs().max().item()
            assert err <= 1e-5, f"{name} rank {rank}: parameter {k} differs by {err} after {STEPS} steps\n{plan_text}"
