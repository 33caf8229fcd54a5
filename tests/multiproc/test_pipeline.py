"""Pipeline parallelism on real gloo processes: loss at every step and the gathered parameters after 3 AdamW steps
equal a single-process run within 1e-5 (fp32); forward-only logits too. Each schedule is forced with
``pipeline={...}`` so that the configuration under test is the one that runs (the plan records it)."""

from __future__ import annotations

import math

import pytest

from autopart.plan import Plan
from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import check, distributed, reference

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
CASES = [(m, c) for m in ("gpt", "hf-llama") for c in CONFIGS]


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
