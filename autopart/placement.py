"""The sharding vocabulary: one placement per mesh axis, as in DTensor.

``Shard(dim)`` splits tensor dimension ``dim`` evenly over the axis, ``Replicate()`` keeps a full copy on every
rank of the axis, ``Partial()`` holds addends whose sum over the axis is the value. ``Strided(dim, blocks)`` cuts
``dim`` into ``blocks`` equal blocks and splits each evenly over the axis, a rank holding its piece of every block,
in order: the layout a fused projection (GPT-2's ``c_attn``, [q | k | v]) is split in for tensor parallelism, so
that splitting its output into the blocks leaves each rank its own heads of q, k and v (DTensor's
``_StridedShard``). Its blocks may differ in length (``Strided(dim, 3, (h, kv, kv))``, printed ``S(0)/h+kv+kv``:
Phi-3-medium's grouped-query ``qkv_proj``), each still split evenly. A ``Spec`` is a tuple with one placement per
mesh axis and prints compactly (``S(0)R``, ``S(1)/3R``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True, order=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"

    def to_json(self) -> str:
        return str(self)


@dataclass(frozen=True, order=True)
class Strided:
    dim: int
    blocks: int
    sizes: tuple = ()  # the blocks' lengths when they differ (a grouped-query [q | k | v]); () when equal

    def __str__(self) -> str:
        return f"S({self.dim})/{'+'.join(map(str, self.sizes)) if self.sizes else self.blocks}"

    @staticmethod
    def of(dim: int, blocks) -> Strided | Shard:
        """The layout of ``dim`` cut into ``blocks``: a count of equal blocks, or their lengths."""
        if isinstance(blocks, int):
            return Strided(dim, blocks)
        blocks = tuple(int(b) for b in blocks if b)  # an empty block holds nothing on any rank
        if len(blocks) == 1:
            return Shard(dim)
        return Strided(dim, len(blocks)) if len(set(blocks)) == 1 else Strided(dim, len(blocks), blocks)

    def parts(self, length: int) -> list[int]:
        """The blocks' lengths along a dim of ``length``."""
        return list(self.sizes) if self.sizes else [length // self.blocks] * self.blocks

    def fits(self, length: int, n: int) -> bool:
        """Each block of a dim of ``length`` splits evenly over ``n`` ranks."""
        if self.sizes:
            return sum(self.sizes) == length and all(b % n == 0 for b in self.sizes)
        return length % (self.blocks * n) == 0

    def to_json(self) -> str:
        return str(self)


def is_shard(p) -> bool:
    """``p`` splits a dim over its axis: ``Shard`` or ``Strided``."""
    return isinstance(p, (Shard, Strided))


@dataclass(frozen=True, order=True)
class Replicate:
    def __str__(self) -> str:
        return "R"

    def to_json(self) -> str:
        return "R"


@dataclass(frozen=True, order=True)
class Partial:
    def __str__(self) -> str:
        return "P"

    def to_json(self) -> str:
        return "P"


Placement = Union[Shard, Strided, Replicate, Partial]
Spec = tuple  # tuple[Placement, ...], one per mesh axis

R = Replicate()
P = Partial()


def parse_placement(text: str) -> Placement:
    """Inverse of ``str``: ``"S(1)"``, ``"S(1)/3"``, ``"R"``, ``"P"``."""
    text = text.strip()
    if text == "R":
        return R
    if text == "P":
        return P
    if text.startswith("S(") and text.endswith(")"):
        return Shard(int(text[2:-1]))
    if text.startswith("S(") and ")/" in text:
        dim, blocks = text[2:].split(")/")
        return Strided.of(int(dim), [int(b) for b in blocks.split("+")] if "+" in blocks else int(blocks))
    raise ValueError(f"cannot parse placement {text!r}: expected 'R', 'P', 'S(<dim>)', 'S(<dim>)/<blocks>' or "
                     f"'S(<dim>)/<size>+<size>+...'")


def spec_str(spec: Spec) -> str:
    return "".join(str(p) for p in spec)


def parse_spec(text: str) -> Spec:
    out, i = [], 0
    while i < len(text):
        if text[i] in "RP":
            out.append(parse_placement(text[i]))
            i += 1
        elif text.startswith("S(", i):
            j = text.index(")", i) + 1
            if text.startswith("/", j):  # S(d)/blocks, S(d)/size+size+...
                j += 1
                while j < len(text) and (text[j].isdigit() or text[j] == "+"):
                    j += 1
            out.append(parse_placement(text[i:j]))
            i = j
        else:
            raise ValueError(f"cannot parse spec {text!r} at position {i}")
    return tuple(out)


def local_shape(shape: tuple[int, ...], spec: Spec, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of one rank's piece of a tensor of global ``shape`` under ``spec`` (even sharding only)."""
    out = list(shape)
    for p, n in zip(spec, mesh_shape):
        if is_shard(p):
            d = p.dim % len(out)
            assert out[d] % n == 0, f"dim {d} of {shape} not divisible by {n}"
            out[d] //= n
    return tuple(out)



def to_dtensor_placements(spec: Spec):
    from torch.distributed.tensor import Partial as DPartial
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard

    from autopart._torch_private import strided_shard

    def one(p):
        if isinstance(p, Strided):  # blocks of unequal lengths: a plain split of the permuted tensor (``permuted``)
            return DShard(p.dim) if p.sizes else strided_shard(p.dim, p.blocks)
        return DShard(p.dim) if isinstance(p, Shard) else DPartial() if isinstance(p, Partial) else DReplicate()

    return tuple(one(p) for p in spec)


def permuted(spec: Spec) -> list[tuple[int, Strided]]:
    """(axis, placement) of each ``Strided`` of unequal blocks in ``spec``. DTensor has no such placement
    (``_StridedShard`` cuts equal blocks), so a parameter in one is stored as the plain split (``Shard``) of its
    blocks' pieces in rank order -- rank 0's piece of every block, then rank 1's, ... -- a tensor whose
    ``full_tensor()`` is that permutation of the parameter; ``ParallelModule`` saves, loads and gathers it in the
    parameter's own order (``runtime.optim_state.unpermute``)."""
    return [(i, p) for i, p in enumerate(spec) if isinstance(p, Strided) and p.sizes]
