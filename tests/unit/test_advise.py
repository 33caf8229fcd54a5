"""``autopart advise``: what-if planning of models described by size on clusters we do not have (meta device, no
process group). Small models only: every plan here takes about a second."""

from __future__ import annotations

import importlib
import json
import math
import multiprocessing

import pytest
import torch
import torch.nn as nn

import autopart
from autopart.cli import main
from autopart.cost.cluster import PRESETS, load_preset, preset

adv = importlib.import_module("autopart.advise")  # the module (``autopart.advise`` is the function)


def tiny_factory() -> nn.Module:
    """A factory for ``--factory tests.unit.test_advise:tiny_factory`` (built under the meta device)."""
    from autopart.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=512, max_seq_len=256, n_layer=2, n_head=4, d_model=128))


def tiny_factory_with_inputs():
    from autopart.models import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128))
    ids = torch.randint(0, 300, (16, 128))
    return model, (ids,), {"labels": ids}


def _check_consistent(d: dict) -> None:
    """The identities the JSON promises (module doc of autopart.advise)."""
    mem = d["memory"]
    assert set(mem["by_kind"]) == set(adv.MEMORY_KINDS)
    assert sum(mem["by_kind"].values()) == pytest.approx(mem["peak"], rel=1e-9)
    assert all(v >= -1e-6 * mem["peak"] for v in mem["by_kind"].values()), mem
    assert 0 < mem["peak"] <= d["memory_budget"] * (1 + 1e-9)
    tflops = d["model_flops_per_step"] / d["step_time_s"] / d["gpus"] / 1e12
    assert d["tflops_per_gpu"] == pytest.approx(tflops, rel=1e-9)
    assert d["mfu"] == pytest.approx(d["tflops_per_gpu"] / d["peak_tflops_per_gpu"], rel=1e-9)
    assert 0 < d["mfu"] < 1
    assert d["tokens_per_s"] == pytest.approx(d["batch"] * d["seq"] / d["step_time_s"], rel=1e-9)
    assert sum(d["terms"].values()) == pytest.approx(d["step_time_s"], rel=1e-9)
    assert d["terms"]["bubble_and_imbalance"] >= -1e-9 * d["step_time_s"]
    assert set(adv.KINDS) <= set(d["communication"])
    for k in adv.KINDS:
        c = d["communication"][k]
        assert c["time_s"] >= 0 and c["bytes"] >= 0
        # no time without bytes; bytes may take none (a pipeline's reduction can hide whole in the cool-down)
        assert c["time_s"] == 0 or c["bytes"] > 0, (k, c)
    assert d["communication"]["gradient_all_reduce"]["time_s"] <= d["communication"]["all_reduce"]["time_s"] + 1e-12
    s = d["strategy"]
    assert d["gpus"] % s["pp"] == 0
    if not s["mixed_axes"]:  # each mesh axis does one thing: the degrees multiply to at most the GPUs
        assert s["dp"] * s["tp"] * s["cp"] * s["pp"] <= d["gpus"]


def test_cli_advise_json_small_model(capsys) -> None:
    rc = main(["advise", "--model", "gpt:125m", "--layers", "2", "--seq", "256", "--gpus-per-node", "8", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] and d["gpus"] == 8 and d["batch"] == 8 and d["seq"] == 256
    # planned on every logical mesh of the node (tensor parallel 1, 2, 4, 8), the fastest kept
    assert [v["mesh"] for v in d["views"]] == [[8], [4, 2], [2, 4]]
    fastest = min((v for v in d["views"] if v["step_time_s"] is not None), key=lambda v: v["step_time_s"])
    assert d["mesh"] == fastest["mesh"] and d["step_time_s"] == fastest["step_time_s"]
    assert d["model"].startswith("gpt:125m")
    _check_consistent(d)
    # 6 N T + attention: N counts the tied embedding once (as the head); the position table is a lookup
    cfg = adv.model_config("gpt", "125m", seq=256, layers=2)[2]
    h, L, V = cfg.d_model, cfg.n_layer, cfg.vocab_size
    matmul_params = L * (12 * h * h + 2 * h) + V * h + h  # no biases (bias=False); 2L + 1 LayerNorm weights
    attention = 3 * 4 * 8 * 256 * 256 * h * L
    assert d["model_flops_per_step"] == pytest.approx(6 * matmul_params * 8 * 256 + attention, rel=1e-6)


def test_cli_advise_table_and_plan_file(capsys, tmp_path) -> None:
    out = tmp_path / "plan.json"
    rc = main(["advise", "--model", "llama", "--size", "1b", "--layers", "2", "--seq", "128", "--out", str(out),
               "--reduce-dtype", "fp32"])
    assert rc == 0
    text = capsys.readouterr().out
    for word in ("strategy", "MFU", "memory per GPU", "communication per GPU per step", "optimizer_states"):
        assert word in text
    saved = autopart.Plan.load(str(out))  # a pipelined plan's mesh is its stage mesh: stages x stage mesh = 8 GPUs
    assert math.prod(saved.mesh_shape) * int(saved.pipeline.get("degree", 1)) == 8, (saved.mesh_shape, saved.pipeline)
    assert saved.options["reduce_dtype"] == "float32"  # --reduce-dtype fp32: the reduction sums bf16 gradients in fp32


def test_communication_reprices_the_recorded_collectives() -> None:
    from autopart.trace import trace

    built = adv.build("gpt", "125m", batch=8, seq=256, layers=2, hidden=256, heads=4)
    traced = trace(built[1], built[2], built[3])
    a = adv.advise(nodes=2, gpus_per_node=4, built=built, traced=traced)  # two links: NVLink and InfiniBand
    plan = a.plan
    assert not plan.pipeline and plan.collectives
    _check_consistent(a.to_json())
    _, per_record = adv.edge_comm(plan, traced, autopart.Cluster.from_json(plan.cluster))
    assert per_record == pytest.approx([r["time_s"] for r in plan.collectives], rel=1e-9, abs=1e-15)
    comm = adv.communication(plan, traced)
    inside = comm[adv.INSIDE_OPS]["time_s"]
    assert inside == pytest.approx(plan.predicted.get("internal_comm_s", inside), rel=1e-9, abs=1e-15)
    assert sum(comm[k]["time_s"] for k in adv.KINDS) + inside == pytest.approx(plan.predicted["comm_s"], rel=1e-9)
    # two nodes of 4: the node axis crosses InfiniBand, the GPU axis stays on NVLink
    links = autopart.Cluster.from_json(plan.cluster).links
    assert links[0].bandwidth < links[1].bandwidth
    assert comm["send_recv"]["bytes"] == 0
    assert a.terms["bubble_and_imbalance"] == pytest.approx(0, abs=1e-9 * a.step_time_s)


def test_pipelined_plan_reads_consistently() -> None:
    from autopart.trace import trace

    built = adv.build("llama", "1b", batch=16, seq=128, layers=4, hidden=256, heads=4, kv_heads=2, ffn=512)
    _, model, inputs, kwargs, _ = built
    traced = trace(model, inputs, kwargs)
    cl = preset("h100-80gb", (2, 4))
    plan = autopart.plan(model, autopart.mesh((2, 4), ("node", "gpu")), inputs, kwargs, cluster=cl, traced=traced,
                         pipeline={"stages": 2, "micro_batches": 4, "schedule": "1f1b", "axis": "node"},
                         roles={"gpu": "dp"}, optimizer_bytes_per_param=12.0)
    assert plan.pipeline["degree"] == 2
    base = dict(model="x", params=sum(p.numel() for p in model.parameters()), cluster=cl.name, gpus=8,
                mesh=(2, 4), batch=16, seq=128, memory_budget=float(cl.memory_budget),
                peak_tflops_per_gpu=cl.device.peak_flops / 1e12,
                model_flops_per_step=adv.model_flops(model, traced, 16 * 128)[0])
    a = adv.read_plan(plan, traced, base)
    _check_consistent(a.to_json())
    assert a.strategy["pp"] == 2 and a.strategy["micro_batches"] == 4 and a.strategy["schedule"] == "1f1b"
    assert a.communication["send_recv"]["bytes"] > 0 and a.communication["send_recv"]["time_s"] > 0
    assert a.terms["bubble_and_imbalance"] > 0  # 1F1B with 2 stages and 4 micro-batches idles


def test_factory_path(capsys) -> None:
    rc = main(["advise", "--factory", "tests.unit.test_advise:tiny_factory", "--seq", "64", "--json",
               "--cluster", "a100-80gb"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d["model"] == "tests.unit.test_advise:tiny_factory" and d["cluster"] == "a100-80gb"
    assert d["params"] == sum(p.numel() for p in tiny_factory().parameters())
    _check_consistent(d)
    a = adv.advise(factory=tiny_factory_with_inputs, cluster="h100-80gb", gpus_per_node=4, views=False)
    assert a.fits and (a.batch, a.seq) == (16, 128)  # the factory's own inputs
    with pytest.raises(ValueError, match="package.module:function"):
        adv.advise(factory="no_colon")
    with pytest.raises(ValueError, match="cannot import"):
        adv.advise(factory="no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no function"):
        adv.advise(factory="tests.unit.test_advise:nope")


TOML = """
name = "test-b200"
base = "h100-80gb"
reserve_bytes = "6GiB"
[device]
peak_flops = 2.25e15
memory_bytes = "180GiB"
[inter_node]
bandwidth = "100GB"
"""


def test_user_cluster_file_toml_and_json(tmp_path, capsys) -> None:
    path = tmp_path / "b200.toml"
    path.write_text(TOML)
    try:
        assert load_preset(str(path)) == "test-b200"
        c = preset("test-b200", (4, 8))
        assert c.device.peak_flops == 2.25e15 and c.device.memory_bytes == 180 * 2**30
        assert c.memory_budget == 174 * 2**30
        h100 = preset("h100-80gb", (4, 8))
        assert c.links[1] == h100.links[1]  # intra-node kept from the base
        assert c.links[0].bandwidth == pytest.approx(100e9)
        assert c.device.host_bandwidth == h100.device.host_bandwidth
        wide = c.with_mesh((2, 16)).links[1]  # a 16-wide axis leaves the node: the file's IB link, 8 per node
        assert wide.across() == c.links[0] and wide.local == 8 and wide.local_link == c.links[1]
        js = tmp_path / "box.json"
        js.write_text(json.dumps({"name": "test-box", "devices_per_node": 4, "reserve_bytes": 2**30,
                                  "device": {"peak_flops": 1e14, "mem_bandwidth": 1e12, "memory_bytes": "16GiB",
                                             "host_bandwidth": 2e10, "mfu": 0.5},
                                  "intra_node": {"alpha": 1e-5, "bandwidth": 1e11},
                                  "inter_node": {"alpha": 2e-5, "beta": 1e-10}}))
        rc = main(["advise", "--model", "gpt:125m", "--layers", "2", "--seq", "128", "--cluster", str(js),
                   "--gpus-per-node", "4", "--json", "--physical-mesh"])
        assert rc == 0
        d = json.loads(capsys.readouterr().out)
        assert d["cluster"] == "test-box" and d["peak_tflops_per_gpu"] == pytest.approx(100)
        assert d["memory_budget"] == 15 * 2**30
        _check_consistent(d)
        # the same cell on the slower file cluster is slower than on an H100
        h = adv.advise("gpt", "125m", layers=2, seq=128, gpus_per_node=4, cluster="h100-80gb", views=False)
        assert d["step_time_s"] > h.step_time_s
    finally:
        PRESETS.pop("test-b200", None)
        PRESETS.pop("test-box", None)


@pytest.mark.parametrize("text, match", [
    ('name = "x"\n[device]\npeak_flops = 1e12\n', "missing \\[intra_node\\]"),
    ('name = "x"\nbase = "h100-80gb"\ncolour = 1\n', "unknown keys \\['colour'\\]"),
    ('name = "x"\nbase = "h100-80gb"\n[device]\nmemory_bytes = "lots"\n', "cannot read 'lots'"),
    ('name = "x"\nbase = "nope"\n', "base 'nope' is not a preset"),
    ('base = "h100-80gb"\n', "give the cluster a name"),
    ('name = "h100-80gb"\nbase = "a100-80gb"\n', "built-in preset"),
    ('name = "x"\nbase = "h100-80gb"\n[intra_node]\nbandwidth = 1e9\nbeta = 1e-9\n', "both bandwidth and beta"),
    ('name = "x" [', "not valid TOML"),
])
def test_bad_cluster_files_say_what_and_how(tmp_path, text, match) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_preset(str(path))
    assert "x" not in PRESETS
    with pytest.raises(ValueError, match="does not exist"):
        load_preset(str(tmp_path / "missing.toml"))


def test_bad_model_descriptions(capsys) -> None:
    with pytest.raises(ValueError, match="unknown model family 'bert'"):
        adv.model_config("bert")
    with pytest.raises(ValueError, match="has no 'ffn'"):
        adv.model_config("gpt", "125m", ffn=1024)
    with pytest.raises(ValueError, match="unknown llama size '3b'"):
        adv.model_config("llama", "3b")
    with pytest.raises(ValueError, match="whole number"):
        adv.model_config("llama", "7b", layers=0)
    with pytest.raises(ValueError, match="unknown cluster"):
        adv.resolve_cluster("tpu-v9")
    assert main(["advise", "--model", "bert"]) == 1
    assert "unknown model family" in capsys.readouterr().err


def test_family_module_missing_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setitem(adv.FAMILIES, "mamba", ("autopart.models.no_such_mamba", "Mamba", "MambaConfig"))
    with pytest.raises(ValueError, match="needs autopart/models/no_such_mamba.py"):
        adv.model_config("mamba", layers=2)


def test_named_sizes_match_published_parameter_counts() -> None:
    def count(model: str) -> float:
        _, cls, cfg = adv.model_config(model)
        with torch.device("meta"):
            return sum(p.numel() for p in cls(cfg).parameters()) / 1e9

    assert count("llama:7b") == pytest.approx(6.74, abs=0.01)  # Llama 2 7B
    assert count("llama:70b") == pytest.approx(68.98, abs=0.05)  # Llama 2 70B
    assert count("llama:8b") == pytest.approx(8.03, abs=0.01)  # Llama 3 8B
    assert count("gpt:175b") == pytest.approx(174.6, abs=0.5)  # GPT-3 175B
    assert count("gpt:1t") == pytest.approx(1008, rel=0.01)  # N21's 1T (1008B)


def test_does_not_fit_names_the_binding_constraint(capsys) -> None:
    rc = main(["advise", "--model", "llama:70b", "--nodes", "1", "--gpus-per-node", "2", "--json"])
    assert rc == 2
    d = json.loads(capsys.readouterr().out)
    assert not d["fits"] and "model states" in d["binding"] and "per GPU" in d["binding"]
    assert d["step_time_s"] is None


def test_practice_recipes() -> None:
    budget = preset("h100-80gb", (1, 8)).memory_budget
    small = adv.practice(1.3e9, 24, 2048, 8, 8, budget, 8, 4096)
    assert small.kind == "DP" and small.dp == 8
    mid = adv.practice(69e9, 80, 8192, 64, 8, budget, 64, 4096)
    assert mid.kind in ("TP", "TP+PP") and mid.tp <= 8 and mid.tp * mid.pp * mid.dp == 64
    big = adv.practice(175e9, 96, 12288, 512, 8, budget, 512, 4096)
    assert big.kind == "TP+PP" and big.tp == 8 and big.pp > 1 and big.tp * big.pp * big.dp == 512
    assert adv.practice(1e12, 128, 25600, 8, 8, budget, 8, 4096) is None


@pytest.mark.parametrize("jobs", [1, 2])  # an alarm in this process; a deadline on forked ones
def test_plan_cap_reports_instead_of_hanging(jobs) -> None:
    a = adv.advise("gpt", "125m", layers=2, seq=128, max_plan_s=1e-3, jobs=jobs)
    assert not a.fits and "not planned" in a.binding and math.isnan(a.step_time_s)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("jobs", [1, 2])
def test_the_plan_cap_is_each_views(monkeypatch, jobs) -> None:
    """``max_plan_s`` caps each mesh view, one after another here or side by side: two views of 1 s each under a
    1.8 s cap are both planned, together past it; a view that runs past it alone is listed as not planned and the
    other kept. (Each view's plan is made beforehand, in a child: the views here take their waits alone.)"""
    import time as time_

    from autopart import forked

    real, made = autopart.plan, {}

    def making(module, mesh, *args, **kwargs):
        made[tuple(mesh.shape)] = p = real(module, mesh, *args, **kwargs)
        return p

    def slow(module, mesh, *args, **kwargs):
        time_.sleep(3.0 if tuple(mesh.shape) == (4, 2) and slow.over else 1.0)
        return plans[tuple(mesh.shape)]

    kw = dict(layers=2, seq=128)  # 8 GPUs: meshes 8, 4x2 (and 2x4 as it)
    monkeypatch.setattr(autopart, "plan", making)
    plans = forked.call(lambda: (adv.advise("gpt", "125m", **kw, jobs=1), made)[1], jobs=2)
    monkeypatch.setattr(autopart, "plan", slow)
    slow.over = False
    a = adv.advise("gpt", "125m", **kw, max_plan_s=1.8, jobs=jobs)
    assert a.fits and all(v["step_time_s"] for v in a.views), a.views
    slow.over = True
    b = adv.advise("gpt", "125m", **kw, max_plan_s=1.8, jobs=jobs)
    views = {tuple(v["mesh"]): v for v in b.views}
    assert views[(4, 2)]["step_time_s"] is None and "more than 1.8 s" in views[(4, 2)]["why"]
    assert b.fits and b.step_time_s == views[(8,)]["step_time_s"] > 0
    assert "4x2 not planned (planning took more than 1.8 s)" in b.views_text()


def test_moe_and_mamba_families_when_present() -> None:
    """moe/mamba are planned when their modules exist; 6 N T counts MoE's active parameters (top_k of n_expert)."""
    pytest.importorskip("autopart.models.moe")
    from autopart.trace import trace

    name, model, inputs, kwargs, cfg = adv.build("moe", "tiny", batch=2, seq=32)
    traced = trace(model, inputs, kwargs)
    flops, total, matmul = adv.model_flops(model, traced, 2 * 32)
    experts = sum(p.numel() for p in model.parameters() if p.dim() == 3 and p.shape[0] == cfg.n_expert)
    embed = model.embed.weight.numel()
    assert experts > 0
    assert matmul == total - embed - experts + experts * cfg.top_k // cfg.n_expert
    a = adv.advise("moe", "tiny", seq=32, gpus_per_node=4, views=False)
    assert a.fits and 0 < a.mfu < 1
    pytest.importorskip("autopart.models.mamba")
    m = adv.advise("mamba", "tiny", seq=32, gpus_per_node=2, views=False)
    assert m.fits and m.strategy["name"]


def test_cli_sweep_writes_table_json_and_chart(tmp_path, capsys) -> None:
    rc = main(["advise", "--sweep", "--sizes", "gpt:125m", "--gpus", "2", "--seq", "128", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "design_guide.json").read_text())
    assert [(r["model"], r["gpus"]) for r in rows] == [("gpt:125m", 2)]
    r = rows[0]
    assert r["advice"]["fits"] and r["practice"]["kind"] == "DP" and r["agrees"] in (True, "tie", False)
    md = (tmp_path / "design_guide.md").read_text()
    assert md.splitlines()[2].startswith("| gpt:125m | 0.1B | 2 |")
    assert (tmp_path / "design_guide.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "[1/1] gpt:125m (0.1B) on 2 GPUs: " in out and "[node=" not in out.split("[1/1]")[0]
    strategy = rows[0]["advice"]["strategy"]
    assert f"[{strategy['layout']}]" in out  # the layout's brackets printed as they are (no rich markup)


def test_diff_table_is_recipe_minus_plan() -> None:
    row = {"model": "m", "gpus": 64, "practice": {"kind": "DP", "tp": 1, "pp": 1, "dp": 64},
           "advice": {"step_time_s": 1.0}, "comparison": {"recipe_step_s": 1.5, "diff": {"compute": 0.1,
                                                                                        "all_reduce": 0.4}}}
    md = adv.sweep_diff_markdown([row])
    assert md.splitlines()[2] == "| m | 64 | DP (tp=1 pp=1 dp=64) | 1.5 | 1 | +100.0 | +400.0 |"
    assert adv.sweep_diff_markdown([{**row, "comparison": {"detail": "x"}}]) == ""


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_mesh_the_solver_does_not_finish_is_skipped(monkeypatch, jobs) -> None:
    """One logical mesh whose ILP times out is recorded as not planned; the others still are, the fastest kept."""
    from autopart.solver.ilp import SolverTimeout

    real = autopart.plan

    def plan(module, mesh, *args, **kwargs):
        if tuple(mesh.shape) == (4, 2):
            raise SolverTimeout("highs found no solution within 1 s for 9 groups (99 variables)")
        return real(module, mesh, *args, **kwargs)

    monkeypatch.setattr(autopart, "plan", plan)
    a = adv.advise("gpt", "125m", layers=2, seq=128, jobs=jobs)  # 8 GPUs: meshes 8, 4x2, 2x4
    views = {tuple(v["mesh"]): v for v in a.views}
    assert set(views) == {(8,), (4, 2), (2, 4)}
    assert views[(4, 2)]["step_time_s"] is None and "no solution within 1 s" in views[(4, 2)]["why"]
    assert "4x2 not planned (highs found no solution within 1 s" in a.views_text()
    assert a.fits and a.step_time_s == min(v["step_time_s"] for v in a.views if v["step_time_s"] is not None)
    def no_fit(module, mesh, *args, **kwargs):
        if tuple(mesh.shape) == (4, 2):
            raise ValueError("no plan fits the 75.6 GiB budget")
        return real(module, mesh, *args, **kwargs)

    monkeypatch.setattr(autopart, "plan", no_fit)
    assert "4x2 does not fit" in adv.advise("gpt", "125m", layers=2, seq=128, jobs=jobs).views_text()
    monkeypatch.setattr(autopart, "plan", lambda *a, **k: (_ for _ in ()).throw(SolverTimeout("no solution")))
    b = adv.advise("gpt", "125m", layers=2, seq=128, jobs=jobs)
    assert not b.fits and b.binding.startswith("not planned: no solution")
    # a fault that is not "this mesh does not fit" stops advise, with the forked call's traceback as its cause
    monkeypatch.setattr(autopart, "plan", lambda *a, **k: {}["no such key"])
    with pytest.raises(KeyError) as e:
        adv.advise("gpt", "125m", layers=2, seq=128, jobs=jobs)
    assert jobs == 1 or "no such key" in str(e.value.__cause__)


def test_views_planned_in_processes_give_the_same_advice() -> None:
    """Planned side by side in forked processes (jobs=3) or one after another here (jobs=1), advise returns the same
    views, plan and figures: two nodes of 4 GPUs, views 2x4, 8 and 4x2 (each its own problem)."""
    from autopart.trace import trace

    built = adv.build("gpt", "125m", batch=8, seq=128, layers=2, hidden=256, heads=4)
    traced = trace(*built[1:4])
    one, three = (adv.advise(nodes=2, gpus_per_node=4, built=built, traced=traced, jobs=j) for j in (1, 3))
    assert [v["mesh"] for v in three.views] == [[2, 4], [8], [4, 2]]
    assert all(v["step_time_s"] and not v.get("same_as") for v in three.views)
    assert all(v["plan_s"] > 0 for x in (one, three) for v in x.views)  # each view's own planning time
    # the same less the timings (and the solves' counts: a process reuses its solves)
    assert one.without_timings() == three.without_timings()


def test_sweep_cells_planned_in_processes_give_the_same_rows(tmp_path, monkeypatch) -> None:
    """The sweep's cells run side by side in forked processes (jobs=4, 2 cells: each cell forks its 2 mesh views
    with its 2 processes) or one after another here (jobs=1): the same rows, in grid order, and every plan of the
    forked run made in a process of its own, none in this one."""
    import os

    import autopart.trace

    where, traced_in = tmp_path / "pids", tmp_path / "traced"

    def noting(real, path):
        def call(*args, **kwargs):
            with open(path, "a") as f:  # a forked child inherits the patch and appends its pid
                f.write(f"{os.getpid()}\n")
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(autopart, "plan", noting(autopart.plan, where))
    monkeypatch.setattr(autopart.trace, "trace", noting(autopart.trace.trace, traced_in))
    sizes = ({"model": "gpt", "size": "125m", "layers": 3, "hidden": 256, "heads": 4, "label": "gpt-3L"},
             {"model": "llama", "size": "1b", "layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 512,
              "label": "llama-2L"})
    out, heard = {}, {}
    for jobs in (1, 4):
        where.write_text(""), traced_in.write_text("")
        heard[jobs] = []
        out[jobs] = adv.sweep(sizes, (4,), seq=128, jobs=jobs, log=heard[jobs].append)
        pids, traces = ([int(p) for p in f.read_text().split()] for f in (where, traced_in))
        assert len(traces) == 2
        if jobs == 1:
            assert set(pids) == set(traces) == {os.getpid()}
        else:  # each cell traced in its own process, each view planned in one of its own
            assert os.getpid() not in pids and len(set(pids)) == len(pids) >= 4, pids
            assert os.getpid() not in traces and len(set(traces)) == 2 and not set(traces) & set(pids)
    for jobs, rows in out.items():
        assert [(r["model"], r["gpus"]) for r in rows] == [("gpt-3L", 4), ("llama-2L", 4)]
        assert sorted(heard[jobs]) == sorted(adv.sweep_line(r) for r in rows)
    a, b = ([{**r, "advice": r["advice"].without_timings()} for r in out[j]] for j in (1, 4))
    assert a == b


def test_a_sweep_cell_whose_process_dies_is_planned_again_alone(tmp_path, monkeypatch) -> None:
    """A cell's process killed (as the out-of-memory killer would) does not lose the sweep: the cell is planned
    again alone once the others are done, and its row comes back in its place."""
    import os

    real, tries = adv.advise, tmp_path / "tries"

    def dying(**kw):
        if kw["built"][0].startswith("gpt"):
            with open(tries, "a") as f:
                f.write("x")
            if len(tries.read_text()) == 1:
                os._exit(9)  # the first try dies without an answer
        return real(**kw)

    monkeypatch.setattr(adv, "advise", dying)
    heard = []
    small = {"layers": 2, "hidden": 256, "heads": 4}
    rows = adv.sweep(({"model": "gpt", "size": "125m", **small}, {"model": "llama", "size": "1b", **small,
                                                                   "kv_heads": 2, "ffn": 512}),
                     (4,), seq=128, views=False, jobs=2, log=heard.append)
    assert tries.read_text() == "xx"
    assert [r["model"].split()[0] for r in rows] == ["gpt:125m", "llama:1b"] and all(r["advice"].fits for r in rows)
    assert any("its process died" in line and "exit code 9" in line for line in heard), heard
    assert heard[-1] == adv.sweep_line(rows[0])


def test_sweep_checks_every_size_before_planning_any(monkeypatch) -> None:
    monkeypatch.setattr(adv, "advise", lambda **kw: pytest.fail("a cell was planned"))
    with pytest.raises(ValueError, match="unknown llama size 'huge'"):
        adv.sweep(("gpt:125m", "llama:huge"), (8,))


def test_accumulated_plan_reads_consistently() -> None:
    """Gradient accumulation over 2 micro-batches with ZeRO-3: the parameters' gathers run once per micro-batch, so
    the communication by kind counts them twice and the terms still sum to the step with nothing left over."""
    from autopart.trace import trace

    built = adv.build("gpt", "125m", batch=16, seq=256, layers=2, hidden=256, heads=4)
    _, model, inputs, kwargs, _ = built
    traced = trace(model, inputs, kwargs)
    cl = preset("h100-80gb", (8,))
    plan = autopart.plan(model, autopart.mesh((8,), ("dp",)), inputs, kwargs, cluster=cl, traced=traced,
                         pipeline={"stages": 1, "micro_batches": 2}, roles={"dp": "dp"}, zero=3,
                         optimizer_bytes_per_param=12.0)
    assert plan.accumulation["micro_batches"] == 2 and set(plan.zero.values()) == {3}
    base = dict(model="x", params=sum(p.numel() for p in model.parameters()), cluster=cl.name, gpus=8, mesh=(8,),
                batch=16, seq=256, memory_budget=float(cl.memory_budget),
                peak_tflops_per_gpu=cl.device.peak_flops / 1e12,
                model_flops_per_step=adv.model_flops(model, traced, 16 * 256)[0])
    a = adv.read_plan(plan, traced, base)
    _check_consistent(a.to_json())
    one = autopart.plan(model, autopart.mesh((8,), ("dp",)), inputs, kwargs, cluster=cl, traced=traced,
                        pipeline="off", roles={"dp": "dp"}, zero=3, optimizer_bytes_per_param=12.0)
    gathers = adv.communication(one, traced)["all_gather"]["bytes"]
    assert gathers > 0 and a.communication["all_gather"]["bytes"] == pytest.approx(2 * gathers, rel=1e-6)
    assert a.terms["bubble_and_imbalance"] == pytest.approx(0, abs=1e-9 * a.step_time_s)


def test_sequence_parallel_regathers_are_reported() -> None:
    """Tensor + sequence parallel: the activations a linear keeps as their sequence shard are gathered again in
    backward (``regather_s`` of the record), which the step pays: the communication by kind reports them as
    all-gathers, so its kinds sum to ``comm_s`` and nothing is left for the bubble, with collective matmuls or
    without."""
    from autopart.trace import trace

    built = adv.build("llama", "1b", batch=16, seq=512, layers=2, hidden=1024, heads=8, kv_heads=4, ffn=2048)
    _, model, inputs, kwargs, _ = built
    traced = trace(model, inputs, kwargs)
    cl = preset("h100-80gb", (2, 4))
    for overlap in (False, True):
        plan = autopart.plan(model, autopart.mesh((2, 4), ("dp", "tp")), inputs, kwargs, cluster=cl, traced=traced,
                             pipeline="off", roles={"dp": "dp", "tp": "tp"}, optimizer_bytes_per_param=12.0,
                             tp_comm_overlap=overlap)
        assert sum(c.get("regather_s", 0.0) for c in plan.collectives) > 0
        comm = adv.communication(plan, traced)
        total = sum(comm[k]["time_s"] for k in adv.KINDS) + comm[adv.INSIDE_OPS]["time_s"]
        assert total == pytest.approx(plan.predicted["comm_s"], rel=1e-9)
        step = plan.predicted["step_time_s"]
        assert adv.terms(plan, traced, comm)["bubble_and_imbalance"] == pytest.approx(0, abs=1e-9 * step)


def test_sweep_counts_a_tie_with_practice_as_agreeing(monkeypatch) -> None:
    """A plan of another family than practice's agrees with it when practice's recipe scores within ``adv.TIE`` of
    the plan (the cell says so and keeps the comparison); beyond that it differs."""
    import dataclasses

    real = adv.advise
    planned = {}

    def other_family(**kw):  # the plan, relabelled as context parallel (not practice's DP family)
        a = real(**kw)
        planned["advice"] = a = dataclasses.replace(a, strategy={**a.strategy, "cp": 2, "name": "CP+DP"})
        return a

    for slower, verdict in ((0.5 * adv.TIE, "tie"), (2 * adv.TIE, False)):
        def recipe(rec, built, traced, cluster, base, *args, slower=slower):
            a = planned["advice"]
            return dataclasses.replace(a, step_time_s=a.step_time_s * (1 + slower),
                                       terms={**a.terms, "compute": a.terms["compute"] + a.step_time_s * slower})

        monkeypatch.setattr(adv, "advise", other_family)
        monkeypatch.setattr(adv, "evaluate_recipe", recipe)
        (row,) = adv.sweep(("gpt:125m",), (2,), seq=128, views=False)
        assert row["practice"].kind == "DP" and row["agrees"] == verdict, row
        assert row["comparison"]["decided_by"] == "compute"
        assert ("tie" in row["comparison"]["detail"]) == (verdict == "tie")
        assert ("agrees (tie)" in adv.sweep_markdown([row])) == (verdict == "tie")


def test_isomorphic_mesh_views_are_planned_once(monkeypatch) -> None:
    """One node's (4, 2) and (2, 4) views are NVLink on both axes: the same problem with its axes renamed, planned
    once (at advise's ILP gap); across nodes every view's links differ and each is planned."""
    real, seen = autopart.plan, []

    def plan(module, mesh, *args, **kwargs):
        seen.append((tuple(mesh.shape), kwargs.get("relative_gap")))
        return real(module, mesh, *args, **kwargs)

    monkeypatch.setattr(autopart, "plan", plan)
    # jobs=1: planned in this process, where the patched plan sees each call
    a = adv.advise("gpt", "125m", layers=2, seq=128, jobs=1)  # 8 GPUs in one node: meshes 8, 4x2, 2x4
    assert seen == [((8,), adv.ADVISE_GAP), ((4, 2), adv.ADVISE_GAP)]
    views = {tuple(v["mesh"]): v for v in a.views}
    assert views[(2, 4)]["same_as"] == [4, 2] and views[(2, 4)]["step_time_s"] == views[(4, 2)]["step_time_s"]
    assert "2x4 " in a.views_text() and "(as 4x2)" in a.views_text()
    # planned on its own, the renamed view predicts the same step (within the ILP gap)
    _, module, inputs, kwargs, _ = adv.build("gpt", "125m", batch=8, seq=128, layers=2)
    cl = adv._mesh_cluster("h100-80gb", 1, 8)
    alone = real(module, autopart.mesh((2, 4), ("outer", "inner")), inputs, kwargs, cluster=cl.with_mesh((2, 4)),
                 optimizer_bytes_per_param=12.0, relative_gap=adv.ADVISE_GAP)
    assert alone.predicted["step_time_s"] == pytest.approx(views[(4, 2)]["step_time_s"], rel=1.5 * adv.ADVISE_GAP)
    seen.clear()
    adv.advise("gpt", "125m", layers=2, seq=128, nodes=2, gpus_per_node=4, jobs=1)  # the node axis: InfiniBand
    assert [s for s, _ in seen] == [(2, 4), (8,), (4, 2)]


def test_relative_gap_is_validated() -> None:
    from autopart.planner import PlanOptions

    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="relative_gap"):
            PlanOptions(relative_gap=bad)
    # advise says so at once, not as every mesh view not fitting
    with pytest.raises(ValueError, match=r"relative_gap=2\.0: give a fraction"):
        adv.advise("gpt", "125m", layers=2, seq=128, relative_gap=2.0)


def test_zero1_gather_bytes_are_reported() -> None:
    """ZeRO-1's all-gather of the updated parameters after the step: every parameter's bytes, each rank
    receiving (n - 1) / n of them (bus bytes), beside its time."""
    from autopart.trace import trace

    built = adv.build("gpt", "125m", batch=8, seq=64, layers=2, hidden=128, heads=4)
    _, model, inputs, kwargs, _ = built
    traced = trace(model, inputs, kwargs)
    plan = autopart.evaluate(model, 8, inputs, kwargs, cluster="h100-80gb", traced=traced, zero=1)
    assert plan.zero and set(plan.zero.values()) == {1}
    comm = adv.communication(plan, traced)
    params = sum(model.get_parameter(fqn).numel() * model.get_parameter(fqn).element_size() for fqn in plan.zero)
    assert comm["all_gather"]["bytes"] == pytest.approx(params * 7 / 8, rel=0.01)  # slices padded
    assert comm["all_gather"]["time_s"] > 0


def test_inference_advice_is_forward_only_with_its_kv_cache(capsys) -> None:
    """Serving (``--inference``): the frozen model's weights are its only state; a decoding step (seq 1) holds and
    reads the K/V cache of the context at every attention; the model FLOPs are the forward's: 2 N per token
    (training's 6 N over 3) and the attention of each query over the cached positions."""
    kw = dict(layers=2, batch=4, gpus_per_node=2, cluster="h100-80gb", views=False)
    short = adv.advise("llama", "1b", seq=1, inference=True, kv_cache_tokens=1024, **kw)
    long = adv.advise("llama", "1b", seq=1, inference=True, kv_cache_tokens=8192, **kw)
    cfg = adv.model_config("llama", "1b", layers=2)[2]
    head = cfg.d_model // cfg.n_head
    whole = cfg.n_layer * 2 * 4 * cfg.n_kv_head * 8192 * head * 2  # K and V, bf16, the batch's 4 sequences
    for a in (short, long):
        d = a.to_json()
        assert d["fits"] and d["inference"]
        _check_consistent(d)
        by = d["memory"]["by_kind"]
        assert by["gradients"] == 0 and by["optimizer_states"] == 0
        assert d["tokens_per_s"] == pytest.approx(4 / d["step_time_s"], rel=1e-9)  # one token per sequence
    # each GPU holds the cache of the heads (or sequences) it computes: the whole of it over 1 or 2 GPUs
    held = long.to_json()["memory"]["by_kind"]["kv_cache"]
    assert any(held == pytest.approx(whole / ways, rel=1e-6) for ways in (1, 2)), (held, whole)
    assert long.step_time_s > short.step_time_s  # reading a longer cache takes longer
    per_position = 4 * 4 * cfg.n_head * head * cfg.n_layer  # 4 B s_q d per attention: Q K^T and P V
    assert long.model_flops_per_step - short.model_flops_per_step == pytest.approx(per_position * (8192 - 1024))
    # a prefill of 128 tokens without a cache: a third of training's FLOPs (forward only, attention as traced)
    inf = adv.advise("llama", "1b", seq=128, inference=True, **kw)
    train = adv.advise("llama", "1b", seq=128, **kw)
    assert inf.model_flops_per_step == pytest.approx(train.model_flops_per_step / 3, rel=1e-9)
    assert train.memory["by_kind"]["optimizer_states"] > 0 and inf.memory["by_kind"]["optimizer_states"] == 0
    with pytest.raises(ValueError, match="inference=True"):
        adv.advise("llama", "1b", seq=1, kv_cache_tokens=1024, **kw)
    # a factory's own example kwargs are kept (its labels a tensor other than the ids: compared by identity, not
    # by a tensor's ambiguous truth value)
    def own_labels():
        model, (ids,), _ = tiny_factory_with_inputs()
        return model, (ids,), {"labels": ids.clone()}

    _, module, _, kwargs, _ = adv.build(factory=own_labels, inference=True)
    assert set(kwargs) == {"labels"} and not any(p.requires_grad for p in module.parameters())
    assert adv.build(factory=tiny_factory_with_inputs, inference=True)[3] == {}  # the defaults: logits
    # a state-space model has no K/V cache: decoding holds each sequence's recurrent state instead (the scan's
    # heads x headdim x d_state and the convolution's last d_conv - 1 inputs, as mamba_ssm's inference cache),
    # whatever the context; it once held nothing, so a large serving batch "fit" without it
    mcfg = adv.model_config("mamba", "tiny")[2]
    state = mcfg.n_layer * 2 * mcfg.d_inner * (mcfg.d_state + mcfg.d_conv - 1) * 2  # batch 2, bf16
    held = []
    for ctx in (512, 8192):
        ssm = adv.advise("mamba", "tiny", seq=1, batch=2, gpus_per_node=2, views=False, inference=True,
                         kv_cache_tokens=ctx)
        assert ssm.fits and "recurrent state" in str(ssm) and "no K/V cache" in str(ssm)
        held.append(ssm.memory["by_kind"]["kv_cache"])
    assert held[0] == held[1] and any(held[0] == pytest.approx(state / ways) for ways in (1, 2)), (held, state)
    rc = main(["advise", "--model", "llama:1b", "--layers", "2", "--gpus-per-node", "2", "--batch", "1", "--seq", "1",
               "--inference", "--context", "2048", "--physical-mesh"])
    text = capsys.readouterr().out
    assert rc == 0 and "latency (one batch)" in text and "K/V cache of 2048 tokens" in text and "kv_cache" in text
    assert main(["advise", "--sweep", "--inference"]) == 1
    assert "--sweep is the training design guide" in capsys.readouterr().err


def test_serving_search_finds_the_batch_of_most_tokens_per_s(capsys) -> None:
    """``advise_serving``: decoding at batch 1, 2, 4, ... until the K/V cache no longer fits (a 1.7 GiB budget on
    2 H100s), then bisected. Every batch that fits stays within the budget (a forward-only plan's working bytes
    were missing from the check of its first solve: batch 64 was said to fit at 2.1 GiB), tokens/s grows with
    the batch while memory-bound, the answer is the most tokens/s among those kept; with a latency bound, the
    largest batch within it."""
    import dataclasses

    c = preset("h100-80gb", (1, 2))
    small = dataclasses.replace(c, reserve_bytes=c.device.memory_bytes - int(1.7 * 2**30))
    kw = dict(layers=2, seq=1, kv_cache_tokens=8192, gpus_per_node=2, views=False)
    s = adv.advise_serving("llama", "1b", cluster=small, max_batch=1024, **kw)
    batches = [a.batch for a in s.rows]
    powers = [b for b in batches if b & (b - 1) == 0]
    assert powers == [2**i for i in range(len(powers))] and len(powers) >= 6
    fit = [a for a in s.rows if a.fits]
    refused = min(a.batch for a in s.rows if not a.fits)
    assert all(a.batch < refused for a in fit) and "does not fit" in s.stopped
    assert any(b & (b - 1) for b in batches)  # bisected between the last power kept and the refused one
    for a in fit:
        assert a.memory["peak"] <= small.memory_budget * (1 + 1e-9), (a.batch, a.memory["peak"])
    one = {a.batch: a for a in fit}
    assert one[16].tokens_per_s > one[8].tokens_per_s > 4 * one[1].tokens_per_s  # weights read once per step
    assert s.best is max(fit, key=lambda a: a.tokens_per_s)
    assert "<- best" in str(s) and s.to_json()["best_batch"] == s.best.batch
    md = s.markdown().splitlines()
    assert len(md) == 2 + len(s.rows) and sum(line.endswith("| best |") for line in md) == 1
    # a latency bound between batch 8's and batch 16's: the largest batch within it, found by bisection
    bound = (one[8].step_time_s + one[16].step_time_s) / 2
    t = adv.advise_serving("llama", "1b", cluster=small, max_batch=1024, max_latency_s=bound, **kw)
    assert t.best.step_time_s <= bound and 8 <= t.best.batch < 16
    assert all(a.step_time_s > bound for a in t.rows if a.batch > t.best.batch)
    assert "over the bound" in t.stopped
    with pytest.raises(ValueError, match="chooses 'batch' itself"):
        adv.advise_serving("llama", "1b", batch=4, **kw)
    rc = main(["advise", "--model", "llama:1b", "--layers", "2", "--gpus-per-node", "2", "--seq", "1",
               "--inference", "--context", "2048", "--batch", "max", "--max-batch", "4", "--physical-mesh"])
    text = capsys.readouterr().out
    assert rc == 0 and "<- best" in text and "max_batch 4 reached" in text and "latency (one batch)" in text
    assert main(["advise", "--model", "llama:1b", "--max-latency-ms", "5"]) == 1
    assert "--inference --batch max" in capsys.readouterr().err
    assert main(["advise", "--model", "llama:1b", "--batch", "max"]) == 1
    assert "add --inference" in capsys.readouterr().err
