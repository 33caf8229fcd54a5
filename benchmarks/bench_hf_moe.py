"""Hugging Face MoE models planned with their sparse-MoE blocks as token-local nodes (``autopart.regions``).

A Mixtral-8x7B-shaped ``MixtralForCausalLM`` (h 4096, I 14336, 8 experts, top-2; ``--layers`` of its 32) and the
same-shaped dense ``LlamaForCausalLM``, built on the meta device, planned for ``--mesh`` ``h100-80gb`` GPUs with
batch x sequence tokens: planning time, predicted step time, the MoE block's layout. With ``--dp-only`` the first
axis is pinned data parallel (a plan the eleventh session's code could not make at all).

    PYTHONPATH=. python benchmarks/bench_hf_moe.py --layers 4 --mesh 8x8
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import autopart


def build(kind: str, layers: int):
    import transformers as T

    common = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, use_cache=False)
    with torch.device("meta"):
        if kind == "mixtral":
            return T.MixtralForCausalLM(T.MixtralConfig(num_local_experts=8, num_experts_per_tok=2,
                                                        router_jitter_noise=0.0, **common))
        return T.LlamaForCausalLM(T.LlamaConfig(**common))


def main() -> None:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--mesh", default="8x8")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dp-only", action="store_true")
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.mesh.split("x"))
    names = tuple("abcd"[: len(shape)])
    ids = torch.randint(0, 32000, (a.batch, a.seq))
    print("| model | planning s | predicted step s | memory/GPU GiB | chosen | MoE block layout | experts split over |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("mixtral", "llama"):
        model = build(kind, a.layers)
        t0 = time.perf_counter()
        plan = autopart.plan(model, autopart.mesh(shape, names), (ids,), {"labels": ids},
                             cluster=autopart.preset("h100-80gb", shape), roles={"a": "dp"} if a.dp_only else None)
        took = time.perf_counter() - t0
        p = plan.predicted
        blocks = sorted({",".join(r["output"]) for r in plan.nodes.values() if "token_local" in r["op"]})
        ep = sorted({"+".join(plan.axis_names[x] for x in r["ep_axes"]) for r in plan.nodes.values()
                     if r.get("ep_axes")})
        chosen = str(plan).splitlines()[0].split("mesh ", 1)[1].split("  on")[0]
        print(f"| {kind} {a.layers} layers | {took:.1f} | {p['step_time_s']:.3f} | "
              f"{p['memory_bytes']['total'] / 2**30:.1f} | {chosen} | {' '.join(blocks) or '-'} | "
              f"{' '.join(ep) or '-'} |")


if __name__ == "__main__":
    main()
