"""The Megatron-Core H100 table's per-GPU compute, measured on one GPU beside what autopart predicts for it.

Three rows of the table (REFERENCE.md; ``bench_pipeline.py megatron``) stay outside +-15%: 1.7B and 7.1B predicted
too fast, 32B too slow. The notes put the first two on compute autopart does not price (non-GEMM work, GEMM
efficiency at h = 2048-4096) and the third on communication only a cluster shows. This script measures the first
part on one GPU, in one short run, so that a session lent a GPU can settle it inside its device time:

* ``1.7B model``: the whole 1.7B GPT (tp = 1: one GPU runs exactly Megatron's per-GPU compute), one micro-batch of
  one 4096-token sequence, forward and backward, bf16 weights, the loss on fp32 logits, as the table's runs;
* ``<row> layer``: one transformer layer at the row's tensor-parallel shard shapes (q/k/v/proj/fc widths / tp,
  heads / tp; LayerNorms on the whole hidden, as without sequence parallelism), forward and backward;
* ``<row> head``: the final LayerNorm, the LM head's vocabulary shard (131072 / tp) and the fp32 cross-entropy.

Each case: the median of timed steps (CUDA events) after warm-up, and one profiled step's GPU time split into GEMM,
attention and other kernels. ``compare`` prices the same modules with autopart's cost model (``h100-80gb``, one
device) and prints measured / predicted per case and kind.

On the GPU (only torch needed; autopart's GPT is loaded from its file, without importing autopart)::

    python3 benchmarks/gpu_megatron_compute.py measure --out $OUT/measured.json       # ~2 minutes on an H100

Here, with the file back::

    PYTHONPATH=. python benchmarks/gpu_megatron_compute.py compare measured.json

``measure --device cpu --tiny`` runs the same code on small shapes (the test suite's smoke check).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ, VOCAB = 4096, 131072
# row, hidden, heads, layers, tensor parallel (REFERENCE.md, Megatron-Core on H100; the pp = 1 rows and 70B's)
ROWS = [("1.7B", 2048, 16, 24, 1), ("7.1B", 4096, 32, 30, 2), ("16B", 6144, 48, 32, 4), ("32B", 7168, 56, 48, 8),
        ("70B", 8192, 64, 84, 8)]
TINY = [("tiny", 256, 4, 2, 2)]
KINDS = ("gemm", "attention", "other")


def _gpt_module():
    """autopart/models/gpt.py loaded by path: the GPU machine need not install autopart's dependencies."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "autopart", "models", "gpt.py")
    spec = importlib.util.spec_from_file_location("_autopart_gpt", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while the file runs
    spec.loader.exec_module(mod)
    return mod


class ShardLayer(nn.Module):
    """autopart's GPT ``Block`` at one tensor-parallel rank's shard shapes: q, k, v and fc split by columns (h / tp,
    4h / tp), the two projections by rows, heads / tp. The collectives tensor parallelism adds are not here."""

    def __init__(self, h: int, heads: int, tp: int) -> None:
        super().__init__()
        self.heads, self.width = heads // tp, h // tp
        self.ln1, self.ln2 = nn.LayerNorm(h, bias=False), nn.LayerNorm(h, bias=False)
        self.q, self.k, self.v = (nn.Linear(h, h // tp, bias=False) for _ in range(3))
        self.proj = nn.Linear(h // tp, h, bias=False)
        self.fc = nn.Linear(h, 4 * h // tp, bias=False)
        self.fc_proj = nn.Linear(4 * h // tp, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.ln1(x)
        q, k, v = (m(y).view(b, s, self.heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, self.width))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class ShardHead(nn.Module):
    """The final LayerNorm, one rank's vocabulary shard of the LM head and the cross-entropy on fp32 logits."""

    def __init__(self, h: int, vocab: int, tp: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(h, bias=False)
        self.head = nn.Linear(h, vocab // tp, bias=False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


def cases(tiny: bool = False) -> list[dict]:
    """Each case's module factory and inputs factory (device, dtype) -> (args,), as ``measure`` and ``compare``
    build them."""
    seq, vocab = (128, 1024) if tiny else (SEQ, VOCAB)
    out = []
    for name, h, heads, layers, tp in (TINY if tiny else ROWS):
        if tp == 1 or tiny:
            def model(name=name, h=h, heads=heads, layers=layers):
                gpt = _gpt_module()
                cfg = gpt.GPTConfig(vocab_size=vocab, max_seq_len=seq, n_layer=layers, n_head=heads, d_model=h,
                                    bias=False, fp32_loss=True, tie_embeddings=False)
                return gpt.GPT(cfg)
            out.append({"case": f"{name} model", "build": model,
                        "inputs": lambda device, dtype: (torch.randint(0, vocab, (1, seq), device=device),) * 2,
                        "loss": "output"})
        out.append({"case": f"{name} layer", "build": lambda h=h, heads=heads, tp=tp: ShardLayer(h, heads, tp),
                    "inputs": lambda device, dtype, h=h: (torch.randn(1, seq, h, device=device, dtype=dtype,
                                                                      requires_grad=True),),
                    "loss": "sum"})
        out.append({"case": f"{name} head", "build": lambda h=h, tp=tp: ShardHead(h, vocab, tp),
                    "inputs": lambda device, dtype, h=h, tp=tp: (
                        torch.randn(1, seq, h, device=device, dtype=dtype, requires_grad=True),
                        torch.randint(0, vocab // tp, (1, seq), device=device)),
                    "loss": "output"})
    return out


def _kind(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa", "cudnn_generated_fort_native_sdpa")):
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "sm80_", "ampere_", "hopper_")):
        return "gemm"
    return "other"


def _step(module: nn.Module, args: tuple, loss: str) -> None:
    out = module(*args)
    (out if loss == "output" else out.float().sum()).backward()


def measure(args) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    info = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
            "seq": 128 if args.tiny else SEQ, "cases": []}
    print(f"{info['device']}, torch {torch.__version__}", flush=True)
    for c in cases(args.tiny):
        if args.only and not any(c["case"].startswith(o) for o in args.only.split(",")):
            continue
        torch.manual_seed(0)
        with device:  # built where it runs: 1.7B parameters initialised on the host took most of a minute
            module = c["build"]().to(dtype=dtype)
        inputs = c["inputs"](device, dtype)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        for _ in range(args.warmup):
            _step(module, inputs, c["loss"])
            module.zero_grad(set_to_none=True)
        sync()
        times = []
        for _ in range(args.steps):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                _step(module, inputs, c["loss"])
                end.record()
                sync()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                _step(module, inputs, c["loss"])
                times.append(time.perf_counter() - t0)
            module.zero_grad(set_to_none=True)
        kinds = dict.fromkeys(KINDS, 0.0)
        top: dict[str, float] = {}
        if cuda:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                _step(module, inputs, c["loss"])
                sync()
            module.zero_grad(set_to_none=True)
            for e in prof.key_averages():
                us = getattr(e, "self_device_time_total", None)
                if us is None:
                    us = getattr(e, "self_cuda_time_total", 0.0)
                if us > 0:
                    kinds[_kind(e.key)] += us / 1e6
                    top[e.key] = top.get(e.key, 0.0) + us / 1e6
        rec = {"case": c["case"], "step_s": statistics.median(times), "min_s": min(times), "kinds_s": kinds,
               "top_kernels_s": dict(sorted(top.items(), key=lambda kv: -kv[1])[:12]),
               "params": sum(p.numel() for p in module.parameters())}
        info["cases"].append(rec)
        print(json.dumps(rec), flush=True)
        del module, inputs
        if cuda:
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)
    return info


def predict(case: dict, tiny: bool, cluster: str = "h100-80gb") -> dict:
    """autopart's prediction for one case on one device of ``cluster``: the plan's compute (forward and backward)
    and its split by the same kinds (an op's record: matmuls, fused attention, the rest)."""
    import autopart

    with torch.device("meta"):
        module = case["build"]().to(torch.bfloat16)
        inputs = case["inputs"](torch.device("meta"), torch.bfloat16)
    if case["loss"] == "sum":  # the layer's output summed, as ``measure`` backpropagates it
        module = _Summed(module)
    plan = autopart.plan(module, (1,), inputs, cluster=cluster, pipeline="off", checkpoint="none", zero=0,
                         offload="none", memory_budget=float("inf"), recipes=False)
    kinds = dict.fromkeys(KINDS, 0.0)
    for rec in plan.nodes.values():
        op = rec.get("op", "")
        if op in ("param", "buffer", "constant", "input"):
            continue
        kind = "attention" if "scaled_dot_product" in op else \
            "gemm" if any(k in op for k in ("linear", "mm", "matmul", "einsum")) else "other"
        kinds[kind] += rec.get("compute_s", 0.0)
    return {"compute_s": plan.predicted["compute_s"], "kinds_s": kinds}


class _Summed(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).float().sum()


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g}"


def compare(args) -> list[dict]:
    """measured / predicted per case; without a measured file (``predict``), autopart's predictions alone."""
    if args.measured:
        with open(args.measured) as f:
            measured = json.load(f)
    else:
        measured = {"device": "(not measured)", "torch": torch.__version__, "seq": 128 if args.tiny else SEQ,
                    "cases": [{"case": c["case"], "step_s": math.nan, "kinds_s": dict.fromkeys(KINDS, math.nan)}
                              for c in cases(args.tiny)]}
    tiny = measured.get("seq") != SEQ
    by_case = {c["case"]: c for c in cases(tiny)}
    rows = []
    print(f"measured on {measured['device']} (torch {measured['torch']}); predicted on {args.cluster}\n")
    print("| case | measured ms | predicted ms | measured / predicted | " +
          " | ".join(f"{k}: measured / predicted ms" for k in KINDS) + " |")
    print("|---|---|---|---|" + "---|" * len(KINDS))
    for m in measured["cases"]:
        if m["case"] not in by_case:
            continue
        p = predict(by_case[m["case"]], tiny, args.cluster)
        row = {"case": m["case"], "measured_s": m["step_s"], "predicted_s": p["compute_s"],
               "ratio": m["step_s"] / p["compute_s"] if p["compute_s"] else math.nan,
               "measured_kinds_s": m["kinds_s"], "predicted_kinds_s": p["kinds_s"]}
        rows.append(row)
        kinds = " | ".join(f"{_ms(m['kinds_s'][k])} / {_ms(p['kinds_s'][k])}" for k in KINDS)
        print(f"| {m['case']} | {_ms(m['step_s'])} | {_ms(p['compute_s'])} | {row['ratio']:.2f} | {kinds} |",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("measure", help="time the cases on this machine's GPU (only torch needed)")
    m.add_argument("--device", default="cuda")
    m.add_argument("--tiny", action="store_true", help="small shapes (a CPU smoke run)")
    m.add_argument("--only", default="", help="comma-separated case prefixes, e.g. '1.7B,7.1B layer'")
    m.add_argument("--warmup", type=int, default=3)
    m.add_argument("--steps", type=int, default=10)
    m.add_argument("--out", default="")
    c = sub.add_parser("compare", help="measured / predicted per case (here: needs autopart)")
    c.add_argument("measured", nargs="?", default="", help="measure's JSON (left out: autopart's predictions alone)")
    c.add_argument("--tiny", action="store_true", help="without a measured file: the small shapes")
    c.add_argument("--cluster", default="h100-80gb")
    c.add_argument("--json", default="")
    args = ap.parse_args(argv)
    measure(args) if args.what == "measure" else compare(args)


if __name__ == "__main__":
    main()
