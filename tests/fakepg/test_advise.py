"""The design-guide sweep on H100 nodes, small enough for CI: 2 model sizes x 2 GPU counts (one node, two nodes)
on the ``meta`` device (no process group); benchmarks/bench_design_guide.py runs the full grid up to 4096 GPUs.
The large model is Llama-2-70B's layer (h 8192, 64 heads, 8 KV heads, SwiGLU 28672) with 20
layers instead of 80 (17.6B parameters: tracing 80 layers costs ~15 s a cell on 2 cores); it keeps the premise that
decides practice -- its model states (16 bytes x 17.6B = 282 GB) fit no GPU, and data parallelism with ZeRO-1
(4 + 12/16 bytes per parameter on 16 GPUs, 84 GB) does not fit either -- so published practice runs it tensor
parallel inside a node. Measured (2 cores): ~30 s of CPU."""

from __future__ import annotations

import functools
import importlib

adv = importlib.import_module("autopart.advise")  # the module (``autopart.advise`` is the function)

SMALL = {"model": "llama", "size": "1b", "layers": 4, "label": "llama-1b-4L"}
LARGE = {"model": "llama", "size": "70b", "layers": 20, "label": "llama-70b-20L"}


@functools.cache
def _rows() -> tuple:
    # the (nodes, 8) mesh alone: planning each cell on its logical views too (the sweep's default) is tested in
    # tests/unit/test_advise.py, and would take this module's CPU time from ~30 s to ~100 s
    return tuple(adv.sweep((SMALL, LARGE), (8, 16), seq=2048, max_plan_s=120, views=False))


def _cell(label: str, gpus: int) -> dict:
    return next(r for r in _rows() if r["model"] == label and r["gpus"] == gpus)


def test_small_model_on_one_node_is_data_parallel() -> None:
    r = _cell("llama-1b-4L", 8)
    a = r["advice"]
    assert a.fits and r["practice"].kind == "DP"
    s = a.strategy
    assert (s["dp"], s["tp"], s["pp"], s["cp"]) == (8, 1, 1, 1), s
    assert r["agrees"] is True


def test_large_model_on_two_nodes_is_tensor_parallel_inside_a_node() -> None:
    r = _cell("llama-70b-20L", 16)
    a = r["advice"]
    assert r["practice"].kind in ("TP", "TP+PP") and r["practice"].tp <= 8
    assert a.fits
    s = a.strategy
    assert s["tp"] > 1 and s["tp_intra_node"], s
    roles = {k.split("=")[0]: v for k, v in s["axes"].items()}  # a pipeline's stage mesh: fewer nodes per stage
    assert "tp" in roles["gpu"] and "tp" not in roles["node"], s["axes"]
    assert a.memory["peak"] <= a.memory_budget * (1 + 1e-9)
    # the states alone do not fit a GPU: the plan shards them
    assert a.params * 16 > a.memory_budget


def test_every_cell_is_reported_and_disagreements_are_explained(tmp_path) -> None:
    rows = _rows()
    assert len(rows) == 4
    for r in rows:
        a = r["advice"]
        assert a.fits or a.binding
        if a.fits:
            assert 0 < a.mfu < 0.6  # REFERENCE.md: a predicted MFU above ~60% is a bug
            assert sum(a.memory["by_kind"].values()) == a.memory["peak"] or abs(
                sum(a.memory["by_kind"].values()) - a.memory["peak"]) <= 1e-6 * a.memory["peak"]
        if r["agrees"] is not True:
            cmp_ = r["comparison"]
            assert cmp_["detail"] and cmp_["decided_by"]
            if cmp_.get("diff"):  # the recipe was scored: the deciding term is one of the step's terms
                assert cmp_["decided_by"] in cmp_["diff"]
                gain = cmp_["recipe_step_s"] - a.step_time_s
                assert sum(cmp_["diff"].values()) == gain or abs(sum(cmp_["diff"].values()) - gain) <= 1e-6
    md = adv.sweep_markdown(list(rows))
    assert md.count("\n") == 1 + len(rows) and "llama-70b-20L" in md
    png = adv.sweep_chart(list(rows), str(tmp_path / "guide.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
