"""What-if planning: plan a model described by family and size (or built by a factory) for a cluster you may not
have, and read the plan as the numbers practitioners compare -- step time, tokens/s, TFLOP/s per GPU and MFU,
memory per GPU by kind, communication by kind -- plus the design-guide sweep (model size x GPU count -> which
strategy wins, checked against published practice).

Everything runs on the ``meta`` device: no weights are allocated and no process group is needed (planning reads
shapes only; ``autopart.plan`` never communicates). The mesh views of one ``advise`` are planned side by side in
forked processes, one per core (``jobs``; ``autopart.forked``).

Definitions (shared/REFERENCE.md):

* model FLOPs per step = 6 N T + attention, N the parameters that multiply activations (every parameter but
  embedding tables used only as lookups; a tied embedding/LM head counts once, as the head; MoE expert weights
  scaled by top_k / n_expert), T = batch x sequence tokens, attention 3 x 4 B H S_q S_k D per attention call
  (forward + backward of QK^T and AV, the whole S x S square as Megatron counts it: 72 B s L h^2 (1 + s/(6h) +
  V/(12 L h)) for a GPT). Recomputation is not model FLOPs.
* TFLOP/s per GPU = model FLOPs / step time / GPUs; MFU = that / the device's peak dense FLOP/s.
* memory per GPU by kind: at the peak the plan's memory row binds (the larger of end of forward and end of backward;
  for a pipeline, the fullest stage). Kinds sum to the peak.
* communication by kind, per GPU and step: the plan's recorded conversions (``plan.collectives``, one record per
  edge with its per-axis forward and backward collectives) re-priced step by step with ``autopart.cost``, plus the
  gradient reduction after backward (``plan.reduced``) and, for a pipeline, the stage-to-stage send/recv. Volume is
  the bytes each GPU puts on the wire (nccl-tests bus bytes: all-reduce 2(n-1)/n S, all-gather, reduce-scatter,
  all-to-all (n-1)/n S, send/recv S). Without a pipeline the times sum to ``plan.predicted["comm_s"]``; with one
  they are a stage's average (the stage plan's records over the degree; parameter gathers once per micro-batch).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import math
import re
import signal
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from autopart import forked
from autopart.cost import Cluster
from autopart.cost.cluster import PRESETS, load_preset
from autopart.cost.cluster import preset as make_preset
from autopart.cost.comm import collective_time
from autopart.cost.compute import dtype_peak_flops
from autopart.placement import Replicate, Shard, is_shard, parse_spec
from autopart.planner import NoPlanFits, PlanOptions, _local_bytes
from autopart.solver.ilp import SolverTimeout

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
# collectives inside ops' lowerings and on graph outputs, which the plan records as node time, not as edges:
# vocab-parallel cross-entropy's all-reduces, ZeRO-1's parameter all-gather after the step, context-parallel
# attention's K/V exchange, output gathers. Their time is known per node, their kind and bytes are not recorded
INSIDE_OPS = "inside_ops"
MEMORY_KINDS = ("parameters", "gradients", "optimizer_states", "activations", "kv_cache", "other")

# family -> (module, model class, config class). moe and mamba are imported when asked for: their modules may not
# exist in every checkout
FAMILIES = {
    "gpt": ("autopart.models.gpt", "GPT", "GPTConfig"),
    "llama": ("autopart.models.llama", "Llama", "LlamaConfig"),
    "moe": ("autopart.models.moe", "MoE", "MoEConfig"),
    "mamba": ("autopart.models.mamba", "Mamba", "MambaConfig"),
}

# named sizes from published configurations. gpt: GPT-3 (Brown et al. 2020, Table 2.1; vocabulary padded to 50304,
# 128-channel heads) and the 1T model of Narayanan et al. 2021 (Table 1); llama: Llama 2 (7b, 13b, 70b) and Llama 3
# / 3.1 / 3.2 (1b, 8b, 405b) as published in their model cards / config.json
SIZES: dict[str, dict[str, dict[str, int]]] = {
    "gpt": {
        "125m": dict(vocab_size=50304, n_layer=12, n_head=12, d_model=768),
        "350m": dict(vocab_size=50304, n_layer=24, n_head=16, d_model=1024),
        "1.3b": dict(vocab_size=50304, n_layer=24, n_head=16, d_model=2048),
        "2.7b": dict(vocab_size=50304, n_layer=32, n_head=32, d_model=2560),
        "6.7b": dict(vocab_size=50304, n_layer=32, n_head=32, d_model=4096),
        "13b": dict(vocab_size=50304, n_layer=40, n_head=40, d_model=5120),
        "175b": dict(vocab_size=50304, n_layer=96, n_head=96, d_model=12288),
        "1t": dict(vocab_size=50304, n_layer=128, n_head=160, d_model=25600),
    },
    "llama": {
        "1b": dict(vocab_size=128256, n_layer=16, n_head=32, n_kv_head=8, d_model=2048, d_ff=8192),
        "7b": dict(vocab_size=32000, n_layer=32, n_head=32, n_kv_head=32, d_model=4096, d_ff=11008),
        "8b": dict(vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336),
        "13b": dict(vocab_size=32000, n_layer=40, n_head=40, n_kv_head=40, d_model=5120, d_ff=13824),
        "70b": dict(vocab_size=32000, n_layer=80, n_head=64, n_kv_head=8, d_model=8192, d_ff=28672),
        "405b": dict(vocab_size=128256, n_layer=126, n_head=128, n_kv_head=8, d_model=16384, d_ff=53248),
    },
}

# user-facing override -> config field
OVERRIDES = {"layers": "n_layer", "hidden": "d_model", "heads": "n_head", "kv_heads": "n_kv_head",
             "vocab": "vocab_size", "ffn": "d_ff", "experts": "n_expert", "top_k": "top_k"}

SWEEP_SIZES = ("llama:1b", "llama:8b", "llama:70b", "llama:405b", "gpt:1t") + (
    ("mamba:1.4b", "mamba:2.8b") if importlib.util.find_spec("autopart.models.mamba") else ())
SWEEP_GPUS = (8, 64, 512, 4096)
# memory one sweep cell may take, tracing and planning in its own process: Llama-405B on 64 H100 nodes, the default
# grid's largest graph, peaked at 1.16 GB resident planned in one process (its mesh views one after another)
SWEEP_CELL_BYTES = 2 * 2**30
# how ``sweep`` ends the line it logs for a cell whose process died (that line is not a cell's result)
RETRIED = "planned again alone after the other cells"
# memory one mesh view may take planned in a forked process (beside the trace it shares with this one): the largest
# of Llama-405B's four views on 64 nodes peaked at 0.68 GB resident, shared pages included
VIEW_BYTES = 2**30
# what-if planning's ILP gap (``advise``, ``sweep``): a plan proven within 1% of the best its model allows. At 0.1%
# (``autopart.plan``'s) HiGHS spent most of Llama-8B's and Llama-70B's advise closing the last fraction of a percent
# after it already held the plan it returned (benchmarks/README.md, "What-if planning")
ADVISE_GAP = 0.01


class PlanTimeout(Exception):
    """Planning ran past the per-plan cap."""


# a view without a plan for want of time (the solver's limit, or ``max_plan_s``), not because it does not fit
_TIMEOUTS = (SolverTimeout, PlanTimeout)


# ---- model -----------------------------------------------------------------------------------------------------
def _family_module(family: str):
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; families are {sorted(FAMILIES)}, or pass a factory "
                         "'module:function' that returns an nn.Module")
    mod_name, cls_name, cfg_name = FAMILIES[family]
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name == mod_name:
            raise ValueError(f"model family {family!r} needs {mod_name.replace('.', '/')}.py, which this autopart "
                             f"does not have yet; use gpt or llama, or pass a factory 'module:function'") from e
        raise
    return getattr(mod, cls_name), getattr(mod, cfg_name)


def _split_model(model: str, size: str | None) -> tuple[str, str | None]:
    """``"llama:70b"`` / ``"llama-70b"`` / (``"llama"``, ``"70b"``) -> (family, size). A size in ``model`` and
    another in ``size`` contradict each other: an error, not one of them silently."""
    family, named = model, None
    if ":" in model:
        family, _, named = model.partition(":")
    else:
        m = re.fullmatch(r"([a-z]+)-(.+)", model)
        if m and m.group(1) in FAMILIES:
            family, named = m.group(1), m.group(2)
    if named and size and named.lower() != size.lower():
        raise ValueError(f"model {model!r} names size {named!r} but size {size!r} (--size) was also given: which "
                         f"one is meant? Give the size once: --model {family}:{size}, or --model {family} "
                         f"--size {size}")
    return family, named or size


def model_config(model: str = "llama", size: str | None = None, seq: int | None = None, **overrides: int | None):
    """The config dataclass of ``family`` at a named size, with overrides (``layers``, ``hidden``, ``heads``,
    ``kv_heads``, ``vocab``, ``ffn``, ``experts``, ``top_k``) applied. Returns (family, model class, config)."""
    family, size = _split_model(model, size)
    cls, cfg_cls = _family_module(family)
    cfg = cfg_cls()
    if size:
        key = size.lower()
        if key in SIZES.get(family, {}):
            cfg = dataclasses.replace(cfg, **SIZES[family][key])
        else:
            names = [key, f"{family}-{key}"]
            found, why = None, ""
            for n in names:
                try:
                    found = cfg_cls.preset(n)
                    break
                except (ValueError, AttributeError) as e:
                    why = str(e) if isinstance(e, ValueError) else why  # the preset's message lists its names
                    continue
            if found is None:
                known = sorted(SIZES.get(family, {}))
                raise ValueError(f"unknown {family} size {size!r}; named sizes are {known}"
                                 + (f" ({cfg_cls.__name__}.preset: {why})" if why else "")
                                 + "; or give --layers/--hidden/--heads ... to describe the model")
            cfg = found
    fields = {f.name for f in dataclasses.fields(cfg)}
    changes: dict[str, Any] = {}
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in OVERRIDES:
            raise ValueError(f"unknown model override {key!r}; overrides are {sorted(OVERRIDES)}")
        target = OVERRIDES[key]
        if target not in fields:
            raise ValueError(f"model family {family!r} has no {key!r} ({target}); its config fields are "
                             f"{sorted(fields)}")
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a whole number >= 1, got {value!r}")
        changes[target] = value
    if "n_head" in changes and "n_kv_head" in fields and "n_kv_head" not in changes and \
            changes["n_head"] % cfg.n_kv_head != 0:
        changes["n_kv_head"] = changes["n_head"]
    if seq is not None and "max_seq_len" in fields:
        changes["max_seq_len"] = max(seq, cfg.max_seq_len)
    if "bias" in fields:
        changes.setdefault("bias", False)
    try:
        cfg = dataclasses.replace(cfg, **changes)
    except ValueError as e:
        raise ValueError(f"{family} with {changes}: {e}") from e
    return family, cls, cfg


def load_factory(spec: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function (it returns an ``nn.Module``, or ``(module, example_inputs,
    example_kwargs)``)."""
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise ValueError(f"factory {spec!r}: write 'package.module:function'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"factory {spec!r}: cannot import {mod_name!r} ({e}); is it on PYTHONPATH?") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"factory {spec!r}: {mod_name} has no function {fn_name!r}")
    return fn


def _vocab_of(model: nn.Module) -> int:
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    v = getattr(cfg, "vocab_size", None)
    if v:
        return int(v)
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    raise ValueError("cannot tell the model's vocabulary (no cfg.vocab_size, no nn.Embedding): return "
                     "(model, example_inputs, example_kwargs) from the factory")


def build(model: str | None = "llama", size: str | None = None, *, factory: str | Callable | None = None,
          batch: int = 8, seq: int = 2048, dtype: torch.dtype = torch.bfloat16, inference: bool = False,
          device: str | torch.device = "meta", **overrides) -> tuple:
    """(description, module on ``device`` (``meta``: no memory; ``cpu`` for real weights, as ``autopart verify``
    runs them), example_inputs, example_kwargs, config or None). ``inference``: the module frozen
    (``requires_grad_(False)``: planned forward-only) and called without labels, returning logits (a factory's own
    example kwargs are kept)."""
    cfg = None
    with torch.device(device):
        if factory is not None:
            fn = load_factory(factory) if isinstance(factory, str) else factory
            out = fn()
            if isinstance(out, tuple):
                module, inputs, kwargs = (list(out) + [None, None])[:3]
                inputs, kwargs = tuple(inputs or ()), dict(kwargs or {})
            else:
                module, inputs, kwargs = out, None, None
            if not isinstance(module, nn.Module):
                raise ValueError(f"factory {factory!r} returned {type(module).__name__}, not an nn.Module")
            module = module.to(device=device, dtype=dtype)
            if inputs is None:
                ids = torch.randint(0, _vocab_of(module), (batch, seq))
                inputs, kwargs = (ids,), {"labels": ids}
            name = factory if isinstance(factory, str) else getattr(factory, "__name__", "factory")
            cfg = getattr(module, "cfg", None)
        else:
            family, size = _split_model(model or "llama", size)
            family, cls, cfg = model_config(family, size, seq=seq, **overrides)
            module = cls(cfg).to(dtype)
            ids = torch.randint(0, cfg.vocab_size, (batch, seq))
            inputs, kwargs = (ids,), {"labels": ids}
            name = f"{family}:{size}" if size else family
            if any(v is not None for v in overrides.values()):
                name += " (" + ", ".join(f"{k}={v}" for k, v in overrides.items() if v is not None) + ")"
    if inference:
        module.requires_grad_(False)
        if set(kwargs) == {"labels"} and kwargs["labels"] is inputs[0]:  # the defaults above: logits, not a loss
            kwargs = {}
    return name, module, inputs, kwargs, cfg


def model_flops(model: nn.Module, traced, tokens: int, inference: bool = False,
                kv_cache_tokens: int = 0) -> tuple[float, int, int]:
    """(model FLOPs per step, parameters, parameters that multiply activations): 6 N T + attention (module doc).
    ``inference``: the forward alone, 2 N T + attention's forward, each query attending to ``kv_cache_tokens``
    cached positions where given (decoding), else to the traced keys."""
    return _flops(model, traced, tokens, inference, kv_cache_tokens, causal_half=False)


def kernel_flops(model: nn.Module, traced, tokens: int, inference: bool = False, kv_cache_tokens: int = 0) -> float:
    """``model_flops`` with attention counted as causal kernels run it: a call with ``is_causal`` computes half of
    the S x S square (flash attention skips the masked blocks; ``autopart.cost.compute`` prices it so). Not the
    published convention (``model_flops``: Megatron's and torchtitan's count the whole square, which overestimates
    causal attention), but what the GPUs can do at most ``Device.mfu`` of peak. Recomputation is not counted.
    Decoding against a K/V cache (``kv_cache_tokens``) attends to every cached position: not halved."""
    return _flops(model, traced, tokens, inference, kv_cache_tokens, causal_half=not kv_cache_tokens)[0]


def _causal(node) -> bool:
    from autopart.cost.compute import _arg

    try:
        return bool(_arg(node.target, node.args, node.kwargs, "is_causal", False))
    except (IndexError, TypeError):
        return False


def _flops(model: nn.Module, traced, tokens: int, inference: bool, kv_cache_tokens: int,
           causal_half: bool) -> tuple[float, int, int]:
    seen: set[int] = set()
    linear_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookup_only = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} - linear_ids
    cfg = getattr(model, "cfg", None)
    n_expert, top_k = getattr(cfg, "n_expert", 0) or 0, getattr(cfg, "top_k", 0) or 0
    total = matmul = 0.0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if id(p) in lookup_only:
            continue
        stacked = p.dim() >= 3 and p.shape[0] == n_expert  # [E, d, f] expert weights (autopart.models.moe)
        scale = top_k / n_expert if n_expert and (stacked or "expert" in name) else 1.0
        matmul += p.numel() * scale
    attention = 0.0
    for n in traced.graph.nodes:
        if n.op == "call_function" and "scaled_dot_product" in str(n.target) and "backward" not in str(n.target):
            q, k = n.args[0].meta["val"], n.args[1].meta["val"]
            *batch, s_q, d = q.shape
            half = 0.5 if causal_half and _causal(n) else 1.0
            if inference:
                attention += half * 4 * math.prod(batch) * s_q * (kv_cache_tokens or k.shape[-2]) * d
            else:
                attention += half * 3 * 4 * math.prod(batch) * s_q * k.shape[-2] * d
    return (2 if inference else 6) * matmul * tokens + attention, int(total), int(matmul)


# ---- reading a plan --------------------------------------------------------------------------------------------
def _bus_bytes(kind: str, nbytes: float, n: int) -> float:
    if n == 1:
        return 0.0
    return nbytes * {"all_reduce": 2 * (n - 1) / n, "send_recv": 1.0}.get(kind, (n - 1) / n)


def _producer(node):
    if node.op == "call_function" and getattr(node.target, "__name__", "") == "getitem":
        return node.args[0], node.args[1]
    return node, None


def edge_comm(plan, traced, cluster: Cluster) -> tuple[dict, list[float]]:
    """Re-price ``plan.collectives`` step by step with the planner's own ``transition_time`` (one mesh axis at a
    time). Returns ({"activations": ({kind: s}, {kind: bus bytes}), "parameters": (...),
    "activation_latency": {kind: s}}, seconds per record): conversions of parameters (ZeRO gathers) apart from
    those of activations, the latency of the activations' (``rec["latency_s"]``, what each micro-batch pays) by
    kind, and each record's time (equal to ``rec["time_s"]``). A step's time is shared by its forward and backward
    collectives as their own prices are (equal under the alpha-beta model, all-gather = reduce-scatter, all-reduce
    both ways, all-to-all both ways, except a ZeRO-3 gradient's reduce-scatter summed in a wider
    ``reduce_dtype``), less what a collective matmul hides of it (``rec["tp_overlap_hidden_s"]``, of step
    ``rec["tp_overlap_step"]``). The backward all-gathers of a kept shard (``rec["regather_s"]``: sequence
    parallelism's activations, which the step pays beside the record's time) count as activations' all-gathers."""
    from autopart.planner import reduce_scale, saves_input, transition_time
    from autopart.strategy.registry import tensor_inputs

    nodes = {n.name: n for n in traced.graph.nodes}
    mesh = cluster.mesh_shape
    t: dict[str, float] = defaultdict(float)
    b: dict[str, float] = defaultdict(float)
    param_t: dict[str, float] = defaultdict(float)
    param_b: dict[str, float] = defaultdict(float)
    lat: dict[str, float] = defaultdict(float)
    per_record = []
    for rec in plan.collectives:
        user, value = nodes[rec["user"]], nodes[rec["value"]]
        u, idx = _producer(value)
        out = plan.nodes[u.name]["output"]
        src = parse_spec(out[idx] if isinstance(out, list) else out)
        dst = parse_spec(plan.nodes[user.name]["inputs"][tensor_inputs(user).index(value)])
        is_param = plan.nodes[u.name]["op"] == "param"
        zero3 = is_param and plan.zero.get(traced.params.get(u.name, ""), 0) == 3
        j = tensor_inputs(user).index(value)
        regather = zero3 and saves_input(user, j)
        val = value.meta["val"]
        cur = list(src)
        rec_t = 0.0
        rec_kinds: dict[str, float] = defaultdict(float)
        for step, (axis, fwd, bwd) in enumerate(rec["steps"]):
            nxt = list(cur)
            nxt[axis] = dst[axis]
            split = tuple(i == axis and bwd in ("all_reduce", "reduce_scatter") for i in range(len(mesh)))
            dt = transition_time(val, tuple(cur), tuple(nxt), split, bwd != "none", cluster, regather=regather,
                                 chained=zero3, reduce_dtype=plan.options.get("reduce_dtype"))
            if step == rec.get("tp_overlap_step"):
                dt -= rec["tp_overlap_hidden_s"]
            kinds = [(k, i == 1) for i, k in enumerate((fwd, bwd)) if k in KINDS] + \
                ([("all_gather", False)] if regather and fwd == "all_gather" else [])
            full = list(cur)
            full[axis] = Replicate()
            nbytes = _local_bytes(val, full, mesh)
            sents = []
            for kind, backward in kinds:
                sent = nbytes / mesh[axis] if kind == "all_to_all" else nbytes  # a rank's buffer is its shard
                if zero3 and backward and kind == "reduce_scatter":  # the gradient, summed in reduce_dtype
                    sent *= reduce_scale(val.dtype, plan.options.get("reduce_dtype"))
                sents.append(sent)
            link = cluster.link(axis).in_chain() if zero3 else cluster.link(axis)
            own = [collective_time(kind, sent, mesh[axis], link) for (kind, _), sent in zip(kinds, sents)]
            total = sum(own)
            for (kind, _), sent, own_t in zip(kinds, sents, own):  # dt shared as the collectives' own prices
                share = dt * own_t / total if total > 0 else dt / len(kinds)
                (param_t if is_param else t)[kind] += share
                rec_kinds[kind] += share
                (param_b if is_param else b)[kind] += _bus_bytes(kind, sent, mesh[axis])
            rec_t += dt
            cur = nxt
        if rec.get("regather_s"):  # the users that keep the shard gather it again in backward (sequence parallel)
            gathers = [(axis, fwd) for axis, fwd, _ in rec["steps"] if fwd == "all_gather"]
            t["all_gather"] += rec["regather_s"]
            if gathers:
                axis = gathers[-1][0]
                b["all_gather"] += rec.get("regather", 1) * _bus_bytes(
                    "all_gather", _local_bytes(val, tuple(dst), mesh), mesh[axis])
        if not is_param and rec.get("latency_s") and rec_t > 0:  # its latency, shared as its time is
            for kind, kt in rec_kinds.items():
                lat[kind] += rec["latency_s"] * kt / rec_t
        per_record.append(rec_t)
    return {"activations": (t, b), "parameters": (param_t, param_b), "activation_latency": lat}, per_record


def gradient_comm(plan, traced, cluster: Cluster) -> tuple[float, float]:
    """(seconds, bus bytes) of the gradient reduction (all-reduce; ZeRO-1/2's reduce-scatter), all of it, overlapped
    or not (``plan.predicted["hidden_comm_s"]`` says how much backward hides): the planner's buckets
    (``planner.gradient_reduction``); the bytes per set of reduced axes. ``gradient_comm_by_kind`` splits it."""
    by_kind = gradient_comm_by_kind(plan, traced, cluster)
    return sum(t for t, _ in by_kind.values()), sum(b for _, b in by_kind.values())


def gradient_comm_by_kind(plan, traced, cluster: Cluster) -> dict[str, tuple[float, float]]:
    """``gradient_comm`` by the collective that runs it: {"all_reduce": (seconds, bus bytes), "reduce_scatter":
    (...)}; ZeRO-1/2 parameters' gradients are reduce-scattered, the others all-reduced. The planner buckets the two
    apart (``planner.gradient_reduction``: per set of reduced axes and ZeRO-1/2 or not), so the seconds add up to
    the whole reduction's."""
    from autopart.planner import gradient_reduction, param_nodes, reduce_scale

    mesh = cluster.mesh_shape
    node_of = param_nodes(traced)
    out = {}
    for kind, sliced in (("all_reduce", False), ("reduce_scatter", True)):
        reduced = {fqn: axes for fqn, axes in plan.reduced.items() if (plan.zero.get(fqn) in (1, 2)) == sliced}
        buckets: dict[tuple, float] = defaultdict(float)
        for fqn in reduced:
            val = node_of[fqn].meta["val"]
            buckets[tuple(reduced[fqn])] += _local_bytes(val, parse_spec(plan.params[fqn]), mesh) \
                * reduce_scale(val.dtype, plan.options.get("reduce_dtype"))  # summed in PlanOptions.reduce_dtype
        nbytes = 0.0
        for axes, size in buckets.items():
            for i in sorted(axes):
                nbytes += _bus_bytes(kind, size, mesh[i])
                size = size / mesh[i] if sliced else size
        secs = gradient_reduction(traced, plan.nodes, reduced, plan.zero, cluster, 1,
                                  plan.options.get("bucket_bytes", {}), plan.options.get("reduce_dtype"))[0] \
            if reduced else 0.0
        out[kind] = (secs, nbytes)
    return out


def zero_gather_bytes(plan, traced, cluster: Cluster) -> float:
    """Bus bytes of ZeRO-1/2's all-gather of the updated parameters after the step (``runtime/zero1.py``), per GPU:
    each parameter's padded slices gathered over the axes it is replicated on, one axis after the other as
    ``planner.zero1_gather_entry`` lays them out (the stage plan's whole model under a pipeline)."""
    from autopart.planner import param_nodes, zero1_gather_entry

    mesh = cluster.mesh_shape
    node_of = param_nodes(traced)
    total = 0.0
    for fqn, level in plan.zero.items():
        if level not in (1, 2) or fqn not in node_of:
            continue
        axes, _, nbytes = zero1_gather_entry(node_of[fqn].meta["val"], parse_spec(plan.params[fqn]), mesh)
        size = nbytes / math.prod(mesh[i] for i in axes)  # a rank's slice
        for i in axes:
            size *= mesh[i]
            total += _bus_bytes("all_gather", size, mesh[i])
    return total


def communication(plan, traced) -> dict[str, dict[str, float]]:
    """Per GPU and step, by collective kind: {"time_s", "bytes"} (module doc), plus "gradient_all_reduce" and
    "gradient_reduce_scatter" (the gradient reduction's part of all_reduce, and ZeRO-1/2's of reduce_scatter,
    reported apart with ``total_s``, all of its time, hidden behind backward or not) and ``INSIDE_OPS`` (time
    only). ``time_s`` is exposed time: what the step waits for (collectives hidden behind compute, a gradient bucket
    behind the backward still to come or a collective matmul's overlap, are not in it). Without a pipeline the times
    of ``KINDS`` and ``INSIDE_OPS`` sum to ``plan.predicted["comm_s"]``."""
    stage = Cluster.from_json(plan.cluster)
    parts, _ = edge_comm(plan, traced, stage)
    (at, ab), (pt, pb), al = parts["activations"], parts["parameters"], parts["activation_latency"]
    grads = gradient_comm_by_kind(plan, traced, stage)
    gt = sum(t for t, _ in grads.values())
    pp = plan.pipeline

    def add_gradients(exposed: float, share: float) -> None:
        """The gradient reduction under the collective that runs it: ``exposed`` seconds (what the step waits for)
        split as the kinds' own times, their bytes and all their time (``total_s``) times ``share``."""
        for kind, (secs, nbytes) in grads.items():
            part = exposed * secs / gt if gt > 0 else 0.0
            out[kind]["time_s"] += part
            out[kind]["bytes"] += nbytes * share
            out[f"gradient_{kind}"] = {"time_s": part, "bytes": nbytes * share, "total_s": secs * share}

    out = {k: {"time_s": 0.0, "bytes": 0.0} for k in KINDS}
    inside = sum(r.get("time_s", 0.0) - r.get("compute_s", 0.0) for r in plan.nodes.values())
    inside_lat = sum(r.get("comm_latency_s", 0.0) for r in plan.nodes.values())  # each micro-batch pays it
    m = int(pp["micro_batches"]) if pp else int((plan.accumulation or {}).get("micro_batches", 1))
    out[INSIDE_OPS] = {"time_s": (inside + (m - 1) * inside_lat) / (int(pp["degree"]) if pp else 1), "bytes": None}
    if not pp:
        # gradient accumulation: a parameter's conversions (ZeRO-3's gathers) run once per micro-batch, as in a
        # pipeline; the activations' are the batch's in all, their latency paid by each (``planner.accumulated``)
        for k in KINDS:
            out[k]["time_s"] = at[k] + (m - 1) * al[k] + m * pt[k]
            out[k]["bytes"] = ab[k] + m * pb[k]
        # ZeRO-1/2's after-step all-gather: the node times (inside ops) hold the ILP's price of it; the step pays
        # what the next forward does not hide of the bucketed gather (``param_gather_s``)
        pred = plan.predicted
        priced = pred.get("param_gather_priced_s", 0.0)
        out[INSIDE_OPS]["time_s"] -= priced
        out["all_gather"]["time_s"] += pred.get("param_gather_s", 0.0) if "param_gather_priced_s" in pred else \
            pred.get("param_gather_latency_s", 0.0)
        out["all_gather"]["bytes"] += zero_gather_bytes(plan, traced, stage)
        add_gradients(gt - plan.predicted.get("hidden_comm_s", 0.0), 1.0)  # what backward does not hide
        return out
    p, m = int(pp["degree"]), int(pp["micro_batches"])
    for k in KINDS:  # the stage plan holds the whole model at the whole batch: a stage's share is 1/p of it
        out[k]["time_s"] = (at[k] + (m - 1) * al[k] + m * pt[k]) / p
        out[k]["bytes"] = (ab[k] + m * pb[k]) / p
    add_gradients(pp["gradient_reduction_s"], 1 / p)  # the exposed tail; bytes and total_s a stage's average
    out["all_gather"]["time_s"] += pp.get("param_gather_s", 0.0)  # ZeRO-1/2's after the step: what forward waits
    out["all_gather"]["bytes"] += zero_gather_bytes(plan, traced, stage) / p
    v = int(pp.get("virtual") or 1) if pp["schedule"] == "interleaved" else 1
    send = max(st.get("send_bytes", 0.0) for st in pp["stages"])
    out["send_recv"] = {"time_s": m * v * pp["p2p_s"], "bytes": 2 * m * v * send}
    return out


def memory(plan) -> dict[str, Any]:
    """Memory per GPU at the binding peak, by kind (``MEMORY_KINDS`` sum to ``peak``), and which moment binds."""
    pred = plan.predicted["memory_bytes"]
    if plan.pipeline:
        from autopart.pipelining import rank_memory

        per_rank = rank_memory(plan.pipeline["stages"])  # a rank holds all its chunks
        rank = max(per_rank, key=lambda r: per_rank[r]["total"])
        mb = per_rank[rank]
        sharding = plan.predicted.get("sharding_only", {}).get("memory_bytes", {})
        params = sharding.get("parameters", 0.0) + sharding.get("gathered_parameters", 0.0)
        opt = sharding.get("optimizer_states", 0.0)
        frac = params / (params + opt) if params + opt > 0 else 1.0
        # GPipe peaks before the gradients exist, or with one micro-batch's activations fewer (solver.pipeline
        # .stage_peak): the gradients present at the peak are what the total leaves beside states and activations
        grads = min(mb["gradients"], max(0.0, mb["total"] - mb["states"] - mb["activations"]))
        kv = mb.get("kv_cache", 0.0)  # inference: the K/V caches of the rank's blocks
        kinds = {"parameters": mb["states"] * frac, "gradients": grads, "optimizer_states": mb["states"] * (1 - frac),
                 "activations": mb["total"] - mb["states"] - grads - kv, "kv_cache": kv, "other": 0.0}
        return {"by_kind": kinds, "peak": mb["total"],
                "binds_at": f"pipeline rank {rank} of {plan.pipeline['degree']}: its states, gradients and the "
                            "activations of its micro-batches in flight",
                "note": "states split into parameters and optimizer states in the stage plan's ratio"}
    states = pred["parameters"] + pred["optimizer_states"] + pred.get("buffers", 0.0)
    fwd, bwd, opt = pred["peak_forward"], pred["peak_backward"], pred.get("peak_optimizer", 0.0)
    if opt > max(fwd, bwd):  # the optimizer step's temporaries (or ZeRO-1/2's gather buckets after it): "other"
        kinds = {"parameters": pred["parameters"], "gradients": pred["gradients"],
                 "optimizer_states": pred["optimizer_states"], "activations": 0.0, "kv_cache": 0.0,
                 "other": opt - states - pred["gradients"] + pred.get("buffers", 0.0)}
        at = "optimizer step (gradients, the step's temporaries or the ZeRO-1/2 parameter gather, activations freed)"
    elif fwd >= bwd:
        kv = pred.get("kv_cache", 0.0)  # inference: held by the attentions, in the forward's peak
        acc = pred.get("accumulated_gradients", 0.0)  # gradient accumulation: earlier micro-batches' gradients
        kinds = {"parameters": pred["parameters"] + pred["gathered_parameters"], "gradients": acc,
                 "optimizer_states": pred["optimizer_states"],
                 "activations": fwd - states - pred["gathered_parameters"] - kv - acc, "kv_cache": kv,
                 "other": pred.get("buffers", 0.0)}
        at = ("end of a later micro-batch's forward (its saved activations beside the gradients accumulated so far)"
              if "accumulated_gradients" in pred else "end of forward (saved activations, no gradients yet)")
    else:
        kinds = {"parameters": pred["parameters"], "gradients": bwd - states,
                 "optimizer_states": pred["optimizer_states"], "activations": 0.0, "kv_cache": 0.0,
                 "other": pred.get("buffers", 0.0)}
        at = "end of backward (gradients and one reduction bucket, activations freed)"
    return {"by_kind": kinds, "peak": pred["total"], "binds_at": at}


def _block_param(fqn: str) -> bool:
    return re.search(r"\.\d+\.", fqn) is not None


def strategy(plan, traced=None) -> dict[str, Any]:
    """What the plan does, in the usual words: degrees of data (dp), tensor (tp), pipeline (pp), context (cp)
    parallelism, ZeRO level, checkpointing, micro-batches; a short name (``DP``, ``ZeRO-3``, ``TP``, ``TP+PP+DP``)."""
    mesh = plan.mesh_shape
    gathered: set[tuple[str, int]] = set()
    for rec in plan.collectives:
        if plan.nodes.get(rec["value"], {}).get("op") == "param":
            for axis, fwd, _ in rec["steps"]:
                if fwd == "all_gather":
                    gathered.add((rec["value"], axis))
    node_of = {fqn: name for name, fqn in (traced.params.items() if traced is not None else ())}
    if not node_of:
        node_of = {fqn: "p_" + fqn.replace(".", "_") for fqn in plan.params}
    roles: list[set[str]] = [set() for _ in mesh]
    # the repeated blocks' parameters and nodes say what the plan does (embeddings and heads are often planned
    # apart); a model without numbered blocks (an MLP from a factory) is read from all of them
    blocks = any(_block_param(fqn) for fqn in plan.params)
    layered = any(r.get("layer") for r in plan.nodes.values())
    for fqn, spec in plan.params.items():
        if blocks and not _block_param(fqn):
            continue
        for i, p in enumerate(parse_spec(spec)):
            if is_shard(p) and mesh[i] > 1:
                roles[i].add("zero" if (node_of.get(fqn), i) in gathered else "tp")
    graph = {n.name: n for n in traced.graph.nodes} if traced is not None else {}

    def rank(name: str) -> int | None:  # the first input's number of dimensions, where the trace is at hand
        n = graph.get(name)
        a = n.args[0] if n is not None and n.args else None
        val = getattr(a, "meta", {}).get("val") if a is not None else None
        return val.dim() if isinstance(val, torch.Tensor) else None

    attn = [(k, r) for k, r in plan.nodes.items() if "scaled_dot_product" in r["op"] and (r["layer"] or not layered)]
    acts = attn or [(k, r) for k, r in plan.nodes.items() if (r["layer"] or not layered)
                    and ("linear" in r["op"] or "mm" in r["op"]) and r["inputs"]]
    for key, rec in acts:
        nd = None if attn else rank(key)
        for i, p in enumerate(parse_spec(rec["inputs"][0])):
            if not isinstance(p, Shard) or mesh[i] == 1:
                continue
            if p.dim == 0:
                roles[i].add("dp")
            elif attn:  # q [batch, heads, sequence, channels]
                if p.dim in (1, 2):
                    roles[i].add("tp" if p.dim == 1 else "cp")
            elif nd is not None:  # a matmul's input [batch, (sequence, ...,) features]
                roles[i].add("tp" if p.dim == nd - 1 else "cp")
            elif p.dim == 1:
                roles[i].add("cp")
    deg = {r: math.prod(n for n, rs in zip(mesh, roles) if r in rs) for r in ("dp", "tp", "cp")}
    links = [(x["alpha"], x["beta"]) for x in plan.cluster["links"]]
    fastest = min(b for _, b in links)
    pp = plan.pipeline or {}
    zero = max((v for k, v in plan.zero.items() if _block_param(k) or not blocks), default=0)
    out = {"dp": deg["dp"], "tp": deg["tp"], "cp": deg["cp"], "pp": int(pp.get("degree", 1)), "zero": zero,
           "axes": {f"{name}={n}": "+".join(sorted(rs)) or "idle" for name, n, rs in
                    zip(plan.axis_names, mesh, roles)},
           "tp_intra_node": all(links[i][1] == fastest for i, rs in enumerate(roles) if "tp" in rs),
           "mixed_axes": [plan.axis_names[i] for i, rs in enumerate(roles) if len(rs & {"dp", "tp", "cp"}) > 1],
           "checkpointed_layers": len(plan.checkpoint), "checkpoint": sorted(set(plan.checkpoint.values())),
           "micro_batches": int(pp.get("micro_batches", plan.accumulation.get("micro_batches", 1))),
           "schedule": pp.get("schedule", ""),
           "offload": list(plan.offload)}
    parts = [x.upper() for x in ("tp", "pp", "cp") if out[x] > 1]
    if out["dp"] > 1:
        parts.append("DP")
    name = "+".join(parts) or "single GPU"
    if name == "DP" and zero:
        name = f"ZeRO-{zero}"
    elif zero:
        name += f" (ZeRO-{zero})"
    if out["mixed_axes"]:
        name += " mixed per layer"
    out["name"] = name
    out["degrees"] = degrees_text(out, plan.axis_names, mesh, roles)
    layout = [f"{k}: {v}" for k, v in out["axes"].items() if not k.endswith("=1")]
    if pp:
        sched = pp["schedule"] + (f"v{pp.get('virtual')}" if pp["schedule"] == "interleaved" else "")
        layout.append(f"pp{pp['degree']} on {pp['axis_name']} m={pp['micro_batches']} {sched}")
    elif plan.accumulation:
        layout.append(f"m={plan.accumulation['micro_batches']} accumulated")
    if zero:
        layout.append(f"zero{zero}")
    if plan.checkpoint:
        layout.append(f"ckpt {len(plan.checkpoint)}")
    if plan.offload:
        layout.append("offload " + "+".join(plan.offload))
    out["layout"] = ", ".join(layout) or "replicated"
    return out


def degrees_text(s: dict, names, mesh, roles: list[set[str]]) -> str:
    """"dp / tp / pp / cp" as the report prints them: a degree that comes from an axis doing more than one thing
    (dp for some ops, tp for others) is marked "(mixed)" and the axis named, since such degrees multiply to more
    than the GPUs."""
    cells = []
    for r in ("dp", "tp", "pp", "cp"):
        mixed = r != "pp" and any(r in rs and len(rs & {"dp", "tp", "cp"}) > 1 for rs in roles)
        cells.append(f"{s[r]} (mixed)" if mixed else str(s[r]))
    text = " / ".join(cells)
    for name, n, rs in zip(names, mesh, roles):
        both = sorted(rs & {"dp", "tp", "cp"})
        if len(both) > 1:
            text += f"; {name}={n} does {', '.join(both[:-1])} and {both[-1]}, each on some ops, counted in each"
    return text


def terms(plan, traced, comm: dict | None = None) -> dict[str, float]:
    """Step time per GPU split into compute (recomputation included), each collective kind, the optimizer step, and
    what is left: the pipeline bubble and stage imbalance (zero without a pipeline). Sums to the predicted step."""
    comm = comm or communication(plan, traced)
    step = plan.predicted["step_time_s"]
    pp = plan.pipeline
    if pp:
        ckpt = {lay for st in pp["stages"] for lay in st["checkpointed"]}
        rec = sum(r.get("fwd_s", 0.0) for r in plan.nodes.values() if r["layer"] in ckpt
                  and r.get("region") not in ("", "layer_output", None))
        compute = (sum(r.get("compute_s", 0.0) for r in plan.nodes.values()) + rec) / int(pp["degree"])
    else:
        compute = plan.predicted["compute_s"]
    out = {"compute": compute}
    out.update({k: comm[k]["time_s"] for k in (*KINDS, INSIDE_OPS)})
    out["optimizer_step"] = plan.predicted.get("optimizer_step_s", 0.0)  # once per step, after the reduction
    out["bubble_and_imbalance"] = step - sum(out.values())
    return out


# ---- the advice ------------------------------------------------------------------------------------------------
def rate(flops_per_s: float) -> str:
    """A FLOP rate with enough digits: TFLOP/s from 1 TFLOP/s up, GFLOP/s below (a CPU's 50 GFLOP/s peak read
    "0 TFLOP/s"), MFLOP/s below 1 GFLOP/s."""
    if not math.isfinite(flops_per_s):
        return "-"
    for scale, unit in ((1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1e6, "MFLOP/s")):
        if abs(flops_per_s) >= scale or unit == "MFLOP/s":
            v = flops_per_s / scale
            return f"{v:.0f} {unit}" if abs(v) >= 100 else f"{v:.3g} {unit}" if abs(v) >= 1 else f"{v:.2g} {unit}"
    return ""



@dataclass(frozen=True)
class Advice:
    """One what-if plan read as practitioners' numbers (``to_json()`` for the fields)."""

    model: str
    params: int
    cluster: str
    gpus: int
    mesh: tuple[int, ...]
    batch: int
    seq: int
    fits: bool
    binding: str = ""  # why nothing fits
    # nothing fits, as the planner measured it (``no_fit_record``): the smallest per-device peak any plan reaches,
    # the budget, the moment of the step it binds at, and its largest terms ({"kind", "node", "bytes"}); {} when
    # the planner did not say (a model too large to trace, a timeout)
    no_fit: dict = field(default_factory=dict)
    strategy: dict = field(default_factory=dict)
    step_time_s: float = math.nan
    tokens_per_s: float = math.nan
    model_flops_per_step: float = math.nan
    tflops_per_gpu: float = math.nan
    peak_tflops_per_gpu: float = math.nan
    mfu: float = math.nan
    # the FLOPs causal kernels run (``kernel_flops``: attention halved under a causal mask, as the cost model prices
    # it), per second per GPU and as a fraction of peak: beside MFU, whose published convention counts the whole
    # S x S square and so reads high at long sequences (it can pass the device's ``mfu``, this cannot)
    kernel_flops_per_step: float = math.nan
    kernel_tflops_per_gpu: float = math.nan
    kernel_mfu: float = math.nan
    memory: dict = field(default_factory=dict)
    memory_budget: float = math.nan
    communication: dict = field(default_factory=dict)
    terms: dict = field(default_factory=dict)
    trace_s: float = 0.0
    plan_s: float = 0.0
    # the logical meshes planned (``mesh_views``): {"mesh": [...], "step_time_s": s or None, "why": "" or the error,
    # "plan_s": the view's own planning time where it was planned; "same_as": [...] where it is another renamed}
    views: list = field(default_factory=list)
    # forward-only (serving): ``step_time_s`` is the latency of one batch through the model, ``tokens_per_s`` the
    # tokens it processes over that (batch x seq; a decoding step, seq 1, makes one token per sequence), with the
    # K/V cache of ``kv_cache_tokens`` positions per sequence held and read at every attention
    inference: bool = False
    kv_cache_tokens: int = 0
    plan: Any = None  # the Plan (not in to_json; save it with plan.save)

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan"}
        d["mesh"] = list(self.mesh)
        d["flops_note"] = self.flops_note()
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}

    def without_timings(self) -> dict[str, Any]:
        """``to_json`` with the plan (``dataclasses.asdict``), less what measures the planning rather than the
        advice: tracing and planning seconds (the views' too), the solver's own times and counts, the stage search's
        seconds. Equal for the same advice however it was planned: views side by side or one after another, a
        sweep's cells in processes of their own or here."""
        d = self.to_json()
        d.pop("plan_s"), d.pop("trace_s")
        for v in d["views"]:
            v.pop("plan_s", None)
        if self.plan is not None:
            d["plan"] = dataclasses.asdict(self.plan)
            d["plan"].pop("solver")
            (d["plan"].get("pipeline") or {}).pop("search_s", None)
        return d

    def flops_note(self) -> str:
        """One line when MFU (the published convention) and ``kernel_mfu`` differ by more than 10%, else ""."""
        if not (self.fits and self.kernel_mfu > 0) or self.mfu <= 1.1 * self.kernel_mfu:
            return ""
        return (f"MFU counts causal attention's whole S x S square (Megatron's convention, to compare with published "
                f"TFLOP/s); the kernels run half of it: {self.kernel_mfu:.1%} of peak "
                f"({rate(self.kernel_tflops_per_gpu * 1e12)} per GPU) is what the GPUs do")

    def __str__(self) -> str:
        head = (f"{self.model} ({self.params / 1e9:.2f}B parameters) on {self.gpus} x {self.cluster} "
                f"(mesh {'x'.join(map(str, self.mesh))}), batch {self.batch} x {self.seq} tokens"
                + (f", inference{self.cache_text()}" if self.inference else ""))
        if not self.fits:
            return f"{head}\ndoes not fit: {self.binding}"
        s = self.strategy
        lines = [head, f"strategy {s['name']}: {s['layout']}",
                 f"{'latency' if self.inference else 'step'} {self.step_time_s:.4g} s, {self.tokens_per_s:,.0f} "
                 f"tokens/s, {rate(self.tflops_per_gpu * 1e12)} per GPU, MFU {self.mfu:.1%} of "
                 f"{rate(self.peak_tflops_per_gpu * 1e12)} ({self.kernel_mfu:.1%} of the FLOPs the kernels run)",
                 "memory/GPU: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in self.memory["by_kind"].items())
                 + f"; peak {self.memory['peak'] / 2**30:.2f} of {self.memory_budget / 2**30:.2f} GiB",
                 "communication/GPU/step: " + ", ".join(
                     f"{k} {v['bytes'] / 2**30:.2f} GiB {v['time_s'] * 1e3:.1f} ms exposed"
                     for k, v in self.communication.items() if k in KINDS and v["bytes"] > 0),
                 f"planned in {self.plan_s:.1f} s after a {self.trace_s:.1f} s trace"]
        if len(self.views) > 1:
            lines.append(f"meshes planned: {self.views_text()}")
        if self.flops_note():
            lines.append(self.flops_note())
        return "\n".join(lines)

    def cache_text(self) -> str:
        """What decoding holds per sequence: the K/V cache of the context at the attentions, a state-space model's
        recurrent state (the ``kv_cache`` memory kind holds both)."""
        if not self.kv_cache_tokens:
            return ""
        ops = {r["op"] for r in self.plan.nodes.values()} if self.plan is not None else set()
        attention = any("scaled_dot_product_attention" in o for o in ops)
        ssm = any(o.startswith("autopart.ssd_scan") for o in ops)
        if ssm and not attention:
            return (f", decoding after {self.kv_cache_tokens} tokens: no K/V cache (no attention), the recurrent "
                    "state of every sequence held instead, the same whatever the context")
        return (f", K/V cache of {self.kv_cache_tokens} tokens per sequence"
                + (" and the recurrent state of the state-space layers" if ssm else "")
                + (" (none held: the model has no attention)" if self.fits and not attention and not ssm else ""))

    def views_text(self) -> str:
        """The logical meshes planned and each one's predicted step (``views``), on one line; a mesh without a plan
        says whether it ran out of time (and which limit) or does not fit."""
        def outcome(v: dict) -> str:
            if v["step_time_s"] is not None:
                return f" {v['step_time_s']:.4g} s"
            return f" not planned ({v['why']})" if v.get("timed_out") else " does not fit"

        return ", ".join("x".join(map(str, v["mesh"])) + outcome(v)
                         + (f" (as {'x'.join(map(str, v['same_as']))})" if v.get("same_as") else "")
                         for v in self.views if v["mesh"])


def resolve_cluster(cluster: str | Cluster) -> str | Cluster:
    """A preset name, a path to a JSON/TOML cluster file (registered as a preset), or a ``Cluster``."""
    if isinstance(cluster, Cluster):
        return cluster
    if cluster in PRESETS:
        return cluster
    if cluster.endswith((".json", ".toml")):
        return load_preset(cluster)
    if cluster == "calibrated":
        raise ValueError("cluster 'calibrated' is this machine as autopart calibrate measured it, for the one mesh it "
                         "measured (autopart plan --cluster calibrated); advise plans clusters of any size: give a "
                         f"preset {sorted(PRESETS)} or the path of a .json/.toml cluster file")
    raise ValueError(f"unknown cluster {cluster!r}: give a preset {sorted(PRESETS)} or the path of a .json/.toml "
                     "cluster file (format: autopart.cost.cluster.load_preset)")


def devices_per_node(cluster: str | Cluster, gpus_per_node: int | None = None) -> int:
    """GPUs per node: ``gpus_per_node`` where given, else the cluster's own (a preset's or a cluster file's
    ``devices_per_node``; a ``Cluster`` named after a preset, that preset's), else 8 (a cluster that puts every rank
    on one host, ``cpu``, or a ``Cluster`` built directly)."""
    if gpus_per_node is not None:
        if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={gpus_per_node!r}: give a whole number >= 1, or None for the "
                             "cluster's devices per node")
        return gpus_per_node
    c = resolve_cluster(cluster)
    spec = PRESETS.get(c.name if isinstance(c, Cluster) else c)
    return (spec.devices_per_node if spec is not None else None) or 8


def _mesh_cluster(cluster: str | Cluster, nodes: int, gpus_per_node: int) -> Cluster:
    """The cluster as a (nodes, gpus_per_node) mesh: the node axis on the inter-node link, the GPU axis inside a
    node. A preset whose nodes hold another number of GPUs is registered again as ``<name>/<g>-per-node``."""
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"need nodes >= 1 and gpus_per_node >= 1, got {nodes} and {gpus_per_node}")
    shape = (nodes, gpus_per_node)
    c = resolve_cluster(cluster)
    if isinstance(c, Cluster):
        return c.with_mesh(shape)
    spec = PRESETS[c]
    if spec.devices_per_node is not None and spec.devices_per_node != gpus_per_node:
        name = f"{c}/{gpus_per_node}-per-node"
        PRESETS.setdefault(name, dataclasses.replace(spec, devices_per_node=gpus_per_node))
        c = name
    return make_preset(c, shape)


def mesh_views(nodes: int, gpus_per_node: int) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """The logical meshes of ``nodes x gpus_per_node`` devices a plan is searched on (Alpa's logical mesh views of a
    physical one): the physical ``(nodes, gpus_per_node)`` mesh, and ``(gpus / t, t)`` for every other divisor t of
    the node (t = 1: one axis over every GPU), ranks numbered node by node. Its inner axis stays inside a node, so
    tensor parallelism of 2 or 4 (Megatron's 7.1B and 16B runs) is expressible, and data parallelism over every
    GPU, which the physical mesh splits into two axes, is one axis priced in two levels (``Link.local``)."""
    gpus, views = nodes * gpus_per_node, []
    divisors = [t for t in range(1, gpus_per_node + 1) if gpus_per_node % t == 0]
    for t in sorted(divisors, key=lambda t: t != gpus_per_node):  # the physical mesh first
        names = ("node", "gpu") if t == gpus_per_node else ("outer", "inner")
        kept = [(n, a) for n, a in zip((gpus // t, t), names) if n > 1] or [(1, "all")]
        shape, names = tuple(n for n, _ in kept), tuple(a for _, a in kept)
        views.append((shape, ("all",) if len(shape) == 1 else names))
    return list(dict.fromkeys(views))


def state_floor(params: int, gpus: int, state_bytes: float, offload_bytes: float) -> float:
    """Bytes per GPU of model states with every state sharded over every GPU (ZeRO-3 over all of them) and the
    optimizer offloaded: a plan needs at least this (``offload_bytes``: the optimizer's share)."""
    return params * (state_bytes - offload_bytes) / gpus


def _held_terms(err: Exception) -> tuple[float, dict[str, float]]:
    """From the planner's no-fit error (``planner.NoPlanFits``): (the smallest per-device peak any plan reaches,
    bytes of each kind of state decoding holds among the largest terms there: {"K/V cache": b, "recurrent state":
    b}); (nan, {}) for another error."""
    if not isinstance(err, NoPlanFits):
        return math.nan, {}
    return err.peak(), err.held()


def no_fit_record(err: Exception) -> dict:
    """``Advice.no_fit`` of the planner's error: {} unless it is ``NoPlanFits`` with figures (a pipelined search's
    reports its plan without stages, on the whole mesh)."""
    src = err.figures if isinstance(err, NoPlanFits) else None
    if src is None or not src.terms:
        return {}

    def num(x: float) -> float | None:  # JSON has no inf or nan
        return float(x) if math.isfinite(x) else None

    return {"smallest_peak_bytes": num(src.min_memory), "limit_bytes": num(src.limit), "binding": src.binding,
            "terms": [{"kind": k, "node": n, "bytes": num(b)} for k, n, b in src.terms]}


def _binding(err: Exception, params: int, gpus: int, cl: Cluster, state_bytes: float,
             inference: bool = False) -> str:
    budget = cl.memory_budget
    full = params * state_bytes / gpus
    text = str(err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    states = "weights" if inference else "model states"
    if full > budget:
        return (f"{states} {params * state_bytes / 2**30:,.0f} GiB ({state_bytes:g} B/parameter) are "
                f"{full / 2**30:.1f} GiB per GPU even sharded over all {gpus} GPUs, over the "
                f"{budget / 2**30:.1f} GiB budget ({first})")
    peak, held = _held_terms(err)
    if held:
        kind, size = max(held.items(), key=lambda kv: kv[1])
        # it binds when the plan would fit without it (or it is most of the peak)
        if math.isnan(peak) or size >= peak - budget or size >= peak / 2:
            what = ("the K/V cache of every sequence's context at every attention" if kind == "K/V cache"
                    else "the recurrent state of every sequence at every state-space layer")
            return (f"{kind}: {what} takes {size / 2**30:.1f} GiB per GPU at the smallest peak any plan reaches "
                    f"({peak / 2**30:.1f} GiB, over the {budget / 2**30:.1f} GiB budget; the {states} fully sharded "
                    f"take {full / 2**30:.1f}); serve a smaller batch or context, or use more GPUs ({first})")
    return (f"activations and working memory: {states} fully sharded take {full / 2**30:.1f} GiB per GPU of "
            f"{budget / 2**30:.1f}, the rest does not fit the batch ({first})")


class _Cap:
    """``with _Cap(seconds):`` raises ``PlanTimeout`` in the main thread after ``seconds`` (no-op if 0/None)."""

    def __init__(self, seconds: float | None) -> None:
        import threading

        # SIGALRM reaches the main thread only: elsewhere the cap is not applied (the solver's limit still is)
        self.seconds = seconds if threading.current_thread() is threading.main_thread() else None

    def __enter__(self):
        if self.seconds:
            def fire(signum, frame):
                raise PlanTimeout(f"planning took more than {self.seconds:g} s")

            self.old = signal.signal(signal.SIGALRM, fire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc) -> None:
        if self.seconds:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)


def _grad_itemsize(itemsize: int, grad_dtype: str | torch.dtype | None) -> int:
    """Bytes per element of a gradient: ``grad_dtype``'s (``PlanOptions.grad_dtype``), else the weights'."""
    if grad_dtype is None:
        return itemsize
    return (grad_dtype if isinstance(grad_dtype, torch.dtype) else getattr(torch, str(grad_dtype))).itemsize


def advise(model: str | None = "llama", size: str | None = None, *, factory: str | Callable | None = None,
           cluster: str | Cluster = "h100-80gb", nodes: int = 1, gpus_per_node: int | None = None,
           batch: int | None = None,
           seq: int | None = None, dtype: torch.dtype = torch.bfloat16, optimizer_bytes_per_param: float = 12.0,
           time_limit_s: float = 30.0, max_plan_s: float | None = None, built: tuple | None = None,
           traced=None, recipes: bool = True, views: bool = True, reduce_dtype: str | torch.dtype | None = None,
           grad_dtype: str | torch.dtype | None = None, relative_gap: float = ADVISE_GAP,
           inference: bool = False, kv_cache_tokens: int = 0, jobs: int | None = None,
           **overrides: int | None) -> Advice:
    """Plan a model for ``nodes x gpus_per_node`` devices of ``cluster`` (a preset, a JSON/TOML file, or a
    ``Cluster``) on the ``meta`` device and read the plan (``Advice``). The model is ``model``/``size`` (a family
    ``gpt``/``llama``/``moe``/``mamba`` and a named size, or ``"llama:70b"``) with overrides ``layers``, ``hidden``,
    ``heads``, ``kv_heads``, ``vocab``, ``ffn``, ``experts``, ``top_k``; or ``factory`` ("module:function" or a
    callable returning an ``nn.Module`` or ``(module, inputs, kwargs)``). ``gpus_per_node``: None (default) takes
    the cluster's own devices per node (a cluster file's ``devices_per_node``; 8 for the GPU presets). ``batch`` is
    the global batch in sequences (default one per GPU). Weights in ``dtype`` with ``optimizer_bytes_per_param``
    optimizer bytes (12: Adam with an fp32 master copy, 16 bytes of model state per parameter as in ZeRO);
    ``reduce_dtype``: the gradient reduction's, ``grad_dtype`` the gradients' ("float32": 18 bytes per
    parameter, as Megatron-LM's fp32 ``main_grad``; ``autopart.plan``). ``max_plan_s`` caps each mesh view's planning
    time, planned here or in a process of its own (the solver's own limit is ``time_limit_s``): a view past it is
    listed as not planned, and the fastest of the others kept; with no plan (none fits, or none within the cap)
    ``fits=False`` with the reason in ``binding``. ``views``: plan on every logical mesh of the nodes
    (``mesh_views``: tensor parallelism of any divisor of the node, data parallelism over all GPUs as one axis) and
    keep the fastest, each listed in ``Advice.views``; False: the ``(nodes, gpus_per_node)`` mesh alone. Views apply to
    presets (and cluster files); a ``Cluster`` given directly is planned on its own mesh. Views whose axes have
    the same sizes and links in another order (one node's (4, 2) and (2, 4): NVLink both) are the same problem with
    its axes renamed: planned once, the other listed with its step time (``same_as``). ``jobs``: processes the
    views are planned in side by side (``autopart.forked``: forked, so nothing is pickled on the way in; None: one
    per core, at most one per view, fewer where memory is short (``VIEW_BYTES`` each); 1: one after another in this
    process); the result is the same whatever it is. ``relative_gap``: each ILP stops once its plan is proven
    within this fraction of the best (``ADVISE_GAP``, 1%: what-if planning reads step times the cost model
    predicts to ~10%; ``autopart.plan`` solves to 0.1%).

    ``inference``: serving, planned forward-only (``autopart.plan`` of the frozen model: no gradients, no
    optimizer states, the weights alone as model state); the step is the latency of one batch of ``batch``
    sequences of ``seq`` tokens (batch 1 for latency, a larger batch for throughput: ``advise_serving``),
    ``kv_cache_tokens`` the K/V cache per sequence each attention holds and reads (decoding: ``seq=1``, the cache
    the context so far; a state-space layer holds its recurrent state per sequence instead, whatever the context), and
    the model FLOPs are the forward's (2 N per token, attention over the cache).

    >>> print(autopart.advise("llama", "70b", cluster="h100-80gb", nodes=8, seq=4096))
    >>> print(autopart.advise("llama", "70b", nodes=1, batch=1, seq=1, inference=True, kv_cache_tokens=8192))
    """
    import autopart
    from autopart.trace import trace

    PlanOptions(relative_gap=relative_gap)  # bad input raises here, not per mesh view as a plan that does not fit
    forked.jobs_for(1, jobs)  # likewise
    gpus_per_node = devices_per_node(cluster, gpus_per_node)
    cl = _mesh_cluster(cluster, nodes, gpus_per_node)
    gpus = cl.world_size
    for what, v, unit, default in (("batch", batch, "sequences in the global batch", "one sequence per GPU"),
                                   ("seq", seq, "tokens per sequence", "2048 tokens")):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{what}={v!r}: give a whole number >= 1 ({unit}), or leave it out for the default "
                             f"({default})")
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s={time_limit_s!r}: the solver's limit per ILP must be a positive number of "
                         "seconds")
    asked = {k: v for k, v in (("batch", batch), ("seq", seq)) if v is not None}  # given, not defaults
    batch = gpus if batch is None else batch
    seq = 2048 if seq is None else seq
    if kv_cache_tokens < 0 or (kv_cache_tokens and not inference):
        raise ValueError(f"kv_cache_tokens={kv_cache_tokens}: a K/V cache is held when decoding; pass "
                         "inference=True (--inference) with kv_cache_tokens >= 0, or leave it 0 for training")
    if built is None:
        built = build(model, size, factory=factory, batch=batch, seq=seq, dtype=dtype, inference=inference,
                      **overrides)
    name, module, inputs, kwargs, _ = built
    got = {"batch": int(inputs[0].shape[0]) if inputs and inputs[0].dim() > 0 else None,
           "seq": int(inputs[0].shape[1]) if inputs and inputs[0].dim() > 1 else None}
    differ = {k: v for k, v in asked.items() if got[k] is not None and got[k] != v}
    if differ:
        raise ValueError(
            f"{name} brings its own example inputs of batch {got['batch']}"
            + (f" x {got['seq']} tokens" if got["seq"] is not None else "") + ", but "
            + " and ".join(f"{k} {v}" for k, v in differ.items()) + " was asked for: the model is planned at its "
            "inputs' shape, so the asked-for shape would be ignored. Leave out batch/seq (--batch/--seq) to plan "
            "the factory's inputs, or have the factory return the module alone (advise then makes token inputs of "
            "batch x seq)")
    if inference and any(p.requires_grad for p in module.parameters()):
        raise ValueError("inference=True needs a frozen model (module.requires_grad_(False)): build() freezes "
                         "the models it builds; freeze the one passed in `built`")
    n_params = sum(p.numel() for p in module.parameters())
    itemsize = next(module.parameters()).dtype.itemsize
    state_bytes = itemsize if inference else itemsize + _grad_itemsize(itemsize, grad_dtype) + \
        optimizer_bytes_per_param
    base = dict(model=name, params=n_params, cluster=cl.name, gpus=gpus, mesh=tuple(cl.mesh_shape),
                batch=int(inputs[0].shape[0]) if inputs else batch, seq=int(inputs[0].shape[1]) if inputs and
                inputs[0].dim() > 1 else seq, memory_budget=float(cl.memory_budget),
                peak_tflops_per_gpu=dtype_peak_flops(cl.device, next(module.parameters()).dtype) / 1e12,
                inference=inference,
                kv_cache_tokens=int(kv_cache_tokens))
    floor = state_floor(n_params, gpus, state_bytes, 0.0 if inference else optimizer_bytes_per_param)
    if floor > cl.memory_budget:  # no trace needed: nothing can fit
        return Advice(fits=False, binding=(
            f"weights: {floor / 2**30:.1f} GiB per GPU even sharded over all {gpus} GPUs (inference holds the "
            f"weights alone: no gradients, no optimizer), over the {cl.memory_budget / 2**30:.1f} GiB budget; use "
            "more GPUs" if inference else
            f"model states: {floor / 2**30:.1f} GiB per GPU even with every state sharded over all {gpus} GPUs "
            f"and the optimizer offloaded, over the {cl.memory_budget / 2**30:.1f} GiB budget; use more GPUs"),
            **base)
    t0 = time.perf_counter()
    traced = traced or trace(module, inputs, kwargs)
    base["trace_s"] = time.perf_counter() - t0 if traced.export_seconds == 0 else traced.export_seconds
    tokens = base["batch"] * base["seq"]
    base["model_flops_per_step"], _, _ = model_flops(module, traced, tokens, inference, kv_cache_tokens)
    base["kernel_flops_per_step"] = kernel_flops(module, traced, tokens, inference, kv_cache_tokens)
    t0 = time.perf_counter()
    shapes = (mesh_views(*cl.mesh_shape) if views and len(cl.mesh_shape) == 2 and cl.name in PRESETS
              else [(tuple(cl.mesh_shape), ("node", "gpu")[:len(cl.mesh_shape)])])
    # one problem per set of views whose axes have the same (size, link) multiset: the others are it renamed
    todo, key_of, problem_of = [], [], {}  # the problems to plan; each view's key; key -> its problem in todo
    for shape, names in shapes:
        view_cluster = cl.with_mesh(shape)
        key = tuple(sorted(zip(shape, view_cluster.links), key=repr))
        if key not in problem_of:
            problem_of[key] = len(todo)
            todo.append((shape, names, view_cluster))
        key_of.append(key)

    def plan_view(j: int):
        shape, names, view_cluster = todo[j]
        t = time.perf_counter()
        with _Cap(max_plan_s):  # each view its own cap, planned here or in a process of its own
            return autopart.plan(module, autopart.mesh(shape, names), inputs, kwargs, cluster=view_cluster,
                                 traced=traced, time_limit_s=time_limit_s,
                                 optimizer_bytes_per_param=optimizer_bytes_per_param, recipes=recipes,
                                 reduce_dtype=reduce_dtype, grad_dtype=grad_dtype, relative_gap=relative_gap,
                                 kv_cache_tokens=kv_cache_tokens), time.perf_counter() - t

    done: dict[int, Any] = {}  # view -> its plan, or why it has none (this mesh does not fit, or ran past the cap)
    # forked even for one view: the solver's threads then stay out of this process, which can go on forking
    n_jobs = forked.jobs_for(max(len(todo), 2), jobs, task_bytes=VIEW_BYTES)
    # one axis over every GPU plans fastest (no stage meshes nor tensor parallelism to weigh): started last
    for j, ok, value in forked.run(plan_view, len(todo), n_jobs, first=lambda j: len(todo[j][0]) == 1):
        if not ok and not isinstance(value, (ValueError, *_TIMEOUTS)):
            raise value
        done[j] = value
    best, tried, err = None, [], None
    listed: dict[tuple, dict] = {}
    for (shape, _), key in zip(shapes, key_of):
        j = problem_of[key]
        if j not in done:
            continue
        if key in listed:  # the same axes in another order: the same problem, its axes renamed
            same = listed[key]
            tried.append({"mesh": list(shape), "step_time_s": same["step_time_s"], "why": same["why"],
                          "same_as": same["mesh"]})
            continue
        value = done[j]
        if isinstance(value, Exception):  # a mesh that does not fit says more than one that ran out of time
            err = value if err is None or isinstance(err, _TIMEOUTS) else err
            tried.append({"mesh": list(shape), "step_time_s": None, "why": str(value).strip().splitlines()[0],
                          "timed_out": isinstance(value, _TIMEOUTS)})
        else:
            value, seconds = value
            step = value.predicted["step_time_s"]
            tried.append({"mesh": list(shape), "step_time_s": step, "why": "", "plan_s": seconds})
            if best is None or step < best.predicted["step_time_s"]:
                best = value
        listed[key] = tried[-1]
    if best is None:
        if isinstance(err, _TIMEOUTS):
            return Advice(fits=False, binding=f"not planned: {err}" + (
                " (raise max_plan_s)" if isinstance(err, PlanTimeout) else ""), plan_s=time.perf_counter() - t0,
                views=tried, **base)
        return Advice(fits=False, binding=_binding(err, n_params, gpus, cl, state_bytes, inference),
                      no_fit=no_fit_record(err),
                      plan_s=time.perf_counter() - t0, views=tried, **base)
    base["mesh"] = tuple((best.pipeline or {}).get("world_mesh_shape", best.mesh_shape))
    return dataclasses.replace(read_plan(best, traced, base, time.perf_counter() - t0), views=tried)


def read_plan(plan, traced, base: dict, plan_s: float = 0.0) -> Advice:
    """An ``Advice`` from a plan of the traced model (``base``: the fields that describe the run)."""
    step = plan.predicted["step_time_s"]
    comm = communication(plan, traced)
    tflops = base["model_flops_per_step"] / step / base["gpus"] / 1e12
    kernel = base.get("kernel_flops_per_step", math.nan) / step / base["gpus"] / 1e12
    return Advice(fits=True, strategy=strategy(plan, traced), step_time_s=step,
                  kernel_tflops_per_gpu=kernel, kernel_mfu=kernel / base["peak_tflops_per_gpu"],
                  tokens_per_s=base["batch"] * base["seq"] / step, tflops_per_gpu=tflops,
                  mfu=tflops / base["peak_tflops_per_gpu"], memory=memory(plan), communication=comm,
                  terms=terms(plan, traced, comm), plan_s=plan_s, plan=plan, **base)


# ---- serving: the batch that maximizes throughput --------------------------------------------------------------
@dataclass(frozen=True)
class Serving:
    """``advise_serving``: the served model planned at growing batches, and the batch of most tokens/s whose latency
    stays within ``max_latency_s`` (``to_json()`` for the fields)."""

    rows: list  # the Advice of every batch tried, by batch
    best: Any  # the Advice of most tokens/s among those that fit within the latency bound, or None
    max_latency_s: float | None
    stopped: str  # why the search went no further

    def to_json(self) -> dict[str, Any]:
        return {"best_batch": self.best.batch if self.best is not None else None, "max_latency_s": self.max_latency_s,
                "stopped": self.stopped, "rows": [r.to_json() for r in self.rows]}

    def table(self) -> list[dict[str, Any]]:
        """A row per batch tried: what practitioners compare (None where it does not fit)."""
        out = []
        for a in self.rows:
            ok = a.fits and (self.max_latency_s is None or a.step_time_s <= self.max_latency_s)
            by = a.memory.get("by_kind", {}) if a.fits else {}
            out.append({"batch": a.batch, "fits": a.fits, "within_latency": ok,
                        "mesh": "x".join(map(str, a.mesh)), "strategy": a.strategy.get("name") if a.fits else None,
                        "latency_s": a.step_time_s if a.fits else None,
                        "tokens_per_s": a.tokens_per_s if a.fits else None,
                        "tokens_per_s_per_gpu": a.tokens_per_s / a.gpus if a.fits else None,
                        "peak_bytes": a.memory.get("peak") if a.fits else None,
                        "kv_cache_bytes": by.get("kv_cache") if a.fits else None,
                        "why": "" if a.fits else a.binding, "best": a is self.best})
        return out

    def markdown(self) -> str:
        """``table()`` as a markdown table (benchmarks/bench_serving.py)."""
        lines = ["| batch | mesh | strategy | latency ms | tokens/s | tokens/s per GPU | peak GiB | K/V GiB | |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for r in self.table():
            if not r["fits"]:
                lines.append(f"| {r['batch']} | | does not fit | | | | | | {r['why'][:60]}... |")
                continue
            note = "best" if r["best"] else ("" if r["within_latency"] else "over the bound")
            lines.append(f"| {r['batch']} | {r['mesh']} | {r['strategy']} | {r['latency_s'] * 1e3:.3f} | "
                         f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_gpu']:,.0f} | "
                         f"{r['peak_bytes'] / 2**30:.2f} | {(r['kv_cache_bytes'] or 0) / 2**30:.2f} | {note} |")
        return "\n".join(lines)

    def __str__(self) -> str:
        if not self.rows:
            return "nothing planned"
        a0 = self.rows[0]
        head = (f"{a0.model} ({a0.params / 1e9:.2f}B parameters) served on {a0.gpus} x {a0.cluster}, {a0.seq} "
                f"token(s) per sequence a step{a0.cache_text()}"
                + (f", latency at most {self.max_latency_s * 1e3:.4g} ms" if self.max_latency_s else ""))
        lines = [head, f"{'batch':>6} {'mesh':>6} {'strategy':<26} {'latency':>11} {'tokens/s':>12} "
                       f"{'per GPU':>10} {'peak GiB':>9} {'K/V GiB':>8}"]
        for r in self.table():
            if not r["fits"]:
                lines.append(f"{r['batch']:>6} does not fit: {r['why'][:100]}")
                continue
            mark = " <- best" if r["best"] else ("" if r["within_latency"] else " (over the latency bound)")
            lines.append(f"{r['batch']:>6} {r['mesh']:>6} {r['strategy'][:26]:<26} {r['latency_s'] * 1e3:>8.3f} ms "
                         f"{r['tokens_per_s']:>12,.0f} {r['tokens_per_s_per_gpu']:>10,.0f} "
                         f"{r['peak_bytes'] / 2**30:>9.2f} {(r['kv_cache_bytes'] or 0) / 2**30:>8.2f}{mark}")
        if self.best is not None and a0.fits:
            lines.append(f"most tokens/s: batch {self.best.batch}, {self.best.tokens_per_s / a0.tokens_per_s:.1f}x "
                         f"batch {a0.batch}'s, at {self.best.step_time_s / a0.step_time_s:.1f}x its latency")
        lines.append(f"stopped: {self.stopped}")
        return "\n".join(lines)


def advise_serving(model: str | None = "llama", size: str | None = None, *, max_batch: int = 1024,
                   max_latency_s: float | None = None, refine: int = 3, log: Callable[[str], None] | None = None,
                   **kw) -> Serving:
    """The throughput objective of serving: ``advise(..., inference=True)`` at batch 1, 2, 4, ... (each planned on
    its own: the mesh, tensor/data split and memory change with the batch) until a batch does not fit (the K/V
    cache grows with it), runs past ``max_latency_s`` (a step's latency bound: the time between tokens when
    decoding) or passes ``max_batch``; then ``refine`` bisections between the last batch kept and the first refused.
    Returns every batch tried and the one of most tokens/s among those kept (``Serving.best``): a larger batch
    amortizes the weights each step reads, so throughput grows with it while latency grows slower, until compute
    binds. ``kw``: ``advise``'s arguments (``cluster``, ``nodes``, ``seq``, ``kv_cache_tokens``, ...), not ``batch``.

    >>> print(autopart.advise_serving("llama", "70b", nodes=1, seq=1, kv_cache_tokens=8192, max_latency_s=0.05))
    """
    for k in ("batch", "built", "traced", "inference"):
        if k in kw:
            raise ValueError(f"advise_serving chooses {k!r} itself; leave it out (max_batch= caps the batch)")
    if max_batch < 1 or (max_latency_s is not None and max_latency_s <= 0) or refine < 0:
        raise ValueError(f"max_batch={max_batch}, max_latency_s={max_latency_s}, refine={refine}: give max_batch "
                         ">= 1, a positive latency bound (or None) and refine >= 0")
    rows: dict[int, Advice] = {}

    def kept(a: Advice) -> bool:
        return a.fits and (max_latency_s is None or a.step_time_s <= max_latency_s)

    def at(b: int) -> Advice:
        a = rows[b] = advise(model, size, batch=b, inference=True, **kw)
        if log is not None:
            log(f"batch {b}: " + (f"{a.step_time_s * 1e3:.3f} ms, {a.tokens_per_s:,.0f} tokens/s on mesh "
                                  f"{'x'.join(map(str, a.mesh))} ({a.strategy['name']})" if a.fits
                                  else f"does not fit: {a.binding[:120]}"))
        return a

    b, stopped, refused = 1, f"max_batch {max_batch} reached", None
    while b <= max_batch:
        a = at(b)
        if not a.fits:
            stopped, refused = f"batch {b} does not fit: {a.binding}", b
            break
        if not kept(a):
            stopped, refused = f"batch {b}'s latency {a.step_time_s * 1e3:.3f} ms is over the bound", b
            break
        b *= 2
    good = [x for x in rows if kept(rows[x])]
    if refused is not None and good:
        lo, hi = max(good), refused
        for _ in range(refine):
            mid = (lo + hi) // 2
            if mid in (lo, hi):
                break
            if kept(at(mid)):
                lo = mid
            else:
                hi = mid
    good = [rows[x] for x in sorted(rows) if kept(rows[x])]
    best = max(good, key=lambda a: a.tokens_per_s) if good else None
    return Serving(rows=[rows[x] for x in sorted(rows)], best=best, max_latency_s=max_latency_s, stopped=stopped)


# ---- published practice and the sweep --------------------------------------------------------------------------
@dataclass(frozen=True)
class Recipe:
    """What published practice would run (Megatron-LM / N21): ``kind`` is DP, TP or TP+PP."""

    kind: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batches: int | None = None
    why: str = ""

    def __str__(self) -> str:
        return f"{self.kind} (tp={self.tp} pp={self.pp} dp={self.dp})"


def practice(params: int, layers: int, hidden: int, gpus: int, gpus_per_node: int, budget: float, batch: int,
             seq: int, state_bytes: float = 16.0) -> Recipe | None:
    """Published practice (N21 section 3.3, K22): data parallel while the model states and activations fit one
    GPU (ZeRO-1's sharded optimizer allowed); else tensor parallel inside a node, the smallest degree that fits;
    else tensor parallel over the whole node and pipeline stages across nodes, the fewest that fit, with selective
    recompute and, if that does not fit, full recompute (as N21 trains its 1T model). Memory per GPU as K22: states
    (``state_bytes`` per parameter, the optimizer's share sharded over the data-parallel ranks) plus activations
    per layer of 34 s b h / t bytes (selective recompute) or 2 s b h / t kept plus one layer's 34 s b h / t
    recomputed (full), L layers in flight at a micro-batch of one sequence under 1F1B. None: nothing fits."""
    opt = state_bytes - 4

    def states(t: int, p: int, d: int) -> float:
        return params * (4 + opt / d) / (t * p)

    if batch % gpus == 0 and states(1, 1, gpus) + 34 * hidden * seq * batch // gpus * layers <= budget:
        return Recipe("DP", 1, 1, gpus, why="model states and activations fit one GPU")
    for t in (2, 4, 8):
        if t > gpus_per_node or gpus % t or batch % (gpus // t):
            continue
        d = gpus // t
        if states(t, 1, d) + 34 * hidden * seq * (batch // d) * layers / t <= budget:
            return Recipe("TP", t, 1, d, why=f"states do not fit one GPU; tensor parallel {t} inside a node does")
    t = min(8, gpus_per_node, gpus)
    for full in (False, True):
        act = (2 * layers + 34) * hidden * seq / t if full else 34 * hidden * seq * layers / t
        for p in range(2, min(layers, gpus // t) + 1):
            if (gpus // t) % p or batch % (gpus // (t * p)):
                continue
            d = gpus // (t * p)
            if states(t, p, d) + act <= budget:
                return Recipe("TP+PP", t, p, d, micro_batches=batch // d,
                              why=f"tensor parallel {t} in a node is not enough; {p} pipeline stages across nodes"
                                  + (" with full activation recompute" if full else ""))
    return None


# a plan of another family than practice's whose recipe scores within this share of the plan's step agrees with
# practice ("tie"): the two are as fast under the cost model, and which one the search returns is a coin toss
# (Llama-1B on 64 H100s: CP 4 x DP 16 at 0.0751 s, DP 0.0752 s)
TIE = 0.01


def agrees(rec: Recipe, s: dict) -> bool:
    """Does a plan's strategy ``s`` (``strategy()``) fall in the recipe's family?"""
    if rec.kind == "DP":
        return s["tp"] == 1 and s["pp"] == 1 and s["cp"] == 1
    if rec.kind == "TP":
        return s["tp"] > 1 and s["tp_intra_node"] and s["pp"] == 1
    return s["tp"] > 1 and s["tp_intra_node"] and s["pp"] > 1


def compare(plan_advice: Advice, recipe_advice: Advice) -> dict[str, Any]:
    """Term-by-term difference recipe - plan (seconds per step; positive: the recipe pays more there) and the term
    that decided."""
    if not recipe_advice.fits:
        return {"decided_by": "memory", "detail": f"the recipe does not fit: {recipe_advice.binding}", "diff": {}}
    keys = list(dict.fromkeys([*plan_advice.terms, *recipe_advice.terms]))
    diff = {k: recipe_advice.terms.get(k, 0.0) - plan_advice.terms.get(k, 0.0) for k in keys}
    gain = recipe_advice.step_time_s - plan_advice.step_time_s
    if gain >= 0:
        key = max(diff, key=lambda k: diff[k])
        detail = (f"the recipe is {gain * 1e3:.1f} ms/step slower; most of it in {key} "
                  f"(+{diff[key] * 1e3:.1f} ms)")
    else:
        key = min(diff, key=lambda k: diff[k])
        detail = (f"the recipe is {-gain * 1e3:.1f} ms/step FASTER than autopart's plan (the search missed it); "
                  f"it saves most in {key} ({diff[key] * 1e3:.1f} ms)")
    return {"decided_by": key, "detail": detail, "diff": diff, "recipe_step_s": recipe_advice.step_time_s,
            "recipe_mfu": recipe_advice.mfu}


def evaluate_recipe(rec: Recipe, built: tuple, traced, cluster: Cluster, base: dict, time_limit_s: float,
                    optimizer_bytes_per_param: float, max_plan_s: float | None,
                    reduce_dtype: str | torch.dtype | None = None, grad_dtype: str | torch.dtype | None = None
                    ) -> Advice:
    import autopart

    _, module, inputs, kwargs, _ = built
    t0 = time.perf_counter()
    try:
        with _Cap(max_plan_s):
            plan = autopart.evaluate(module, base["gpus"], inputs, kwargs, cluster=cluster, tp=rec.tp, pp=rec.pp,
                                     micro_batches=rec.micro_batches, zero=None, offload=None, traced=traced,
                                     time_limit_s=time_limit_s, optimizer_bytes_per_param=optimizer_bytes_per_param,
                                     reduce_dtype=reduce_dtype, grad_dtype=grad_dtype)
    except (ValueError, PlanTimeout) as e:
        return Advice(fits=False, binding=str(e).strip().splitlines()[0], no_fit=no_fit_record(e),
                      plan_s=time.perf_counter() - t0, **base)
    return read_plan(plan, traced, base, time.perf_counter() - t0)


def sweep(sizes: tuple[str | dict, ...] = SWEEP_SIZES, gpu_counts: tuple[int, ...] = SWEEP_GPUS,
          cluster: str | Cluster = "h100-80gb", gpus_per_node: int | None = None, seq: int = 4096,
          batch_per_gpu: int = 1,
          time_limit_s: float = 20.0, max_plan_s: float | None = 120.0, optimizer_bytes_per_param: float = 12.0,
          views: bool = True, log: Callable[[str], None] | None = None,
          reduce_dtype: str | torch.dtype | None = None,
          grad_dtype: str | torch.dtype | None = None, relative_gap: float = ADVISE_GAP,
          jobs: int | None = None) -> list[dict[str, Any]]:
    """The design-guide study: every model size x GPU count planned (global batch ``batch_per_gpu`` sequences per
    GPU), the winner named, and compared with published practice (``practice``). ``sizes``: "family:size"
    strings, or dicts of ``build`` arguments (``{"model": "llama", "size": "70b", "layers": 20, "label": "x"}``).
    Where the plan's family differs from practice, the recipe is scored with ``autopart.evaluate`` and the
    deciding cost term reported. ``views``: plan each cell on the logical meshes of its nodes (``advise``).
    ``reduce_dtype``: the gradient reduction's, ``grad_dtype`` the gradients', for the plans and practice's recipes
    alike (``autopart.plan``); ``relative_gap``: the ILPs' (``advise``). ``gpus_per_node``: None takes the
    cluster's devices per node (``advise``).

    ``jobs``: processes the cells are planned in (None: one per core, fewer where memory is short; 1: one after
    another in this process, each cell's mesh views too). The cells run side by side in forked processes
    (``autopart.forked``), the largest models first, each tracing its model and planning its views one after
    another; when there are fewer cells than processes, each cell plans its views side by side with its share. The
    rows come back in grid order (sizes, then GPU counts) whatever ``jobs`` is; ``log`` hears each as it ends. A
    cell whose process dies without an answer (killed for memory) is planned again alone after the others.
    ``max_plan_s`` caps each mesh view's planning (``advise``)."""
    gpus_per_node = devices_per_node(cluster, gpus_per_node)
    gpu_counts, sizes = tuple(gpu_counts), tuple(sizes)
    if not sizes or not gpu_counts:
        raise ValueError(f"sweep needs at least one model size and one GPU count, got sizes={sizes!r}, "
                         f"gpu_counts={gpu_counts!r}")
    # every cell's GPU count checked before any is planned (a bad one would stop the sweep after hours of planning)
    bad = [g for g in gpu_counts if isinstance(g, bool) or not isinstance(g, int) or g < 1
           or (g > gpus_per_node and g % gpus_per_node)]
    if bad:
        raise ValueError(f"GPU counts {bad} cannot be planned on {gpus_per_node}-GPU nodes: give whole numbers >= 1 "
                         f"that are at most one node ({gpus_per_node}) or a multiple of it (--gpus-per-node "
                         "changes the node size)")
    for name, v in (("seq", seq), ("batch_per_gpu", batch_per_gpu)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}: give a whole number >= 1")
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s={time_limit_s!r}: the solver's limit per ILP must be a positive number of "
                         "seconds")
    PlanOptions(relative_gap=relative_gap)  # bad input raises here, not in every cell
    forked.jobs_for(1, jobs)  # likewise

    def size_args(s: int) -> tuple[str | None, dict]:  # (the size's label if it has one, its ``build`` arguments)
        kw = dict(sizes[s]) if isinstance(sizes[s], dict) else {"model": sizes[s]}
        return kw.pop("label", None), kw

    # every size built once here (on meta: a second or less), so that a bad one fails before any cell is planned
    # and the cells can start largest first: (parameters, bytes of model state per parameter)
    params = []
    for s in range(len(sizes)):
        module = build(batch=batch_per_gpu, seq=seq, **size_args(s)[1])[1]
        itemsize = next(module.parameters()).dtype.itemsize  # the weights' (build's dtype: bf16)
        params.append((sum(p.numel() for p in module.parameters()),
                       itemsize + _grad_itemsize(itemsize, grad_dtype) + optimizer_bytes_per_param))

    def place(gpus: int) -> tuple[int, int]:  # a cell's nodes and GPUs per node
        return (gpus // gpus_per_node, gpus_per_node) if gpus >= gpus_per_node else (1, gpus)

    def setup(s: int, gpus: int) -> tuple:  # a cell's nodes, GPUs per node, cluster, batch, label and built model
        nodes, per_node = place(gpus)
        label, kw = size_args(s)
        built = build(batch=batch_per_gpu * gpus, seq=seq, **kw)
        return nodes, per_node, _mesh_cluster(cluster, nodes, per_node), batch_per_gpu * gpus, label or built[0], built

    rows: dict[int, dict] = {}
    todo = []  # (cell index, size index, gpus) of the cells whose model states can fit: traced and planned
    for s in range(len(sizes)):
        for g, gpus in enumerate(gpu_counts):
            i = s * len(gpu_counts) + g
            n_params, states = params[s]
            budget = _mesh_cluster(cluster, *place(gpus)).memory_budget
            floor = state_floor(n_params, gpus, states, optimizer_bytes_per_param)
            if floor <= budget:
                todo.append((i, s, gpus))
                continue
            # no plan can fit: no trace, no process
            _, per_node, cl, batch, label, built = setup(s, gpus)
            adv = Advice(model=built[0], params=n_params, cluster=cl.name, gpus=gpus, mesh=cl.mesh_shape,
                         batch=batch, seq=seq, fits=False, memory_budget=float(cl.memory_budget),
                         binding=f"model states: {floor / 2**30:.0f} GiB per GPU even fully sharded with the "
                                 f"optimizer offloaded > {cl.memory_budget / 2**30:.0f} GiB")
            rows[i] = _sweep_row(label, built, None, adv, cl, per_node, batch, seq, states, time_limit_s,
                                 optimizer_bytes_per_param, max_plan_s, reduce_dtype, grad_dtype, jobs)
            if log:
                log(sweep_line(rows[i]))

    def cell(k: int, inner: int | None) -> dict:
        from autopart.trace import trace

        _, s, gpus = todo[k]
        nodes, per_node, cl, batch, label, built = setup(s, gpus)
        _, module, inputs, kwargs, _ = built
        t0 = time.perf_counter()
        traced = trace(module, inputs, kwargs)
        traced.export_seconds = time.perf_counter() - t0
        adv = advise(cluster=cl, nodes=nodes, gpus_per_node=per_node, batch=batch, seq=seq, built=built,
                     traced=traced, time_limit_s=time_limit_s, max_plan_s=max_plan_s,
                     optimizer_bytes_per_param=optimizer_bytes_per_param, views=views, reduce_dtype=reduce_dtype,
                     grad_dtype=grad_dtype, relative_gap=relative_gap, jobs=inner)
        return _sweep_row(label, built, traced, adv, cl, per_node, batch, seq, params[s][1], time_limit_s,
                          optimizer_bytes_per_param, max_plan_s, reduce_dtype, grad_dtype, inner)

    n = forked.jobs_for(len(todo), jobs, task_bytes=SWEEP_CELL_BYTES)
    inner = jobs  # in this process: each cell's views as asked
    if n > 1:  # every process holds a cell while more wait: views one after another; else the cells share the
        # processes (and the memory) ``jobs`` allows views
        inner = 1 if n < len(todo) else max(1, forked.jobs_for(1 << 30, jobs, task_bytes=VIEW_BYTES) // n)
    # the largest models (the longest to trace and plan) first, then the most GPUs (the most mesh views), so that
    # no long cell starts last while the other processes idle
    died = []
    for k, ok, value in forked.run(lambda k: cell(k, inner), len(todo), n,
                                   first=lambda k: (-params[todo[k][1]][0], -todo[k][2])):
        if not ok and isinstance(value, forked.ChildDied) and n > 1:
            # killed (the kernel's out-of-memory killer, most often, with the other cells beside it): planned
            # again alone once they are done, rather than losing the sweep
            died.append(k)
            if log:
                spec = sizes[todo[k][1]]
                log(f"{size_args(todo[k][1])[0] or spec} on {todo[k][2]} GPUs: its process died ({value}); {RETRIED}")
            continue
        if not ok:
            raise value
        rows[todo[k][0]] = value
        if log:
            log(sweep_line(value))
    for k in died:  # alone now, with every process for its views; dying again raises ``ChildDied``
        rows[todo[k][0]] = value = forked.call(functools.partial(cell, k, jobs), jobs)
        if log:
            log(sweep_line(value))
    return [rows[i] for i in sorted(rows)]


def _sweep_row(label: str, built: tuple, traced, adv: Advice, cl: Cluster, per_node: int, batch: int, seq: int,
               states: float, time_limit_s: float, optimizer_bytes_per_param: float, max_plan_s: float | None,
               reduce_dtype, grad_dtype, jobs: int | None) -> dict[str, Any]:
    """One cell of ``sweep``: its advice beside published practice (``practice``), and where they differ,
    practice's recipe scored (``evaluate_recipe``) and the deciding cost term named (``compare``)."""
    n_params, gpus, cfg = adv.params, adv.gpus, built[4]
    row = {"model": label, "params": n_params, "gpus": gpus, "advice": adv}
    shape = (getattr(cfg, "n_layer", None), getattr(cfg, "d_model", None))
    rec = practice(n_params, *shape, gpus, per_node, cl.memory_budget, batch, seq, states) if all(shape) else None
    row["practice"] = rec
    if not all(shape):
        row["agrees"] = None
        row["comparison"] = {"decided_by": "", "detail": "no layer count / hidden size to apply practice to"}
    elif rec is None:  # None: practice has no recipe; autopart went beyond it (offload, full recompute)
        row["agrees"] = True if not adv.fits else None
        row["comparison"] = {"decided_by": "memory", "detail": (
            f"no in-GPU recipe of practice fits; autopart fits with {adv.strategy['layout']}" if adv.fits
            else "practice has no recipe that fits either")}
    elif not adv.fits:
        row["agrees"] = False
        row["comparison"] = {"decided_by": "memory", "detail": f"practice suggests {rec}; autopart found "
                                                               f"no plan: {adv.binding}"}
    else:
        row["agrees"] = agrees(rec, adv.strategy)
        if not row["agrees"]:
            base = {k: getattr(adv, k) for k in (
                "model", "params", "cluster", "gpus", "mesh", "batch", "seq", "model_flops_per_step",
                "kernel_flops_per_step", "memory_budget", "peak_tflops_per_gpu", "trace_s")}
            rec_adv = forked.call(functools.partial(
                evaluate_recipe, rec, built, traced, cl, base, time_limit_s, optimizer_bytes_per_param,
                max_plan_s, reduce_dtype, grad_dtype), jobs)
            row["comparison"] = compare(adv, rec_adv)
            gain = row["comparison"].get("recipe_step_s", math.inf) - adv.step_time_s
            if 0 <= gain <= TIE * adv.step_time_s:  # practice's recipe is as fast: its conclusion stands
                row["agrees"] = "tie"
                row["comparison"]["detail"] = (f"a tie: practice's recipe is within {TIE:.0%} of the plan "
                                               f"({row['comparison']['detail']})")
    return row


def sweep_line(row: dict) -> str:
    adv: Advice = row["advice"]
    rec = row.get("practice")
    what = (f"{adv.strategy['name']} [{adv.strategy['layout']}] step {adv.step_time_s:.3g} s MFU {adv.mfu:.1%}"
            if adv.fits else f"does not fit: {adv.binding}")
    out = f"{row['model']} ({row['params'] / 1e9:.1f}B) on {row['gpus']} GPUs: {what}; planned in {adv.plan_s:.1f} s"
    out += f"; practice {rec if rec else 'none fits'}: {_agree_word(row['agrees'])}"
    if "comparison" in row:
        out += f" ({row['comparison']['detail']})"
    return out


def _agree_word(agrees: bool | str | None) -> str:
    return {True: "agrees", "tie": "agrees (tie)", False: "differs", None: "beyond practice"}[agrees]


def sweep_json(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        d = {"model": r["model"], "params": r["params"], "gpus": r["gpus"], "advice": r["advice"].to_json(),
             "practice": dataclasses.asdict(r["practice"]) if r["practice"] else None, "agrees": r["agrees"]}
        if "comparison" in r:
            d["comparison"] = r["comparison"]
        out.append(d)
    return out


def sweep_markdown(rows: list[dict]) -> str:
    lines = ["| model | params | GPUs | autopart's winner | layout | step (s) | MFU | TFLOP/s/GPU | planning (s) | "
             "published practice | agrees | deciding term (recipe - plan) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a: Advice = r["advice"]
        rec = r["practice"]
        cmp_ = r.get("comparison", {})
        if a.fits:
            cells = [a.strategy["name"], a.strategy["layout"], f"{a.step_time_s:.3g}", f"{a.mfu:.1%}",
                     f"{a.tflops_per_gpu:.0f}" if a.tflops_per_gpu >= 10 else f"{a.tflops_per_gpu:.3g}"]
        else:
            cells = ["does not fit", a.binding.split(" (")[0], "-", "-", "-"]
        lines.append(f"| {r['model']} | {r['params'] / 1e9:.1f}B | {r['gpus']} | " + " | ".join(cells) +
                     f" | {a.plan_s:.1f} | {rec if rec else 'none fits'} | {_agree_word(r['agrees'])} | "
                     f"{cmp_.get('detail', '')} |")
    return "\n".join(lines)


def sweep_diff_markdown(rows: list[dict]) -> str:
    """Term by term, recipe minus plan, for the cells where published practice was scored (``sweep`` rows or
    their ``sweep_json``): milliseconds per step; the largest positive term is what made autopart's plan win."""
    rows = [r if isinstance(r.get("advice"), dict) else sweep_json([r])[0] for r in rows]
    scored = [r for r in rows if r.get("comparison", {}).get("diff")]
    if not scored:
        return ""
    keys = list(dict.fromkeys(k for r in scored for k in r["comparison"]["diff"]))
    lines = ["| model | GPUs | practice's recipe | recipe step (s) | plan step (s) | " +
             " | ".join(k.replace("_", " ") for k in keys) + " |", "|---" * (5 + len(keys)) + "|"]
    for r in scored:
        c, p = r["comparison"], r["practice"]
        rec = f"{p['kind']} (tp={p['tp']} pp={p['pp']} dp={p['dp']})"
        lines.append(f"| {r['model']} | {r['gpus']} | {rec} | {c['recipe_step_s']:.3g} | "
                     f"{r['advice']['step_time_s']:.3g} | " +
                     " | ".join(f"{c['diff'].get(k, 0.0) * 1e3:+.1f}" for k in keys) + " |")
    return "\n".join(lines)


def sweep_chart(rows: list[dict], path: str, title: str = "") -> str:
    """A PNG: model size (rows) x GPU count (columns), each cell colored by the winning strategy family and
    labelled with its layout and MFU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    gpus = sorted({r["gpus"] for r in rows})
    families = ["DP", "ZeRO", "TP", "TP+DP", "PP", "TP+PP", "CP", "does not fit"]
    colors = dict(zip(families, ["#4c9be8", "#8fc4f5", "#f2a541", "#f7c873", "#b07cc6", "#e0675a", "#5cb85c",
                                 "#d9d9d9"]))

    def family(a: Advice) -> str:
        if not a.fits:
            return "does not fit"
        s = a.strategy
        if s["cp"] > 1:
            return "CP"
        if s["tp"] > 1 and s["pp"] > 1:
            return "TP+PP"
        if s["pp"] > 1:
            return "PP"
        if s["tp"] > 1:
            return "TP+DP" if s["dp"] > 1 else "TP"
        return "ZeRO" if s["zero"] else "DP"

    fig, ax = plt.subplots(figsize=(2.8 * len(gpus) + 1.5, 1.6 * len(models) + 1.5))
    for r in rows:
        i, j = models.index(r["model"]), gpus.index(r["gpus"])
        a: Advice = r["advice"]
        fam = family(a)
        ax.add_patch(plt.Rectangle((j, i), 1, 1, color=colors[fam], ec="white"))
        layout = a.strategy["layout"].replace(", ", "\n") if a.fits else ""
        text = f"{a.strategy['name']}\n{layout}\nMFU {a.mfu:.0%}" if a.fits else "does not fit"
        if a.fits and r["agrees"] is not True:
            text += "\n(" + _agree_word(r["agrees"]).replace("differs", "differs from practice") + ")"
        ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=6.5)
    ax.set_xlim(0, len(gpus))
    ax.set_ylim(0, len(models))
    ax.set_xticks([j + 0.5 for j in range(len(gpus))], [str(g) for g in gpus])
    ax.set_yticks([i + 0.5 for i in range(len(models))],
                  [f"{m}\n{next(r['params'] for r in rows if r['model'] == m) / 1e9:.1f}B" for m in models])
    ax.set_xlabel("GPUs")
    ax.set_ylabel("model")
    ax.invert_yaxis()
    used = [f for f in families if any(family(r["advice"]) == f for r in rows)]
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[f]) for f in used], labels=used,
              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(used), fontsize=8)
    ax.set_title(title or "autopart design guide: winning strategy per model size and GPU count")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
