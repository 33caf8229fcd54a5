"""Orchestration only: trace -> plan -> passes -> runtime."""

from __future__ import annotations

import dataclasses
import pickle
import re
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from autopart.cost import Cluster, preset
from autopart.plan import Plan
from autopart.planner import PlanOptions, make_plan, needs_grad_map
from autopart.runtime.mesh import Mesh
from autopart.runtime.mesh import mesh as make_mesh
from autopart.trace import Traced, trace

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(x: str | float | int | None) -> float | None:
    """``"12GiB"`` -> bytes; numbers pass through."""
    if x is None or isinstance(x, (int, float)):
        return x
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", x)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read memory size {x!r}: write a number of bytes or e.g. '12GiB', '80GB'")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def _as_mesh(mesh: Mesh | tuple | int) -> Mesh:
    if isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, (tuple, list, int)):
        return Mesh(tuple(mesh) if not isinstance(mesh, int) else (mesh,),
                    tuple(f"axis{i}" for i in range(1 if isinstance(mesh, int) else len(mesh))))
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        names = mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(mesh.ndim))
        return Mesh(tuple(mesh.shape), tuple(names), device_mesh=mesh)
    raise ValueError(f"mesh must be autopart.mesh(...), a DeviceMesh, or a shape tuple; got {type(mesh).__name__}")


def _as_cluster(cluster: str | Cluster, m: Mesh) -> Cluster:
    if isinstance(cluster, Cluster):
        if tuple(cluster.mesh_shape) != m.shape:
            cluster = cluster.with_mesh(m.shape)
        return cluster
    return preset(cluster, m.shape)


# An explicit memory_budget is planned against less this share: the memory model's predicted peaks were measured
# within +-10% of the real ones (benchmarks/bench_memory.py), and a plan that says it fits must fit. The cluster's
# default budget (capacity less its reserve) is used as it is.
MEMORY_MODEL_MARGIN = 0.10


def _options(roles, pins, memory_budget, time_limit_s, seed, local_batch, backend, checkpoint=None,
             zero=None, offload=None, pipeline=None, optimizer_bytes_per_param=8.0, kv_cache_tokens=0,
             reduce_dtype=None, grad_dtype=None) -> PlanOptions:
    limit = parse_bytes(memory_budget)
    if limit is not None and not limit > 0:
        raise ValueError(f"memory_budget={memory_budget!r}: give a positive size per device (bytes or '12GiB'), or "
                         "leave it None for the device's capacity")
    if limit is not None and limit != float("inf"):
        limit *= 1 - MEMORY_MODEL_MARGIN
    return PlanOptions(roles=dict(roles or {}), pins=dict(pins or {}), memory_limit=limit,
                       memory_margin=MEMORY_MODEL_MARGIN if limit is not None and limit != float("inf") else 0.0,
                       time_limit_s=time_limit_s, seed=seed, local_batch=local_batch, backend=backend,
                       checkpoint=checkpoint, zero=zero, offload=offload, pipeline=pipeline,
                       optimizer_bytes_per_param=optimizer_bytes_per_param, kv_cache_tokens=kv_cache_tokens,
                       reduce_dtype=reduce_dtype, grad_dtype=grad_dtype)


def plan(model: nn.Module, mesh: Mesh | tuple, example_inputs: tuple = (), example_kwargs: dict | None = None, *,
         cluster: str | Cluster = "cpu", roles: dict[str, str] | None = None, pins: dict[str, str] | None = None,
         memory_budget: str | float | None = None, time_limit_s: float = 30.0, seed: int = 0,
         local_batch: bool = False, backend: str = "auto", checkpoint: dict[str, str] | str | None = None,
         zero: int | None = None, offload: str | None = None, pipeline: dict | str | None = None,
         optimizer_bytes_per_param: float = 8.0, traced: Traced | None = None, kv_cache_tokens: int = 0,
         recipes: bool = True, tp_comm_overlap: bool | None = None,
         reduce_dtype: str | torch.dtype | None = None, grad_dtype: str | torch.dtype | None = None,
         relative_gap: float = 1e-3) -> Plan:
    """Plan ``model`` for ``mesh`` without any process group. ``roles`` pins what a mesh axis does
    (``{"tp": "tp"}``: weights sharded there, inputs replicated; ``"dp"``: the batch stays split there and weights
    are used whole, replicated or ZeRO-sharded and gathered; ``"pp"``: pipeline stages along it); ``pins`` fixes the
    placement of a parameter (by name) or graph node (``{"lm_head.weight": "RS(0)"}``). ``pipeline``: None lets
    the solver split an unpinned axis into stages when that is faster or needed to fit; ``"off"``; or a dict forcing
    any of ``stages``, ``micro_batches``, ``schedule`` (``gpipe``/``1f1b``/``interleaved``), ``virtual``, ``axis``;
    ``{"stages": 1, "micro_batches": m}`` is gradient accumulation without stages (``plan.accumulation``).
    ``optimizer_bytes_per_param``: optimizer state bytes per parameter (8: Adam's two fp32 states; 12 with an fp32
    master copy of bf16 weights, as Megatron-LM's mixed precision). Inference: a model whose parameters do not
    require gradients (``model.requires_grad_(False)``) is planned forward-only, without gradients or optimizer
    states; ``kv_cache_tokens`` adds the K/V cache of that many positions at every attention (decoding).
    ``tp_comm_overlap``: run (and price) the sequence-parallel all-gather into a linear and the reduce-scatter out
    of one as collective matmuls (``autopart.passes.tp_overlap``); None: on devices that overlap communication
    with compute (GPUs), not on the cpu preset.
    ``reduce_dtype``: the dtype the data-parallel gradient reduction sums in ("float32" / ``torch.float32`` for bf16
    gradients, as Megatron-LM and FSDP2's ``reduce_dtype``; the sums are cast back); None: each gradient's own.
    ``grad_dtype``: the dtype gradients are kept and accumulated in ("float32" for bf16 parameters: micro-batches,
    pipeline schedules and repeated ``forward_backward`` calls sum in fp32, as Megatron-LM's ``main_grad``; the
    optimizer then needs master weights, ``pm.optimizer(cls, master_dtype=torch.float32)``); the reduction sums in
    it too unless ``reduce_dtype`` is given. None: each parameter's own dtype.
    ``memory_budget`` (bytes or "12GiB"; default
    the cluster device's capacity less its reserve) is planned against less ``MEMORY_MODEL_MARGIN`` (10%), the
    memory model's measured accuracy. ``relative_gap``: each ILP solve stops once its plan is proven within this
    fraction of the best possible (``plan.solver["ilp"]["max_gap"]`` reports what was reached); ``autopart.advise``
    plans at 1% for speed."""
    m = _as_mesh(mesh)
    c = _as_cluster(cluster, m)
    t = traced or trace(model, example_inputs, example_kwargs)
    opts = _options(roles, pins, memory_budget, time_limit_s, seed, local_batch, backend, checkpoint, zero, offload,
                    pipeline, optimizer_bytes_per_param, kv_cache_tokens, reduce_dtype, grad_dtype)
    p = make_plan(t, c, m.names, dataclasses.replace(opts, recipes=recipes, tp_comm_overlap=tp_comm_overlap,
                                                     relative_gap=relative_gap))
    p.solver["export_s"] = t.export_seconds
    return p


def evaluate(model: nn.Module, gpus: int, example_inputs: tuple = (), example_kwargs: dict | None = None, *,
             cluster: str | Cluster = "cpu", tp: int = 1, pp: int = 1, micro_batches: int | None = None,
             schedule: str = "1f1b", virtual: int = 2, zero: int | None = 0, checkpoint: str | None = None,
             offload: str | None = "none", memory_budget: str | float | None = None, traced: Traced | None = None,
             time_limit_s: float = 30.0, optimizer_bytes_per_param: float = 8.0, recipe: str | None = None,
             gpus_per_node: int = 8, reduce_dtype: str | torch.dtype | None = None,
             grad_dtype: str | torch.dtype | None = None) -> Plan:
    """Score a user-given configuration under autopart's cost model: ``gpus = dp x pp x tp``, Megatron-style
    (``tp`` the inner axis, weights sharded there; ``dp`` data parallel; ``pp`` stages over the data axis, the
    micro-batch count and schedule as given; with ``pp=1``, ``micro_batches`` is gradient accumulation: that many
    micro-batches one after another, the gradients reduced once). Only the per-node shardings inside those roles
    and, unless given, the stage boundaries and per-layer checkpointing are optimised. Returns the ``Plan``
    (``predicted``, ``pipeline``, ``accumulation``); raises ``ValueError`` if the configuration does not fit
    ``memory_budget``.

    >>> autopart.evaluate(model, 768, (ids,), {"labels": ids}, cluster="h100-80gb", tp=8, pp=2, micro_batches=384)

    ``recipe`` scores one of the standard recipes instead (``autopart.recipes.RECIPES``: "ddp", "zero1", "fsdp",
    "megatron", "megatron-fsdp", "megatron-1f1b") on a mesh of (nodes, ``gpus_per_node``):

    >>> autopart.evaluate(model, 64, (ids,), {"labels": ids}, cluster="h100-80gb", recipe="megatron-fsdp")
    """
    for name, v in (("gpus", gpus), ("tp", tp), ("pp", pp), ("gpus_per_node", gpus_per_node)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"evaluate: {name}={v!r}; give a whole number >= 1")
    if micro_batches is not None and (not isinstance(micro_batches, int) or micro_batches < 1):
        raise ValueError(f"evaluate: micro_batches={micro_batches!r}; give a whole number >= 1 (or None)")
    from autopart.solver.pipeline import SCHEDULES

    if schedule not in SCHEDULES:
        raise ValueError(f"evaluate: schedule={schedule!r}; the schedules are {', '.join(SCHEDULES)}")
    if recipe is not None:
        from autopart.recipes import recipe_options

        g = min(gpus, gpus_per_node)
        if gpus % g:
            raise ValueError(f"{gpus} GPUs are not whole nodes of {g}")
        shape, names = ((gpus // g, g), ("dp", "tp")) if gpus > g else ((gpus,), ("dp",))
        if recipe in ("ddp", "zero1", "fsdp"):  # the batch over every GPU: one axis, priced level by level
            shape, names = (gpus,), ("dp",)
        kw = recipe_options(recipe, names, shape)
        if kw is None:
            raise ValueError(f"recipe {recipe!r} does not apply to mesh {shape}")
        return globals()["plan"](model, Mesh(shape, names), example_inputs, example_kwargs, cluster=cluster,
                                 checkpoint=checkpoint, offload=offload, memory_budget=memory_budget, traced=traced,
                                 time_limit_s=time_limit_s, optimizer_bytes_per_param=optimizer_bytes_per_param,
                                 reduce_dtype=reduce_dtype, grad_dtype=grad_dtype, **kw)
    if gpus % (tp * pp):
        raise ValueError(f"{gpus} GPUs are not a multiple of tp x pp = {tp} x {pp}")
    dp = gpus // (tp * pp)
    shape, names = ((dp * pp, tp), ("dp", "tp")) if tp > 1 else ((dp * pp,), ("dp",))
    roles = {"dp": "dp", "tp": "tp"} if tp > 1 else {"dp": "dp"}
    if pp > 1:
        pipeline = {"stages": pp, "schedule": schedule, "axis": "dp"}
        if schedule == "interleaved":
            pipeline["virtual"] = virtual
        if micro_batches is not None:
            pipeline["micro_batches"] = micro_batches
    elif micro_batches is not None:  # gradient accumulation: the micro-batches one after another, no stages
        pipeline = {"stages": 1, "micro_batches": micro_batches}
    else:
        pipeline = "off"
    return globals()["plan"](model, Mesh(shape, names), example_inputs, example_kwargs, cluster=cluster, roles=roles,
                             zero=zero, checkpoint=checkpoint, offload=offload, memory_budget=memory_budget,
                             pipeline=pipeline, traced=traced, time_limit_s=time_limit_s,
                             optimizer_bytes_per_param=optimizer_bytes_per_param, reduce_dtype=reduce_dtype,
                             grad_dtype=grad_dtype)


def parallelize(model: nn.Module, mesh: Mesh | Any, example_inputs: tuple = (), example_kwargs: dict | None = None, *,
                loss_fn: Callable | None = None, plan: Plan | None = None, cluster: str | Cluster = "cpu",
                roles: dict[str, str] | None = None, pins: dict[str, str] | None = None,
                memory_budget: str | float | None = None, time_limit_s: float = 30.0, seed: int = 0,
                local_batch: bool = False, backend: str = "auto", checkpoint: dict[str, str] | str | None = None,
                zero: int | None = None, offload: str | None = None, pipeline: dict | str | None = None,
                kv_cache_tokens: int = 0, tp_comm_overlap: bool | None = None,
                reduce_dtype: str | torch.dtype | None = None, grad_dtype: str | torch.dtype | None = None):
    """Plan (on rank 0, shared with every rank) and return a ``ParallelModule`` running this rank's program
    (``plan`` documents the planning arguments).

    Call under ``torchrun`` with ``mesh = autopart.mesh(shape, names)``. Every rank must build the same model;
    parameters are broadcast from rank 0 before sharding.
    """
    from autopart.passes import run_passes
    from autopart.runtime.module import ParallelModule, signature

    m = _as_mesh(mesh)
    if m.device_mesh is None:
        m = make_mesh(m.shape, m.names)
        if m.device_mesh is None:
            raise RuntimeError("parallelize needs a process group: run under torchrun (or init_process_group "
                               "first); to plan without one, use autopart.plan(...)")
    example_sig = signature(example_inputs, example_kwargs or {}, model.training)
    local_axes: tuple[int, ...] = ()
    factor = 1
    if local_batch:
        local_axes = tuple(m.names.index(a) for a, r in (roles or {}).items() if r == "dp")
        if not local_axes:
            raise ValueError("local_batch=True: say which mesh axes the data loader splits the batch over with "
                             "roles={'<axis name>': 'dp'}; each rank then passes its slice of the batch")
        for i in local_axes:
            factor *= m.shape[i]
        # trace the global batch: every rank's slice has the example's shape
        example_inputs = tuple(_repeat_batch(a, factor) for a in example_inputs)
        example_kwargs = {k: _repeat_batch(v, factor) for k, v in (example_kwargs or {}).items()}
    plan_kw = dict(cluster=cluster, roles=roles, memory_budget=memory_budget, time_limit_s=time_limit_s, seed=seed,
                   local_batch=local_batch, backend=backend, checkpoint=checkpoint, zero=zero, offload=offload,
                   kv_cache_tokens=kv_cache_tokens, tp_comm_overlap=tp_comm_overlap, reduce_dtype=reduce_dtype,
                   grad_dtype=grad_dtype)
    t = trace(model, example_inputs, example_kwargs)
    if plan is None:
        plan = _shared_plan(model, m, t, pins=pins, pipeline=pipeline, **plan_kw)
    if plan.pipeline:
        return _parallelize_pipelined(model, m, plan, t, example_inputs, example_kwargs or {}, loss_fn, pins,
                                      plan_kw, local_axes, factor)
    if tuple(plan.mesh_shape) != m.shape:
        raise ValueError(f"plan was made for mesh {plan.mesh_shape}, this mesh is {m.shape}")
    gm = run_passes(t, plan, needs_grad_map(t))

    pm = ParallelModule(gm, plan, model, m, params=t.params, buffers=t.buffers, constants=t.constant_values,
                        tied=t.tied, user_inputs=t.user_inputs, input_names=t.input_paths, aliases=t.aliases,
                        loss_fn=loss_fn, local_batch_axes=local_axes,
                        example_signature=example_sig, out_spec=t.out_spec,
                        make_program=_program_maker(model, m, pins, {**plan_kw, "pipeline": "off"}, factor))
    if int(plan.accumulation.get("micro_batches", 1)) > 1:
        _add_micro_batch_program(pm, model, m, plan, example_inputs, example_kwargs or {}, pins, plan_kw, factor)
    return pm


def _add_micro_batch_program(pm, model, m: Mesh, plan: Plan, example_inputs: tuple, example_kwargs: dict, pins,
                             plan_kw: dict, local: int = 1) -> None:
    """Gradient accumulation: the program of one micro-batch, as for pipeline stages (re-traced at the micro-batch
    size, its shardings re-solved with every parameter pinned to the plan's placement and the plan's
    checkpointing). Its gradients must be the ones the module's reducer was built for (the same parameters reduced
    over the same axes, the same ZeRO levels): otherwise a clear error rather than a silently wrong reduction.
    ``local``: with ``local_batch=True``, the ranks the data loader splits the batch over (``example_inputs`` are
    the global batch): each rank's micro-batch is 1/``local`` of the global one, and the program is registered
    under that local signature, which ``forward_backward`` cuts the rank's slice into."""
    from autopart.runtime.module import signature
    from autopart.runtime.pipeline import first_micro_batch

    acc = plan.accumulation
    micro_kw = dict(plan_kw, memory_budget=float("inf"), pipeline="off", checkpoint=dict(plan.checkpoint),
                    cluster=Cluster.from_json(plan.cluster))
    margs, mkw = first_micro_batch(example_inputs, example_kwargs, int(acc["batch"]), int(acc["micro_batch_size"]))
    prog = _program_maker(model, m, pins, micro_kw)(margs, mkw, plan.param_pins())
    if prog.plan.reduced != plan.reduced or prog.plan.zero != plan.zero:
        raise RuntimeError("gradient accumulation: the micro-batch's re-solved plan reduces gradients differently "
                           f"from the plan (reduced {prog.plan.reduced} vs {plan.reduced}; ZeRO {prog.plan.zero} vs "
                           f"{plan.zero}); pass zero=<level> and roles={{'<axis>': 'dp'}} explicitly so both agree, "
                           f"and report this: the parameters were pinned to the plan's options")
    if local > 1:
        size = _local_micro_batch(int(acc["micro_batch_size"]), local, int(acc["batch"]), "gradient accumulation")
        margs, mkw = first_micro_batch(example_inputs, example_kwargs, int(acc["batch"]), size)
    pm._programs[signature(margs, mkw, model.training)] = prog


def _local_micro_batch(size: int, local: int, batch: int, what: str) -> int:
    """With ``local_batch=True``, a rank's share of a micro-batch of ``size`` sequences split over the ``local``
    ranks that load the data; a clear error where it does not split."""
    if size % local:
        raise ValueError(f"{what} with local_batch=True: a micro-batch of {size} sequences does not split over the "
                         f"{local} ranks that load the data; plan micro_batches so that the global batch {batch} / "
                         f"micro_batches is a multiple of {local}")
    return size // local


def _shared_plan(model: nn.Module, mesh: Mesh, traced: Traced, **kw) -> Plan:
    """``plan(...)`` made on rank 0 and broadcast, so every rank runs the same plan."""
    import torch.distributed as dist

    text: list[Any] = [None]
    failed: Exception | None = None
    if dist.get_rank() == 0:
        try:
            text[0] = globals()["plan"](model, mesh, traced=traced, **kw).to_json()
        except Exception as exc:
            # every rank raises it: the others would otherwise wait in the broadcast, then fail on a closed
            # connection that names nothing (the error is rank 0's, pickled where it can be)
            failed = exc
            try:
                pickle.loads(pickle.dumps(exc))  # the other ranks unpickle it (a custom __init__ may refuse)
                text[0] = exc
            except Exception:  # noqa: BLE001 - an exception that does not round-trip: its type and message
                text[0] = RuntimeError(f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(text, src=0)
    if failed is not None:
        raise failed  # rank 0: its own error, with its traceback
    if isinstance(text[0], BaseException):
        raise text[0]
    return Plan.from_json(text[0])


def _program_maker(model: nn.Module, mesh: Mesh, pins, plan_kw: dict, repeat: int = 1) -> Callable:
    """``make_program(args, kwargs, param_pins)`` for ``ParallelModule``: trace a new input signature (each batched
    input repeated ``repeat`` times: the global batch of per-rank slices) and plan it with every parameter pinned to
    its current placement. Holds the model weakly: the user's full-size model is not kept alive for it."""
    from autopart.passes import run_passes
    from autopart.runtime.module import Program

    model_ref = weakref.ref(model)

    def make_program(args: tuple, kwargs: dict, param_pins: dict[str, str], training: bool | None = None) -> Program:
        model = model_ref()
        if model is None:
            raise RuntimeError("called with inputs of a new shape or signature, which needs tracing the model again, "
                               "but the original model object was freed: keep it alive, or call with the planned "
                               "signature")
        if repeat > 1:
            args = tuple(_repeat_batch(a, repeat) for a in args)
            kwargs = {k: _repeat_batch(v, repeat) for k, v in kwargs.items()}
        modes = {mod: mod.training for mod in model.modules()}
        if training is not None:  # traced in the parallel module's mode (``pm.eval()``); each submodule's restored
            model.train(training)
        try:
            t2 = trace(model, args, kwargs)
        finally:
            for mod, mode in modes.items():
                mod.training = mode
        p2 = _shared_plan(model, mesh, t2, pins={**(pins or {}), **param_pins}, **plan_kw)
        return Program(run_passes(t2, p2, needs_grad_map(t2)), p2, t2.params, t2.buffers, t2.constant_values,
                       t2.tied, t2.user_inputs, t2.input_paths, t2.out_spec)

    return make_program


def _repeat_batch(x: Any, factor: int) -> Any:
    if isinstance(x, torch.Tensor) and x.dim() > 0:
        return torch.cat([x] * factor, dim=0)
    return x


def _parallelize_pipelined(model, m: Mesh, plan: Plan, t: Traced, example_inputs: tuple, example_kwargs: dict,
                           loss_fn, pins, plan_kw, local_axes: tuple[int, ...] = (), local: int = 1):
    """A pipelined plan: re-trace one micro-batch, re-solve its shardings on the stage mesh with every parameter
    pinned to the plan's placement (and the plan's per-layer checkpointing), and run it as stages. With
    ``local_batch=True`` (``local_axes``, over ``local`` ranks; ``example_inputs`` are the global batch) each rank
    passes its slice of the batch, the same on every stage: its micro-batches are 1/``local`` of the plan's, and
    the micro-batch program is registered under that local signature."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from autopart.runtime.mesh import backend_for_device
    from autopart.runtime.pipeline import PipelinedModule, first_micro_batch, world_layout

    pipe = plan.pipeline
    world = tuple(pipe["world_mesh_shape"])
    if world != m.shape:
        raise ValueError(f"plan was made for mesh {world}, this mesh is {m.shape}")
    axis, p = int(pipe["axis"]), int(pipe["degree"])
    if axis in local_axes:
        raise ValueError(f"local_batch=True: the plan's pipeline stages are cut from mesh axis {m.names[axis]!r}, "
                         "which the data loader splits the batch over; name a separate pipeline axis "
                         "(roles={'<axis>': 'pp'}) or pass the global batch (local_batch=False)")
    size = _local_micro_batch(int(pipe["micro_batch_size"]), local, int(pipe["batch"]), "a pipeline")
    layout = world_layout(world, axis, p)
    pp_name = "pp" if "pp" not in m.names else "_pp"
    _, device = backend_for_device()
    dm = DeviceMesh(device, layout, mesh_dim_names=(pp_name, *m.names))
    stage_dm = dm[m.names]
    pp_group = dm[pp_name].get_group()
    # the schedule's send/recv get a group of their own: a collective of ours (the loss broadcast) on the same
    # group as a send still in flight at the end of a schedule mismatched messages on gloo
    p2p_group = None
    cells = layout.reshape(p, -1)
    for cell in range(cells.shape[1]):
        ranks = [int(r) for r in cells[:, cell]]
        g = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            p2p_group = g
    pp_rank = dm.get_local_rank(pp_name)
    stage_mesh = Mesh(tuple(plan.mesh_shape), m.names, device_mesh=stage_dm)
    stage_roles = {a: r for a, r in (plan_kw.get("roles") or {}).items() if r != "pp"}
    micro_kw = dict(plan_kw, roles=stage_roles, memory_budget=float("inf"), pipeline="off",
                    checkpoint=dict(plan.checkpoint), cluster=Cluster.from_json(plan.cluster))
    make_program = _program_maker(model, stage_mesh, pins, micro_kw, local)
    # this rank's micro-batch (the global one unless local_batch); make_program traces the global micro-batch
    margs, mkw = first_micro_batch(example_inputs, example_kwargs, int(pipe["batch"]), size)
    prog = make_program(margs, mkw, plan.param_pins())
    if prog.plan.zero != plan.zero:
        raise RuntimeError(f"pipeline: the micro-batch's re-solved plan shards gradients and optimizer states "
                           f"differently from the plan (ZeRO {prog.plan.zero} vs {plan.zero}); pass zero=<level> "
                           f"explicitly so both agree, and report this: the parameters were pinned to the plan's "
                           f"options")
    # the buckets the pipelined plan was priced with (its reduction runs from the schedule's last micro-batches),
    # not the micro-batch re-solve's own choice
    prog.plan.options["bucket_bytes"] = dict(plan.options.get("bucket_bytes", {}))
    # which chunks use each parameter (a tied embedding/head: the first and the last)
    from autopart.pipelining import assign_stages, buffer_chunks

    stage_of = assign_stages(prog.gm, prog.plan, pipe["stage_of_layer"])
    # and each buffer's (refused where one updated in place is used on several pipeline ranks)
    buffer_users = buffer_chunks(prog.gm, prog.buffers, prog.tied, stage_of, p,
                                 {name: rec.get("layer", "") for name, rec in prog.plan.nodes.items()})
    users: dict[str, set[int]] = {}
    for n in prog.gm.graph.nodes:
        if n.op != "call_function":
            continue
        for a in n.all_input_nodes:
            name = prog.tied.get(a.name, a.name)
            if a.op == "placeholder" and name in prog.params:
                users.setdefault(prog.params[name], set()).add(stage_of[n.name])
    owned = {fqn for fqn, cs in [*users.items(), *buffer_users.items()] if any(c % p == pp_rank for c in cs)}
    named = dict(model.named_parameters(remove_duplicate=False))
    shapes = {fqn: (tuple(named[fqn].shape), named[fqn].dtype) for fqn in prog.params.values()}
    from autopart.runtime.module import signature

    pm = PipelinedModule(prog.gm, prog.plan, model, stage_mesh, params=prog.params, buffers=prog.buffers,
                         constants=prog.constants, tied=prog.tied, user_inputs=prog.user_inputs,
                         input_names=prog.input_names, aliases=t.aliases, loss_fn=loss_fn,
                         local_batch_axes=local_axes,
                         example_signature=signature(margs, mkw, model.training), make_program=make_program,
                         owned=owned, out_spec=prog.out_spec,
                         pipeline=pipe, pp_group=pp_group, p2p_group=p2p_group, pp_rank=pp_rank,
                         stage_of_layer=pipe["stage_of_layer"],
                         world_mesh=layout)
    pm.plan = plan  # the whole plan (stages, schedule); each program keeps its micro-batch plan in Program.plan
    pm.setup_sharing({f: sorted(c) for f, c in users.items()}, shapes)
    named_buffers = dict(model.named_buffers(remove_duplicate=False))
    persistent = set(model.state_dict(keep_vars=True))
    # the persistent buffers, each with the first stage holding it, for ``full_state_dict`` (the same on every rank)
    pm._buffer_owner = {fqn: (min(c % p for c in cs), tuple(named_buffers[fqn].shape), named_buffers[fqn].dtype)
                        for fqn, cs in sorted(buffer_users.items()) if fqn in persistent}
    return pm
