"""Training-step time of autopart's plans vs torch's own engines, same model, same 2 gloo processes, one run.

    PYTHONPATH=. python benchmarks/bench_step_time.py [--steps 20] [--warmup 5] [--profile]

* data parallel: ``torch.nn.parallel.DistributedDataParallel`` (each rank its half of the batch) vs
  ``autopart.parallelize(..., roles={"dp": "dp"}, zero=0)`` on a 2-device mesh (DDP's strategy: replicated weights,
  gradients all-reduced in buckets; the runtimes compared), and autopart's own choice on that axis
  (``roles={"dp": "dp"}``: it may ZeRO-shard weights, priced on the ``cpu`` preset, not this machine);
* tensor parallel: ``torch.distributed.tensor.parallel.parallelize_module`` with ``ColwiseParallel`` on
  q/k/v/mlp.fc and ``RowwiseParallel`` on attn.proj/mlp.proj (the attention forward counts local heads, as torch's
  TP tutorial does) vs ``autopart.parallelize(..., roles={"tp": "tp"})``.

A step is forward + backward + AdamW step + zero_grad on the same global batch. Each step is timed between two
barriers; the table gives the median over ``--steps`` steps after ``--warmup`` (two interleaved rounds per
engine, pooled). ``--foreach`` gives AdamW ``foreach=True`` (DDP and autopart; torch TP's mixed plain/DTensor parameters
fail foreach). ``--profile`` prints cProfile's top functions of rank 0's autopart steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "multiproc"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CFG = dict(vocab_size=1024, max_seq_len=128, n_layer=4, n_head=4, d_model=256)
BATCH, SEQ = 8, 128
OPT_KW: dict = {}


def _model():
    from autopart.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG))


def _ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CFG["vocab_size"], (BATCH, SEQ), generator=g)


def _local_heads_forward(self, x):
    """Attention.forward with the head count read from the (possibly column-sharded) projection output."""
    b, s, h = x.shape
    hd = h // self.n_head
    q = self.q(x).view(b, s, -1, hd).transpose(1, 2)
    k = self.k(x).view(b, s, -1, hd).transpose(1, 2)
    v = self.v(x).view(b, s, -1, hd).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(y.transpose(1, 2).reshape(b, s, -1))


def _setup(kind: str):
    """Returns (step function, loss of the first step's inputs is not compared: engines differ in batch split)."""
    import autopart

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    model.train()
    ids = _ids()
    if kind == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, **OPT_KW)
        local = ids.chunk(world)[rank]

        def step():
            loss = ddp(local, labels=local)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    if kind == "torch-tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        plan = {}
        for i in range(CFG["n_layer"]):
            for n in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
                plan[f"blocks.{i}.{n}"] = ColwiseParallel()
            for n in ("attn.proj", "mlp.proj"):
                plan[f"blocks.{i}.{n}"] = RowwiseParallel()
            model.blocks[i].attn.forward = types.MethodType(_local_heads_forward, model.blocks[i].attn)
        parallelize_module(model, dm, plan)
        # foreach fails on torch TP's mix of plain and DTensor parameters (aten._foreach_mul_ mixed Tensor/DTensor)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            loss = model(ids, labels=ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    role = {"autopart-dp": "dp", "autopart-dp-choice": "dp", "autopart-tp": "tp"}[kind]
    mesh = autopart.mesh((world,), (role,))
    zero = {"zero": 0} if kind == "autopart-dp" else {}
    pm = autopart.parallelize(model, mesh, (ids,), {"labels": ids}, roles={role: role}, **zero)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, **OPT_KW)

    def step():
        loss = pm.forward_backward(ids, labels=ids)
        opt.step()
        opt.zero_grad()
        return loss
    step.plan = pm.plan
    return step


def _time(step, n: int) -> list[float]:
    out = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        out.append(time.perf_counter() - t0)
    return out


def run(steps: int, warmup: int, profile: bool, foreach: bool = False):
    if foreach:
        OPT_KW["foreach"] = True
    kinds = ["torch-ddp", "autopart-dp", "autopart-dp-choice", "torch-tp", "autopart-tp"]
    fns, setup_s = {}, {}
    for k in kinds:
        t0 = time.perf_counter()
        fns[k] = _setup(k)
        setup_s[k] = time.perf_counter() - t0
    times = {k: [] for k in kinds}
    for k in kinds:
        _time(fns[k], warmup)
    half = max(1, steps // 2)
    for _ in range(2):  # interleaved rounds: drift on the machine hits every engine alike
        for k in kinds:
            times[k] += _time(fns[k], half)
    prof = None
    if profile:
        import cProfile
        import io
        import pstats

        prof = {}
        for k in ("autopart-dp", "autopart-dp-choice", "autopart-tp", "torch-ddp", "torch-tp"):
            pr = cProfile.Profile()
            pr.enable()
            _time(fns[k], half)
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
            prof[k] = s.getvalue()
    plans = {k: str(getattr(fns[k], "plan", "")) for k in kinds}
    return {"times": times, "setup_s": setup_s, "profile": prof, "plans": plans}


def main() -> None:
    from harness import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--show-plans", action="store_true")
    ap.add_argument("--foreach", action="store_true", help="AdamW(foreach=True) for DDP and autopart (torch TP cannot)")
    a = ap.parse_args()
    res = run_ranks(2, run, a.steps, a.warmup, a.profile, a.foreach)[0]
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    print(f"reference GPT {CFG}, batch {BATCH} x seq {SEQ}, 2 gloo ranks x 1 thread, torch {torch.__version__}; "
          f"median of {len(res['times']['torch-ddp'])} steps after {a.warmup} warm-up; AdamW foreach={a.foreach}")
    print("| parallelism | torch engine | torch step ms | autopart step ms | autopart / torch "
          "| setup s (torch / autopart) |")
    print("|---|---|---|---|---|---|")
    for name, t, ap_ in (("data, dp=2 (zero=0)", "torch-ddp", "autopart-dp"),
                         ("data, dp=2 (autopart's choice)", "torch-ddp", "autopart-dp-choice"),
                         ("tensor, tp=2", "torch-tp", "autopart-tp")):
        engine = "DistributedDataParallel" if t == "torch-ddp" else "parallelize_module Colwise/Rowwise"
        print(f"| {name} | {engine} | {med[t] * 1e3:.1f} | {med[ap_] * 1e3:.1f} | {med[ap_] / med[t]:.2f} | "
              f"{res['setup_s'][t]:.1f} / {res['setup_s'][ap_]:.1f} |")
    if a.show_plans:
        for k in ("autopart-dp", "autopart-dp-choice", "autopart-tp"):
            print(f"\n{k} plan:\n{res['plans'][k]}")
    if res["profile"]:
        for k, text in res["profile"].items():
            print(f"\n==== cProfile, rank 0, {k} ====\n{text}")


if __name__ == "__main__":
    main()
