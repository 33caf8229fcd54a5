"""Transformer vs Mamba at matched parameter counts, as sequences grow: the plan autopart chooses for each, its
predicted step time, memory per GPU and communication by kind (issue 5's design-guide comparison).

    PYTHONPATH=. python benchmarks/bench_transformer_vs_mamba.py [--seqs 4096,32768,131072] [--gpus 64,512]
        [--tokens 4194304] [--max-plan-s 300]

Models (2.67B and 2.71B parameters, bf16 weights, Adam with fp32 master: 16 bytes of state per parameter):

* transformer: Llama-style, d_model 2560, 32 layers, 32 heads (8 KV heads), SwiGLU 7680, vocabulary 50304;
* mamba: the reference Mamba (autopart/models/mamba.py: Mamba-1 block with Mamba-2's per-head scalar decay), d_model
  2560, 64 layers, expand 2, d_state 16, head dim 64, chunks of 256 tokens, vocabulary 50304.

Global batch: ``--tokens`` tokens per step (4M), i.e. tokens / seq sequences; ``h100-80gb`` nodes of 8. Every
number is autopart's prediction on the meta device (``autopart.advise``), nothing runs.
"""

from __future__ import annotations

import argparse
import time

import torch

VOCAB = 50304


def transformer(batch: int, seq: int):
    from autopart.models import Llama, LlamaConfig

    def make():
        cfg = LlamaConfig(vocab_size=VOCAB, max_seq_len=seq, n_layer=32, n_head=32, n_kv_head=8, d_model=2560,
                          d_ff=7680)
        model = Llama(cfg)
        ids = torch.randint(0, VOCAB, (batch, seq))
        return model, (ids,), {"labels": ids}

    make.__name__ = "transformer-2.7b"
    return make


def mamba(batch: int, seq: int):
    from autopart.models.mamba import Mamba, MambaConfig

    def make():
        cfg = MambaConfig(vocab_size=VOCAB, n_layer=64, d_model=2560, d_state=16, expand=2, headdim=64,
                          chunk_size=256)
        model = Mamba(cfg)
        ids = torch.randint(0, VOCAB, (batch, seq))
        return model, (ids,), {"labels": ids}

    make.__name__ = "mamba-2.7b"
    return make


def _fmt_comm(comm: dict) -> str:
    parts = []
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"):
        c = comm.get(kind) or {}
        if c.get("bytes"):
            parts.append(f"{kind.replace('_', '-')} {c['bytes'] / 2**30:.1f} GiB")
    return ", ".join(parts) or "-"


def _fmt_strategy(s: dict) -> str:
    degrees = ", ".join(f"{k}{s[k]}" for k in ("dp", "tp", "cp", "pp") if s.get(k, 1) > 1)
    extra = []
    if s.get("micro_batches", 1) > 1:
        extra.append(f"m={s['micro_batches']} {s.get('schedule', '')}".strip())
    if s.get("checkpoint"):
        extra.append("recompute " + "/".join(s["checkpoint"]) + f" x{s.get('checkpointed_layers', 0)}")
    return f"{s.get('name', '?')} ({degrees}{'; ' + '; '.join(extra) if extra else ''})"


def main() -> None:
    import autopart

    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="4096,32768,131072")
    ap.add_argument("--gpus", default="64,512")
    ap.add_argument("--tokens", type=int, default=4 * 2**20)
    ap.add_argument("--max-plan-s", type=float, default=300.0)
    ap.add_argument("--no-recipes", action="store_true", help="skip scoring the standard recipes (faster)")
    args = ap.parse_args()
    rows = []
    for gpus in [int(g) for g in args.gpus.split(",")]:
        for seq in [int(s) for s in args.seqs.split(",")]:
            batch = max(1, args.tokens // seq)
            for label, maker in (("transformer", transformer), ("mamba", mamba)):
                t0 = time.perf_counter()
                a = autopart.advise(factory=maker(batch, seq), cluster="h100-80gb", nodes=gpus // 8,
                                    batch=batch, seq=seq, max_plan_s=args.max_plan_s, recipes=not args.no_recipes)
                row = {"model": label, "params": a.params, "gpus": gpus, "seq": seq, "batch": batch,
                       "fits": a.fits, "wall_s": time.perf_counter() - t0}
                if a.fits:
                    row.update(strategy=_fmt_strategy(a.strategy), step=a.step_time_s, mfu=a.mfu,
                               mem=a.memory.get("peak", float("nan")), comm=_fmt_comm(a.communication),
                               tokens_per_s=a.tokens_per_s)
                else:
                    row.update(why=a.binding[:160])
                rows.append(row)
                print(row, flush=True)
    print("\n| model | params | GPUs | seq | batch | plan | step (s) | tokens/s | MFU | memory/GPU (GiB) | "
          "communication per GPU per step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["fits"]:
            print(f"| {r['model']} | {r['params'] / 1e9:.2f}B | {r['gpus']} | {r['seq']} | {r['batch']} | "
                  f"{r['strategy']} | {r['step']:.3f} | {r['tokens_per_s'] / 1e6:.2f}M | {r['mfu']:.0%} | "
                  f"{r['mem'] / 2**30:.1f} | {r['comm']} |")
        else:
            print(f"| {r['model']} | {r['params'] / 1e9:.2f}B | {r['gpus']} | {r['seq']} | {r['batch']} | "
                  f"does not fit: {r['why']} | | | | | |")


if __name__ == "__main__":
    main()
