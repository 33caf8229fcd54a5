"""``autopart plan | explain | advise | demo`` — the command line."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

DEMO_STEPS = 20
_REDUCE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", None: None}  # --reduce-dtype -> PlanOptions.reduce_dtype


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


def _batch_arg(text: str) -> int | str:
    if text == "max":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch {text!r}: give a number of sequences, or 'max' with "
                                         "--inference") from None


def _rich_advice(adv, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    from autopart.advise import INSIDE_OPS, KINDS

    console.print(f"[bold]{escape(adv.model)}[/bold] ({adv.params / 1e9:.2f}B parameters) on {adv.gpus} x "
                  f"{escape(adv.cluster)} (mesh {'x'.join(map(str, adv.mesh))}), global batch {adv.batch} x "
                  f"{adv.seq} tokens"
                  + (f", inference (forward only){adv.cache_text()}" if adv.inference else ""))
    if not adv.fits:
        console.print(f"[red]does not fit[/red]: {escape(adv.binding)}")
        return
    s = adv.strategy
    t = Table(title="plan", show_header=False)
    t.add_row("strategy", s["name"])
    t.add_row("layout", s["layout"])
    t.add_row("dp / tp / pp / cp", s.get("degrees") or f"{s['dp']} / {s['tp']} / {s['pp']} / {s['cp']}")
    t.add_row("ZeRO", str(s["zero"]))
    t.add_row("checkpointing", f"{s['checkpointed_layers']} layers {'/'.join(s['checkpoint'])}".strip())
    t.add_row("micro-batches", f"{s['micro_batches']} {s['schedule']}".strip())
    t.add_row("latency (one batch)" if adv.inference else "step time", f"{adv.step_time_s:.4g} s")
    t.add_row("tokens/s", f"{adv.tokens_per_s:,.0f}")
    from autopart.advise import rate

    t.add_row("FLOP/s per GPU", f"{rate(adv.tflops_per_gpu * 1e12)} (model FLOPs {adv.model_flops_per_step:.3g} per "
              "step)")
    t.add_row("MFU", f"{adv.mfu:.1%} of {rate(adv.peak_tflops_per_gpu * 1e12)} peak; {adv.kernel_mfu:.1%} of the "
              f"FLOPs the kernels run ({rate(adv.kernel_tflops_per_gpu * 1e12)}: causal attention halved)")
    gap = (adv.plan.solver.get("ilp") or {}).get("max_gap") if adv.plan is not None else None
    t.add_row("planning", f"{adv.plan_s:.1f} s after a {adv.trace_s:.1f} s trace"
              + (f" (largest ILP gap {gap:.2%})" if gap is not None else ""))
    if len(adv.views) > 1:
        t.add_row("meshes planned", adv.views_text())
    console.print(t)
    m = Table(title=f"memory per GPU (peak at {adv.memory['binds_at']})")
    m.add_column("kind")
    m.add_column("GiB", justify="right")
    for k, v in adv.memory["by_kind"].items():
        m.add_row(k, f"{v / 2**30:.2f}")
    m.add_row("[bold]peak[/bold]", f"{adv.memory['peak'] / 2**30:.2f} of {adv.memory_budget / 2**30:.2f}")
    console.print(m)
    comm = adv.communication
    grads = [comm[k] for k in ("gradient_all_reduce", "gradient_reduce_scatter") if k in comm]
    total = sum(g.get("total_s", g["time_s"]) for g in grads)
    exposed = sum(g["time_s"] for g in grads)
    note = "exposed ms: the time the step waits for each kind; what runs behind compute is not in it"
    if total > exposed * 1.01 + 1e-9:
        note += (f" (the gradient reduction runs {total * 1e3:.2f} ms in all, {(total - exposed) * 1e3:.2f} ms of "
                 "it behind backward)")
    c = Table(title="communication per GPU per step", caption=note)
    c.add_column("kind")
    c.add_column("GiB sent", justify="right")
    c.add_column("exposed ms", justify="right")
    labels = {"gradient_all_reduce": "  of which gradient all-reduce",
              "gradient_reduce_scatter": "  of which gradient reduce-scatter (ZeRO)",
              INSIDE_OPS: "inside ops (kind not recorded)"}
    rows = []
    for k in KINDS:
        rows.append(k)
        g = f"gradient_{k}"
        if g in comm and (k == "all_reduce" or comm[g]["bytes"]):
            rows.append(g)
    for k in (*rows, INSIDE_OPS):
        v = comm[k]
        c.add_row(labels.get(k, k), "-" if v["bytes"] is None else f"{v['bytes'] / 2**30:.3f}",
                  f"{v['time_s'] * 1e3:.2f}")
    console.print(c)
    terms = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in adv.terms.items() if abs(v) > 1e-7)
    console.print(f"step = {terms}")
    if adv.flops_note():
        console.print(f"note: {adv.flops_note()}", highlight=False, markup=False)


def _sizes_arg(text: str) -> tuple:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _gpus_arg(text: str) -> tuple[int, ...]:
    out = []
    for x in _sizes_arg(text):
        try:
            out.append(int(x))
        except ValueError:
            raise ValueError(f"--gpus {text!r}: {x!r} is not a whole number; give comma-separated GPU counts, "
                             "e.g. --gpus 8,64,512") from None
    if not out:
        raise ValueError(f"--gpus {text!r}: give comma-separated GPU counts, e.g. --gpus 8,64,512")
    return tuple(out)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_advise_flags(args: argparse.Namespace, adv_mod) -> None:
    """Flags that would be ignored, contradict each other or are out of range: an error naming them, not a plan of
    something else."""
    for name in ("nodes", "gpus_per_node", "seq", "max_batch", "batch_per_gpu"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"{_flag(name)} {v}: give a whole number >= 1 (or leave it out for the default)")
    if isinstance(args.batch, int) and args.batch < 1:
        raise ValueError(f"--batch {args.batch}: give a whole number >= 1 of sequences in the global batch (default: "
                         "one per GPU), or 'max' with --inference")
    if args.context < 0:
        raise ValueError(f"--context {args.context}: the K/V cache per sequence is a number of tokens >= 0")
    if not args.time_limit > 0:
        raise ValueError(f"--time-limit {args.time_limit:g}: the solver's limit per ILP must be a positive number of "
                         "seconds")
    if args.max_plan_s < 0:
        raise ValueError(f"--max-plan-s {args.max_plan_s:g}: a cap on one plan's seconds, > 0 (0: no cap)")
    if args.factory is not None and args.model is not None:
        raise ValueError(f"--factory {args.factory} replaces --model, but --model {args.model} was given too: "
                         "give one of them")
    if args.factory is not None and args.size is not None:
        raise ValueError(f"--size {args.size} names a size of a --model family; --factory {args.factory} builds "
                         "its own model: leave --size out")
    if args.model is not None:
        adv_mod._split_model(args.model, args.size)  # a size in --model and another in --size: which one?
    overrides = [_flag(k) for k in adv_mod.OVERRIDES if getattr(args, k) is not None]
    if args.sweep:
        if args.inference or args.context:
            raise ValueError("--sweep is the training design guide; --inference and --context plan one model, "
                             "without --sweep")
        single = [f for f, v in (("--model", args.model), ("--size", args.size), ("--factory", args.factory),
                                 ("--batch", args.batch), ("--nodes", args.nodes), ("--dtype", args.dtype),
                                 ("--max-batch", args.max_batch), ("--max-latency-ms", args.max_latency_ms))
                  if v is not None] + overrides
        if single:
            raise ValueError(f"{', '.join(single)}: --sweep plans the models of --sizes on the GPU counts of --gpus "
                             "(the global batch --batch-per-gpu sequences per GPU, bf16 weights) and would ignore "
                             "them; leave them out, or drop --sweep to plan one model")
        return
    sweep_only = [f for f, v in (("--sizes", args.sizes), ("--gpus", args.gpus),
                                 ("--batch-per-gpu", args.batch_per_gpu)) if v is not None]
    if sweep_only:
        raise ValueError(f"{', '.join(sweep_only)}: only the design-guide sweep reads "
                         f"{'them' if len(sweep_only) > 1 else 'it'}; add --sweep, or give one model's run with "
                         "--model/--nodes/--gpus-per-node/--batch")
    if args.max_batch is not None and args.batch != "max":
        raise ValueError(f"--max-batch {args.max_batch} caps the serving search: pass it with --inference --batch "
                         "max (a fixed --batch plans that batch)")


def cmd_advise(args: argparse.Namespace) -> int:
    import importlib
    import json

    import torch
    from rich.console import Console

    adv_mod = importlib.import_module("autopart.advise")  # the module; autopart.advise is the function

    console = Console()
    _check_advise_flags(args, adv_mod)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype or "bf16"]
    cluster = adv_mod.resolve_cluster(args.cluster)
    gap = adv_mod.ADVISE_GAP if args.gap is None else args.gap
    if args.sweep:
        sizes = _sizes_arg(args.sizes) if args.sizes else adv_mod.SWEEP_SIZES
        gpus = _gpus_arg(args.gpus) if args.gpus else adv_mod.SWEEP_GPUS
        cells, done = len(sizes) * len(gpus), []

        def progress(line: str) -> None:  # the cells end in any order (side by side): say how many are done
            if not line.endswith(adv_mod.RETRIED):
                done.append(line)
            console.print(f"[{len(done)}/{cells}] {line}", highlight=False, markup=False)

        rows = adv_mod.sweep(sizes, gpus, cluster=cluster, gpus_per_node=args.gpus_per_node,
                             seq=4096 if args.seq is None else args.seq,
                             batch_per_gpu=1 if args.batch_per_gpu is None else args.batch_per_gpu,
                             time_limit_s=args.time_limit,
                             max_plan_s=args.max_plan_s, optimizer_bytes_per_param=args.optimizer_bytes,
                             views=not args.physical_mesh,
                             log=None if args.json else progress,
                             reduce_dtype=_REDUCE_DTYPES[args.reduce_dtype],
                             grad_dtype=_REDUCE_DTYPES[args.grad_dtype], relative_gap=gap, jobs=args.jobs)
        md = adv_mod.sweep_markdown(rows)
        diff = adv_mod.sweep_diff_markdown(rows)
        if diff:
            md += "\n\nterm by term where practice was scored (recipe - plan, ms per step):\n\n" + diff
        if args.json:
            print(json.dumps(adv_mod.sweep_json(rows), indent=1))
        else:
            console.print(md, highlight=False, soft_wrap=True, markup=False)
        if args.out:
            import os

            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "design_guide.md"), "w") as f:
                f.write(md + "\n")
            with open(os.path.join(args.out, "design_guide.json"), "w") as f:
                json.dump(adv_mod.sweep_json(rows), f, indent=1)
            name = cluster if isinstance(cluster, str) else cluster.name
            png = adv_mod.sweep_chart(rows, os.path.join(args.out, "design_guide.png"),
                                      f"autopart design guide on {name}")
            if not args.json:
                console.print(f"wrote {args.out}/design_guide.md, .json and {png}")
        return 0
    overrides = {k: getattr(args, k) for k in adv_mod.OVERRIDES}
    if args.batch == "max" or args.max_latency_ms is not None:
        if args.batch != "max":
            raise ValueError("--max-latency-ms bounds the serving search: pass it with --inference --batch max")
        if not args.inference:
            raise ValueError("--batch max searches serving's batch of most tokens/s: add --inference (training "
                             "plans take a number of sequences)")
        srv = adv_mod.advise_serving(
            args.model or ("llama" if not args.factory else None), args.size, factory=args.factory,
            cluster=cluster, nodes=args.nodes or 1, gpus_per_node=args.gpus_per_node, seq=args.seq, dtype=dtype,
            time_limit_s=args.time_limit, max_plan_s=args.max_plan_s, views=not args.physical_mesh,
            relative_gap=gap, kv_cache_tokens=args.context, jobs=args.jobs,
            max_batch=1024 if args.max_batch is None else args.max_batch,
            max_latency_s=args.max_latency_ms / 1e3 if args.max_latency_ms is not None else None,
            log=None if args.json else lambda line: console.print(line, highlight=False, markup=False), **overrides)
        if args.json:
            print(json.dumps(srv.to_json(), indent=1))
        else:
            console.print(str(srv), highlight=False, soft_wrap=True, markup=False)
            if srv.best is not None:
                console.print()
                _rich_advice(srv.best, console)
        if args.out and srv.best is not None:
            srv.best.plan.save(args.out)
            if not args.json:
                console.print(f"plan of batch {srv.best.batch} saved to {args.out}")
        return 0 if srv.best is not None else 2
    a = adv_mod.advise(args.model or ("llama" if not args.factory else None), args.size, factory=args.factory,
                       cluster=cluster, nodes=args.nodes or 1, gpus_per_node=args.gpus_per_node, batch=args.batch,
                       seq=args.seq,
                       dtype=dtype, optimizer_bytes_per_param=args.optimizer_bytes, time_limit_s=args.time_limit,
                       max_plan_s=args.max_plan_s, views=not args.physical_mesh,
                       reduce_dtype=_REDUCE_DTYPES[args.reduce_dtype],
                       grad_dtype=_REDUCE_DTYPES[args.grad_dtype], relative_gap=gap, inference=args.inference,
                       kv_cache_tokens=args.context, jobs=args.jobs, **overrides)
    if args.json:
        print(json.dumps(a.to_json(), indent=1))
    else:
        _rich_advice(a, console)
    if args.out and a.plan is not None:
        a.plan.save(args.out)
        if not args.json:
            console.print(f"plan saved to {args.out}")
    return 0 if a.fits else 2


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
    a = sub.add_parser("advise", help="what-if planning: a model by family and size (or a factory) on a cluster "
                                      "preset or file x node count; --sweep for the design guide",
                       description="Plan on the meta device, without a process group, and report step time, "
                                   "tokens/s, TFLOP/s per GPU, MFU, memory per GPU by kind and communication by "
                                   "kind. Exit status 2 when nothing fits.")
    a.add_argument("--model", default=None, help="family (gpt, llama, moe, mamba), or family:size, e.g. llama:70b "
                                                "(default llama)")
    a.add_argument("--size", default=None, help="named size, e.g. 7b, 13b, 70b (llama); 1.3b, 175b, 1t (gpt)")
    a.add_argument("--factory", default=None, help="'module:function' returning an nn.Module (or (module, "
                                                   "example_inputs, example_kwargs)); replaces --model")
    for flag, what in (("layers", "layers"), ("hidden", "hidden size"), ("heads", "attention heads"),
                       ("kv-heads", "key/value heads"), ("vocab", "vocabulary"), ("ffn", "MLP hidden size"),
                       ("experts", "experts (moe)"), ("top-k", "experts per token (moe)")):
        a.add_argument(f"--{flag}", type=int, default=None, help=f"override the {what}")
    a.add_argument("--cluster", default="h100-80gb", help="a preset (cpu, a100-80gb, h100-80gb, h200-141gb) or the "
                                                           "path of a .json/.toml cluster file")
    a.add_argument("--nodes", type=int, default=None, help="nodes (default 1)")
    a.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node (default: the cluster's devices_per_node; 8 for the GPU presets)")
    a.add_argument("--batch", type=_batch_arg, default=None,
                   help="global batch in sequences (default: one per GPU); with --inference, 'max': the batch of "
                        "most tokens/s that fits (and keeps --max-latency-ms), searched 1, 2, 4, ... up to "
                        "--max-batch")
    a.add_argument("--max-latency-ms", type=float, default=None,
                   help="--batch max: the longest a step may take (decoding: the time between tokens)")
    a.add_argument("--max-batch", type=int, default=None, help="--batch max: the largest batch tried (default "
                                                                   "1024)")
    a.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; 4096 for --sweep)")
    a.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"], help="the weights' (default bf16)")
    a.add_argument("--optimizer-bytes", type=float, default=12.0, help="optimizer bytes per parameter (12: Adam "
                                                                        "with an fp32 master copy)")
    a.add_argument("--reduce-dtype", default=None, choices=["fp32", "bf16"],
                   help="sum the data-parallel gradient reduction in this dtype (fp32: Megatron-LM's default with "
                        "bf16 weights); default: the gradients' own")
    a.add_argument("--grad-dtype", default=None, choices=["fp32", "bf16"],
                   help="keep and accumulate gradients in this dtype (fp32: Megatron-LM's main_grad of bf16 "
                        "weights, 18 bytes of model state per parameter with --optimizer-bytes 12); default: the "
                        "weights' own")
    a.add_argument("--inference", action="store_true",
                   help="serving: plan the frozen model forward-only (no gradients, no optimizer states); the step "
                        "is one batch's latency (--batch 1 for latency, larger for throughput)")
    a.add_argument("--context", type=int, default=0,
                   help="--inference: the K/V cache per sequence, in tokens, every attention holds and reads "
                        "(decoding: --seq 1 --context 8192)")
    a.add_argument("--time-limit", type=float, default=20.0, help="the solver's limit per ILP, seconds")
    a.add_argument("--gap", type=float, default=None, help="each ILP stops once its plan is proven within this "
                                                           "fraction of the best (default: advise's ADVISE_GAP, 0.01; "
                                                           "autopart.plan: 0.001)")
    a.add_argument("--max-plan-s", type=float, default=300.0, help="cap on one plan's time (each mesh view's), "
                   "seconds")
    a.add_argument("--jobs", type=int, default=None, help="processes the mesh views (with --sweep: the cells) are "
                   "planned in side by side (default: one per core; 1: one after another in this process)")
    a.add_argument("--physical-mesh", action="store_true", help="plan on the (nodes, gpus-per-node) mesh only, not "
                                                                 "also on its logical views (tensor parallel 1, 2, "
                                                                 "4 inside a node; one axis over all GPUs)")
    a.add_argument("--json", action="store_true", help="print JSON instead of tables")
    a.add_argument("--out", default=None, help="advise: save the plan here; --sweep: a folder for design_guide.md, "
                                               ".json and .png")
    a.add_argument("--sweep", action="store_true", help="the design guide: model sizes x GPU counts")
    a.add_argument("--sizes", default=None, help="--sweep: comma-separated family:size list (default "
                                                 "llama:1b,llama:8b,llama:70b,llama:405b,gpt:1t,mamba:1.4b,mamba:2.8b)")
    a.add_argument("--gpus", default=None, help="--sweep: comma-separated GPU counts (default 8,64,512,4096)")
    a.add_argument("--batch-per-gpu", type=int, default=None, help="--sweep: sequences per GPU in the global batch "
                                                                       "(default 1)")
    a.set_defaults(fn=cmd_advise)
    c = sub.add_parser("calibrate", help="measure this machine on spawned gloo ranks (collectives per mesh axis, "
                                         "matmul, attention, memory bandwidth); cached for cluster='calibrated'")
    c.add_argument("--nproc", type=int, default=2, help="gloo ranks to spawn on this host")
    c.add_argument("--mesh", default=None, help="mesh shape, e.g. 2x2 (default: one axis of --nproc ranks)")
    c.add_argument("--quick", action="store_true", help="fewer sizes and shapes: a few seconds")
    c.add_argument("--cache", default=None, help="cache folder (default: $AUTOPART_CACHE or ~/.cache/autopart)")

    def cmd_calibrate(args: argparse.Namespace) -> int:
        from autopart.calibrate import cli

        return cli(args)
    c.set_defaults(fn=cmd_calibrate)
    args = ap.parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except ValueError as e:
        if args.cmd != "advise":
            raise
        print(f"autopart advise: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
