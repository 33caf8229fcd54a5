"""The plan's optimizer state as a ``torch.distributed.checkpoint`` state dict, and back.

``torch.optim.Optimizer.state_dict`` keys states by the optimizer's parameter index, and on a ZeRO-1/2 plan its
tensors are per-rank slices of a flat local tensor (``runtime/zero1.py``): saved as they are with DCP, every rank
would write one key, DCP would keep one rank's slice as if the tensor were replicated, and a resumed run would
silently start from wrong moments. ``optimizer_state_dict`` instead keys states by parameter name, as
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` does, with every per-element state a DTensor:

* a parameter's state (a plain optimizer over DTensor parameters; the host copies of ``HostOffloadOptimizer``) is
  a DTensor of the parameter's shape and placements, as the parameter;
* a ZeRO-1/2 slice's state is a DTensor of the parameter's shape too, with the parameter's placements but for
  the mesh axes its state is sharded over (ZeRO), which shard the parameter's largest dimension no other axis
  shards (``_saved_placements``): saving gathers one parameter's state at a time over those axes and keeps this
  rank's block of it, about its slice's size; loading gathers the block back and keeps the slice;
* scalars (Adam's ``step``) as they are: the same on every rank;
* master weights (``pm.optimizer(cls, master_dtype=...)``) as one more state, ``master_weight``, laid out as the
  others;
* the groups' hyperparameters, once when the groups agree (``_hyperparameters``).

Each rank holds distinct blocks of each DTensor, so DCP saves every block once; and nothing in the saved layout
depends on the plan's slices, so DCP reshards it on load: a checkpoint resumes on another plan, mesh or world size
(other ZeRO levels, tensor and pipeline parallelism, offload), as ``pm.state_dict()``'s weights do.
"""

from __future__ import annotations

import contextlib
import logging
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
    perm: tuple = ()  # the parameter's blocks of unequal lengths, stored permuted (``placement.permuted``)


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
            entries.append(_Entry(fqn, p, d, s, module._permuted.get(module._key_of[fqn], ())))
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


def _saved_placements(s) -> list:
    """Placements of a ZeRO-1/2 parameter's state as saved: the parameter's, with its ZeRO axes sharding the
    parameter's largest dimension that no other axis shards, so that each rank saves a block of about its slice's
    size, a block of the parameter's own shape that any plan can load. A parameter with every dimension sharded
    already (a tensor-parallel bias) keeps the ZeRO axes replicated: its state is saved whole, once."""
    p = s.param
    taken = {pl.dim for pl in p.placements if isinstance(pl, Shard)}
    free = [d for d in range(p.dim()) if d not in taken]
    if not free:
        return savable_placements(p.placements)
    k = max(free, key=lambda d: p.shape[d])
    return savable_placements([Shard(k) if i in s.axes else pl for i, pl in enumerate(p.placements)])


def savable_placements(placements) -> list:
    """``placements`` as saved: a fused projection's strided split (``placement.Strided``, DTensor's
    ``_StridedShard``) as the plain split of its dim, which DCP can write (a rank's strided piece is not one block
    of the tensor) and any plan can load."""
    from autopart._torch_private import is_strided_shard

    return [Shard(p.dim) if is_strided_shard(p) else p for p in placements]


def redistribute(t: DTensor, placements) -> DTensor:
    """``t.redistribute(mesh, placements)``, where a strided split (``_StridedShard``) in ``placements`` is cut by
    hand from the dim gathered on its axis: DTensor's own redistribution into one fails on a 2-D mesh (torch 2.13,
    a tensor-parallel state loaded from a plain split)."""
    from autopart._torch_private import is_strided_shard

    placements = list(placements)
    if list(t.placements) == placements:
        return t
    with _quiet_redistribute():
        if not any(is_strided_shard(p) for p in placements):
            return t.redistribute(t.device_mesh, placements)
        mesh = t.device_mesh
        mid = t.redistribute(mesh, [Replicate() if is_strided_shard(p) else p for p in placements])
    local, coords = mid.to_local(), mesh.get_coordinate()
    for i, p in enumerate(placements):
        if is_strided_shard(p):
            n = mesh.size(i)
            local = torch.cat([b.chunk(n, dim=p.dim)[coords[i]] for b in local.chunk(p.split_factor, dim=p.dim)],
                              dim=p.dim)
    return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False, shape=t.shape, stride=t.stride())


def _gathered_on(t: DTensor, axes) -> torch.Tensor:
    """``t``'s local tensor with ``axes`` gathered (replicated), the others as they are."""
    with _quiet_redistribute():
        return t.redistribute(t.device_mesh, [Replicate() if i in axes else p for i, p in enumerate(t.placements)]
                              ).to_local()


def unpermute(t: DTensor, perm) -> DTensor:
    """A tensor held permuted (``placement.permuted``: each rank's pieces of unequal blocks as the plain split of a
    permuted tensor) -> the same placements over the tensor in its own order. Gathers the permuted axes."""
    return _reordered(t, perm, to_own_order=True)


def permute(t: DTensor, perm) -> DTensor:
    """Inverse of ``unpermute``: ``t`` (its permuted axes split plainly) -> this rank's piece of each block."""
    return _reordered(t, perm, to_own_order=False)


def _reordered(t: DTensor, perm, to_own_order: bool) -> DTensor:
    if not perm or not isinstance(t, DTensor):
        return t
    mesh, coords = t.device_mesh, t.device_mesh.get_coordinate()
    local = _gathered_on(t, [i for i, _ in perm])  # on each permuted axis: the whole dim, in its stored order
    for i, p in perm:
        n, d = mesh.size(i), p.dim
        parts = p.parts(local.shape[d])
        if to_own_order:  # rank r's pieces of every block, for each r -> each block whole; then the plain split
            per_rank = [piece.split([q // n for q in parts], dim=d) for piece in local.chunk(n, dim=d)]
            local = torch.cat([per_rank[r][j] for j in range(len(parts)) for r in range(n)], dim=d)
            local = local.chunk(n, dim=d)[coords[i]]
        else:  # each block whole -> this rank's piece of every block
            local = torch.cat([b.narrow(d, coords[i] * (b.shape[d] // n), b.shape[d] // n)
                               for b in local.split(parts, dim=d)], dim=d)
    return DTensor.from_local(local.contiguous(), mesh, t.placements, run_check=False, shape=t.shape,
                              stride=t.stride())


def savable(t: Any) -> Any:
    """A DTensor in ``savable_placements`` (redistributed, a copy, where they differ); anything else as it is."""
    if not isinstance(t, DTensor):
        return t
    target = savable_placements(t.placements)
    if target == list(t.placements):
        return t
    with _quiet_redistribute():
        return t.redistribute(t.device_mesh, target)


@contextlib.contextmanager
def _quiet_redistribute():
    """Without DTensor's warning that a gather over several mesh axes runs one all-gather per axis: a checkpoint's
    one-off gathers, one parameter at a time, printed on every rank for every parameter."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _slice_to_param(s, t: torch.Tensor) -> DTensor:
    """This rank's slice ``t`` of a flat local tensor, gathered over the slice's axes into a DTensor of the
    parameter's shape and placements (this rank's whole local tensor)."""
    mesh = s.param.device_mesh
    placements, rows = _slice_layout(s, mesh)
    ways = math.prod(mesh.shape[i] for i in s.axes)
    local = F.pad(t.detach().reshape(-1), (0, s.size - t.numel())).view(1, s.size)
    flat = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size((rows, ways * s.size)),
                              stride=(ways * s.size, 1))
    with _quiet_redistribute():
        gathered = flat.redistribute(mesh, [Replicate() if i in s.axes else pl for i, pl in enumerate(placements)])
    shape = s.param.to_local().shape
    whole = gathered.to_local()[0, : math.prod(shape)].view(shape)
    return DTensor.from_local(whole, mesh, s.param.placements, run_check=False, shape=s.param.shape,
                              stride=s.param.stride())


def _to_saved(e: _Entry, t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    if e.slice is not None:  # gathered one parameter at a time, then cut into this rank's block of the saved layout
        s = e.slice
        home = s.param.to_local().device
        block = unpermute(_slice_to_param(s, t.to(home)), e.perm).redistribute(s.param.device_mesh,
                                                                               _saved_placements(s))
        local = block.to_local().to(t.device, copy=True)  # a copy: the gathered tensor is freed
        return DTensor.from_local(local, block.device_mesh, block.placements, run_check=False, shape=block.shape,
                                  stride=block.stride())
    if isinstance(t, DTensor) or not isinstance(e.device, DTensor):
        return savable(unpermute(t, e.perm))
    p = e.device
    return savable(unpermute(DTensor.from_local(t.detach(), p.device_mesh, p.placements, run_check=False,
                                                shape=p.shape, stride=p.stride()), e.perm))


def _from_saved(e: _Entry, v: Any, like: Any) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    if e.slice is not None and isinstance(v, DTensor):  # the saved layout, back to this rank's slice
        s = e.slice
        whole = permute(redistribute(v.to(s.param.to_local().device), s.param.placements), e.perm).to_local()
        local = whole.reshape(-1)[s.start: s.end]
        return local.to(like.device) if isinstance(like, torch.Tensor) else local
    if isinstance(v, DTensor) and isinstance(e.device, DTensor):  # saved split plainly (``savable``): back to the
        v = permute(redistribute(v, e.device.placements), e.perm)  # parameter's strided split
    return v.to_local() if isinstance(v, DTensor) and not isinstance(like, DTensor) else v


def _zero_grad(p: torch.Tensor) -> torch.Tensor:
    """Zeros for ``p``'s gradient, in the gradients' dtype (``Tensor.grad_dtype``: ``PlanOptions.grad_dtype``)."""
    from autopart.runtime.grads import grad_dtype_of

    return torch.zeros_like(p, dtype=grad_dtype_of(p))


def _init_state(module, opt, groups: list[list[_Entry]]) -> None:
    """Give ``opt`` its state tensors (zeros) by one step at learning rate 0 with zero gradients, as
    ``torch.distributed.checkpoint.state_dict`` does: a freshly built optimizer has none for DCP to load into.
    Unlike that, the step count is set back to 0: an optimizer saved before its first step (and stepping on)
    would otherwise run Adam's bias correction one step late."""
    if opt.state:
        return
    for entries in groups:
        for e in entries:
            if e.device.requires_grad:
                if e.device.grad is not None:
                    return  # a backward ran: the caller's step will create the states
                e.device.grad = _zero_grad(e.device)
            if e.slice is not None and e.slice.param.grad is None:  # ZeRO-1's step reads the parameter's gradient
                e.slice.param.grad = _zero_grad(e.slice.param)
    lrs = [g.get("lr") for g in opt.param_groups]
    for g in opt.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        if lr is not None:
            g["lr"] = lr
    for st in opt.state.values():  # that step is not one: saved before the first step, a run resumes from step 0
        step = st.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif isinstance(step, (int, float)):
            st["step"] = type(step)(0)
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
    return {"state": state, "param_groups": _hyperparameters(opt)}


def _hyperparameters(opt) -> list[dict]:
    """The groups' hyperparameters, without their parameters' names: DCP writes a non-tensor value once, as if every
    rank held the same, and the stages of a pipeline hold different parameters. One group when all agree, as they
    do for ``pm.optimizer(cls, **kwargs)`` (its groups, plain parameters and ZeRO-1/2 slices, are the plan's, not
    the user's), so that any plan loads it."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return groups[:1] if all(_same(g, groups[0]) for g in groups) else groups


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


@torch.no_grad()
def load_optimizer_state_dict(module, opt, sd: dict) -> None:
    """Load what ``optimizer_state_dict`` gave (filled by ``dcp.load``) into ``opt``."""
    from autopart.runtime.module import ShadowOptimizer

    groups = _entries(module, opt)
    if isinstance(opt, ShadowOptimizer):  # its copies of the weights: the module's, loaded or not (master: below;
        opt.sync_from_device()  # a checkpoint without master weights keeps these, pm.load_checkpoint)
    saved_groups = sd["param_groups"]
    if len(saved_groups) == 1:
        saved_groups = saved_groups * len(opt.param_groups)
    missing = [e.fqn for entries in groups for e in entries if e.fqn not in sd["state"] and opt.state.get(e.key)]
    if len(saved_groups) != len(opt.param_groups) or missing:
        raise ValueError(f"load_optimizer_state_dict: the checkpoint holds {len(saved_groups)} parameter groups "
                         f"for this optimizer's {len(opt.param_groups)} (groups with different hyperparameters are "
                         f"saved apart), and no state for {missing[:3]}: was it saved from another model or "
                         "optimizer? The optimizer must be built as the saved one was (pm.optimizer(cls, ...))")
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
