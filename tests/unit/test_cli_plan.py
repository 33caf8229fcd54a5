"""``autopart plan | explain | diff``: the command line's flags reach ``autopart.plan`` as the help says, saved
plans read back, and bad input gets a one-line error and exit status 1 (no traceback), a budget no plan meets 2."""

from __future__ import annotations

import json

import pytest
import torch

import autopart
from autopart.cli import main
from autopart.plan import PLAN_VERSION, Plan


@pytest.fixture
def calls(monkeypatch):
    """``autopart.plan`` replaced by a recorder: what the CLI asked for, without planning."""
    seen: list[dict] = []

    def record(model, mesh, inputs, kwargs, **opts):
        seen.append(dict(model=model, mesh=mesh, inputs=inputs, kwargs=kwargs, **opts))
        raise SystemExit(0)

    monkeypatch.setattr(autopart, "plan", record)
    return seen


def _ask(calls, *argv: str) -> dict:
    with pytest.raises(SystemExit):
        main(["plan", *argv])
    return calls[-1]


def test_flags_reach_the_planner(calls) -> None:
    c = _ask(calls, "--model", "llama:7b", "--mesh", "4x8", "--cluster", "h100-80gb", "--role", "tp=tp",
             "--role", "dp=dp", "--pin", "lm_head.weight=RS(0)", "--pipeline",
             "stages=2,micro_batches=8,schedule=1f1b,axis=dp", "--zero", "1", "--checkpoint", "selective",
             "--offload", "optimizer", "--reduce-dtype", "fp32", "--memory-budget", "70GiB", "--gap", "0.01",
             "--time-limit", "12")
    # the published Llama-2-7B, built on meta in bf16 (a GPU cluster's default), one sequence per device
    cfg = c["model"].cfg
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.vocab_size) == (32, 4096, 32, 32000)
    p = next(c["model"].parameters())
    assert p.device.type == "meta" and p.dtype == torch.bfloat16
    assert tuple(c["inputs"][0].shape) == (32, 2048) and c["kwargs"]["labels"] is c["inputs"][0]
    assert c["mesh"].shape == (4, 8) and c["mesh"].names == ("dp", "tp")
    assert c["cluster"] == "h100-80gb" and c["roles"] == {"tp": "tp", "dp": "dp"}
    assert c["pins"] == {"lm_head.weight": "RS(0)"}
    assert c["pipeline"] == {"stages": 2, "micro_batches": 8, "schedule": "1f1b", "axis": "dp"}
    assert (c["zero"], c["checkpoint"], c["offload"]) == (1, "selective", "optimizer")
    assert c["optimizer_bytes_per_param"] == 12.0 and c["reduce_dtype"] == "float32" and c["grad_dtype"] is None
    assert c["memory_budget"] == "70GiB" and c["kv_cache_tokens"] == 0 and c["relative_gap"] == 0.01
    assert c["time_limit_s"] == 12.0


def test_defaults_follow_the_cluster_and_the_model(calls) -> None:
    c = _ask(calls)  # gpt:tiny on a 2x2 cpu mesh: fp32, Adam's 8 bytes, the preset's own 64 positions
    assert next(c["model"].parameters()).dtype == torch.float32 and c["optimizer_bytes_per_param"] == 8.0
    assert tuple(c["inputs"][0].shape) == (8, 64) and c["pipeline"] is None and c["roles"] == {}
    c = _ask(calls, "--model", "gpt", "--size", "gpt-13b", "--mesh", "2x4x8", "--cluster", "a100-80gb",
             "--dtype", "fp32", "--layers", "2")
    assert c["mesh"].names == ("axis0", "axis1", "axis2") and tuple(c["inputs"][0].shape) == (64, 2048)
    assert c["model"].cfg.n_layer == 2 and c["optimizer_bytes_per_param"] == 8.0
    c = _ask(calls, "--model", "llama:tiny", "--inference", "--context", "128", "--pipeline", "off")
    assert not any(p.requires_grad for p in c["model"].parameters())  # frozen: planned forward-only
    assert c["kwargs"] == {} and c["kv_cache_tokens"] == 128 and c["pipeline"] == "off"
    assert tuple(c["inputs"][0].shape) == (8, 1)  # with a K/V cache: a decoding step, one new token a sequence
    c = _ask(calls, "--model", "llama:tiny", "--cluster", "h100-80gb", "--dtype", "fp16", "--names", "data,model")
    assert next(c["model"].parameters()).dtype == torch.float16 and c["optimizer_bytes_per_param"] == 12.0
    assert c["mesh"].names == ("data", "model")


@pytest.mark.parametrize("argv, says", [
    (["--model", "llama:7"], "unknown llama size '7'"),
    (["--model", "gpt:nope"], "choose one of ['gpt-1.3b'"),
    (["--role", "tp"], "write NAME=VALUE"),
    (["--role", "zz=tp"], "the mesh's axes are ['dp', 'tp']"),
    (["--role", "tp=tp", "--role", "tp=dp"], "given twice"),
    (["--mesh", "2x2x2", "--names", "a,b"], "names 2 axes but --mesh 2x2x2 has 3"),
    (["--pipeline", "stages=x"], "stages takes a whole number"),
    (["--pipeline", "depth=2"], "keys ['axis', 'micro_batches'"),
    (["--context", "5"], "add --inference"),
    (["--batch", "0"], "--batch 0"),
    (["--gap", "1"], "a fraction in [0, 1)"),
    (["--cluster", "tpu"], "unknown cluster 'tpu'"),
    (["--factory", "nosuch_module:fn"], "cannot import 'nosuch_module'"),
    (["--model", "llama", "--factory", "x:y"], "--model: --factory x:y builds its own model"),
    (["--pin", "no.such.param=RS(0)"], "no.such.param"),
    (["--factory", "x:y", "--layers", "3"], "--layers: --factory x:y builds its own model"),
    (["--pipeline", "stages=2,stages=4"], "stages is given twice"),
    (["--inference", "--optimizer-bytes", "16"], "--optimizer-bytes: --inference plans forward only"),
    (["--optimizer-bytes", "-1"], "--optimizer-bytes -1"),
    (["--names", "dp,"], "an axis name is empty"),
    (["--out", "/nonexistent-folder/p.json"], "checked before planning"),
    # the planner's own checks, before any solve (PlanInputError), not "no plan fits"
    (["--model", "llama:tiny", "--inference", "--checkpoint", "full"], "on a forward-only graph"),
    (["--pipeline", "stages=3"], "divides none of the mesh axes stages may split: dp (2), tp (2)"),
    (["--pipeline", "stages=2", "--role", "dp=dp", "--role", "tp=tp"], "every mesh axis has a role"),
    (["--pipeline", "stages=2,virtual=2,schedule=1f1b"], "the interleaved schedule's chunks per rank"),
])
def test_bad_input_is_one_clear_line(argv, says, capsys) -> None:
    assert main(["plan", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("autopart plan: ") and says in err and "Traceback" not in err, err


def test_usage_errors_exit_1_not_2(capsys) -> None:
    """Exit status 2 is "no plan fits": argparse's usage errors exit 1, as other bad input does."""
    for argv in (["plan", "--mesh", "4xx8"], ["plan", "--dtype", "fp8"], ["calibrate", "--mesh", "foo"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 1, argv
    assert "device counts joined by 'x'" in capsys.readouterr().err
    assert main(["calibrate", "--nproc", "0"]) == 1
    assert "--nproc 0" in capsys.readouterr().err


def test_a_factory_with_overrides_is_refused_by_advise_too(capsys) -> None:
    assert main(["advise", "--factory", "x:y", "--layers", "2"]) == 1
    assert "--layers: --factory x:y builds its own model" in capsys.readouterr().err


def test_explain_of_a_missing_node_still_saves_the_plan(tmp_path, capsys) -> None:
    out = tmp_path / "p.json"
    assert main(["plan", "--pipeline", "off", "--explain", "nosuch", "--out", str(out)]) == 1
    assert "no node or parameter 'nosuch'" in capsys.readouterr().err
    assert Plan.load(str(out)).mesh_shape == (2, 2)


def test_no_plan_fits_exits_2_with_the_planner_s_reasons(capsys) -> None:
    assert main(["plan", "--memory-budget", "1KiB", "--pipeline", "off"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopart plan: no plan fits") and "Raise memory_budget to at least" in err


def test_saved_plans_print_explain_and_diff(tmp_path, capsys) -> None:
    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    assert main(["plan", "--out", a, "--pipeline", "off"]) == 0
    assert main(["plan", "--out", b, "--pipeline", "off", "--role", "dp=dp", "--role", "tp=tp"]) == 0
    capsys.readouterr()
    pa, pb = Plan.load(a), Plan.load(b)
    assert pb.axis_role(1) == "tensor" and pa.params != pb.params
    assert main(["explain", a]) == 0
    assert capsys.readouterr().out.strip() == str(pa).strip()
    assert main(["explain", a, "lm_head.weight"]) == 0
    assert capsys.readouterr().out.strip() == pa.explain("lm_head.weight").strip()
    assert main(["diff", a, b]) == 0
    out = capsys.readouterr().out
    assert out.strip() == pa.diff(pb).strip() and "param blocks.0.attn.q.weight: RR -> RS(0)" in out
    assert main(["diff", a, a]) == 0
    assert capsys.readouterr().out.startswith("no decision differs; predicted step")


def test_files_that_are_not_plans(tmp_path, capsys) -> None:
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"a": 1}))
    assert main(["explain", str(other)]) == 1
    err = capsys.readouterr().err
    assert "not an autopart plan" in err and str(other) in err  # the file is named
    assert main(["explain", str(tmp_path / "missing.json")]) == 1
    assert "No such file" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not an autopart plan"):
        Plan.from_json(json.dumps({"version": 0, "mesh_shape": [2]}))
    with pytest.raises(ValueError, match="not an autopart plan of version"):  # a field this version does not know
        Plan.from_json(json.dumps({"version": PLAN_VERSION, "mesh_shape": [2], "axis_names": ["x"], "bogus": 1}))


def test_the_calibrated_cluster_says_how_to_measure_it(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("AUTOPART_CACHE", str(tmp_path))  # no calibration there
    assert main(["plan", "--cluster", "calibrated"]) == 1
    err = capsys.readouterr().err
    assert "no calibration of this machine" in err and "autopart calibrate --nproc 4 --mesh 2x2" in err


def test_advise_says_what_calibrated_is_for(capsys) -> None:
    assert main(["advise", "--cluster", "calibrated", "--layers", "2"]) == 1
    assert "autopart plan --cluster calibrated" in capsys.readouterr().err
