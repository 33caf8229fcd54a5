"""Grouped-query attention with fewer K/V heads than the GPUs of a node: decoding with the heads split wider than
the K/V heads (each GPU holds the K/V heads whole and reads the one its query heads use, as vLLM does), against
the planner without that option, in the same run.

    PYTHONPATH=. python benchmarks/bench_gqa.py [--context 8192] [--batches 1,16]

Per model (Llama-family shapes of public models: GLM-4-9B's 32 query / 2 K/V heads, StarCoder2-15B's 48 / 4, and
Llama-3-8B's 32 / 8 as the control, whose K/V heads split 8 ways anyway): ``autopart.advise(..., inference=True)``
on one ``h100-80gb`` node decoding one token per sequence over a cache of ``--context`` tokens, every logical mesh
view, once as the planner is and once with the option removed (``registry.COMBO_CHECKS`` of SDPA refusing it).
Reported: the step (time between tokens), the chosen mesh and attention layout, the K/V cache per GPU. Every number
is a prediction on the meta device.
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SDPA = torch.ops.aten.scaled_dot_product_attention.default
MODELS = {  # name: llama-family overrides
    "glm4-9b-like (32q/2kv)": dict(layers=40, hidden=4096, heads=32, kv_heads=2, ffn=13696, vocab=151552),
    "starcoder2-15b-like (48q/4kv)": dict(layers=40, hidden=6144, heads=48, kv_heads=4, ffn=24576, vocab=49152),
    "llama-3-8b (32q/8kv)": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256),
}


def _clear() -> None:
    from autopart import planner
    from autopart.strategy import registry

    registry._OPTIONS_CACHE.clear()
    planner._ANALYZED.clear()


def _row(name: str, over: dict, batch: int, context: int, split: bool) -> dict:
    import autopart
    from autopart.strategy import registry
    from autopart.strategy.context import gqa_split

    _clear()
    patch = {} if split else {SDPA: lambda *a: not gqa_split(*a)}
    with mock.patch.dict(registry.COMBO_CHECKS, patch):
        a = autopart.advise("llama", cluster="h100-80gb", nodes=1, batch=batch, seq=1, kv_cache_tokens=context,
                            inference=True, **over)
    _clear()
    if not a.fits:
        return {"step_ms": float("nan"), "mesh": "-", "attention": "does not fit", "kv_gib": float("nan")}
    att = next(r for r in a.plan.nodes.values() if r["op"] == "aten.scaled_dot_product_attention.default")
    return {"step_ms": a.step_time_s * 1e3, "mesh": "x".join(map(str, a.mesh)),
            "attention": f"q {att['inputs'][0]}, k/v {att['inputs'][1]}",
            "kv_gib": a.plan.predicted["memory_bytes"].get("kv_cache", 0.0) / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batches", default="1,16")
    args = ap.parse_args()
    print(f"decoding on one h100-80gb node (8 GPUs), K/V cache of {args.context} tokens a sequence\n")
    print("| model | batch | without the split: step ms, mesh, attention, K/V GiB/GPU | with it: step ms, mesh, "
          "attention, K/V GiB/GPU | with / without |")
    print("|---|---|---|---|---|")
    for name, over in MODELS.items():
        for b in map(int, args.batches.split(",")):
            off = _row(name, over, b, args.context, False)
            on = _row(name, over, b, args.context, True)
            print(f"| {name} | {b} | {off['step_ms']:.3f}, {off['mesh']}, {off['attention']}, {off['kv_gib']:.2f} | "
                  f"{on['step_ms']:.3f}, {on['mesh']}, {on['attention']}, {on['kv_gib']:.2f} | "
                  f"{on['step_ms'] / off['step_ms']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
