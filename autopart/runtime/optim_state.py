"""The plan's optimizer state as a ``torch.distributed.checkpoint`` state dict, and back.

``torch.optim.Optimizer.state_dict`` keys states by the optimizer's parameter index, and on a ZeRO-1/2 plan its
tensors are per-rank slices of a flat local tensor (``runtime/zero1.py``): saved as they are with DCP, every rank
would write one key, DCP would keep one rank's slice as if the tensor were replicated, and a resumed run would
silently start from wrong moments. ``optimizer_state_dict`` instead keys states by parameter name, as
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` does, with every per-element state a DTensor:

* a parameter's state (a plain optimizer over DTensor parameters; the host copies of ``HostOffloadOptimizer``) is
  a DTensor of the parameter's shape and placements, as the parameter;
* a ZeRO-1/2 slice's state is a DTensor of shape ``(L, D * S)``: ``L`` the product of the mesh axes the parameter
  is sharded over (``Shard(0)`` there: one row per distinct local tensor), ``D`` the ranks it is replicated over
  and ``S`` the slice length (``Shard(1)`` there, outer axis first, as ``zero1_slice`` numbers the slices); a
  rank's local block is its slice, zero-padded to ``S``;
* scalars (Adam's ``step``) as they are: the same on every rank;
* master weights (``pm.optimizer(cls, master_dtype=...)``) as one more state, ``master_weight``, laid out as the
  others.

Each rank holds distinct blocks of each DTensor, so DCP saves every slice once and loads each back to its rank.
A checkpoint resumes the same plan on the same mesh (the slices' layout is the plan's); the model's weights go
through ``pm.state_dict()`` as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

# the state name master weights are saved under (``ShadowOptimizer`` with a ``dtype``): finer than the module's
# weights, so a resumed run continues from them rather than from their rounding
MASTER = "master_weight"


@dataclass
class _Entry:
    fqn: str
    key: torch.Tensor  # what ``opt.state`` is keyed by (the copy a ShadowOptimizer steps)
    device: torch.Tensor  # the module's parameter, or a ZeRO-1/2 slice leaf
    slice: Any  # zero1._Slice, or None


def _entries(module, opt) -> list[list[_Entry]]:
    """Per parameter group of ``opt``, its parameters in order, named."""
    from autopart.runtime.module import ShadowOptimizer

    name_of: dict[int, str] = {}
    for fqn, key in module._key_of.items():
        name_of.setdefault(id(module._params[key]), fqn)
    slice_of = {id(s.leaf): s for s in getattr(opt, "autopart_zero1_slices", [])}
    device = iter(opt.params) if isinstance(opt, ShadowOptimizer) else None
    groups = []
    for group in opt.param_groups:
        entries = []
        for p in group["params"]:
            d = next(device) if device is not None else p
            s = slice_of.get(id(d))
            fqn = name_of.get(id(s.param if s is not None else d))
            if fqn is None:
                raise ValueError("optimizer_state_dict: the optimizer steps a tensor that is not one of this module's "
                                 "parameters; build it with pm.optimizer(cls, ...)")
            entries.append(_Entry(fqn, p, d, s))
        groups.append(entries)
    return groups


def _slice_layout(s, mesh) -> tuple[list, int]:
    """(placements, rows L) of a ZeRO-1/2 slice's state DTensor."""
    sizes = list(mesh.shape)
    placements, rows = [], 1
    for i, pl in enumerate(s.param.placements):
        if i in s.axes:
            placements.append(Shard(1))
        elif isinstance(pl, Shard) and sizes[i] > 1:
            placements.append(Shard(0))
            rows *= sizes[i]
        else:
            placements.append(Replicate())
    return placements, rows


def _to_saved(e: _Entry, t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    if e.slice is not None:
        s = e.slice
        mesh = s.param.device_mesh
        placements, rows = _slice_layout(s, mesh)
        size = s.size
        ways = math.prod(mesh.shape[i] for i in s.axes)
        local = F.pad(t.detach().reshape(-1), (0, size - t.numel())).view(1, size)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size((rows, ways * size)),
                                  stride=(ways * size, 1))
    if isinstance(t, DTensor) or not isinstance(e.device, DTensor):
        return t
    p = e.device
    return DTensor.from_local(t.detach(), p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


def _from_saved(e: _Entry, v: Any, like: Any) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    local = v.to_local() if isinstance(v, DTensor) and not isinstance(like, DTensor) else v
    if e.slice is not None and isinstance(v, DTensor):
        local = local.reshape(-1)[: e.slice.end - e.slice.start]
    return local


def _init_state(module, opt, groups: list[list[_Entry]]) -> None:
    """Give ``opt`` its state tensors (zeros) by one step at learning rate 0 with zero gradients, as
    ``torch.distributed.checkpoint.state_dict`` does: a freshly built optimizer has none for DCP to load into."""
    if opt.state:
        return
    for entries in groups:
        for e in entries:
            if e.device.requires_grad:
                if e.device.grad is not None:
                    return  # a backward ran: the caller's step will create the states
                e.device.grad = torch.zeros_like(e.device)
            if e.slice is not None and e.slice.param.grad is None:  # ZeRO-1's step reads the parameter's gradient
                e.slice.param.grad = torch.zeros_like(e.slice.param)
    lrs = [g.get("lr") for g in opt.param_groups]
    for g in opt.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        if lr is not None:
            g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    module.zero_grad(set_to_none=True)
    module._finish_param_gathers()  # the step's ZeRO-1/2 gather: done before anything loads the weights


def optimizer_state_dict(module, opt) -> dict:
    """``{"state": {name: {state: tensor}}, "param_groups": [hyperparameters per group]}`` (module docstring)."""
    groups = _entries(module, opt)
    _init_state(module, opt, groups)
    state: dict[str, dict] = {}
    for entries in groups:
        for e in entries:
            st = opt.state.get(e.key)
            if st:
                state[e.fqn] = {k: _to_saved(e, v) for k, v in st.items()}
                if e.key is not e.device and e.key.dtype != e.device.dtype:  # master weights: finer than the module's
                    state[e.fqn][MASTER] = _to_saved(e, e.key.detach())
    # the groups' hyperparameters, without their parameters' names: DCP writes a non-tensor value once, as if every
    # rank held the same, and the stages of a pipeline hold different parameters
    param_groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"state": state, "param_groups": param_groups}


@torch.no_grad()
def load_optimizer_state_dict(module, opt, sd: dict) -> None:
    """Load what ``optimizer_state_dict`` gave (filled by ``dcp.load``) into ``opt``."""
    from autopart.runtime.module import ShadowOptimizer

    groups = _entries(module, opt)
    if isinstance(opt, ShadowOptimizer):  # its copies of the weights: the module's, loaded or not (master: below)
        opt.sync_from_device()
    saved_groups = sd["param_groups"]
    missing = [e.fqn for entries in groups for e in entries if e.fqn not in sd["state"] and opt.state.get(e.key)]
    if len(saved_groups) != len(opt.param_groups) or missing:
        raise ValueError(f"load_optimizer_state_dict: the checkpoint holds {len(saved_groups)} parameter groups "
                         f"for this optimizer's {len(opt.param_groups)}, and no state for {missing[:3]}; a checkpoint "
                         "resumes the plan (and the optimizer) it was saved with")
    for g, saved in zip(opt.param_groups, saved_groups):
        g.update({k: v for k, v in saved.items() if k != "params"})
    for entries in groups:
        for e in entries:
            saved = sd["state"].get(e.fqn)
            if saved is None:
                continue
            st = opt.state[e.key]
            for k, v in saved.items():
                if k == MASTER:
                    e.key.data.copy_(_from_saved(e, v, e.key.data))
                    continue
                old = st.get(k)
                new = _from_saved(e, v, old)
                if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.shape == new.shape:
                    old.copy_(new)
                else:
                    st[k] = new.clone() if isinstance(new, torch.Tensor) else new
