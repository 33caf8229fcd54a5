"""Pipeline parallelism on real gloo processes: loss at every step and the gathered parameters after 3 AdamW steps
equal a single-process run within 1e-5 (fp32); forward-only logits too. Each schedule is forced with
``pipeline={...}`` so that the configuration under test is the one that runs (the plan records it)."""

from __future__ import annotations

import math

import pytest

from autopart.plan import Plan
from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import batches, check, distributed, reference

pytestmark = pytest.mark.multiproc

LAYERS = 4
CONFIGS = {
    # name: (mesh shape, axis names, roles, forced pipeline options)
    "pp2-gpipe": ((2,), ("pp",), {"pp": "pp"}, {"schedule": "gpipe", "micro_batches": 2}),
    "pp2-1f1b": ((2,), ("pp",), {"pp": "pp"}, {"schedule": "1f1b", "micro_batches": 4}),
    "pp2-interleaved": ((2,), ("pp",), {"pp": "pp"}, {"schedule": "interleaved", "virtual": 2, "micro_batches": 2}),
    "pp2xtp2": ((2, 2), ("pp", "tp"), {"pp": "pp", "tp": "tp"}, {"schedule": "1f1b", "micro_batches": 2}),
    "pp2xdp2xtp2": ((2, 2, 2), ("pp", "dp", "tp"), {"pp": "pp", "dp": "dp", "tp": "tp"},
                    {"schedule": "1f1b", "micro_batches": 2}),
}
# every schedule on GPT; Hugging Face Llama (its rotary buffers and mask in the stages) on the interleaved
# schedule's virtual stages and under tensor and data parallelism (1F1B): its GPipe and plain 1F1B runs repeated
# what these cover (CI time)
CASES = [("gpt", c) for c in CONFIGS] + [("hf-llama", c) for c in ("pp2-interleaved", "pp2xtp2", "pp2xdp2xtp2")]


@pytest.mark.parametrize("model,config", CASES, ids=[f"{m}-{c}" for m, c in CASES])
def test_pipeline_parity(model: str, config: str) -> None:
    if model.startswith("hf-"):
        pytest.importorskip("transformers")
    shape, names, roles, pipe = CONFIGS[config]
    results = run_ranks(math.prod(shape), distributed, model, shape, names, roles, False, None, pipe, LAYERS)
    check(model, results, reference(model, LAYERS))
    plan = Plan.from_json(results[0][3])
    assert all(r[3] == results[0][3] for r in results), "ranks ran different plans"
    pp = plan.pipeline
    assert pp["degree"] == 2 and pp["schedule"] == pipe["schedule"]
    assert pp["micro_batches"] == pipe["micro_batches"]
    chunks = 2 * pp["virtual"]
    assert sorted(set(pp["stage_of_layer"].values())) == list(range(chunks))
    assert len(pp["stages"]) == chunks and sum(len(s["layers"]) for s in pp["stages"]) == LAYERS
    if "tp" in roles:
        assert plan.axis_role(names.index("tp")) in ("tensor", "data+tensor")
    if "dp" in roles:
        assert plan.reduced, "a data-parallel stage reduces gradients"


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_pipeline_with_checkpointing(mode: str) -> None:
    """Activation checkpointing inside pipeline stages (forced on every block) keeps parity."""
    shape, names, roles = (2,), ("pp",), {"pp": "pp"}
    pipe = {"schedule": "1f1b", "micro_batches": 2}
    results = run_ranks(2, distributed, "gpt", shape, names, roles, False, mode, pipe, LAYERS)
    check("gpt", results, reference("gpt", LAYERS))
    plan = Plan.from_json(results[0][3])
    assert plan.checkpoint == {f"blocks.{i}": mode for i in range(LAYERS)}
    assert plan.pipeline["degree"] == 2


def test_pipeline_chosen_by_the_solver() -> None:
    """With only the pipeline axis named, the solver picks micro-batches, schedule and boundaries; parity holds."""
    results = run_ranks(2, distributed, "llama", (2,), ("pp",), {"pp": "pp"}, False, None, None, LAYERS)
    check("llama", results, reference("llama", LAYERS))
    pp = Plan.from_json(results[0][3]).pipeline
    assert pp["degree"] == 2 and pp["micro_batches"] >= 1 and pp["schedule"] in ("gpipe", "1f1b", "interleaved")


def _clipped_run(axes: tuple[str, str] = ("pp", "tp"), zero: int | None = None, norm_type: float = 2.0):
    import torch

    import autopart
    from tests.multiproc.parity import OPT, batches, make_model

    model = make_model("gpt", LAYERS)
    mesh = autopart.mesh((2, 2), axes)
    ids0 = batches()[0]
    pm = autopart.parallelize(model, mesh, (ids0,), {"labels": ids0}, roles={a: a for a in axes}, zero=zero,
                              pipeline={"schedule": "1f1b", "micro_batches": 2})
    opt = pm.optimizer(torch.optim.AdamW, **OPT)
    out = []
    for ids in batches():
        out.append(pm.forward_backward(ids, labels=ids).item())
        out.append(float(pm.clip_grad_norm_(0.5, norm_type=norm_type)))
        opt.step()
        opt.zero_grad()
    return out, {k: v.clone() for k, v in pm.full_state_dict().items()}, dict(pm.plan.zero)


@pytest.mark.parametrize("axes,zero,norm_type", [(("pp", "tp"), None, 2.0), (("pp", "tp"), None, math.inf),
                                                  (("pp", "dp"), 1, 2.0), (("pp", "dp"), 2, 2.0),
                                                  (("pp", "dp"), 2, math.inf)])
def test_pipeline_grad_clipping(axes, zero, norm_type) -> None:
    """``pm.clip_grad_norm_`` clips by the norm over every stage (the tied embedding/head counted once), of
    tensor-parallel shards and of ZeRO-1/2 gradient slices (each summed only on its slice's rank), 2-norm and
    max-norm: losses, norms and parameters as one process clipping its gradients, over 3 AdamW steps."""
    import torch

    from tests.multiproc.parity import reference_clipped

    results = run_ranks(4, _clipped_run, axes, zero, norm_type)
    ref, model = reference_clipped("gpt", LAYERS, norm_type=norm_type)
    for out, params, levels in results:
        assert set(levels.values()) == ({zero} if zero else {0}) or not zero and not levels, levels
        assert out == pytest.approx(ref, abs=1e-5), (out, ref)  # losses and global gradient norms
        for k, v in model.named_parameters():
            torch.testing.assert_close(params[k], v.detach(), rtol=0, atol=1e-5)


def _checkpoint_run(path: str):
    import torch
    import torch.distributed.checkpoint as dcp

    import autopart
    from tests.multiproc.parity import OPT, batches, make_model

    mesh = autopart.mesh((2, 2), ("pp", "tp"))
    ids = batches()[0]
    kw = dict(roles={"pp": "pp", "tp": "tp"}, pipeline={"schedule": "1f1b", "micro_batches": 2})
    pm = autopart.parallelize(make_model("gpt", LAYERS), mesh, (ids,), {"labels": ids}, **kw)
    opt = torch.optim.AdamW(pm.parameters(), **OPT)
    pm.forward_backward(ids, labels=ids)
    opt.step()
    dcp.save(pm.state_dict(), checkpoint_id=path)  # each rank writes its stage's shards
    trained = {k: v.clone() for k, v in pm.full_state_dict().items()}
    fresh = autopart.parallelize(make_model("gpt", LAYERS), mesh, (ids,), {"labels": ids}, **kw)
    before = {k: v.clone() for k, v in fresh.full_state_dict().items()}
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state)
    return trained, {k: v.clone() for k, v in fresh.full_state_dict().items()}, before


def test_pipeline_distributed_checkpoint_roundtrip(tmp_path) -> None:
    """torch.distributed.checkpoint saves and loads a pipelined module (stage parameters as DTensors)."""
    import torch

    for trained, loaded, before in run_ranks(4, _checkpoint_run, str(tmp_path / "ckpt")):
        assert trained.keys() == loaded.keys()
        assert any((trained[k] - before[k]).abs().max() > 0 for k in trained)
        for k in trained:
            torch.testing.assert_close(loaded[k], trained[k], rtol=0, atol=0)


def _dp_overlap_run(pipe: dict, zero: int):
    import torch

    import autopart
    from autopart.runtime import grads
    from tests.multiproc.parity import OPT, batches, make_model, train

    grads.BUCKET_BYTES = 16 * 2**10  # several buckets per chunk on the tiny model
    mesh = autopart.mesh((2, 2), ("pp", "dp"))
    ids0 = batches()[0]
    pm = autopart.parallelize(make_model("gpt", LAYERS), mesh, (ids0,), {"labels": ids0},
                              roles={"pp": "pp", "dp": "dp"}, zero=zero, pipeline=pipe)
    grads.STATS.update(launched_in_backward=0, launched_at_end=0)
    losses, full = train(pm, pm.optimizer(torch.optim.AdamW, **OPT))
    buckets = [(b.deferred, b.scatter, sorted({pm._grads._chunk_of[e.key] for e in b.entries}))
               for b in pm._grads.buckets()]
    return losses, full, str(pm.plan), pm.plan.to_json(), pm(batches()[0]).detach(), dict(grads.STATS), buckets


def test_pipeline_reduction_launched_in_schedule() -> None:
    """pp2 x dp2, interleaved (2 chunks per rank), ZeRO-2, 16 KiB buckets: every bucket of a parameter one stage
    holds was reduce-scattered from a gradient hook during the schedule (once the last micro-batch's backward
    through its chunk had accumulated it), none after it; a bucket holds one chunk's parameters; the tied
    embedding/head (held by the first and the last stage) is reduced after its stages' sum. Losses, parameters and
    forward-only logits match one process after 3 AdamW steps."""
    pipe, zero = {"schedule": "interleaved", "virtual": 2, "micro_batches": 2}, 2
    results = run_ranks(4, _dp_overlap_run, pipe, zero)
    check("gpt", [r[:5] for r in results], reference("gpt", LAYERS))
    plan = Plan.from_json(results[0][3])
    assert plan.pipeline["schedule"] == pipe["schedule"] and plan.reduced
    assert max(plan.zero.values(), default=0) == zero, plan.zero
    for *_, stats, buckets in results:
        launched = [b for b in buckets if not b[0]]
        assert len(launched) >= 2 and all(len(chunks) == 1 for _, _, chunks in launched), buckets
        assert sum(deferred for deferred, _, _ in buckets) >= 1, buckets  # the tied embedding/head
        assert all(scatter for _, scatter, _ in launched), buckets
        assert stats == {"launched_in_backward": len(batches()) * len(launched), "launched_at_end": 0}, stats
