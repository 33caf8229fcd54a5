"""Parity on real gloo processes: loss at every step and the gathered parameters after 3 AdamW steps equal a
single-process run within 1e-5 (fp32), for dp=2, tp=2 and 2x2, on four models."""

from __future__ import annotations

import math

import pytest

from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import check, distributed, reference

pytestmark = pytest.mark.multiproc

CONFIGS = {
    "dp2": ((2,), ("dp",), {"dp": "dp"}),
    "tp2": ((2,), ("tp",), {"tp": "tp"}),
    "dp2xtp2": ((2, 2), ("dp", "tp"), {"dp": "dp", "tp": "tp"}),
}
MODELS = ["gpt", "llama", "hf-gpt2", "hf-llama"]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("model", MODELS)
def test_parity(model: str, config: str) -> None:
    if model.startswith("hf-"):
        pytest.importorskip("transformers")
    shape, names, roles = CONFIGS[config]
    results = run_ranks(math.prod(shape), distributed, model, shape, names, roles)
    check(model, results, reference(model))
    plan_json = results[0][3]
    assert all(r[3] == plan_json for r in results), "ranks ran different plans"
    if "tp" in roles:  # the plan really is tensor parallel: matmul weights sharded on the tp axis
        from autopart.plan import Plan

        plan = Plan.from_json(plan_json)
        axis = names.index("tp")
        assert plan.axis_role(axis) in ("tensor", "data+tensor")
        sharded = [k for k, v in plan.params.items() if "S" in v and k.endswith("weight")]
        assert len(sharded) >= 4, plan.params
        if model == "hf-gpt2":  # the fused [q | k | v] split in its blocks: each rank its heads, nothing between
            assert all(plan.params[f"transformer.h.{i}.attn.c_attn.weight"].endswith("S(1)/3") for i in range(2))
            assert not any(kind == "all_to_all" for kind, _ in plan.collective_counts("transformer.h.0")), \
                plan.collective_counts("transformer.h.0")
    if "dp" in roles:
        from autopart.plan import Plan

        plan = Plan.from_json(plan_json)
        assert plan.axis_role(names.index("dp")) in ("data", "data+tensor")
        assert plan.reduced, "a data-parallel plan reduces gradients"


# architectures whose graphs needed rules or passes beyond GPT-2 and Llama: RMSNorm's type_as (Gemma), weight.T
# and list indexing (Falcon), in-place writes into new tensors (T5's labels shifted right; ``inplace``), the SSM's
# conv1d, zero pads and repeat_interleave (Mamba-2); an op without a rule on a data-parallel batch (``unruled``:
# gathered for it); Phi-3's fused projections sliced and chunked into blocks (split in them: ``Strided``). One
# spawned world runs them all (start-up dominates).
# Mixture-of-experts layers that dispatch over all tokens run as one token-local node on each rank's own tokens
# (``hf-mixtral``: Hugging Face's sort/histc/grouped_mm; ``routed``: a declared module with a nonzero loop; under
# tp2, hf-mixtral's and DeepSeek-V3's experts split over the axis: expert parallelism).
ZOO = [("hf-gemma", "dp2"), ("hf-falcon", "tp2"), ("hf-t5", "dp2"), ("hf-mamba2", "dp2"), ("inplace", "tp2"),
       ("unruled", "dp2"), ("hf-mixtral", "dp2"), ("routed", "dp2"), ("hf-mixtral", "tp2"),
       ("hf-mixtral", "dp2-ep"), ("hf-deepseek-v3", "tp2"), ("hf-phi3-gqa", "tp2"), ("hf-mamba2", "tp2"),
       ("hf-mamba2-g2", "tp2")]
# dp2-ep: the experts pinned split over the data-parallel axis (expert parallelism over the dp ranks, as
# DeepSpeed-MoE runs it), the rest data parallel
_EXPERTS = [f"model.layers.{i}.mlp.experts.{w}" for i in range(2) for w in ("gate_up_proj", "down_proj")]
ZOO_CONFIGS = {**CONFIGS, "dp2-ep": CONFIGS["dp2"] + (False, None, None, 2, dict.fromkeys(_EXPERTS, "S(0)")),
               "dp2xtp2-ep-both": CONFIGS["dp2xtp2"] + (False, None, None, 2, dict.fromkeys(_EXPERTS, "S(0)S(0)"))}


def _zoo(cases):
    return [distributed(model, *ZOO_CONFIGS[config]) for model, config in cases]


def test_more_architectures() -> None:
    """Each (model, config) of ``ZOO`` on 2 gloo ranks matches one process over 3 AdamW steps (loss, parameters,
    forward-only logits), on a plan that splits what its roles say (a data-parallel plan reduces gradients; a
    tensor-parallel one shards weights)."""
    pytest.importorskip("transformers")
    from autopart.plan import Plan

    results = run_ranks(2, _zoo, ZOO)
    for i, (model, config) in enumerate(ZOO):
        per_rank = [r[i] for r in results]
        check(f"{model} {config}", per_rank, reference(model))
        plan = Plan.from_json(per_rank[0][3])
        if config.startswith("dp2"):
            assert plan.reduced, (model, str(plan))
        else:
            assert any("S" in v for v in plan.params.values()), (model, plan.params)
        local = [r for r in plan.nodes.values() if "token_local" in r["op"]]
        if model in ("hf-mixtral", "routed") and config == "dp2":
            assert len(local) == 2 and all(r["output"] == ["S(0)"] for r in local), local  # on the rank's tokens
        if config == "dp2-ep":  # the experts' gradients are complete on their rank: not reduced
            assert not set(_EXPERTS) & set(plan.reduced) and "4 experts over dp" in str(plan), plan.reduced
        if model == "hf-deepseek-v3":  # its experts split over tp too (with its shared expert and grouped routing)
            assert "model.layers.1.mlp (4 experts over tp)" in per_rank[0][2], per_rank[0][2]
        if model == "hf-phi3-gqa":  # grouped-query qkv_proj sliced into q (32), k, v (16): split in its blocks of
            # unequal lengths (stored permuted); gate_up_proj chunked in 2; a block's only collectives Megatron's
            assert [plan.params[f"model.layers.0.{w}.weight"] for w in ("self_attn.qkv_proj", "mlp.gate_up_proj")] \
                == ["S(0)/32+16+16", "S(0)/2"], plan.params
            block = [c for c in plan.collectives if c["layer"] == "model.layers.1"]
            assert sorted(s for c in block for s in c["steps"][0][1:] if s.startswith(("all_", "reduce_"))) == \
                ["all_reduce"] * 4, block
        if model.startswith("hf-mamba2") and config == "tp2":  # in_proj split into z (64), xBC, dt (8), and xBC
            # after the depthwise convolution into x (64), B, C (8 each, 16 with 2 groups): in_proj in those five
            # blocks, the convolution in x, B, C (its groups made local)
            mixer, bc = "backbone.layers.0.mixer", 16 if model == "hf-mamba2-g2" else 8
            assert [plan.params[f"{mixer}.{w}.weight"] for w in ("in_proj", "conv1d", "out_proj")] == \
                [f"S(0)/64+64+{bc}+{bc}+8", f"S(0)/64+{bc}+{bc}", "S(1)"], plan.params
        if model == "hf-mamba2-g2":  # heads and groups split alike: Mamba-2's one all-reduce forward (and backward)
            block = [c for c in plan.collectives if c["layer"] == "backbone.layers.1"]
            assert sorted(s for c in block for s in c["steps"][0][1:] if s.startswith(("all_", "reduce_"))) == \
                ["all_reduce"] * 2, block
        if model == "hf-mixtral" and config == "tp2":  # expert parallel: each rank's tokens to their experts' ranks
            experts = {k: v for k, v in plan.params.items() if ".experts." in k}
            assert len(experts) == 4 and set(experts.values()) == {"S(0)"}, experts
            assert len(local) == 2 and all(r["output"][0].startswith("S(") for r in local), local


MOE_2X2 = [("hf-mixtral", "dp2xtp2"), ("hf-mixtral", "dp2xtp2-ep-both")]


def test_hf_moe_expert_parallel_on_2x2() -> None:
    """Hugging Face Mixtral on 4 ranks: dp x tp roles (the experts split over tp, the tokens over both axes), and
    the experts pinned split over both axes (4 experts, one per rank: the dispatch nests, dp then tp), as one
    process over 3 AdamW steps."""
    pytest.importorskip("transformers")
    from autopart.plan import Plan

    results = run_ranks(4, _zoo, MOE_2X2)
    for i, (model, config) in enumerate(MOE_2X2):
        per_rank = [r[i] for r in results]
        check(f"{model} {config}", per_rank, reference(model))
        over = "dp+tp" if config.endswith("ep-both") else "tp"
        assert f"model.layers.0.mlp (4 experts over {over})" in per_rank[0][2], per_rank[0][2]
        plan = Plan.from_json(per_rank[0][3])
        assert not set(_EXPERTS) & {k for k, axes in plan.reduced.items() if 1 in axes}, plan.reduced


# GPT-2's fused c_attn split in its blocks (Strided) with FSDP on the other axis (ZeRO-3 over the weight's rows, the
# bias, whose one dim is the strided one, whole there: torchtitan's FSDP2 + TP layout) and inside pipeline stages
FUSED = [("dp2xtp2-zero3", (2, 2), ("dp", "tp"), {"dp": "dp", "tp": "tp"}, "off", 3),
         ("pp2xtp2", (2, 2), ("pp", "tp"), {"pp": "pp", "tp": "tp"}, {"schedule": "1f1b", "micro_batches": 2}, None)]


def _fused(cases):
    return [distributed("hf-gpt2", shape, names, roles, pipeline=pp, zero=zero)
            for _, shape, names, roles, pp, zero in cases]


def test_fused_projection_with_fsdp_and_pipeline_stages() -> None:
    pytest.importorskip("transformers")
    from autopart.plan import Plan

    results = run_ranks(4, _fused, FUSED)
    for i, (label, *_rest) in enumerate(FUSED):
        per_rank = [r[i] for r in results]
        check(f"hf-gpt2 {label}", per_rank, reference("hf-gpt2"))
        plan = Plan.from_json(per_rank[0][3])
        w, b = (plan.params[f"transformer.h.0.attn.c_attn.{x}"] for x in ("weight", "bias"))
        if label == "dp2xtp2-zero3":
            assert (w, b) == ("S(0)S(1)/3", "RS(0)/3") and plan.zero["transformer.h.0.attn.c_attn.weight"] == 3
        else:
            assert (w, b) == ("RS(1)/3", "RS(0)/3") and plan.pipeline["degree"] == 2, (w, b, plan.pipeline)
