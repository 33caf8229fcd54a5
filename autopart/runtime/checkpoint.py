"""Checkpoints in one call: ``pm.save_checkpoint(path, opt)`` and ``pm.load_checkpoint(path, opt)``.

Both run ``torch.distributed.checkpoint`` (DCP) on the dicts of ``ParallelModule.state_dict`` and
``optimizer_state_dict`` (``runtime/optim_state.py``), so a checkpoint resumes on another plan, mesh or world size
as those do, and add what a training job needs around the README's four lines:

* **A save is atomic.** DCP writes every rank's shards and then rank 0's ``.metadata``; a job killed in between
  leaves a directory without metadata, and one killed while overwriting ``path`` would leave the old and the new
  checkpoint mixed. ``save_checkpoint`` writes to ``<path>.partial`` and, once every rank has written, rank 0 moves
  it in place of ``path`` (the previous one aside to ``<path>.old`` first, removed last: a directory cannot be
  replaced by a rename while it holds files). A save that fails on any rank raises a ``RuntimeError`` on every
  rank (DCP's ``CheckpointException``, a ``BaseException``, as its cause) and leaves ``path`` as it was.
  ``load_checkpoint`` reads ``<path>.old`` only when ``path`` is missing, which happens only between the two renames.
* **Master weights either way.** An optimizer with master weights (``pm.optimizer(cls, master_dtype=...)``) loads
  a checkpoint saved without them: its master copies start from the loaded weights. One without loads a checkpoint
  saved with them: it steps the loaded (rounded) weights.
* **Nothing else is replaced:** a save refuses a ``path`` that holds anything but a checkpoint (a file, a
  directory of other files). Every rank must see the same filesystem, as DCP requires of a checkpoint anyway.
* **The job's other state** (``extra``): a step counter, an LR scheduler, a data loader's position. Values are saved
  as DCP saves them: tensors sharded as they are, other objects pickled, objects with ``state_dict`` /
  ``load_state_dict`` (``torch.optim.lr_scheduler``) through those.
* **A mismatch is named before anything loads:** the weights or optimizer states the checkpoint lacks, with what
  to do about it.
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from autopart.runtime.optim_state import MASTER

PARTIAL = ".partial"  # a save in progress (or one that failed: the next save clears it)
OLD = ".old"  # the checkpoint a save is replacing, while it moves the new one in place
METADATA = ".metadata"  # DCP's index, written by rank 0 after every rank wrote its shards
_RESERVED = ("model", "optim")


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _state(module, opt, extra: dict | None) -> dict[str, Any]:
    clash = sorted(set(extra or {}) & set(_RESERVED))
    if clash:
        raise ValueError(f"extra={{...}} uses the key(s) {clash}, which hold the checkpoint's weights and optimizer "
                         "state: name them otherwise")
    state: dict[str, Any] = {"model": module.state_dict()}
    if opt is not None:
        state["optim"] = module.optimizer_state_dict(opt)
    state.update(extra or {})
    return state


def save_checkpoint(module, path: str | os.PathLike, opt=None, extra: dict | None = None) -> None:
    """Save ``module``'s weights, ``opt``'s state (built by ``module.optimizer``) and ``extra`` to the directory
    ``path``, atomically (module docstring). Every rank calls it."""
    path = os.fspath(path)
    tmp, old = path + PARTIAL, path + OLD
    if os.path.lexists(path) and not _replaceable(path):  # the same answer on every rank: a shared filesystem
        raise FileExistsError(f"save_checkpoint: {path!r} exists and is not a checkpoint (no {METADATA} in it): "
                              "saving would replace it and everything in it. Pass a new directory, or the one a "
                              "previous save wrote")
    state = _state(module, opt, extra)
    if _rank0():
        shutil.rmtree(tmp, ignore_errors=True)  # what a save that did not finish left
    _barrier()
    try:
        dcp.save(state, checkpoint_id=tmp)  # raises on every rank if any rank failed to write
    except dcp.CheckpointException as e:  # a BaseException: named here as the error it is
        if _rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        first = next(iter(e.failures.items()), None)
        cause = f"rank {first[0]}: {type(first[1][0]).__name__}: {first[1][0]}" if first else str(e)
        raise RuntimeError(f"save_checkpoint: writing {path!r} failed on rank(s) {sorted(e.failures)} ({cause}); "
                           f"nothing was replaced: {path!r} holds the previous checkpoint, if there was one. Free "
                           "the space or fix the path's permissions, and save again") from e
    except BaseException:
        if _rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    if _rank0():
        if os.path.lexists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        if os.path.isdir(old):
            shutil.rmtree(old)
        elif os.path.lexists(old):
            os.remove(old)
    _barrier()  # no rank returns (and, say, loads) before the checkpoint is in place


def _replaceable(path: str) -> bool:
    """Whether a save may replace what is at ``path``: a checkpoint (DCP's index in it) or an empty directory,
    never a file or a directory of other things (a user's output directory passed by mistake)."""
    return os.path.isdir(path) and not os.path.islink(path) and (
        os.path.isfile(os.path.join(path, METADATA)) or not os.listdir(path))


def _checkpoint_dir(path: str) -> str:
    if os.path.isfile(os.path.join(path, METADATA)):
        return path
    if not os.path.lexists(path) and os.path.isfile(os.path.join(path + OLD, METADATA)):
        warnings.warn(f"load_checkpoint: {path!r} is missing and {path + OLD!r} holds a checkpoint: a save was "
                      "stopped while it replaced it; loading the previous checkpoint", stacklevel=3)
        return path + OLD
    why = (f"{path + PARTIAL!r} exists: a save into it did not finish" if os.path.lexists(path + PARTIAL) else
           f"{path!r} exists but holds no {METADATA} (DCP's index): not a finished DCP checkpoint"
           if os.path.lexists(path) else f"{path!r} does not exist")
    raise FileNotFoundError(f"load_checkpoint: no checkpoint at {path!r}: {why}. Pass the directory "
                            "pm.save_checkpoint (or dcp.save) wrote")


def load_checkpoint(module, path: str | os.PathLike, opt=None, extra: dict | None = None) -> dict[str, Any]:
    """Load into ``module`` (of any plan) the weights saved at ``path``, into ``opt`` (built by
    ``module.optimizer``; None: weights only) its state, and into ``extra`` the values saved under its keys (as
    ``dcp.load`` does: a tensor in place, an object with ``load_state_dict`` through it, any other value replaced in
    the dict). Returns ``extra`` (an empty dict if None). Every rank calls it."""
    path = _checkpoint_dir(os.fspath(path))
    saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    state = _state(module, opt, extra)
    missing = [f"model.{k}" for k in state["model"] if f"model.{k}" not in saved]
    if opt is not None:
        if not any(k.startswith("optim.") for k in saved):
            raise ValueError(f"load_checkpoint: the checkpoint at {path!r} holds no optimizer state (it was saved "
                             "without opt=): pass opt=None to load the weights alone")
        for fqn, st in state["optim"]["state"].items():
            if MASTER in st and f"optim.state.{fqn}.{MASTER}" not in saved:
                del st[MASTER]  # saved without master weights: they start from the loaded weights
            missing += [f"optim.state.{fqn}.{k}" for k in st if f"optim.state.{fqn}.{k}" not in saved]
    missing += [k for k in extra or {} if k not in saved and not any(s.startswith(k + ".") for s in saved)]
    if missing:
        raise ValueError(f"load_checkpoint: the checkpoint at {path!r} lacks {len(missing)} of the entries this "
                         f"module and optimizer hold, e.g. {missing[:4]}. Was it saved from another model (the "
                         "weights' names differ), with another optimizer class (its states differ), or without "
                         "these extra keys? Load it with the model and optimizer class it was saved with")
    dcp.load(state, checkpoint_id=path)
    module.load_state_dict(state["model"])
    if opt is not None:
        module.load_optimizer_state_dict(opt, state["optim"])
    if extra is None:
        return {}
    for k, v in extra.items():
        if not isinstance(v, Stateful):  # loaded in place through its load_state_dict
            extra[k] = state[k]
    return extra
