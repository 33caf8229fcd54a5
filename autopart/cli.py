"""``autopart plan | explain | demo`` — the command line."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

DEMO_STEPS = 20


def _demo_model():
    import torch

    from autopart.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, max_seq_len=64, n_layer=2, n_head=4, d_model=64))


def _demo_batches(steps: int):
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (8, 32), generator=g) for _ in range(steps)]


DEMO_ROLES = {"dp": "dp", "tp": "tp"}


def _reference_losses(steps: int) -> list[float]:
    import torch

    model = _demo_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for ids in _demo_batches(steps):
        loss = model(ids, labels=ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def demo_worker(steps: int) -> None:
    """Runs on every rank under torchrun."""
    import torch
    import torch.distributed as dist

    import autopart

    torch.set_num_threads(1)
    mesh = autopart.mesh((2, 2), names=("dp", "tp"))
    model = _demo_model()
    ids = _demo_batches(1)[0]
    pm = autopart.parallelize(model, mesh, (ids,), {"labels": ids}, roles=DEMO_ROLES)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    losses = []
    for ids in _demo_batches(steps):
        losses.append(pm.forward_backward(ids, labels=ids).item())
        opt.step()
        opt.zero_grad()
    if dist.get_rank() == 0:
        ref = _reference_losses(steps)
        print(f"\n{'step':>4}  {'autopart (4 ranks)':>18}  {'single process':>14}  {'|diff|':>8}")
        for i, (a, b) in enumerate(zip(losses, ref)):
            print(f"{i:>4}  {a:>18.6f}  {b:>14.6f}  {abs(a - b):>8.1e}")
        worst = max(abs(a - b) for a, b in zip(losses, ref))
        print(f"\nmax |loss difference| over {steps} steps: {worst:.2e} "
              f"({'parity' if worst <= 1e-5 else 'MISMATCH'})")
        print("\nrank 0's program (first lines):")
        print("\n".join(pm.program().splitlines()[:12]))
    dist.destroy_process_group()


def cmd_demo(args: argparse.Namespace) -> int:
    import autopart

    model = _demo_model()
    ids = _demo_batches(1)[0]
    mesh = autopart.mesh((2, 2), names=("dp", "tp"))
    print(f"planning a {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter GPT for a 2x2 (dp, tp) "
          f"CPU mesh, roles pinned: {DEMO_ROLES}\n")
    plan = autopart.plan(model, mesh, (ids,), {"labels": ids}, roles=DEMO_ROLES)
    print(plan)
    print(f"\nlaunching 4 gloo workers with torchrun, {args.steps} AdamW steps ...", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "autopart.cli", "_demo_worker", "--steps", str(args.steps)]
    return subprocess.call(cmd, env=env)


def cmd_plan(args: argparse.Namespace) -> int:
    import torch

    import autopart
    from autopart.models import GPT, GPTConfig, Llama, LlamaConfig

    family, _, size = args.model.partition(":")
    cfg = (GPTConfig if family == "gpt" else LlamaConfig).preset(size or "tiny")
    with torch.device("meta" if args.meta else "cpu"):
        model = (GPT if family == "gpt" else Llama)(cfg)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    shape = tuple(int(x) for x in args.mesh.split("x"))
    names = tuple(args.names.split(",")) if args.names else tuple(f"axis{i}" for i in range(len(shape)))
    roles = dict(kv.split("=") for kv in args.role) if args.role else {}
    plan = autopart.plan(model, autopart.mesh(shape, names), (ids,), {"labels": ids}, cluster=args.cluster,
                         roles=roles, memory_budget=args.memory_budget)
    print(plan)
    if args.explain:
        print()
        print(plan.explain(args.explain))
    if args.out:
        plan.save(args.out)
        print(f"\nplan saved to {args.out}")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from autopart.plan import Plan

    print(Plan.load(args.plan).explain(args.node))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="autopart", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="plan a small GPT for a 2x2 CPU mesh and train it on 4 gloo ranks")
    d.add_argument("--steps", type=int, default=DEMO_STEPS)
    d.set_defaults(fn=cmd_demo)
    w = sub.add_parser("_demo_worker")
    w.add_argument("--steps", type=int, default=DEMO_STEPS)
    w.set_defaults(fn=lambda a: demo_worker(a.steps) or 0)
    p = sub.add_parser("plan", help="plan a reference model (gpt:<preset> | llama:<preset>) for a mesh")
    p.add_argument("--model", default="gpt:tiny")
    p.add_argument("--mesh", default="2x2", help="mesh shape, e.g. 8x8")
    p.add_argument("--names", default="dp,tp")
    p.add_argument("--cluster", default="cpu")
    p.add_argument("--role", action="append", help="axis=role, e.g. tp=tp")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--memory-budget", default=None)
    p.add_argument("--meta", action="store_true", help="build the model on the meta device (no memory)")
    p.add_argument("--explain", default=None, help="node or parameter to explain")
    p.add_argument("--out", default=None, help="save the plan as JSON")
    p.set_defaults(fn=cmd_plan)
    e = sub.add_parser("explain", help="explain a decision of a saved plan")
    e.add_argument("plan")
    e.add_argument("node")
    e.set_defaults(fn=cmd_explain)
    args = ap.parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
