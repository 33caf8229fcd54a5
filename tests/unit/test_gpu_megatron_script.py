"""``benchmarks/gpu_megatron_compute.py``, the prepared script a session lent a GPU runs: its measure step on CPU at
small shapes (the same code path but the profiler's), then its comparison with autopart's predictions."""

from __future__ import annotations

import importlib.util
import json
import math
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script():
    spec = importlib.util.spec_from_file_location("gpu_megatron_compute",
                                                  os.path.join(ROOT, "benchmarks", "gpu_megatron_compute.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_measure_then_compare_on_cpu(tmp_path, capsys) -> None:
    s = _script()
    out = tmp_path / "measured.json"
    s.main(["measure", "--device", "cpu", "--tiny", "--steps", "1", "--warmup", "0", "--out", str(out)])
    measured = json.loads(out.read_text())
    assert [c["case"] for c in measured["cases"]] == ["tiny model", "tiny layer", "tiny head"]
    assert all(c["step_s"] > 0 and c["params"] > 0 for c in measured["cases"])
    rows = s.compare(type("A", (), {"measured": str(out), "cluster": "h100-80gb", "json": "", "tiny": False})())
    assert [r["case"] for r in rows] == ["tiny model", "tiny layer", "tiny head"]
    for r in rows:  # predicted compute is positive and its kinds add up to it
        assert r["predicted_s"] > 0 and math.isfinite(r["ratio"])
        assert sum(r["predicted_kinds_s"].values()) <= r["predicted_s"] * (1 + 1e-9)
    assert rows[1]["predicted_kinds_s"]["attention"] > 0 and rows[1]["predicted_kinds_s"]["gemm"] > 0
    assert "| tiny layer |" in capsys.readouterr().out


def test_the_shard_layer_is_the_gpt_block_at_tp_1() -> None:
    """At tensor parallel 1 the shard layer computes what autopart's GPT block computes (same weights)."""
    import torch

    s = _script()
    gpt = s._gpt_module()
    cfg = gpt.GPTConfig(n_head=4, d_model=64, bias=False)
    block, shard = gpt.Block(cfg), s.ShardLayer(64, 4, 1)
    with torch.no_grad():
        for a, b in (("ln1", "ln1"), ("ln2", "ln2"), ("attn.q", "q"), ("attn.k", "k"), ("attn.v", "v"),
                     ("attn.proj", "proj"), ("mlp.fc", "fc"), ("mlp.proj", "fc_proj")):
            shard.get_submodule(b).weight.copy_(block.get_submodule(a).weight)
    x = torch.randn(2, 16, 64)
    torch.testing.assert_close(shard(x), block(x), atol=1e-5, rtol=1e-5)
