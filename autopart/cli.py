"""``autopart plan | explain | diff | verify | advise | calibrate | demo`` — the command line."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

DEMO_STEPS = 20
_REDUCE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", None: None}  # --reduce-dtype -> PlanOptions.reduce_dtype
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype -> the torch dtype's name


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
    _exit_rank()


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


def _mesh_arg(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        raise argparse.ArgumentTypeError(f"{text!r}: write the mesh shape as device counts joined by 'x', e.g. 8 or "
                                         "8x8 (nodes x GPUs per node) or 2x4x8")
    return shape


def _pairs(flag: str, items: list[str] | None, example: str) -> dict[str, str]:
    """``--role dp=dp --role tp=tp`` -> {"dp": "dp", "tp": "tp"}; a malformed or repeated key is an error."""
    out: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"{flag} {item!r}: write NAME=VALUE, e.g. {flag} {example}")
        if key.strip() in out:
            raise ValueError(f"{flag} {item!r}: {key.strip()!r} was given twice ({out[key.strip()]!r} and "
                             f"{value.strip()!r}); give it once")
        out[key.strip()] = value.strip()
    return out


def _pipeline_arg(text: str | None) -> dict | str | None:
    """``--pipeline``: None or "auto" (the solver decides), "off", or ``key=value,...`` over ``stages``,
    ``micro_batches``, ``schedule``, ``virtual``, ``axis`` (``autopart.plan``'s ``pipeline`` dict)."""
    if text is None or text == "auto":
        return None
    if text == "off":
        return "off"
    keys = {"stages": int, "micro_batches": int, "virtual": int, "schedule": str, "axis": str}
    out: dict = {}
    for item in text.split(","):
        key, sep, value = (s.strip() for s in item.partition("="))
        key = key.replace("-", "_")
        if not sep or key not in keys or not value:
            raise ValueError(f"--pipeline {text!r}: give auto, off, or comma-separated KEY=VALUE with keys "
                             f"{sorted(keys)}, e.g. --pipeline stages=4,micro_batches=8,schedule=1f1b")
        if key in out:
            raise ValueError(f"--pipeline {text!r}: {key} is given twice; give it once")
        try:
            out[key] = keys[key](value)
        except ValueError:
            raise ValueError(f"--pipeline {text!r}: {key} takes a whole number, got {value!r}") from None
    return out


def _layout_flags(p: argparse.ArgumentParser) -> None:
    """How a model is laid out on the mesh (``plan``, ``verify``): what ``_layout_args`` reads, with the forced
    ZeRO level and checkpointing."""
    p.add_argument("--mesh", type=_mesh_arg, default=(2, 2), help="mesh shape, e.g. 8x8 (default 2x2)")
    p.add_argument("--names", default=None, help="comma-separated axis names, one per mesh axis (default dp,tp for "
                                                 "a 2-D mesh, else axis0,axis1,...); labels, the solver decides "
                                                 "what each axis does unless --role pins it")
    p.add_argument("--role", action="append", help="AXIS=ROLE pins what an axis does (dp: batch split, weights "
                                                   "whole or ZeRO-sharded; tp: weights sharded; pp: pipeline stages), "
                                                   "e.g. --role tp=tp; repeat for more axes")
    p.add_argument("--pin", action="append", help="NAME=PLACEMENT fixes a parameter's or graph node's placement, "
                                                  "e.g. --pin lm_head.weight=RS(0); repeat for more")
    p.add_argument("--zero", type=int, default=None, choices=[0, 1, 2, 3],
                   help="force a ZeRO level on the data-parallel axes, which --role names (e.g. --role dp=dp); "
                        "default: the solver decides per parameter")
    p.add_argument("--checkpoint", default=None, choices=["full", "selective", "none"],
                   help="force activation checkpointing of every layer (default: the solver decides per layer)")
    p.add_argument("--pipeline", default=None,
                   help="auto (default: the solver may split an axis into stages), off, or KEY=VALUE,... over "
                        "stages, micro_batches, schedule (gpipe, 1f1b, interleaved), virtual, axis, e.g. "
                        "stages=4,micro_batches=8,schedule=1f1b")


def _layout_args(args: argparse.Namespace) -> tuple[tuple[int, ...], tuple[str, ...], dict, dict, dict | str | None]:
    """--mesh, --names, --role, --pin, --pipeline: (shape, names, roles, pins, pipeline), checked."""
    shape = args.mesh
    if args.names:
        names = tuple(n.strip() for n in args.names.split(","))
        if not all(names):
            raise ValueError(f"--names {args.names!r}: an axis name is empty; give one name per axis, e.g. dp,tp")
        if len(names) != len(shape):
            raise ValueError(f"--names {args.names!r} names {len(names)} axes but --mesh "
                             f"{'x'.join(map(str, shape))} has {len(shape)}: give one name per axis")
    else:
        names = ("dp", "tp") if len(shape) == 2 else tuple(f"axis{i}" for i in range(len(shape)))
    roles = _pairs("--role", args.role, f"{names[-1]}=tp")
    for axis in roles:
        if axis not in names:
            raise ValueError(f"--role {axis}={roles[axis]}: the mesh's axes are {list(names)} (--names), not "
                             f"{axis!r}")
    pins = _pairs("--pin", args.pin, "lm_head.weight=RS(0)")
    pipeline = _pipeline_arg(args.pipeline)
    return shape, names, roles, pins, pipeline


def _overrides(args: argparse.Namespace, adv_mod) -> dict:
    """--layers, --hidden, ... as ``advise.build`` takes them (None: not given)."""
    return {k: getattr(args, k) for k in adv_mod.OVERRIDES}


def _check_factory_flags(args: argparse.Namespace, adv_mod) -> None:
    """A factory builds its own model: --model, --size and the size overrides would be ignored."""
    if args.factory is None:
        return
    given = [f for f, v in (("--model", args.model), ("--size", args.size)) if v is not None] + \
        [_flag(k) for k in adv_mod.OVERRIDES if getattr(args, k) is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: --factory {args.factory} builds its own model and would ignore "
                         f"{'them' if len(given) > 1 else 'it'}; leave {'them' if len(given) > 1 else 'it'} out, or "
                         "describe the model with --model instead of --factory")


def _is_cpu_cluster(cluster) -> bool:
    from autopart.cost.cluster import CALIBRATED, PRESETS, Cluster

    if cluster == CALIBRATED:  # autopart calibrate measures gloo ranks on this machine's CPUs
        return True
    if isinstance(cluster, Cluster):
        return cluster.device.name == "cpu"
    spec = PRESETS.get(cluster)
    return spec is not None and spec.device.name == "cpu"


def _default_seq(adv_mod, args: argparse.Namespace) -> int:
    """The sequence length ``plan`` traces when ``--seq`` is not given: a preset's own ``max_seq_len`` (the tiny
    models' 64, gpt-13b's 2048), 2048 for the published sizes (``advise.SIZES``: what ``advise`` plans) and
    factories."""
    if args.factory is not None:
        return 2048
    family, size = adv_mod._split_model(args.model, args.size)
    if size and size.lower() in adv_mod.SIZES.get(family, {}):
        return 2048
    return int(getattr(adv_mod.model_config(family, size)[2], "max_seq_len", 2048))


def cmd_plan(args: argparse.Namespace) -> int:
    import importlib

    import torch

    import autopart
    from autopart.cost.cluster import CALIBRATED

    adv_mod = importlib.import_module("autopart.advise")
    _check_factory_flags(args, adv_mod)
    if args.model is None and args.factory is None:
        args.model = "gpt:tiny"
    if args.inference:
        training_only = [f for f, v in (("--optimizer-bytes", args.optimizer_bytes), ("--grad-dtype", args.grad_dtype),
                                        ("--reduce-dtype", args.reduce_dtype)) if v is not None] + \
            (["--offload " + args.offload] if args.offload in ("optimizer", "both") else [])
        if training_only:
            raise ValueError(f"{', '.join(training_only)}: --inference plans forward only, without gradients or "
                             f"optimizer states; leave {'them' if len(training_only) > 1 else 'it'} out")
    if args.optimizer_bytes is not None and not args.optimizer_bytes >= 0:
        raise ValueError(f"--optimizer-bytes {args.optimizer_bytes:g}: bytes of optimizer state per parameter, >= 0 "
                         "(12: Adam with an fp32 master copy; 8: Adam's two states; 0: SGD)")
    if args.out:
        folder = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(f"--out {args.out}: cannot write there ({folder} is not a writable folder); checked "
                             "before planning, so that no plan is lost")
    _check_counts(args, "batch", "seq")
    if args.context < 0:
        raise ValueError(f"--context {args.context}: the K/V cache per sequence is a number of tokens >= 0")
    if not (args.time_limit > 0 and 0 <= args.gap < 1):
        raise ValueError(f"--time-limit {args.time_limit:g} / --gap {args.gap:g}: the solver's limit per ILP is a "
                         "positive number of seconds, the gap a fraction in [0, 1)")
    if args.context and not args.inference:
        raise ValueError(f"--context {args.context} is the K/V cache of a decoding step: add --inference")
    shape, names, roles, pins, pipeline = _layout_args(args)
    # 'calibrated': this machine as autopart calibrate measured it, for this mesh (advise's what-if meshes have none)
    cluster = args.cluster if args.cluster == CALIBRATED else adv_mod.resolve_cluster(args.cluster)
    dtype_name = args.dtype or ("fp32" if _is_cpu_cluster(cluster) else "bf16")
    dtype = getattr(torch, _DTYPES[dtype_name])
    opt_bytes = args.optimizer_bytes if args.optimizer_bytes is not None else \
        (8.0 if dtype == torch.float32 else 12.0)
    seq = args.seq or (1 if args.context else _default_seq(adv_mod, args))  # a decoding step: one new token
    batch = args.batch or max(8, math.prod(shape))
    overrides = _overrides(args, adv_mod)
    what, model, inputs, kwargs, _ = adv_mod.build(args.model, args.size, factory=args.factory, batch=batch,
                                                   seq=seq, dtype=dtype, inference=args.inference, **overrides)
    n = sum(p.numel() for p in model.parameters())
    print(f"planning {what} ({n / 1e9:.3g}B" if n >= 1e9 else f"planning {what} ({n / 1e6:.3g}M", end="")
    print(f" parameters, {dtype_name}"
          f"{', forward only' if args.inference else f', optimizer {opt_bytes:g} B/parameter'}), batch {batch} x "
          f"{seq} tokens, for mesh {'x'.join(map(str, shape))} ({', '.join(names)}) on "
          f"{cluster if isinstance(cluster, str) else cluster.name}", flush=True)
    plan = autopart.plan(model, autopart.mesh(shape, names), inputs, kwargs, cluster=cluster, roles=roles,
                         pins=pins, memory_budget=args.memory_budget, time_limit_s=args.time_limit,
                         zero=args.zero, checkpoint=args.checkpoint, offload=args.offload, pipeline=pipeline,
                         optimizer_bytes_per_param=opt_bytes, kv_cache_tokens=args.context,
                         reduce_dtype=_REDUCE_DTYPES[args.reduce_dtype], grad_dtype=_REDUCE_DTYPES[args.grad_dtype],
                         relative_gap=args.gap)
    print(plan)
    if args.out:  # before explaining: a node the plan does not have must not cost the plan
        plan.save(args.out)
        print(f"\nplan saved to {args.out}")
    if args.explain:
        print()
        print(plan.explain(args.explain))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from autopart.plan import Plan

    plan = Plan.load(args.plan)
    print(plan.explain(args.node) if args.node else plan)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from autopart.plan import Plan

    text = Plan.load(args.a).diff(Plan.load(args.b))
    print(text if len(text.splitlines()) > 1 else f"no decision differs; {text}")  # its last line: the steps
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


def _check_counts(args: argparse.Namespace, *names: str) -> None:
    """Flags that count something (sequences, nodes, steps): a whole number >= 1 where given."""
    for name in names:
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"{_flag(name)} {v}: give a whole number >= 1 (or leave it out for the default)")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_advise_flags(args: argparse.Namespace, adv_mod) -> None:
    """Flags that would be ignored, contradict each other or are out of range: an error naming them, not a plan of
    something else."""
    _check_counts(args, "nodes", "gpus_per_node", "seq", "max_batch", "batch_per_gpu")
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
    _check_factory_flags(args, adv_mod)
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
    dtype = getattr(torch, _DTYPES[args.dtype or "bf16"])
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
    overrides = _overrides(args, adv_mod)
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


# ---- verify: a model's plan against one process, on gloo ranks of this machine ---------------------------------
# AdamW as the parity tests run it (tests/multiproc/parity.py says why eps 1e-3: float noise in entries whose
# gradient is about eps would otherwise be amplified past the 1e-5 tolerance)
VERIFY_OPT = {"lr": 1e-2, "eps": 1e-3}
VERIFY_MISMATCH = 3  # exit status: the run differs from one process (1: bad input, 2: no plan fits)


def _verify_flags(p: argparse.ArgumentParser) -> None:
    _model_flags(p, "gpt:tiny")
    _layout_flags(p)  # a gloo rank a device of --mesh
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences (default 8; a factory's own "
                                                           "inputs are used as they are)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 32)")
    p.add_argument("--steps", type=int, default=3, help="AdamW steps compared (default 3)")
    p.add_argument("--atol", type=float, default=1e-5, help="largest difference of a loss, a parameter or a buffer "
                                                            "that counts as equal (default 1e-5, fp32)")
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)  # the launcher's folder: plan in, answer out


def _verify_model(args: argparse.Namespace, adv_mod, device: str = "cpu"):
    """(description, the model in fp32 with seed 0 on ``device`` (every rank and the reference build the same),
    the batches of each step, whether a factory gave its own inputs): fresh token ids per step for a family model,
    the factory's own inputs every step where it gives them."""
    import torch

    torch.manual_seed(0)
    overrides = _overrides(args, adv_mod)
    batch, seq = args.batch or 8, args.seq or 32
    family = args.model if args.model is not None or args.factory is not None else "gpt:tiny"  # --model's default
    what, model, inputs, kwargs, cfg = adv_mod.build(family, args.size, factory=args.factory, batch=batch,
                                                     seq=seq, dtype=torch.float32, device=device, **overrides)
    model.train()
    if args.factory is not None:
        own = not (set(kwargs) == {"labels"} and inputs and kwargs["labels"] is inputs[0]
                   and tuple(inputs[0].shape) == (batch, seq))
        return what, model, [(inputs, kwargs)] * args.steps, own
    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(args.steps):
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g, device=device)
        steps.append(((ids,), {"labels": ids}))
    return what, model, steps, False


def _loss_of(out):
    import torch

    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        loss = out[0]
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = f" of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else ""
        raise ValueError(f"the model returned {type(out).__name__}{shape}, not a scalar loss (a 0-d tensor, or an "
                         "output whose .loss is one): verify trains the model; have it return its loss when called "
                         "with labels (a factory can wrap it)")
    return loss


def _differs(a, b) -> float:
    """Largest |a - b|; inf where the shapes differ or either holds a NaN or an infinity (never 'equal')."""

    if tuple(a.shape) != tuple(b.shape):
        return float("inf")
    if a.numel() == 0:
        return 0.0
    d = (a.detach().double() - b.detach().double()).abs().max().item()
    return d if math.isfinite(d) else float("inf")


def verify_worker(args: argparse.Namespace) -> None:
    """Runs on every rank under torchrun: the launcher's plan run, then (rank 0) one process of the same model,
    compared; an exception is written for the launcher to show before it is raised."""
    import json
    import traceback

    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    try:
        result = _verify_rank(args)
    except BaseException as e:
        with open(os.path.join(args.work, f"rank{rank}.err"), "w") as f:
            f.write(f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
        raise
    if result is not None:
        with open(os.path.join(args.work, "result.json"), "w") as f:
            json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()
    _exit_rank()


def _exit_rank() -> None:
    """Leave a torchrun rank whose work is done without interpreter teardown: destroying torch's static objects at
    exit sometimes finds a C++ thread still joinable ("terminate called without an active exception", SIGABRT),
    which torchrun reports as the run failing (seen in CI on a rank that had finished; tests/multiproc/harness.py
    leaves its ranks the same way)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _verify_rank(args: argparse.Namespace) -> dict | None:
    import importlib

    import torch
    import torch.distributed as dist

    import autopart
    from autopart.plan import Plan

    torch.set_num_threads(1)
    adv_mod = importlib.import_module("autopart.advise")
    shape, names, *_ = _layout_args(args)
    what, model, steps, _ = _verify_model(args, adv_mod)
    inputs, kwargs = steps[0]
    plan = Plan.load(os.path.join(args.work, "plan.json"))
    pm = autopart.parallelize(model, autopart.mesh(shape, names), inputs, kwargs, plan=plan)
    opt = pm.optimizer(torch.optim.AdamW, **VERIFY_OPT)
    losses = []
    for inp, kw in steps:
        losses.append(pm.forward_backward(*inp, **kw).item())
        opt.step()
        opt.zero_grad()
    full = pm.full_state_dict()
    if dist.get_rank() != 0:
        return None
    _, ref, _, _ = _verify_model(args, adv_mod)
    ref_opt = torch.optim.AdamW(ref.parameters(), **VERIFY_OPT)
    ref_losses = []
    for inp, kw in steps:
        loss = _loss_of(ref(*inp, **kw))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    # every name of every parameter (tied ones under each) and every buffer a checkpoint holds
    want = dict(ref.named_parameters(remove_duplicate=False))
    want.update((k, v) for k, v in ref.state_dict().items() if k not in want)
    diffs = {name: _differs(full[name], t) if name in full else float("inf") for name, t in want.items()}
    loss_diffs = [abs(a - b) if math.isfinite(a - b) else float("inf") for a, b in zip(losses, ref_losses)]
    worst = max(diffs, key=lambda k: diffs[k]) if diffs else ""
    return {"model": what, "losses": losses, "reference": ref_losses, "loss_diff": max(loss_diffs),
            "param_diff": diffs.get(worst, 0.0), "worst_param": worst, "compared": len(diffs),
            "missing": sorted(n for n in want if n not in full),
            "buffers": sorted(set(want) - {n for n, _ in ref.named_parameters(remove_duplicate=False)}),
            "steps": len(steps)}


def cmd_verify(args: argparse.Namespace) -> int:
    import importlib
    import json
    import tempfile

    import autopart
    from autopart.forked import available_memory

    adv_mod = importlib.import_module("autopart.advise")
    _check_factory_flags(args, adv_mod)
    _check_counts(args, "batch", "seq", "steps")
    if not args.atol >= 0:
        raise ValueError(f"--atol {args.atol:g}: a difference, >= 0")
    shape, names, roles, pins, pipeline = _layout_args(args)  # checked here, before any rank starts
    ranks = math.prod(shape)
    what, model, steps, own = _verify_model(args, adv_mod, device="meta")  # its size and graph, no memory
    if own and (args.batch or args.seq):
        raise ValueError("--batch/--seq: the factory gives its own inputs, which verify uses as they are; leave "
                         "them out (or have the factory return the module alone)")
    n = sum(p.numel() for p in model.parameters())
    # every rank builds the whole fp32 model before sharding it; rank 0 also trains one with AdamW (weights,
    # gradients, two states): (ranks + 4) copies at least, activations aside
    need, free = 4 * n * (ranks + 4), available_memory()
    if free is not None and need > 0.8 * free:
        raise ValueError(f"{what} has {n / 1e9:.3g}B parameters: verifying it on {ranks} ranks holds at least "
                         f"{need / 2**30:.1f} GiB in fp32 ((ranks + 4) copies of the weights), more than this "
                         f"machine's {free / 2**30:.1f} GiB available. verify checks how a plan computes, which a "
                         "small variant of the model shows: e.g. --layers 2 --hidden 256 (and --heads, --ffn where "
                         "the family has them)")
    del model
    what, model, steps, _ = _verify_model(args, adv_mod)  # it fits: on the CPU, traced as the ranks trace it
    inputs, kwargs = steps[0]
    try:  # a model that returns no loss is said before ranks start
        out = model(*inputs, **kwargs)
    except Exception:  # noqa: BLE001  (whatever else fails, the ranks' own run says it)
        out = None
    if out is not None:
        _loss_of(out)
    plan = autopart.plan(model, autopart.mesh(shape, names), inputs, kwargs, roles=roles, pins=pins,
                         zero=args.zero, checkpoint=args.checkpoint, pipeline=pipeline)
    del model
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in zip(
        ("input",) * len(inputs) + tuple(kwargs), list(inputs) + list(kwargs.values())) if hasattr(v, "shape"))
    print(f"verifying {what} ({n / 1e6:.3g}M parameters, fp32 on the CPU) on mesh {'x'.join(map(str, shape))} "
          f"({', '.join(names)}): {ranks} gloo ranks against one process, {args.steps} AdamW steps ({shapes})\n",
          flush=True)
    print(plan, flush=True)
    with tempfile.TemporaryDirectory(prefix="autopart-verify-") as work:
        plan.save(os.path.join(work, "plan.json"))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "autopart.cli", "_verify_worker", *args.argv_rest, "--work", work]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if _traceback_wanted():
            rc = subprocess.call(cmd, env=env)
        else:  # the ranks' output kept: shown only if they fail
            with open(os.path.join(work, "ranks.log"), "w") as log:
                rc = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        out = os.path.join(work, "result.json")
        if rc != 0 or not os.path.exists(out):
            errs = sorted(f for f in os.listdir(work) if f.endswith(".err"))
            if errs:
                with open(os.path.join(work, errs[0])) as f:
                    first = f.read().split("\n\n", 1)[0]
                why = f"{errs[0][:-4].replace('rank', 'rank ')} raised {first}"
            else:  # killed or aborted outside Python: the lines that say why, else the output's end
                log = os.path.join(work, "ranks.log")
                lines = open(log).read().strip().splitlines() if os.path.exists(log) else []
                said = [ln for ln in lines if any(k in ln for k in ("terminate called", "what()", "Error", "error:",
                                                                     "Killed", "Signal"))]
                why = "no rank raised a Python exception; their output says:\n" + "\n".join((said or lines)[-15:])
            raise RuntimeError(f"the {ranks}-rank run failed (torchrun exit status {rc}): {why}\n"
                               "(AUTOPART_TRACEBACK=1 shows every rank's output)")
        with open(out) as f:
            r = json.load(f)
    print(f"\n{'step':>4}  {f'autopart ({ranks} ranks)':>18}  {'one process':>14}  {'|diff|':>8}")
    for i, (a, b) in enumerate(zip(r["losses"], r["reference"])):
        print(f"{i:>4}  {a:>18.6f}  {b:>14.6f}  {abs(a - b):>8.1e}")
    ok = r["loss_diff"] <= args.atol and r["param_diff"] <= args.atol and not r["missing"]
    buffers = f" and {len(r['buffers'])} buffers" if r["buffers"] else ""
    print(f"\nmax |loss difference| {r['loss_diff']:.2e}; max |difference| after {r['steps']} steps "
          f"{r['param_diff']:.2e} ({r['worst_param']}; parameters{buffers}, {r['compared']} in all); tolerance "
          f"{args.atol:g}: " + ("parity" if ok else "MISMATCH"))
    if r["missing"]:
        print(f"missing from the run's full_state_dict: {', '.join(r['missing'])}")
    if not ok:
        print("autopart verify: the run differs from one process. A model with randomness in training (dropout, "
              "noise) cannot match: set it off for the check; otherwise this is autopart's bug: please report it "
              "with the plan above and this command", file=sys.stderr)
    return 0 if ok else VERIFY_MISMATCH

def _model_flags(p: argparse.ArgumentParser, default: str) -> None:
    """The model a command plans: a family at a named size, with overrides, or a factory (``advise.build``)."""
    p.add_argument("--model", default=None, help=f"family (gpt, llama, moe, mamba), or family:size, e.g. llama:70b "
                                                 f"or gpt:gpt-13b (default {default})")
    p.add_argument("--size", default=None, help="named size, e.g. 7b, 13b, 70b (llama); 1.3b, 175b, 1t (gpt); or "
                                                "a preset of the family's config (tiny, llama-7b, gpt-13b)")
    p.add_argument("--factory", default=None, help="'module:function' returning an nn.Module (or (module, "
                                                   "example_inputs, example_kwargs)); replaces --model")
    for flag, what in (("layers", "layers"), ("hidden", "hidden size"), ("heads", "attention heads"),
                       ("kv-heads", "key/value heads"), ("vocab", "vocabulary"), ("ffn", "MLP hidden size"),
                       ("experts", "experts (moe)"), ("top-k", "experts per token (moe)")):
        p.add_argument(f"--{flag}", type=int, default=None, help=f"override the {what}")


def _precision_flags(p: argparse.ArgumentParser, optimizer_default: float | None, dtype_help: str,
                     optimizer_help: str) -> None:
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"], help=dtype_help)
    p.add_argument("--optimizer-bytes", type=float, default=optimizer_default, help=optimizer_help)
    p.add_argument("--reduce-dtype", default=None, choices=["fp32", "bf16"],
                   help="sum the data-parallel gradient reduction in this dtype (fp32: Megatron-LM's default with "
                        "bf16 weights); default: the gradients' own")
    p.add_argument("--grad-dtype", default=None, choices=["fp32", "bf16"],
                   help="keep and accumulate gradients in this dtype (fp32: Megatron-LM's main_grad of bf16 "
                        "weights, 18 bytes of model state per parameter with --optimizer-bytes 12); default: the "
                        "weights' own")


class _Parser(argparse.ArgumentParser):
    """Usage errors exit 1, as other bad input does: exit status 2 is "no plan fits" (plan, advise)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(1, f"{self.prog}: error: {message}\n")


def _traceback_wanted() -> bool:
    return os.environ.get("AUTOPART_TRACEBACK", "").strip().lower() not in ("", "0", "false", "no", "off")


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="autopart", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser,  # the _workers: torchrun's, not listed
                            metavar="{plan,explain,diff,verify,advise,calibrate,demo}")
    d = sub.add_parser("demo", help="plan a small GPT for a 2x2 CPU mesh and train it on 4 gloo ranks")
    d.add_argument("--steps", type=int, default=DEMO_STEPS)
    d.set_defaults(fn=cmd_demo)
    w = sub.add_parser("_demo_worker")
    w.add_argument("--steps", type=int, default=DEMO_STEPS)
    w.set_defaults(fn=lambda a: demo_worker(a.steps) or 0)
    p = sub.add_parser("plan", help="plan a model (family:size or a factory) for a mesh and print the plan",
                       description="Trace a model (built on the meta device: no weights are allocated) and plan it "
                                   "for a mesh of a cluster, as autopart.plan does; print the plan. Exit status 1 "
                                   "on bad input, 2 when no plan fits the memory budget.")
    _model_flags(p, "gpt:tiny")
    _layout_flags(p)
    p.add_argument("--cluster", default="cpu", help="a preset (cpu, a100-80gb, h100-80gb, h200-141gb), "
                                                    "'calibrated' (this machine, measured by autopart calibrate) or "
                                                    "the path of a .json/.toml cluster file (default cpu)")
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences (default: 8, or one per "
                                                           "device when the mesh has more)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: a preset's max_seq_len, 2048 "
                                                         "for the named sizes and factories; 1 with --context, a "
                                                         "decoding step)")
    _precision_flags(p, optimizer_default=None,
                     dtype_help="the weights' (default: bf16 on a GPU cluster, fp32 on cpu)",
                     optimizer_help="optimizer state bytes per parameter (default: 12 for bf16/fp16 weights, Adam "
                                    "with an fp32 master copy; 8 for fp32, Adam's two states)")
    p.add_argument("--offload", default=None, choices=["none", "optimizer", "activations", "both"],
                   help="force CPU offload (default: the solver decides)")
    p.add_argument("--memory-budget", default=None, help="per device, e.g. 70GiB (default: the device's capacity "
                                                         "less its reserve)")
    p.add_argument("--inference", action="store_true", help="plan the frozen model forward-only (no gradients, "
                                                            "no optimizer states)")
    p.add_argument("--context", type=int, default=0, help="--inference: the K/V cache per sequence, in tokens, "
                                                          "every attention holds and reads (decoding: --seq "
                                                          "defaults to 1 with it)")
    p.add_argument("--time-limit", type=float, default=30.0, help="the solver's limit per ILP, seconds (default 30)")
    p.add_argument("--gap", type=float, default=1e-3, help="each ILP stops once its plan is proven within this "
                                                           "fraction of the best (default 0.001; advise plans at "
                                                           "0.01, faster)")
    p.add_argument("--meta", action="store_true", help=argparse.SUPPRESS)  # always so now; kept for old commands
    p.add_argument("--explain", default=None, help="also explain this node's or parameter's decision")
    p.add_argument("--out", default=None, help="save the plan as JSON (autopart explain / diff read it)")
    p.set_defaults(fn=cmd_plan)
    e = sub.add_parser("explain", help="print a saved plan, or explain one decision of it")
    e.add_argument("plan", help="a plan saved by autopart plan --out or plan.save")
    e.add_argument("node", nargs="?", default=None, help="a graph node or parameter (default: print the plan)")
    e.set_defaults(fn=cmd_explain)
    v = sub.add_parser("verify", help="train a model's plan on gloo ranks of this machine and compare its losses "
                                      "and parameters with one process",
                       description="Plan a model (small: it runs in fp32 on the CPU, one process a device), train it "
                                   "a few AdamW steps on gloo ranks launched with torchrun, train the same model in "
                                   "one process, and compare the losses and the parameters. Exit status 0 on parity, "
                                   "1 on bad input, 2 when no plan fits, 3 when the run differs.")
    _verify_flags(v)
    v.set_defaults(fn=cmd_verify)
    vw = sub.add_parser("_verify_worker")
    _verify_flags(vw)
    vw.set_defaults(fn=lambda a: verify_worker(a) or 0)
    df = sub.add_parser("diff", help="what differs between two saved plans")
    df.add_argument("a", help="a saved plan (autopart plan --out, plan.save)")
    df.add_argument("b", help="the plan to compare it with, of the same model")
    df.set_defaults(fn=cmd_diff)
    a = sub.add_parser("advise", help="what-if planning: a model by family and size (or a factory) on a cluster "
                                      "preset or file x node count; --sweep for the design guide",
                       description="Plan on the meta device, without a process group, and report step time, "
                                   "tokens/s, TFLOP/s per GPU, MFU, memory per GPU by kind and communication by "
                                   "kind. Exit status 2 when nothing fits.")
    _model_flags(a, "llama")
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
    _precision_flags(a, optimizer_default=12.0, dtype_help="the weights' (default bf16)",
                     optimizer_help="optimizer bytes per parameter (12: Adam with an fp32 master copy)")
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
    c.add_argument("--mesh", type=_mesh_arg, default=None, help="mesh shape, e.g. 2x2 (default: one axis of "
                                                                "--nproc ranks)")
    c.add_argument("--quick", action="store_true", help="fewer sizes and shapes: a few seconds")
    c.add_argument("--cache", default=None, help="cache folder (default: $AUTOPART_CACHE or ~/.cache/autopart)")

    def cmd_calibrate(args: argparse.Namespace) -> int:
        from autopart.calibrate import cli

        return cli(args)
    c.set_defaults(fn=cmd_calibrate)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    args.argv_rest = argv[1:]  # verify hands its flags to its ranks
    if args.cmd in ("demo", "_demo_worker", "_verify_worker") or _traceback_wanted():
        return int(args.fn(args) or 0)
    from autopart.planner import NoPlanFits

    try:
        return int(args.fn(args) or 0)
    except NoPlanFits as e:  # the input is fine, the budget is not: advise's "nothing fits" status
        print(f"autopart {args.cmd}: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if args.cmd != "verify":
            raise
        print(f"autopart verify: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:  # bad input (a size, a flag, a file): the message says what and how to fix
        text = str(e)
        hint = "(AUTOPART_TRACEBACK=1 for where it was raised)"
        print(f"autopart {args.cmd}: {text}" + ("\n" if "\n" in text else " ") + hint, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
