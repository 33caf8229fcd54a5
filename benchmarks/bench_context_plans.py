"""When context parallelism pays: the table of ``tests/fakepg/test_context_plans.py`` (a Llama-2-7B-class model on
``h100-80gb`` nodes at REFERENCE.md's NeMo lengths, planned with and without the sequence split of attention), plus
the 16K plan with every attention pinned to the ring on ``x`` (CP forced), to show the margin by which it is off.

    PYTHONPATH=. python benchmarks/bench_context_plans.py [--seqs 16384,65536,262144] [--no-merge]

``--no-merge`` prices the ring without its passes in memory (``strategy.context.ring_merge_time`` patched to 0): the
cost model before they were priced. Every number is a prediction on the meta device; ~20 s to trace each length and
5-30 s a plan on 2 cores.
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _attention(plan) -> str:
    rs = [r for r in plan.nodes.values() if r["op"] == "aten.scaled_dot_product_attention.default"]
    return f"{rs[0]['output']} {rs[0].get('tag', '')}".strip() + f" (x{len(rs)})"


def _forced_ring(s: int):
    """The ``s``-token plan with every attention's sequence split on ``x`` by the ring."""
    import autopart
    from autopart import planner
    from autopart.strategy import registry
    from tests.fakepg import test_context_plans as T

    model, ids, t = T._traced(s)
    shape = T.CASES[s]
    spec = "S(0)" + "".join("S(2)" if i == 1 else "R" for i in range(1, len(shape)))
    pins = {n.name: f"{spec} [cp_ring]" for n in t.graph.nodes if n.target == SDPA}
    registry._OPTIONS_CACHE.clear()
    planner._ANALYZED.clear()
    return autopart.plan(model, autopart.mesh(shape, T.NAMES[:len(shape)]), (ids,), {"labels": ids},
                         cluster=autopart.preset("h100-80gb", shape), roles={"dp": "dp"}, traced=t, pipeline="off",
                         pins=pins)


def main() -> None:
    from autopart.strategy import context
    from tests.fakepg import test_context_plans as T

    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="16384,65536,262144")
    ap.add_argument("--no-merge", action="store_true", help="price the ring without its merge passes")
    args = ap.parse_args()
    patch = mock.patch.object(context, "ring_merge_time", lambda *a: 0.0) if args.no_merge else mock.MagicMock()
    with patch:
        print("| seq | mesh | with CP: attention | step s | without CP: attention | step s | gain |")
        print("|---|---|---|---|---|---|---|")
        for s in [int(x) for x in args.seqs.split(",")]:
            a, b = T._plan(s, True), T._plan(s, False)
            sa, sb = a.predicted["step_time_s"], b.predicted["step_time_s"]
            print(f"| {s // 1024}K | {T.CASES[s]} | {_attention(a)} | {sa:.4f} | {_attention(b)} | {sb:.4f} | "
                  f"{sb / sa:.3f}x |", flush=True)
        if 16384 in T.CASES:
            p = _forced_ring(16384)
            r = next(r for r in p.nodes.values() if r["op"] == "aten.scaled_dot_product_attention.default")
            print(f"\n16K, every attention pinned to the ring on x: step {p.predicted['step_time_s']:.4f} s; per "
                  f"attention {1e3 * (r['time_s'] - r['compute_s']):.3f} ms beyond its compute (exposed hops and "
                  f"merge passes)")


if __name__ == "__main__":
    main()
