"""Where one rank's compute goes, by op kind, as the planner prices it (models on ``meta``, no process group).

    PYTHONPATH=. python benchmarks/bench_compute.py                       # Megatron table's 1.7B, one rank, tp=1
    PYTHONPATH=. python benchmarks/bench_compute.py --row 7.1B --cluster a100-80gb

For a row of the Megatron-Core H100 table (``bench_pipeline.MEGATRON``: GPT, seq 4096, vocab 131072, bf16), the
graph of one data-parallel rank's batch (global batch / dp sequences, unsharded: the row's tp is not applied) is
priced op by op as ``planner._node_prices`` prices an op replicated on every axis, each with its backward (the
planner skips the backward of the few ops no gradient reaches, such as the position ids'): FLOPs forward plus
backward (``node_flops`` + ``backward_flops``), bytes 3x the forward's (``node_bytes``), seconds by
``roofline_time`` with the op's target (fused attention at the device's ``attention_flops``). Printed per op kind:
calls, TFLOP, GB, seconds, share, and the seconds of calls that are compute-bound; then the total against the row's
Megatron FLOPs (72 B s L h^2 (1 + s/(6h) + V/(12 L h))) as TFLOP/s. Communication, the optimizer step and the
pipeline are not in it: ``bench_pipeline.py megatron`` scores whole steps.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from autopart.cost.cluster import PRESETS, preset
from autopart.cost.compute import backward_flops, node_bytes, node_flops, roofline_time
from autopart.models.gpt import GPT, GPTConfig
from autopart.planner import _fx_vals
from autopart.trace import trace
from benchmarks.bench_pipeline import MEGATRON, SEQ, VOCAB, megatron_flops


def breakdown(row: str, cluster: str) -> list[dict]:
    spec = {r[0]: r for r in MEGATRON}
    if row not in spec:
        raise ValueError(f"unknown row {row!r}; rows are {sorted(spec)}")
    _, h, heads, layers, _, _, dp, _, batch, _ = spec[row]
    b = batch // dp
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=layers, n_head=heads, d_model=h, bias=False)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
        ids = torch.randint(0, VOCAB, (b, SEQ))
    device = preset(cluster, (1,)).device  # a preset name or a cluster file
    kinds: dict[str, dict] = defaultdict(lambda: {"calls": 0, "flops": 0.0, "bytes": 0.0, "s": 0.0, "bound_s": 0.0})
    for n in trace(model, (ids,), {"labels": ids}).graph.nodes:
        if n.op != "call_function" or not isinstance(n.meta.get("val"), torch.Tensor):  # as the planner's "op" kind
            continue
        val = n.meta["val"]
        fwd = node_flops(n.target, _fx_vals(n.args), _fx_vals(n.kwargs), val)
        flops = fwd + backward_flops(n.target, fwd)
        nbytes = 3 * node_bytes(_fx_vals(list(n.args) + list(n.kwargs.values())), val, n.target)
        s = roofline_time(flops, nbytes, device, n.target, with_backward=True)
        k = kinds[str(n.target).removeprefix("aten.")]
        k["calls"] += 1
        k["flops"] += flops
        k["bytes"] += nbytes
        k["s"] += s
        k["bound_s"] += s if s > nbytes / device.mem_bandwidth else 0.0
    total = sum(k["s"] for k in kinds.values())
    rows = [{"op": op, **k} for op, k in sorted(kinds.items(), key=lambda kv: -kv[1]["s"])]
    print(f"{row}, one rank's {b} x {SEQ} tokens on {cluster}: {total:.4f} s priced, "
          f"{megatron_flops(b, layers, h) / total / 1e12:.0f} TFLOP/s by Megatron's count\n")
    print("| op | calls | TFLOP | GB | s | share | of which compute-bound s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["s"] >= 5e-5:
            print(f"| {r['op']} | {r['calls']} | {r['flops'] / 1e12:.2f} | {r['bytes'] / 1e9:.2f} | {r['s']:.4f} | "
                  f"{100 * r['s'] / total:.1f}% | {r['bound_s']:.4f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--row", default="1.7B", help="a row of the Megatron table (bench_pipeline.MEGATRON)")
    ap.add_argument("--cluster", default="h100-80gb", help=f"a preset {sorted(PRESETS)} or a cluster file")
    args = ap.parse_args()
    breakdown(args.row, args.cluster)


if __name__ == "__main__":
    main()
