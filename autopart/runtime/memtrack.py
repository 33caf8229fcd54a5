"""Measured memory: the peak of live tensor bytes over a region of code, per category.

    with MemoryTracker() as mt:
        mt.track(model.parameters(), "parameters")          # storages created before the region
        mt.track(optimizer_state_tensors(opt), "optimizer_states")
        mt.track_gradients(model.parameters())               # label each .grad when backward accumulates it
        step()
    mt.peak_bytes, mt.peak_breakdown, mt.peak_op

How it counts (CPU; exact in bytes, no allocator rounding):

* a dispatch mode sees every ATen op run inside the region, autograd's backward included, and registers the
  storage of each output tensor the first time it sees it; a DTensor counts its local shard's storage;
* a storage counts once however many views share it (keyed by the storage object, whose Python object torch
  preserves for the storage's lifetime), with its ``nbytes()``; a later resize is picked up when an op returns it;
* a storage stops counting when it is freed (``weakref.finalize`` on the storage object);
* storages that existed before the region count only when registered with :meth:`track` (parameters, optimizer
  states, inputs); unregistered pre-existing tensors are invisible, so register whatever the region keeps alive;
* new storages count as ``activations`` (activations and temporaries) unless registered otherwise;
  :meth:`track` re-labels a storage already counted (a gradient created during backward, say).

What it does not see: memory allocated below the dispatcher without a tensor output (kernel workspaces, gloo's
internal staging buffers), and tensors of ops run while the mode is disabled. On CUDA, ``cuda_peak_bytes`` is
``torch.cuda.max_memory_allocated`` over the region (the caching allocator's view: everything resident, rounded
to its blocks), reset on entry.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from autopart._torch_private import dispatch_mode_class, dtensor_local, is_fake

CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "buffers")


def _tensors(x: Any) -> Iterable[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple, set)) or (hasattr(x, "__iter__") and not isinstance(x, (str, bytes))):
        for v in x:
            yield from _tensors(v)


def optimizer_state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor an optimizer keeps between steps (Adam's exp_avg, exp_avg_sq, step)."""
    return list(_tensors(list(opt.state.values())))


class _Mode(dispatch_mode_class()):  # type: ignore[misc]
    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tracker._see(out, "activations", relabel=False, op=func)
        return out


class MemoryTracker:
    """Live tensor bytes over a ``with`` region: ``current_bytes``, ``peak_bytes``, per category at the peak."""

    def __init__(self, timeline: bool = False) -> None:
        self.timeline: list[tuple[str, int, int]] | None = [] if timeline else None  # (op, +/- bytes, current)
        self._live: dict[int, list] = {}  # id(storage) -> [nbytes, category, finalizer, op that made it]
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.peak_bytes = 0
        self._peak_recs: list[tuple[list, int]] = []  # (record, its bytes then)
        self.peak_op = ""
        self.cuda_peak_bytes: int | None = None
        self._mode: _Mode | None = None
        self._hooks: list = []

    @property
    def peak_breakdown(self) -> dict[str, int]:
        """Bytes per category of the storages live at the peak, each under its latest label (a gradient created
        during backward counts as ``gradients`` once :meth:`track_gradients`' hook has labelled it)."""
        out = dict.fromkeys(CATEGORIES, 0)
        for rec, n in self._peak_recs:
            out[rec[1]] += n
        return out

    def peak_by_op(self, category: str | None = None) -> dict[str, tuple[int, int]]:
        """Storages live at the peak grouped by the op that first returned them: op -> (count, bytes), largest
        first; ``track`` for registered ones."""
        out: dict[str, list[int]] = {}
        for rec, n in self._peak_recs:
            if category is None or rec[1] == category:
                c = out.setdefault(str(rec[3]), [0, 0])
                c[0] += 1
                c[1] += n
        return {k: (c, b) for k, (c, b) in sorted(out.items(), key=lambda kv: -kv[1][1])}

    @property
    def current_bytes(self) -> int:
        return sum(self.current.values())

    def track(self, tensors: Any, category: str = "parameters") -> None:
        """Count (or re-label) the storages of ``tensors`` (a tensor, or any nesting of lists/dicts/iterables)."""
        if category not in CATEGORIES:
            raise ValueError(f"category {category!r}: use one of {CATEGORIES}")
        self._see(tensors, category, relabel=True, op="track")

    def track_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Label each parameter's ``.grad`` as ``gradients`` when backward accumulates it (hooks removed on exit);
        gradients that already exist are labelled now."""
        for p in params:
            if p.grad is not None:
                self.track(p.grad, "gradients")
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda q: None if q.grad is None else self.track(q.grad, "gradients")))  # ZeRO-2 frees it

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak_bytes = self.current_bytes
        self._peak_recs = [(r, r[0]) for r in self._live.values()]
        self.peak_op = "reset"

    def _see(self, x: Any, category: str, relabel: bool, op: Any) -> None:
        grew = False
        for t in _tensors(x):
            if isinstance(t, DTensor):
                t = dtensor_local(t)
            if t.device.type == "meta" or is_fake(t):
                continue
            st = t.untyped_storage()
            n = st.nbytes()
            if n == 0:
                continue
            rec = self._live.get(id(st))
            if rec is None:
                self._live[id(st)] = [n, category, weakref.finalize(st, self._free, id(st)), op]
                self.current[category] += n
                grew = True
                if self.timeline is not None:
                    self.timeline.append((str(op), n, self.current_bytes))
                continue
            if rec[0] != n:
                self.current[rec[1]] += n - rec[0]
                grew = grew or n > rec[0]
                rec[0] = n
            if relabel and rec[1] != category:
                self.current[rec[1]] -= rec[0]
                self.current[category] += rec[0]
                rec[1] = category
        if grew and self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self._peak_recs = [(r, r[0]) for r in self._live.values()]
            self.peak_op = str(op)

    def _free(self, key: int) -> None:
        rec = self._live.pop(key, None)
        if rec is not None:
            self.current[rec[1]] -= rec[0]
            if self.timeline is not None:
                self.timeline.append(("free", -rec[0], self.current_bytes))

    def __enter__(self) -> MemoryTracker:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        self._mode = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.cuda_peak_bytes = torch.cuda.max_memory_allocated()

    def stop(self) -> None:
        """Stop following frees (detach every finalizer); counts keep their last values."""
        for rec in self._live.values():
            rec[2].detach()
        self._live.clear()

    def __str__(self) -> str:
        parts = " ".join(f"{k}={v / 2**20:.2f}" for k, v in self.peak_breakdown.items() if v)
        return (f"peak {self.peak_bytes / 2**20:.2f} MiB ({parts}) at {self.peak_op}; "
                f"now {self.current_bytes / 2**20:.2f} MiB")
