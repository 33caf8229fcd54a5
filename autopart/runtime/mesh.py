"""Meshes: a plain description for planning, a ``DeviceMesh`` with named axes under ``torchrun``."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Mesh:
    shape: tuple[int, ...]
    names: tuple[str, ...]
    device_mesh: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.shape = tuple(int(s) for s in self.shape)
        if len(self.names) != len(self.shape):
            raise ValueError(f"mesh shape {self.shape} has {len(self.shape)} axes but {len(self.names)} names "
                             f"{self.names}")
        if any(s < 1 for s in self.shape):
            raise ValueError(f"mesh shape {self.shape}: every axis needs at least one device")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"mesh axis names {self.names} repeat")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def distributed(self) -> bool:
        return self.device_mesh is not None


def backend_for_device() -> tuple[str, str]:
    if torch.cuda.is_available():
        return "nccl", "cuda"
    return "gloo", "cpu"


def init_from_env() -> None:
    """Initialise the default process group from the ``torchrun`` environment (gloo on CPU, NCCL on GPU)."""
    if dist.is_initialized():
        return
    backend, device = backend_for_device()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)


def mesh(shape: tuple[int, ...] | int, names: tuple[str, ...] | None = None) -> Mesh:
    """A mesh of devices with named axes. Under ``torchrun`` (or with a process group already initialised) it
    wraps a ``DeviceMesh``; otherwise it is a description used for planning only."""
    if isinstance(shape, int):
        shape = (shape,)
    names = tuple(names) if names is not None else tuple(f"axis{i}" for i in range(len(shape)))
    m = Mesh(tuple(shape), names)
    if dist.is_initialized() or "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        init_from_env()
        world = dist.get_world_size()
        if m.size != world:
            raise ValueError(f"mesh {m.shape} holds {m.size} devices but the world size is {world}: make the "
                             f"product of the mesh shape equal the number of processes (torchrun "
                             f"--nproc-per-node={m.size}) or change the shape")
        from torch.distributed.device_mesh import init_device_mesh

        _, device = backend_for_device()
        m.device_mesh = init_device_mesh(device, m.shape, mesh_dim_names=m.names)
    return m
