"""ParallelModule: runs one rank's rewritten graph with DTensor parameters.

Parameters are ``DTensor``s on the mesh with the plan's placements, so ``torch.optim``, gradient clipping and
``torch.distributed.checkpoint`` see ordinary (sharded) parameters. Each call feeds the graph the local shards
(``DTensor.to_local``, differentiable), slices user inputs to the plan's input placements, and after backward
sums the gradients the plan marks as reduced over their mesh axes, in one flat buffer per set of axes.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autopart.placement import Shard, parse_spec, to_dtensor_placements
from autopart.plan import Plan
from autopart.runtime import collectives as C


def _local_chunk(full: torch.Tensor, spec, coords: list[int], sizes: list[int]) -> torch.Tensor:
    out = full
    for p, c, n in zip(spec, coords, sizes):
        if isinstance(p, Shard):
            out = out.chunk(n, dim=p.dim)[c]
    return out


class ParallelModule(nn.Module):
    def __init__(self, gm: fx.GraphModule, plan: Plan, model: nn.Module, mesh, *, params: dict[str, str],
                 buffers: dict[str, str], constants: dict[str, Any], user_inputs: list[str],
                 input_names: list[str], aliases: dict[str, list[str]], out_spec: Any = None,
                 loss_fn: Callable | None = None, local_batch: bool = False, sync_params: bool = True) -> None:
        super().__init__()
        self.plan = plan
        self.gm = gm
        self.mesh = mesh
        dm = mesh.device_mesh
        self._dm = dm
        self._groups = [dm.get_group(i) for i in range(dm.ndim)]
        self._coords = list(dm.get_coordinate())
        self._sizes = list(dm.shape)
        self._param_ph = params  # placeholder -> fqn
        self._buffer_ph = buffers
        self._constants = constants
        self._user_inputs = user_inputs
        self._input_names = input_names
        self._aliases = aliases
        self._out_spec = out_spec
        self.loss_fn = loss_fn
        self.local_batch = local_batch
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        self._device = device
        named = dict(model.named_parameters(remove_duplicate=False))
        named_buffers = dict(model.named_buffers(remove_duplicate=False))
        self._params = nn.ParameterDict()
        self._key_of: dict[str, str] = {}
        for ph, fqn in params.items():
            full = named[fqn].detach().to(device)
            if sync_params:
                full = full.clone()
                dist.broadcast(full, src=0)
            spec = parse_spec(plan.params[fqn])
            local = _local_chunk(full, spec, self._coords, self._sizes).contiguous()
            dt = DTensor.from_local(local, dm, to_dtensor_placements(spec), run_check=False,
                                    shape=full.shape, stride=full.stride())
            key = fqn.replace(".", "__")
            self._params[key] = nn.Parameter(dt, requires_grad=named[fqn].requires_grad)
            self._key_of[fqn] = key
        self._buffers_local = {ph: named_buffers[fqn].detach().to(device) for ph, fqn in buffers.items()}
        self._reduced = {fqn: tuple(axes) for fqn, axes in plan.reduced.items()}
        self._input_specs = {name: parse_spec(s) for name, s in plan.inputs.items()}

    # ---- parameters ----------------------------------------------------------------------------------------
    def param(self, fqn: str) -> nn.Parameter:
        for k, others in self._aliases.items():
            if fqn in others:
                fqn = k
        return self._params[self._key_of[fqn]]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered to its full shape, on every rank, keyed by the model's names (tied too)."""
        out = {}
        for fqn, key in self._key_of.items():
            full = self._params[key].detach().full_tensor()
            out[fqn] = full
            for alias in self._aliases.get(fqn, []):
                out[alias] = full
        return out

    # ---- running -------------------------------------------------------------------------------------------
    def _bind_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        names = [n for n in self._input_names if n.startswith("args[")]
        if len(tensors) != len(names):
            raise ValueError(f"expected {len(names)} positional tensor inputs as when planned, got {len(tensors)}")
        for name in self._input_names:
            if name.startswith("kwargs["):
                key = name[8:-2]
                if key not in kwargs:
                    raise ValueError(f"the plan was traced with keyword input {key!r}; pass it (or re-plan "
                                     f"without it)")
                tensors.append(kwargs[key])
        out = []
        for ph, t in zip(self._user_inputs, tensors):
            t = t.to(self._device)
            spec = self._input_specs.get(ph)
            if spec is not None:
                for axis, (p, c, n) in enumerate(zip(spec, self._coords, self._sizes)):
                    if isinstance(p, Shard) and not (self.local_batch and p.dim == 0):
                        t = t.chunk(n, dim=p.dim)[c]
            out.append(t)
        return out

    def _run(self, args: tuple, kwargs: dict) -> Any:
        inputs = self._bind_inputs(args, kwargs)
        feed = []
        user = iter(inputs)
        for node in self.gm.graph.find_nodes(op="placeholder"):
            name = node.name
            if name in self._param_ph:
                feed.append(self._params[self._key_of[self._param_ph[name]]].to_local())
            elif name in self._buffer_ph:
                feed.append(self._buffers_local[name])
            elif name in self._constants:
                feed.append(self._constants[name])
            else:
                feed.append(next(user))
        with C.axis_groups(self._groups, self._coords, self._sizes):
            outs = self.gm(*feed)
        return outs

    def forward(self, *args, **kwargs):
        outs = self._run(args, kwargs)
        if self._out_spec is not None:
            return torch.utils._pytree.tree_unflatten(list(outs), self._out_spec)
        return outs[0] if len(outs) == 1 else outs

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
        """Forward and backward of the global batch; gradients land in ``.grad`` of this rank's shards.
        Returns the loss (detached), equal to the single-process loss of the same global batch."""
        loss = self._loss_of(self.forward(*args, **kwargs))
        loss.backward()
        self.reduce_gradients()
        return loss.detach()

    def reduce_gradients(self) -> None:
        """Sum the gradients the plan marks as reduced over their axes (data-parallel reduction), bucketed."""
        buckets: dict[tuple[int, ...], list[torch.Tensor]] = defaultdict(list)
        for fqn, axes in self._reduced.items():
            p = self._params[self._key_of[fqn]]
            if p.grad is not None:
                buckets[axes].append(p.grad._local_tensor)
        for axes, grads in buckets.items():
            flat = torch.cat([g.reshape(-1) for g in grads])
            for a in axes:
                dist.all_reduce(flat, group=self._groups[a])
            off = 0
            for g in grads:
                g.copy_(flat[off: off + g.numel()].view_as(g))
                off += g.numel()

    def program(self) -> str:
        """This rank's program as Python."""
        return self.gm.code
