"""``autopart advise``'s inputs and report labels: bad input gets a clear error (what, why, how to fix), never a
silently wrong answer; the report's rows say what the plan does. Tiny models only (a plan takes about a second)."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
import torch.nn as nn

from autopart.cli import main
from autopart.cost.cluster import PRESETS

adv = importlib.import_module("autopart.advise")  # the module (``autopart.advise`` is the function)

SMALL = dict(layers=2, seq=128, views=False)


def llama_with_inputs():
    """A factory returning its own example inputs: batch 4 x 64 tokens."""
    from autopart.models import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128))
    ids = torch.randint(0, 300, (4, 64))
    return model, (ids,), {"labels": ids}


class MLP(nn.Module):
    """No numbered blocks: nothing has a ``layer`` name."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(512, 2048)
        self.l2 = nn.Linear(2048, 512)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x))).float().pow(2).mean()


def mlp_with_inputs():
    return MLP(), (torch.randn(64, 128, 512),), {}


def llama_mixed():
    """Batch 4 on 8 GPUs: the plan splits heads on some ops and the sequence on others over one axis."""
    from autopart.models import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=32000, n_layer=2, n_head=16, n_kv_head=4, d_model=2048, d_ff=5632,
                              max_seq_len=4096))
    ids = torch.randint(0, 32000, (4, 1024))
    return model, (ids,), {"labels": ids}


# ---- 1. a cluster file's devices_per_node ----------------------------------------------------------------------
def test_cluster_file_devices_per_node_is_the_default(tmp_path, capsys) -> None:
    path = tmp_path / "four.toml"
    path.write_text('name = "test-four"\nbase = "h100-80gb"\ndevices_per_node = 4\n')
    try:
        a = adv.advise("gpt", "125m", cluster=str(path), nodes=2, **SMALL)
        assert a.fits and a.gpus == 8 and a.mesh == (2, 4)  # 2 nodes of the file's 4, not of 8
        assert a.cluster == "test-four"
        assert adv.devices_per_node(str(path)) == 4
        assert adv.devices_per_node("h100-80gb") == 8 and adv.devices_per_node("cpu") == 8  # presets keep 8
        assert adv.devices_per_node(str(path), 2) == 2  # given: it overrides the file
        rc = main(["advise", "--model", "gpt:125m", "--layers", "2", "--seq", "128", "--cluster", str(path),
                   "--nodes", "2", "--physical-mesh", "--json"])
        assert rc == 0
        d = json.loads(capsys.readouterr().out)
        assert d["gpus"] == 8 and d["mesh"] == [2, 4]
    finally:
        PRESETS.pop("test-four", None)


def test_sweep_checks_every_gpu_count_before_planning(monkeypatch) -> None:
    planned = []
    monkeypatch.setattr(adv, "advise", lambda *a, **k: planned.append(k) or pytest.fail("planned"))
    with pytest.raises(ValueError, match=r"GPU counts \[12\].*8-GPU nodes"):
        adv.sweep(("gpt:125m",), (4, 12))
    with pytest.raises(ValueError, match=r"GPU counts \[0\]"):
        adv.sweep(("gpt:125m",), (0,))
    assert planned == []
    assert main(["advise", "--sweep", "--sizes", "gpt:125m", "--gpus", "4,12"]) == 1
    assert main(["advise", "--sweep", "--sizes", "gpt:125m", "--gpus", "4,x"]) == 1
    assert planned == []


# ---- 2. silently accepted input --------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (["--batch", "0"], ["--batch 0", ">= 1"]),
    (["--seq", "0"], ["--seq 0", ">= 1"]),
    (["--model", "llama:8b", "--size", "70b"], ["'8b'", "'70b'", "once"]),
    (["--model", "llama-8b", "--size", "70b"], ["'8b'", "'70b'"]),
    (["--gpus", "64"], ["--gpus", "--sweep"]),
    (["--sizes", "llama:8b"], ["--sizes", "--sweep"]),
    (["--batch-per-gpu", "4"], ["--batch-per-gpu", "--sweep"]),
    (["--batch", "1", "--max-batch", "4"], ["--max-batch", "--batch max"]),
    (["--sweep", "--batch", "8"], ["--batch", "ignore"]),
    (["--sweep", "--layers", "2"], ["--layers", "ignore"]),
    (["--model", "gpt", "--factory", "x:y"], ["--factory", "--model"]),
    (["--time-limit", "0"], ["--time-limit", "positive"]),
])
def test_cli_rejects_ignored_or_contradictory_flags(argv, words, capsys, monkeypatch) -> None:
    monkeypatch.setattr(adv, "advise", lambda *a, **k: pytest.fail("planned despite bad input"))
    monkeypatch.setattr(adv, "sweep", lambda *a, **k: pytest.fail("planned despite bad input"))
    argv = (["--model", "gpt:125m"] if "--model" not in argv and "--sweep" not in argv else []) + argv
    assert main(["advise", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("autopart advise: ")
    for w in words:
        assert w in err, (w, err)


def test_api_rejects_non_positive_and_contradictions() -> None:
    for kw in (dict(batch=0), dict(seq=0), dict(batch=-2), dict(time_limit_s=0)):
        with pytest.raises(ValueError, match=r"(>= 1|positive)"):
            adv.advise("gpt", "125m", layers=2, gpus_per_node=2, views=False, **kw)
    with pytest.raises(ValueError, match="'8b'.*'70b'"):
        adv.advise("llama:8b", "70b", layers=2, seq=128, gpus_per_node=2, views=False)
    assert adv._split_model("llama:8b", "8B") == ("llama", "8b")  # the same size twice is no contradiction


def test_factory_inputs_versus_explicit_batch_and_seq() -> None:
    kw = dict(factory=llama_with_inputs, gpus_per_node=2, views=False)
    a = adv.advise(**kw)  # no batch/seq asked for: the factory's inputs
    assert a.fits and (a.batch, a.seq) == (4, 64)
    assert adv.advise(batch=4, seq=64, **kw).fits  # asked for what the factory brings: fine
    with pytest.raises(ValueError, match=r"own example inputs of batch 4 x 64 tokens, but batch 16 .*Leave out"):
        adv.advise(batch=16, **kw)
    with pytest.raises(ValueError, match=r"but seq 2048 was asked for"):
        adv.advise(seq=2048, **kw)


# ---- 3. error messages -----------------------------------------------------------------------------------------
def test_inference_too_big_is_worded_for_inference() -> None:
    a = adv.advise("llama", "70b", gpus_per_node=1, batch=1, seq=1, inference=True, kv_cache_tokens=16)
    assert not a.fits and a.binding.startswith("weights: ") and "inference" in a.binding
    assert "optimizer offloaded" not in a.binding and "model states" not in a.binding
    t = adv.advise("llama", "70b", gpus_per_node=1, batch=1, seq=16)  # training keeps its wording
    assert not t.fits and "optimizer offloaded" in t.binding


def test_serving_stopped_by_the_kv_cache_names_it() -> None:
    # 2 layers x 8 K/V heads x 64 channels x K and V x 2 bytes = 4 KiB per token: 64 GiB of cache per sequence at
    # 2**24 tokens. Batch 1 fits an H100, batch 2 does not, because of the cache
    srv = adv.advise_serving("llama", "1b", layers=2, gpus_per_node=1, seq=1, kv_cache_tokens=2**24, views=False)
    assert srv.best is not None and srv.best.batch == 1
    assert srv.stopped.startswith("batch 2 does not fit: K/V cache: "), srv.stopped
    assert "activations and working memory" not in srv.stopped
    # the figures behind those words, as the planner measured them (not parsed from its message)
    nf = srv.rows[-1].no_fit
    cache = sum(t["bytes"] for t in nf["terms"] if t["kind"] == "K/V cache")
    assert cache == pytest.approx(2 * 64 * 2**30, rel=0.01) and nf["smallest_peak_bytes"] > cache
    assert nf["smallest_peak_bytes"] > nf["limit_bytes"] and srv.rows[-1].to_json()["no_fit"] == nf
    assert srv.best.no_fit == {}


# ---- 4. report labels ------------------------------------------------------------------------------------------
def test_strategy_of_a_model_without_numbered_blocks() -> None:
    a = adv.advise(factory=mlp_with_inputs, gpus_per_node=8, views=False)
    assert a.fits and a.plan.params and not any(r["layer"] for r in a.plan.nodes.values())
    specs = {r["inputs"][0] for r in a.plan.nodes.values() if "linear" in r["op"]}
    assert specs == {"RS(0)"}  # the plan splits the batch 8 ways
    s = a.strategy
    assert (s["dp"], s["tp"], s["pp"], s["cp"]) == (8, 1, 1, 1) and s["axes"]["gpu=8"] == "dp"
    assert s["name"] in ("DP", f"ZeRO-{s['zero']}") and s["name"] != "single GPU"
    assert s["zero"] == max(a.plan.zero.values(), default=0)


def test_mixed_axis_degrees_are_marked(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    rc = main(["advise", "--factory", "tests.unit.test_advise_inputs:llama_mixed", "--physical-mesh"])
    assert rc == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "dp / tp / pp / cp" in line)
    assert "8 (mixed)" in row and "gpu=8 does cp and tp, each on some ops" in row, row
    # unit: one axis doing dp and tp, another only dp
    s = {"dp": 16, "tp": 8, "pp": 1, "cp": 1}
    text = adv.degrees_text(s, ("node", "gpu"), (2, 8), [{"dp"}, {"dp", "tp"}])
    assert text == "16 (mixed) / 8 (mixed) / 1 / 1; gpu=8 does dp and tp, each on some ops, counted in each"
    assert adv.degrees_text(s, ("node", "gpu"), (2, 8), [{"dp"}, {"tp"}]) == "16 / 8 / 1 / 1"


def test_zero2_gradient_reduce_scatter_and_exposed_time(capsys, monkeypatch) -> None:
    import autopart
    from autopart.trace import trace

    built = adv.build("gpt", "125m", batch=8, seq=64, layers=2, hidden=128, heads=4)
    _, model, inputs, kwargs, _ = built
    traced = trace(model, inputs, kwargs)
    plan = autopart.evaluate(model, 8, inputs, kwargs, cluster="h100-80gb", traced=traced, zero=2)
    assert set(plan.zero.values()) == {2}
    comm = adv.communication(plan, traced)
    rs, grs, gar = comm["reduce_scatter"], comm["gradient_reduce_scatter"], comm["gradient_all_reduce"]
    assert rs["bytes"] > 0 and rs["time_s"] > 0 and grs["bytes"] == pytest.approx(rs["bytes"])
    assert gar["bytes"] == 0 and gar["time_s"] == 0  # no gradient is all-reduced under ZeRO-2
    for g in (grs, gar):
        assert g["total_s"] >= g["time_s"] - 1e-15
    inside = comm[adv.INSIDE_OPS]["time_s"]
    assert sum(comm[k]["time_s"] for k in adv.KINDS) + inside == pytest.approx(plan.predicted["comm_s"], rel=1e-9)
    # without ZeRO the same gradients are all-reduced: twice the bus bytes of the reduce-scatter
    plain = adv.communication(autopart.evaluate(model, 8, inputs, kwargs, cluster="h100-80gb", traced=traced,
                                                zero=0), traced)
    assert plain["gradient_reduce_scatter"]["bytes"] == 0
    assert plain["gradient_all_reduce"]["bytes"] == pytest.approx(2 * grs["bytes"], rel=0.01)
    # the table: the column says the time is the exposed part, the reduce-scatter row is under reduce_scatter
    monkeypatch.setenv("COLUMNS", "300")
    from rich.console import Console

    from autopart.cli import _rich_advice

    a = adv.read_plan(plan, traced, dict(model="m", params=1, cluster="h100-80gb", gpus=8, mesh=(8,), batch=8,
                                         seq=64, model_flops_per_step=1e12, memory_budget=8e10,
                                         peak_tflops_per_gpu=989.0))
    _rich_advice(a, Console())
    out = capsys.readouterr().out
    assert "exposed ms" in out and "time (ms)" not in out
    lines = out.splitlines()
    i = next(k for k, line in enumerate(lines) if "│ reduce_scatter" in line)
    assert "of which gradient reduce-scatter" in lines[i + 1]


# ---- 5. MFU in the published convention, beside the FLOPs causal kernels run -------------------------------------
@pytest.mark.parametrize("inference", [False, True])
def test_kernel_mfu_beside_conventional_mfu_at_a_long_sequence(inference) -> None:
    from autopart.cost.cluster import preset

    # a small vocabulary and 2 layers at 16k tokens: attention is most of the FLOPs
    a = adv.advise("llama", "1b", layers=2, vocab=1024, gpus_per_node=1, batch=1, seq=16384, views=False,
                   inference=inference)
    assert a.fits
    ceiling = preset("h100-80gb", (1,)).device.mfu
    assert a.mfu > 1.1 * a.kernel_mfu  # the whole S x S square against the causal half
    assert 0 < a.kernel_mfu <= ceiling
    assert a.kernel_flops_per_step < a.model_flops_per_step
    assert a.kernel_tflops_per_gpu == pytest.approx(a.kernel_flops_per_step / a.step_time_s / a.gpus / 1e12)
    assert a.kernel_mfu == pytest.approx(a.kernel_tflops_per_gpu / a.peak_tflops_per_gpu)
    d = a.to_json()
    assert d["kernel_mfu"] == pytest.approx(a.kernel_mfu) and "causal" in d["flops_note"]
    assert "of the FLOPs the kernels run" in str(a) and a.flops_note() in str(a)
    # the published convention is unchanged: 6 N T + the whole square (inference 2 N T + its forward)
    from autopart.trace import trace

    _, module, inputs, kwargs, _ = adv.build("llama", "1b", layers=2, vocab=1024, batch=1, seq=16384,
                                            inference=inference)
    traced = trace(module, inputs, kwargs)
    conv, _, n = adv.model_flops(module, traced, 16384, inference)
    attention = conv - (2 if inference else 6) * n * 16384
    assert a.model_flops_per_step == pytest.approx(conv)
    assert a.kernel_flops_per_step == pytest.approx(conv - attention / 2)


def test_short_sequences_carry_no_flops_note() -> None:
    a = adv.advise("gpt", "125m", gpus_per_node=2, **SMALL)
    assert a.fits and a.kernel_mfu <= a.mfu <= 1.1 * a.kernel_mfu and a.flops_note() == ""


# ---- 6. small FLOP rates -----------------------------------------------------------------------------------------
def test_cpu_rates_are_printed_with_their_digits(capsys, monkeypatch) -> None:
    assert adv.rate(50e9) == "50 GFLOP/s" and adv.rate(3.21e9) == "3.21 GFLOP/s" and adv.rate(989e12) == "989 TFLOP/s"
    assert adv.rate(1.5e12) == "1.5 TFLOP/s" and adv.rate(0.25e9) == "250 MFLOP/s"
    monkeypatch.setenv("COLUMNS", "300")
    rc = main(["advise", "--model", "gpt:125m", "--layers", "2", "--seq", "128", "--cluster", "cpu",
               "--gpus-per-node", "2", "--physical-mesh"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "of 50 GFLOP/s peak" in out and "0 TFLOP/s" not in out
    row = next(line for line in out.splitlines() if "FLOP/s per GPU" in line)
    assert "GFLOP/s" in row and " 0.0 " not in row


def test_fp32_is_priced_and_rated_at_the_fp32_peak() -> None:
    """An fp32 model on an H100 runs its matmuls at the fp32 rate (67 TFLOP/s, no TF32 by PyTorch's default): its
    MFU is of that peak, under the preset's GEMM ceiling, and its step a multiple of the bf16 model's (it was
    priced at the bf16 tensor-core peak: 383 TFLOP/s a GPU for llama-1b)."""
    bf16 = adv.advise("gpt", "125m", gpus_per_node=2, cluster="h100-80gb", **SMALL)
    fp32 = adv.advise("gpt", "125m", gpus_per_node=2, cluster="h100-80gb", dtype=torch.float32, **SMALL)
    assert bf16.peak_tflops_per_gpu == pytest.approx(989) and fp32.peak_tflops_per_gpu == pytest.approx(67)
    assert fp32.fits and fp32.mfu < 0.65 and fp32.tflops_per_gpu < 67
    assert fp32.step_time_s > 2 * bf16.step_time_s  # this small model's memory-bound ops are the same
