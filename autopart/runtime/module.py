"""ParallelModule: runs one rank's rewritten graph with DTensor parameters.

Parameters are ``DTensor``s on the mesh with the plan's placements, so ``torch.optim``, gradient clipping and
``torch.distributed.checkpoint`` see ordinary (sharded) parameters. Each call feeds the graph the local shards
(``local_shard``: ``DTensor.to_local`` with a cheaper backward) and slices user inputs to the plan's input
placements; the gradients the plan marks as reduced are summed over their mesh axes in flat buckets launched during
backward (``runtime/grads.py``). With a ZeRO-1/2 optimizer the parameters' after-step all-gather completes during
the next forward, before each parameter's first use (``runtime/zero1.py``); everything else that reads the parameters
finishes it first (``_finish_param_gathers``).
"""

from __future__ import annotations

import inspect
import math
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autopart._torch_private import dtensor_local, dtensor_spec, dtensor_with_spec, unflatten_outputs
from autopart.placement import Shard, Strided, parse_spec, permuted, to_dtensor_placements
from autopart.plan import Plan
from autopart.runtime import collectives as C
from autopart.runtime import context as RC
from autopart.runtime import grads as G
from autopart.runtime import optim_state as O
from autopart.runtime.grads import BUCKET_BYTES  # noqa: F401 - where callers have read it from


class _LocalShard(torch.autograd.Function):
    """``DTensor.to_local`` of a parameter, whose backward wraps the local gradient in the parameter's own spec.

    ``to_local``'s backward builds the gradient's DTensor with ``DTensor.from_local``: a new spec, its global stride
    computed, its fields validated, ~100 us of CPU a parameter and backward on this host, which a small model pays
    for every parameter every step (the fidelity GPT, 16 tokens a rank, the two in turn in one process: one rank
    21.0 ms a step with it, 17.2 with this; 4 ranks on 2 cores 111 and 100 ms).
    A parameter's gradient has the parameter's placements, global shape and (once laid out as the parameter's local
    shard, the layout ``AccumulateGrad`` keeps anyway) stride, so it shares the parameter's spec, as FSDP2 builds
    its sharded gradients (``_from_local_no_grad``). A double backward (``create_graph``) takes ``to_local``'s own
    differentiable path."""

    @staticmethod
    def forward(ctx, param: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        local = dtensor_local(param)
        ctx.spec, ctx.layout = dtensor_spec(param), (local.shape, local.stride())
        ctx.set_materialize_grads(False)
        return local.view_as(local)  # a fresh tensor: autograd writes its metadata into it

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):  # type: ignore[override]
        if grad is None:
            return None
        spec = ctx.spec
        if torch.is_grad_enabled():  # create_graph: the gradient itself must be differentiable
            return DTensor.from_local(grad, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                                      stride=spec.stride)
        shape, stride = ctx.layout
        if grad.stride() != stride:
            grad = torch.empty_strided(shape, stride, dtype=grad.dtype, device=grad.device).copy_(grad)
        return dtensor_with_spec(grad, spec)


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor parameter, differentiable: its gradient lands in ``param.grad`` as a DTensor
    of the parameter's placements (``_LocalShard``)."""
    return _LocalShard.apply(param)


def split_batch(args: tuple, kwargs: dict, m: int) -> list[tuple[tuple, dict]]:
    """The inputs as ``m`` micro-batches: every tensor whose dim 0 is the batch (that of the first tensor with a
    dimension) cut into ``m`` equal consecutive parts along it, the others passed to each unchanged."""
    batch = next((a.shape[0] for a in list(args) + list(kwargs.values())
                  if isinstance(a, torch.Tensor) and a.dim() > 0), None)
    if batch is None or batch % m:
        raise ValueError(f"the plan accumulates gradients over {m} micro-batches; got a batch of {batch}, not a "
                         f"multiple of {m}: pass a batch divisible by {m}, or re-plan with other micro_batches")
    b = batch // m

    def cut(x: Any, i: int) -> Any:
        return x[i * b:(i + 1) * b] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch else x

    return [(tuple(cut(a, i) for a in args), {k: cut(v, i) for k, v in kwargs.items()}) for i in range(m)]


def _local_chunk(full: torch.Tensor, spec, coords: list[int], sizes: list[int]) -> torch.Tensor:
    out = full
    for p, c, n in zip(spec, coords, sizes):
        if isinstance(p, Shard):
            out = out.chunk(n, dim=p.dim)[c]
        elif isinstance(p, Strided):  # its piece of each block, in order
            out = torch.cat([b.narrow(p.dim, c * (b.shape[p.dim] // n), b.shape[p.dim] // n)
                             for b in out.split(p.parts(out.shape[p.dim]), dim=p.dim)], dim=p.dim)
    return out


def _savable_state_dict(module, state_dict, prefix, local_metadata) -> None:
    from autopart.runtime.optim_state import savable, unpermute

    for k, v in list(state_dict.items()):
        key = k[len(prefix) + len("_params."):] if k.startswith(f"{prefix}_params.") else None
        state_dict[k] = savable(unpermute(v, module._permuted.get(key, ())))


def _strided_state_dict(module, state_dict, prefix, *args) -> None:
    """Values for strided parameters, saved split plainly (``_savable_state_dict``), back in their layout."""
    from autopart._torch_private import is_strided_shard
    from autopart.runtime.optim_state import permute, redistribute

    for key, p in module._params.items():
        k = f"{prefix}_params.{key}"
        v = state_dict.get(k)
        perm = module._permuted.get(key, ())
        if isinstance(v, DTensor) and (perm or any(is_strided_shard(q) for q in p.placements)):
            state_dict[k] = permute(redistribute(v, p.placements), perm)


@dataclass
class Program:
    """One traced signature's rewritten graph and how to feed it."""

    gm: fx.GraphModule
    plan: Plan
    params: dict[str, str]  # placeholder -> parameter FQN
    buffers: dict[str, str]
    constants: dict[str, Any]
    tied: dict[str, str]  # placeholder of a tied name (no users) -> canonical parameter placeholder
    user_inputs: list[str]
    input_names: list[str]  # "args[0]" / "kwargs['labels']" per user input
    out_spec: Any = None  # the forward's output structure (``Traced.out_spec``); None: a flat tuple

    def structured(self, outs: tuple | list) -> Any:
        """The graph's outputs in the forward's structure (a dict stays a dict, a ModelOutput a ModelOutput)."""
        return unflatten_outputs(list(outs), self.out_spec)


def _value_key(v: Any) -> Any:
    """An input as a signature key: a tensor (also inside a list, tuple or dict) by shape and dtype, containers by
    their items, anything else by itself where hashable, else its repr."""
    if isinstance(v, torch.Tensor):
        return ("Tensor", tuple(v.shape), v.dtype)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_value_key(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((k, _value_key(x)) for k, x in sorted(v.items(), key=lambda kv: repr(kv[0]))))
    try:
        hash(v)
        return (type(v).__name__, v)
    except TypeError:
        return (type(v).__name__, repr(v))


def signature(args: tuple, kwargs: dict, training: bool = True) -> tuple:
    """What a traced graph is specialised to: positions, names, shapes and dtypes of the tensor inputs, the values
    of the others (``torch.export`` bakes a Python number or flag into the graph: another value needs another
    trace) and the module's mode (dropout and batch norm trace differently under ``eval()``)."""
    key = [(f"args[{i}]", _value_key(a)) for i, a in enumerate(args)]
    key += [(f"kwargs[{k!r}]", _value_key(v)) for k, v in sorted(kwargs.items())]
    if not training:
        key.append(("eval",))
    return tuple(key)


class ShadowOptimizer(torch.optim.Optimizer):
    """An optimizer that steps copies of the tensors it owns (their "shadows") on another device or in another
    dtype: ``step`` copies each gradient to its shadow (cast to the shadow's dtype), steps ``cls`` over the shadows
    and copies them back (cast to the tensor's dtype).

    * master weights (``dtype``): bf16 parameters with fp32 copies that the optimizer updates, so that updates
      smaller than a bf16 step accumulate (Megatron-LM's ``--bf16`` optimizer, FSDP2's fp32 sharded parameters
      under a bf16 ``param_dtype``; ``pm.optimizer(cls, master_dtype=torch.float32)``);
    * host offload (``device="cpu"``, ``HostOffloadOptimizer``): ZeRO-Offload.

    ``params``: the tensors the optimizer owns, a list or torch-style parameter groups (``[{"params": [...]},
    ...]``): a module's local shards, or ZeRO-1/2's slices of its parameters (``runtime/zero1.py``: each rank then
    keeps, moves and steps only its slice, as Megatron's distributed optimizer keeps fp32 copies of its shard and
    DeepSpeed's ``offload_optimizer`` with stages 1 and 2). A ``torch.optim.Optimizer`` whose ``param_groups`` and
    ``state`` are the inner optimizer's: LR schedulers, step hooks and ``state_dict`` work as on any optimizer.
    Clip gradients on the module's parameters before."""

    def __init__(self, params: list, cls: type, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, **kwargs) -> None:
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        self.params: list[torch.Tensor] = []
        self.shadows: list[nn.Parameter] = []
        shadow_groups = []
        for group in groups:
            hs = []
            for p in group["params"]:
                local = self._local(p.detach())
                where = torch.device(device) if device is not None else local.device
                pin = where.type == "cpu" and torch.cuda.is_available()
                h = torch.empty(local.shape, dtype=dtype or local.dtype, device=where, pin_memory=pin)
                h.copy_(local)
                self.params.append(p)
                self.shadows.append(nn.Parameter(h, requires_grad=p.requires_grad))
                hs.append(self.shadows[-1])
            shadow_groups.append({**group, "params": hs})
        self.inner = cls(shadow_groups, **kwargs)
        super().__init__(self.shadows, self.inner.defaults)  # the hooks' and schedulers' machinery
        self.param_groups = self.inner.param_groups  # ... over the inner optimizer's groups and state
        self.state = self.inner.state

    @staticmethod
    def _local(t: torch.Tensor) -> torch.Tensor:
        return t._local_tensor if isinstance(t, DTensor) else t

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:
        if closure is not None:
            raise NotImplementedError(f"{type(self).__name__}.step takes no closure: the optimizer's copies would not "
                                      "see the gradients it computes; run forward and backward before step()")
        for p, h in zip(self.params, self.shadows):
            if p.grad is None:
                h.grad = None
            else:
                g = self._local(p.grad)
                h.grad = g.to(h.device, h.dtype, copy=True) if h.grad is None else h.grad.copy_(g)
        self.inner.step()
        for p, h in zip(self.params, self.shadows):
            self._local(p.data).copy_(h.detach(), non_blocking=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def sync_from_device(self) -> None:
        """After weights were loaded into the module (its ``load_state_dict`` calls this on the optimizers it
        built): each copy takes its tensor's value where the two differ beyond the tensor's rounding of the copy,
        so that the next step starts from the loaded weights, and master weights that round to them are kept."""
        for p, h in zip(self.params, self.shadows):
            local = self._local(p.detach())
            if h.dtype == local.dtype:
                h.copy_(local)
                continue
            stale = h.to(local.dtype).to(local.device) != local
            if stale.any():
                h.copy_(torch.where(stale.to(h.device), local.to(h.device, h.dtype), h))

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


class HostOffloadOptimizer(ShadowOptimizer):
    """Optimizer states in host memory (ZeRO-Offload): a ``ShadowOptimizer`` whose copies live on the host, in the
    tensors' dtype unless ``dtype`` (master weights) says otherwise."""

    def __init__(self, params: list, cls: type, dtype: torch.dtype | None = None, **kwargs) -> None:
        super().__init__(params, cls, device="cpu", dtype=dtype, **kwargs)


def build_optimizer(params: list, cls: type, host: bool = False, master_dtype: torch.dtype | None = None,
                    **kwargs) -> torch.optim.Optimizer:
    """``cls`` over ``params`` (tensors or parameter groups), or a ``ShadowOptimizer`` stepping copies of them: on
    the host (``host``: the plan's optimizer offload), in ``master_dtype`` (master weights), or both."""
    if host:
        return HostOffloadOptimizer(params, cls, dtype=master_dtype, **kwargs)
    if master_dtype is not None:
        return ShadowOptimizer(params, cls, dtype=master_dtype, **kwargs)
    return cls(params, **kwargs)


class ParallelModule(nn.Module):
    overlap_grads = True  # launch gradient reductions from backward (``runtime/grads.py``); pipelines do not

    def __init__(self, gm: fx.GraphModule, plan: Plan, model: nn.Module, mesh, *, params: dict[str, str],
                 buffers: dict[str, str], constants: dict[str, Any], tied: dict[str, str], user_inputs: list[str],
                 input_names: list[str], aliases: dict[str, list[str]],
                 loss_fn: Callable | None = None, local_batch_axes: tuple[int, ...] = (), sync_params: bool = True,
                 example_signature: tuple = (), make_program: Callable | None = None,
                 owned: set[str] | None = None, out_spec: Any = None) -> None:
        super().__init__()
        self.plan = plan
        self.mesh = mesh
        dm = mesh.device_mesh
        self._dm = dm
        self._groups = [dm.get_group(i) for i in range(dm.ndim)]
        self._coords = list(dm.get_coordinate())
        self._sizes = list(dm.shape)
        self._aliases = aliases
        self._key_cache: dict[str, str] = {}  # fqn (an alias too) -> its key in self._params (``_key``)
        self.loss_fn = loss_fn
        self.local_batch_axes = local_batch_axes
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        self._device = device
        named = dict(model.named_parameters(remove_duplicate=False))
        named_buffers = dict(model.named_buffers(remove_duplicate=False))
        self._params = nn.ParameterDict()
        self._key_of: dict[str, str] = {}
        self._permuted: dict[str, tuple] = {}  # key -> (axis, Strided) of blocks of unequal lengths (stored permuted)
        gd = plan.options.get("grad_dtype")
        # gradients kept and accumulated in it (PlanOptions.grad_dtype); None: each parameter's own dtype
        self._grad_dtype = grad_dtype = getattr(torch, gd) if gd else None
        if grad_dtype is not None and not hasattr(torch.Tensor, "grad_dtype"):  # else: an attribute, ignored
            raise RuntimeError(f"the plan keeps gradients in {gd} (grad_dtype), which needs torch's "
                               f"Tensor.grad_dtype; torch {torch.__version__} has none. Upgrade torch, or plan "
                               "without grad_dtype")
        for fqn in params.values():
            full = named[fqn].detach().to(device)
            if sync_params:
                full = full.clone()
                dist.broadcast(full, src=0)
            if owned is not None and fqn not in owned:  # another pipeline stage's parameter
                continue
            spec = parse_spec(plan.params[fqn])
            local = _local_chunk(full, spec, self._coords, self._sizes).clone()  # own storage, not a view of full
            dt = DTensor.from_local(local, dm, to_dtensor_placements(spec), run_check=False,
                                    shape=full.shape, stride=full.stride())
            key = fqn.replace(".", "__")
            if permuted(spec):  # blocks of unequal lengths: stored as the plain split of their pieces in rank order
                self._permuted[key] = tuple(permuted(spec))
            self._params[key] = nn.Parameter(dt, requires_grad=named[fqn].requires_grad)
            if grad_dtype is not None and dt.is_floating_point():  # autograd casts, then accumulates, in it
                self._params[key].grad_dtype = grad_dtype
            self._key_of[fqn] = key
        # buffers (batch norm's running statistics, a rotary table): this module's own copies, which the graphs
        # update in place, registered under ``_buffer_store`` so that ``state_dict`` (checkpoints) carries the
        # persistent ones; a pipeline stage holds those its chunks use (``owned``)
        persistent = set(model.state_dict(keep_vars=True))
        self._buffer_store = nn.Module()
        self._buffers_local: dict[str, torch.Tensor] = {}
        for fqn in dict.fromkeys(buffers.values()):
            if owned is not None and fqn not in owned:
                continue
            local = named_buffers[fqn].detach().to(device, copy=True)
            self._buffer_store.register_buffer(fqn.replace(".", "__"), local, persistent=fqn in persistent)
            self._buffers_local[fqn] = local
        self._reduced = {fqn: tuple(axes) for fqn, axes in plan.reduced.items() if fqn in self._key_of}
        first_use: list[str] = []  # parameter keys in the order forward first uses them
        for node in gm.graph.nodes:
            for a in node.all_input_nodes if node.op != "placeholder" else ():
                fqn = params.get(tied.get(a.name, a.name)) if a.op == "placeholder" else None
                key = self._key_of.get(fqn) if fqn is not None else None
                if key is not None and key not in first_use:
                    first_use.append(key)
        self._first_use = first_use  # also the order of ZeRO-1/2's after-step gather buckets (runtime/zero1.py)
        self._grads = G.GradReducer(
            dict(self._params.items()), {self._key_of[f]: axes for f, axes in self._reduced.items()},
            {self._key_of[f]: lvl for f, lvl in plan.zero.items() if f in self._key_of}, first_use, self._groups,
            self._coords, self._sizes, dm, overlap=self.overlap_grads and G.OVERLAP_WITH_BACKWARD,
            bucket_bytes=plan.options.get("bucket_bytes"), reduce_dtype=plan.options.get("reduce_dtype"))
        self._programs = {example_signature: Program(gm, plan, params, buffers, constants, tied, user_inputs,
                                                     input_names, out_spec)}
        self.train(model.training)  # the mode the plan was traced in (``signature``)
        self._make_program = make_program
        self._param_gather = None  # zero1.ParamGather of the ZeRO-1/2 optimizer, set by it
        self._marked: dict[int, tuple[fx.GraphModule, fx.GraphModule]] = {}  # id(gm) -> (gm, zero1.mark_param_uses)
        self.register_state_dict_pre_hook(lambda module, prefix, keep_vars: module._finish_param_gathers())
        # and before loading weights: a gather still running would overwrite them with the slices it carries
        self.register_load_state_dict_pre_hook(lambda module, *args: module._finish_param_gathers())
        self._shadow_optimizers: list[weakref.ref] = []  # ShadowOptimizers built by self.optimizer
        self.register_load_state_dict_post_hook(lambda module, incompatible: module._sync_shadow_optimizers())
        # a fused projection's strided parameters leave as the plain split of their dim (DCP cannot write a strided
        # piece; any plan loads the plain one) and come back strided
        self.register_state_dict_post_hook(_savable_state_dict)
        self.register_load_state_dict_pre_hook(_strided_state_dict)

    # ---- parameters ----------------------------------------------------------------------------------------
    def _key(self, fqn: str) -> str:
        key = self._key_cache.get(fqn)
        if key is None:
            name = fqn
            for k, others in self._aliases.items():
                if name in others:
                    name = k
            key = self._key_cache[fqn] = self._key_of[name]
        return key

    def param(self, fqn: str) -> nn.Parameter:
        self._finish_param_gathers()
        return self._params[self._key(fqn)]

    def named_parameters(self, *args, **kwargs):
        """``nn.Module.named_parameters`` (and so ``parameters``), the after-step gathers finished first."""
        self._finish_param_gathers()
        return super().named_parameters(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, without finishing the after-step gathers (``named_parameters`` would): called
        between ``step`` and the next forward, it touches gradients only."""
        for p in self._params.values():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.requires_grad_(False)
                p.grad.zero_()

    def _sync_shadow_optimizers(self) -> None:
        """After weights were loaded: the copies of the shadow optimizers (host offload, master weights) take
        them (else their next step would write back the weights they held)."""
        for ref in self._shadow_optimizers:
            opt = ref()
            if opt is not None:
                opt.sync_from_device()

    def _finish_param_gathers(self) -> None:
        """Complete the ZeRO-1/2 after-step all-gathers still running (``runtime/zero1.py``): every read of the
        parameters outside forward goes through here, so it never sees this rank's stale copy of the others'
        slices."""
        if self._param_gather is not None:
            self._param_gather.finish()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered to its full shape, on every rank, keyed by the model's names (tied too), and
        the persistent buffers (as the model's ``state_dict`` holds them)."""
        self._finish_param_gathers()
        out = {}
        for fqn, key in self._key_of.items():
            full = O.unpermute(self._params[key].detach(), self._permuted.get(key, ())).full_tensor()
            out[fqn] = full
            for alias in self._aliases.get(fqn, []):
                out[alias] = full
        out.update(self._persistent_buffers())
        return out

    def _persistent_buffers(self) -> dict[str, torch.Tensor]:
        """This rank's persistent buffers by the model's names (copies)."""
        saved = self._buffer_store.state_dict(keep_vars=True)  # the persistent ones
        return {fqn: t.clone() for fqn, t in self._buffers_local.items() if fqn.replace(".", "__") in saved}

    # ---- running -------------------------------------------------------------------------------------------
    def _program(self, args: tuple, kwargs: dict) -> Program:
        key = signature(args, kwargs, self.training)
        prog = self._programs.get(key)
        if prog is None:
            if self._make_program is None:
                raise ValueError(f"this module was planned for inputs {next(iter(self._programs))}, got {key}: "
                                 "it runs only the signature and mode (train or eval) it was planned for; "
                                 "parallelize the model again for another (after model.eval() for eval mode)")
            # a new signature (forward without labels, another batch size, another value of a non-tensor input,
            # eval mode): trace and plan it with every parameter pinned to its current placement, so the same
            # sharded parameters serve both programs
            prog = self._make_program(args, kwargs, {fqn: self.plan.params[fqn] for fqn in self._key_of},
                                      training=self.training)
            self._programs[key] = prog
        return prog

    @staticmethod
    def _user_tensors(prog: Program, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensor inputs in the program's order: positional ones, then keyword ones by the traced names."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        names = [n for n in prog.input_names if n.startswith("args[")]
        if len(tensors) != len(names):
            raise ValueError(f"expected {len(names)} positional tensor inputs as when planned, got {len(tensors)}")
        for name in prog.input_names:
            if name.startswith("kwargs["):
                key = name[8:-2]
                if key not in kwargs:
                    raise ValueError(f"the plan was traced with keyword input {key!r}; pass it (or re-plan "
                                     f"without it)")
                tensors.append(kwargs[key])
        return tensors

    def _bind_inputs(self, prog: Program, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's pieces of the user inputs (``tensors`` in the program's order, ``_user_tensors``)."""
        out = []
        layout = prog.gm.meta.get("autopart.context")  # balanced context parallelism: the sequence permuted
        for ph, t in zip(prog.user_inputs, tensors):
            t = RC.to_layout(t.to(self._device), layout, ph)
            spec = parse_spec(prog.plan.inputs[ph]) if ph in prog.plan.inputs else None
            if spec is not None:
                for axis, (p, c, n) in enumerate(zip(spec, self._coords, self._sizes)):
                    if isinstance(p, Shard) and not (axis in self.local_batch_axes and p.dim == 0):
                        t = t.chunk(n, dim=p.dim)[c]
            out.append(t)
        return out

    def _state_value(self, prog: Program, name: str) -> Any:
        """What feeds placeholder ``name`` (tied names resolved) when it is not a user input: this rank's local
        parameter shard (differentiable), a buffer, or a lifted constant; None for a user input."""
        name = prog.tied.get(name, name)
        if name in prog.params:  # its after-step gather may still run: the graph waits for it (``_call``)
            return local_shard(self._params[self._key(prog.params[name])])
        if name in prog.buffers:
            return self._buffers_local[prog.buffers[name]]
        return prog.constants.get(name)

    def _call(self, prog: Program, gm: fx.GraphModule, feed: list) -> Any:
        """Run ``gm`` (the program or a piece of it) with this rank's collective groups and saved-tensor hooks.
        With a ZeRO-1/2 optimizer, a copy of ``gm`` that waits for each parameter's after-step gather just before
        its first use (``zero1.mark_param_uses``) runs instead; the caller finishes the buckets no graph needed."""
        offload = "activations" in prog.plan.offload
        gather = self._param_gather
        if gather is not None:
            from autopart.runtime import zero1

            if id(gm) not in self._marked:
                keys = {}
                for ph in gm.graph.find_nodes(op="placeholder"):
                    name = prog.tied.get(ph.name, ph.name)
                    key = self._key(prog.params[name]) if name in prog.params else None
                    if key in gather.bucket_of:
                        keys[ph.name] = key
                self._marked[id(gm)] = (gm, zero1.mark_param_uses(gm, keys))
            gm = self._marked[id(gm)][1]
            zero1._ACTIVE.append(gather)
        try:
            with C.axis_groups(self._groups, self._coords, self._sizes), C.saved_tensor_hooks(offload):
                out = gm(*feed)
        finally:
            if gather is not None:
                zero1._ACTIVE.pop()
        return out

    def _run(self, args: tuple, kwargs: dict) -> Any:
        """The outputs of one call, in the model's structure (``Program.structured``)."""
        prog = self._program(args, kwargs)
        user = iter(self._bind_inputs(prog, self._user_tensors(prog, args, kwargs)))
        feed = []
        for node in prog.gm.graph.find_nodes(op="placeholder"):
            value = self._state_value(prog, node.name)
            feed.append(next(user) if value is None else value)
        outs = self._grads.mark(self._call(prog, prog.gm, feed))  # its backward starts the gradient reduction
        self._finish_param_gathers()  # buckets of parameters this program does not use
        return prog.structured(RC.from_layout(outs, prog.gm.meta.get("autopart.context")))

    def forward(self, *args, **kwargs):
        """The model's forward on the global batch: its outputs in the model's structure (a tensor, a tuple, a
        dict, a Hugging Face ModelOutput), every tensor whole on every rank."""
        return self._run(args, kwargs)

    def _loss_of(self, out: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(out)
        if isinstance(out, torch.Tensor) and out.dim() == 0:
            return out
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, dict):
            loss = out.get("loss")
        if loss is None and isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) \
                and out[0].dim() == 0:
            loss = out[0]
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError("forward_backward needs a scalar loss: the model's output has no scalar 'loss'; "
                             "pass loss_fn=... to parallelize (a function of the output returning a scalar)")
        return loss

    def forward_backward(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward of the global batch; gradients land in ``.grad`` of this rank's shards (added to
        gradients already there, so several calls accumulate), reduced over the data-parallel axes in buckets
        launched during backward (``runtime/grads.py``); a ZeRO-1/2 parameter's reduced gradient goes to its
        optimizer's slice (``.grad`` keeps this rank's unreduced one: ``clip_grad_norm_`` reads the slices).
        Returns the loss (detached), equal to the single-process loss of the same global batch.

        With gradient accumulation (``plan.accumulation``: m micro-batches) the batch-split inputs (those whose dim 0
        is the batch) are cut into m micro-batches, run forward and backward one after another through the
        micro-batch's program (``api._add_micro_batch_program``): the first m - 1 backwards only accumulate into
        ``.grad``, the last one's launches the buckets, which reduce the sum (``GradReducer.accumulating``), so the
        reduction runs once and only the last backward hides it. Each micro-batch's loss is divided by m: the
        gradients and the returned loss are those of the mean of the micro-batch losses, the global batch's loss
        when each micro-batch averages over the same number of elements (a mean-reduced loss with no ignored
        targets; with ignored targets, the mean of the micro-batch means), as the pipelined runtime does. ZeRO-2
        holds the whole accumulated gradient until that last backward (it is reduce-scattered into the slices only
        then, not per micro-batch): its gradient memory saving applies after the step."""
        held = {}
        for key in self._reduced_keys():
            p = self._params[key]
            if p.grad is not None:  # reduce only this call's gradients, then add what was accumulated before
                held[key], p.grad = p.grad, None
        m = int(self.plan.accumulation.get("micro_batches", 1))
        if m == 1:
            loss = self._loss_of(self.forward(*args, **kwargs))
            loss.backward()
        else:
            parts = []
            for i, (margs, mkw) in enumerate(split_batch(args, kwargs, m)):
                with self._grads.accumulating(last=i == m - 1):
                    part = self._loss_of(self.forward(*margs, **mkw)) / m
                    part.backward()
                parts.append(part.detach())
            loss = torch.stack(parts).sum()
        self.reduce_gradients()
        for key, g in held.items():
            p = self._params[key]
            p.grad = g if p.grad is None else p.grad + g
        return loss.detach()

    def _reduced_keys(self) -> list[str]:
        return [self._key_of[fqn] for fqn in self._reduced]

    def reduce_gradients(self) -> None:
        """Sum the gradients the plan marks as reduced over their axes. Backward already did it when the reduction
        overlaps it (the default; nothing to do then); otherwise (``grads.OVERLAP_WITH_BACKWARD`` off) it runs here,
        in buckets of at most BUCKET_BYTES. ``forward_backward`` calls it; loops that call ``loss.backward()``
        themselves call it once per backward."""
        if not self._grads.overlap:
            self._grads.post_backward()

    # the process group a pipelined module sums its stages' norms over (``runtime/pipeline.py``); None: one stage
    _stage_group = None

    def _counts_in_norm(self, fqn: str) -> bool:
        """Whether this rank's gradient of ``fqn`` counts in the global norm (a pipeline counts a parameter held
        by several stages once)."""
        return True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the whole model by their global norm; returns the norm before clipping (any
        p-norm, ``inf`` the largest entry). ``torch.nn.utils.get_total_norm`` over this rank's DTensor gradients
        computes it (given the gradients, not the parameters: ``clip_grad_norm_`` of a list of gradients reads
        their ``.grad``, None, and clips nothing), except for ZeRO-1/2 parameters with their optimizer, whose
        gradient is summed only on this rank's slice (under ZeRO-2 the only part kept): their slices' norms are
        combined over the mesh (every rank holds one slice of each distinct local tensor). A pipelined module sums
        its stages' parts over the pipeline (``_stage_group``), counting each parameter once
        (``_counts_in_norm``): torch's function over its parameters would see only the rank's stage."""
        self._finish_param_gathers()
        plain, slices, whole, sliced = [], [], [], []
        for fqn, key in self._key_of.items():
            is_slice = self._grads.sliced(key)
            g = self._slice_grad(key) if is_slice else self._params[key].grad
            if g is None:
                continue
            (slices if is_slice else plain).append(g)
            if self._counts_in_norm(fqn):
                (sliced if is_slice else whole).append(g)
        norm_type = float(norm_type)
        inf = math.isinf(norm_type)
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        total = torch.nn.utils.get_total_norm(whole, norm_type, foreach=True) if whole else \
            torch.zeros((), device=self._device)
        total = (total.full_tensor() if isinstance(total, DTensor) else total).float()
        part = torch.zeros((), device=self._device)
        if sliced:
            part = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in sliced])
            part = part.max() if inf else (part ** norm_type).sum()
        if slices:
            for group in self._groups:  # over the whole mesh, axis by axis
                dist.all_reduce(part, op=op, group=group)
        total = torch.maximum(total, part) if inf else total ** norm_type + part
        if self._stage_group is not None:
            dist.all_reduce(total, op=op, group=self._stage_group)
        if not inf:
            total = total ** (1.0 / norm_type)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in plain + slices:
            g.mul_(float(coef) if isinstance(g, DTensor) else coef.to(g.dtype))
        return total

    def _slice_grad(self, key: str) -> torch.Tensor | None:
        """This rank's slice of a ZeRO-1/2 parameter's reduced gradient (None if not sliced or no gradient)."""
        if not self._grads.sliced(key):
            return None
        s = self._grads._entries[key].slice
        if self._grads.scattered(key):
            return s.leaf.grad
        g = self._params[key].grad
        return None if g is None else dtensor_local(g).view(-1)[s.start:s.end]

    def optimizer(self, cls: type = torch.optim.AdamW, master_dtype: torch.dtype | None = None, **kwargs) -> Any:
        """The optimizer the plan asks for over this rank's parameters: ``cls(self.parameters(), **kwargs)``
        (``foreach=True`` unless given: on DTensor parameters the per-parameter loop is dispatch-bound; on host
        copies ``fused=True`` where ``cls`` has it); when the
        plan shards optimizer states ZeRO-1/2 style, ``cls`` over this rank's slices of those parameters
        (``runtime/zero1.py``; their gradients are then reduce-scattered into the slices); when it offloads
        optimizer states, the same optimizer stepping on host copies (of those slices, with ZeRO-1/2).
        ``master_dtype`` (``torch.float32`` for bf16 parameters): the optimizer updates copies of this rank's
        parameters (or slices) in that dtype, cast back after each step (``ShadowOptimizer``); plan such a model
        with ``optimizer_bytes_per_param=12`` (the copy and Adam's two fp32 states), as Megatron-LM's ``--bf16``,
        and ``grad_dtype="float32"`` for gradients accumulated in fp32 too (which needs ``master_dtype``)."""
        zero1 = any(level in (1, 2) for level in self.plan.zero.values())
        host = "optimizer" in self.plan.offload
        low = sorted({str(p.dtype) for p in self._params.values() if p.requires_grad and p.dtype in
                      (torch.bfloat16, torch.float16)})
        if low and master_dtype is None:
            warnings.warn(f"pm.optimizer: parameters in {', '.join(low)} stepped directly lose every update below "
                          "their precision (bf16 keeps 8 bits of mantissa); pass master_dtype=torch.float32 for fp32 "
                          "master weights, as Megatron-LM and FSDP2 keep them", stacklevel=2)
        gd = self._grad_dtype
        other = sorted({str(p.dtype) for p in self._params.values() if p.requires_grad and gd is not None and
                        p.dtype.is_floating_point and p.dtype != gd})
        if other and master_dtype is None:
            gd = str(gd).removeprefix("torch.")
            raise ValueError(f"pm.optimizer: the plan keeps gradients in {gd} (grad_dtype) and the parameters are "
                             f"{', '.join(other)}: an optimizer stepping the parameters themselves cannot take those "
                             f"gradients. Pass master_dtype=torch.{gd} (the optimizer steps {gd} copies, as "
                             "Megatron-LM's fp32 main_grad with its fp32 master weights), or plan without grad_dtype")
        accepted = inspect.signature(cls).parameters
        if "foreach" not in kwargs and "fused" not in kwargs:
            if host and "fused" in accepted:  # torch's fused CPU kernel: 7x foreach here (bench_offload.py)
                kwargs["fused"] = True
            elif "foreach" in accepted:
                kwargs["foreach"] = True  # one kernel per group instead of a DTensor dispatch per parameter
        if zero1:  # optimizer states of ZeRO-1 parameters: this rank's flat slice only (runtime/zero1.py)
            from autopart.runtime.zero1 import sharded_state_optimizer

            opt = sharded_state_optimizer(self, cls, host=host, master_dtype=master_dtype, **kwargs)
        else:
            opt = build_optimizer(list(self.parameters()), cls, host, master_dtype, **kwargs)
        if isinstance(opt, ShadowOptimizer):
            self._shadow_optimizers.append(weakref.ref(opt))
        return opt

    def optimizer_state_dict(self, opt: torch.optim.Optimizer) -> dict:
        """``opt``'s state (built by ``self.optimizer``) keyed by parameter name, every per-element state a DTensor
        (ZeRO-1/2 slices included), for ``torch.distributed.checkpoint``: ``dcp.save({"model": pm.state_dict(),
        "optim": pm.optimizer_state_dict(opt)}, ...)``; to resume, ``dcp.load`` the same structure into a fresh
        module's dicts (of any plan: the states are laid out by their parameters' shapes, which DCP reshards),
        then ``pm.load_state_dict`` and ``pm.load_optimizer_state_dict``. A fresh optimizer gets its zero states
        first (one step at learning rate 0), for DCP to load into (``runtime/optim_state.py``)."""
        from autopart.runtime.optim_state import optimizer_state_dict

        return optimizer_state_dict(self, opt)

    def load_optimizer_state_dict(self, opt: torch.optim.Optimizer, state: dict) -> None:
        """Load into ``opt`` what ``optimizer_state_dict`` gave, after ``dcp.load`` filled it."""
        from autopart.runtime.optim_state import load_optimizer_state_dict

        load_optimizer_state_dict(self, opt, state)

    def save_checkpoint(self, path, opt: torch.optim.Optimizer | None = None, extra: dict | None = None) -> None:
        """Weights, ``opt``'s state and ``extra`` (a step counter, an LR scheduler, ...) to the directory ``path``
        with torch.distributed.checkpoint, atomically: a save that fails or is killed leaves the previous
        checkpoint at ``path`` whole (``runtime/checkpoint.py``). Every rank calls it."""
        from autopart.runtime.checkpoint import save_checkpoint

        save_checkpoint(self, path, opt, extra)

    def load_checkpoint(self, path, opt: torch.optim.Optimizer | None = None, extra: dict | None = None) -> dict:
        """Load what ``save_checkpoint`` (or ``dcp.save`` of the README's dicts) wrote, on this module's plan,
        whatever plan, mesh or world size saved it; ``opt`` (built by ``self.optimizer``) with or without master
        weights whatever the saving one had; ``extra``'s keys filled in place. Returns ``extra``."""
        from autopart.runtime.checkpoint import load_checkpoint

        return load_checkpoint(self, path, opt, extra)

    def program(self) -> str:
        """This rank's program (for the planned signature) as Python."""
        return next(iter(self._programs.values())).gm.code
