"""The machine the plan is priced for: one device type, a logical mesh of ranks, and one link per mesh axis.

A ``Cluster`` is pure data. Collective costs (``autopart.cost.comm``) read ``cluster.link(axis)``; compute costs
(``autopart.cost.compute``) read ``cluster.device``; memory limits read ``cluster.memory_budget``.

Presets derive the link of every mesh axis from where the axis falls in the machine: axes are laid out
innermost-first (the last axis varies fastest over ranks), so an axis lies inside one node when its size times the
sizes of all axes to its right is at most the number of devices per node. Such an axis gets the intra-node link
(NVLink), any other the inter-node link (InfiniBand). This is why TP goes on the last axis and DP on the first
(REFERENCE.md, "Place the innermost groups ... on the fastest links").
"""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, asdict, dataclass, fields, replace
from typing import Any

GiB = 2**30
MiB = 2**20
_COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@dataclass(frozen=True)
class Link:
    """Alpha-beta model of one link: a message of S bytes takes ``alpha + S * beta`` seconds."""

    alpha: float  # seconds per message
    beta: float  # seconds per byte
    # measured (kind, alpha, beta) of single collectives (``autopart.calibrate``), in the ring parametrization of
    # ``autopart.cost.comm``; a collective not listed uses ``alpha`` and ``beta``
    per_collective: tuple[tuple[str, float, float], ...] = ()
    # the collective library also runs all-reduce as a tree over this link and picks the faster: NCCL's double binary
    # tree spans nodes, 2 log2(n) latency steps where the ring takes 2(n-1); inside a node its tree is a chain (as
    # many steps as the ring), and gloo's all-reduce is a ring
    tree: bool = False
    # a mesh axis spanning nodes with ``local`` of its ranks in each node (a data-parallel axis of 48 over 12 nodes
    # with tensor parallelism of 2 inside them: 4): its collectives run over ``local_link`` inside the node and this
    # link across, the bytes shrinking outward (``autopart.cost.comm``), as NCCL's rings and trees spread a group's
    # traffic over the node's NICs. 1: every rank of the axis in its own node (or the axis inside one node)
    local: int = 1
    local_link: Link | None = None
    # measured (kind, alpha, beta) of the same collectives called one right after another (``autopart.calibrate``
    # on CPUs, where ranks share cores: ``per_collective`` is timed after a burst of compute, and the ranks arrive
    # out of step; called back to back they run in lockstep, ~2x faster at 64 KiB on 4 ranks over 2 cores).
    # ZeRO-3's collectives, a single op's compute apart, pay these (``in_chain``; ``planner.transition_time``).
    # Empty: no difference (GPUs, presets)
    chained: tuple[tuple[str, float, float], ...] = ()
    # the collective library's low-latency protocol (NCCL's LL: 8-byte stores carrying their own flag, no
    # handshake per chunk), which it picks for small messages: a collective of ``steps`` ring steps moving B bus
    # bytes per rank takes ``ll_latency + steps * ll_hop + B / ll_bandwidth`` where the default protocol takes
    # ``steps * alpha + B * beta``, and the faster is priced (``autopart.cost.comm``). ``ll_bandwidth`` 0: none
    # (gloo; a collective measured by ``autopart.calibrate`` keeps its own fit)
    ll_latency: float = 0.0
    ll_hop: float = 0.0
    ll_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.local, int) and self.local >= 1):
            raise ValueError(f"Link local must be an integer >= 1 (ranks of the axis per node), got {self.local!r}")
        if isinstance(self.local_link, dict):
            object.__setattr__(self, "local_link", Link(**self.local_link))
        if (self.local > 1) != (self.local_link is not None):
            raise ValueError(f"Link: local={self.local} needs a local_link (the link inside a node) exactly when "
                             f"local > 1, got local_link={self.local_link}")
        if not self.alpha >= 0:
            raise ValueError(f"Link alpha must be >= 0 seconds, got {self.alpha}")
        if not self.beta > 0:
            raise ValueError(f"Link beta must be > 0 seconds per byte, got {self.beta}")
        if not (self.ll_latency >= 0 and self.ll_hop >= 0 and self.ll_bandwidth >= 0):
            raise ValueError(f"Link ll_latency, ll_hop (seconds) and ll_bandwidth (bytes/s, 0: no low-latency "
                             f"protocol) must be >= 0, got {self.ll_latency}, {self.ll_hop}, {self.ll_bandwidth}")
        for name in ("per_collective", "chained"):
            object.__setattr__(self, name, tuple((str(k), float(a), float(b)) for k, a, b in getattr(self, name)))
            for kind, a, b in getattr(self, name):
                if kind not in _COLLECTIVE_KINDS or not a >= 0 or not b > 0:
                    raise ValueError(f"Link {name} entry ({kind!r}, {a}, {b}): need a collective of "
                                     f"{_COLLECTIVE_KINDS}, alpha >= 0 and beta > 0")

    def for_collective(self, kind: str) -> Link:
        """The link as collective ``kind`` sees it: its measured alpha and beta if calibrated, else this one."""
        for k, a, b in self.per_collective:
            if k == kind:
                return Link(alpha=a, beta=b)
        return self

    def in_chain(self) -> Link:
        """The link as a collective issued right after another one sees it: its ``chained`` measurements where
        calibrated (they replace ``per_collective``), else this one."""
        return self._derived("_in_chain", lambda: replace(self, per_collective=self.chained, chained=())) \
            if self.chained else self

    def across(self) -> Link:
        """The link between nodes alone (``local`` dropped)."""
        return self._derived("_across", lambda: replace(self, local=1, local_link=None)) if self.local > 1 else self

    def without_latency(self) -> Link:
        """The same link with every alpha 0 (its measured collectives' and its node-local link's too) and no
        low-latency protocol: what a parameter's share of a bucketed collective pays, the bucket paying the latency
        once (a bucket is large: the default protocol's bandwidth)."""
        return self._derived("_without_latency", lambda: replace(
            self, alpha=0.0, ll_latency=0.0, ll_hop=0.0, ll_bandwidth=0.0,
            per_collective=tuple((k, 0.0, b) for k, _, b in self.per_collective),
            chained=tuple((k, 0.0, b) for k, _, b in self.chained),
            local_link=self.local_link.without_latency() if self.local_link else None))

    def default_protocol(self) -> Link:
        """The same link without its low-latency protocol (its node-local link's too): what a bucket of gradients or
        gathered parameters pays per collective, large enough that the library runs its default protocol, so that
        its latency is the default protocol's (``planner.bucket_bytes``, ``grad_reduction_share``)."""
        if self.ll_bandwidth <= 0 and (self.local_link is None or self.local_link.ll_bandwidth <= 0):
            return self
        return self._derived("_default_protocol", lambda: replace(
            self, ll_latency=0.0, ll_hop=0.0, ll_bandwidth=0.0,
            local_link=self.local_link.default_protocol() if self.local_link else None))

    def _derived(self, name: str, make) -> Link:
        # memoised on the (frozen) link: pricing asks for these ~25k times a 70B plan, and each ``replace`` runs
        # ``__post_init__``'s checks again
        out = self.__dict__.get(name)
        if out is None:
            out = make()
            object.__setattr__(self, name, out)
        return out

    @property
    def bandwidth(self) -> float:
        """Bytes per second (1 / beta)."""
        return 1.0 / self.beta

    def low_latency(self, steps: int, bus_bytes: float) -> float:
        """Seconds of a collective of ``steps`` ring steps moving ``bus_bytes`` per rank under the low-latency
        protocol; infinite where the link has none."""
        if self.ll_bandwidth <= 0:
            return math.inf
        return self.ll_latency + steps * self.ll_hop + bus_bytes / self.ll_bandwidth

    def __str__(self) -> str:
        s = f"{self.alpha * 1e6:.3g}us@{self.bandwidth / 1e9:.3g}GB/s"
        return s if self.local == 1 else f"{s} ({self.local} per node over {self.local_link})"


@dataclass(frozen=True)
class Device:
    """One accelerator (or one CPU rank). ``mfu`` is the fraction of ``peak_flops`` large matmuls achieve."""

    name: str
    peak_flops: float  # dense FLOP/s for the training dtype (bf16 on GPUs, fp32 on cpu)
    mem_bandwidth: float  # bytes/s
    memory_bytes: int
    host_bandwidth: float  # bytes/s device<->host
    mfu: float = 1.0
    # dense FLOP/s of float32 matmuls and attention where they run slower than ``peak_flops`` (a GPU's bf16 tensor
    # cores): PyTorch runs fp32 matmuls without TF32 by default (``torch.backends.cuda.matmul.allow_tf32`` False),
    # on the CUDA cores (the GPU presets: the datasheets' FP32 figure); a user who enables TF32 gives the TF32
    # figure here. ``autopart.cost.compute.dtype_peak_flops`` picks the rate of each op's dtype, ``mfu`` applying to
    # it as to ``peak_flops``. 0: ``peak_flops`` (cpu, whose ``peak_flops`` is fp32's; calibrated devices)
    fp32_flops: float = 0.0
    # dense FLOP/s of float32 convolutions: cuDNN runs them in TF32 by default (``torch.backends.cudnn.allow_tf32``
    # True) on the tensor cores (the GPU presets: the datasheets' dense TF32 figure). 0: ``fp32_flops``
    tf32_flops: float = 0.0
    # bytes/s of host memory one rank's optimizer step moves when the optimizer is offloaded (the node's DRAM
    # bandwidth shared by its ranks: the step reads and writes the states and the host copy, a memory-bound pass;
    # ``planner.optimizer_offload_seconds``). 0: the host step is not priced (cpu: the host is the device)
    host_step_bandwidth: float = 0.0
    # bytes/s the optimizer step on the device reaches over what it reads and writes (each element's weight and
    # states read and written, its gradient read: ``planner.optimizer_step_seconds``). 0: ``mem_bandwidth`` (every
    # preset: a fused or multi-tensor Adam is a memory-bound pass on a GPU); ``autopart.calibrate`` measures the
    # user's optimizer class's kernel (AdamW, foreach): on a CPU its arithmetic, not the DRAM, bounds it
    optimizer_bandwidth: float = 0.0
    # seconds the device's optimizer step spends per parameter (per tensor it steps) beyond its bytes: a foreach
    # kernel's per-tensor work and, on DTensor parameters, their dispatch. Measured by ``autopart.calibrate``; 0 on
    # the presets
    optimizer_param_latency: float = 0.0
    # seconds each GEMM kernel takes beyond its FLOPs at ``peak_flops * mfu`` (its launch, prologue and epilogue, the
    # last partial wave of tiles), which a small GEMM cannot amortise: a GEMM of F FLOPs then runs at
    # F / (F / achievable_flops + gemm_latency) (``autopart.cost.compute.roofline_time``). 0: every GEMM at
    # ``achievable_flops`` whatever its size (every preset; benchmarks/clusters/h100-xla-gemms.toml fits both terms
    # to XLA's measured H100 GEMMs)
    gemm_latency: float = 0.0
    # per-kernel FLOPs below which ``gemm_latency`` is not extrapolated: a smaller GEMM runs at the rate the form
    # gives a GEMM of this size (its time ``F * (1 / achievable_flops + gemm_latency / gemm_min_flops)``), not at a
    # rate falling to 0 with F. ``autopart.calibrate`` sets it to the smallest GEMM it measured; 0: no floor
    gemm_min_flops: float = 0.0
    # measured by ``autopart.calibrate`` (0: not measured, use the two rates above): FLOP/s of fused attention,
    # forward and backward counted as ``autopart.cost.compute`` counts them (the GPU presets: a published kernel's,
    # see ``preset``), and bytes/s of elementwise ops with transcendental math (gelu, exp, softmax, ...), which are
    # compute-bound on CPUs
    attention_flops: float = 0.0
    math_bandwidth: float = 0.0
    # bytes/s of variants of those ops whose math runs at another rate, as ((key, rate), ...) with keys from
    # ``autopart.cost.compute.math_variant`` (``"gelu:tanh"``: GPT-2's gelu, ~2.5x slower than erf's on a CPU),
    # measured by ``autopart.calibrate``; a variant not listed runs at ``math_bandwidth``
    math_variants: tuple[tuple[str, float], ...] = ()
    # seconds of framework time per graph op, forward and backward (dispatch, autograd, the runtime's Python;
    # kernel launches on a GPU), measured by ``autopart.calibrate`` on a model too small for its arithmetic to count
    op_latency: float = 0.0
    # seconds of the runtime's work per parameter per step (its DTensor wrapped as a local tensor and back, the
    # gradient hook and accumulation), measured with ``op_latency`` by ``autopart.calibrate``
    param_latency: float = 0.0
    # seconds per ZeRO-3 parameter per step the runtime spends beyond what its collectives cost on the calibrated
    # links (the gathers for forward and backward and the gradient's reduce-scatter, each wrapped in DTensor and
    # autograd work), measured by ``autopart.calibrate``
    zero3_latency: float = 0.0
    # where ranks share a host's cores (gloo ranks on a CPU host: more ranks than cores), a rank computes faster
    # while others of its host idle (a pipeline's fill and drain): ``host_ranks`` ranks on one host, and
    # ``alone_speedup`` a rank's speed alone over its speed with all of them busy (measured by ``autopart.calibrate``;
    # 1 where a rank owns its device). ``solver.pipeline`` prices each schedule slot by the ranks busy in it
    host_ranks: int = 1
    alone_speedup: float = 1.0
    # collectives run on their own stream concurrently with compute (NCCL on GPUs: copy engines and a few SMs), so
    # the runtime's asynchronous gradient buckets hide behind the backward still to run. False where communication
    # competes with compute for the same cores (gloo on CPU ranks): every collective then adds to the step
    comm_overlap: bool = False

    def __post_init__(self) -> None:
        for field in ("peak_flops", "mem_bandwidth", "memory_bytes", "host_bandwidth"):
            if not getattr(self, field) > 0:
                raise ValueError(f"Device {self.name!r}: {field} must be > 0, got {getattr(self, field)}")
        for field in ("fp32_flops", "tf32_flops", "gemm_latency", "gemm_min_flops", "attention_flops",
                      "math_bandwidth", "op_latency", "param_latency", "zero3_latency", "host_step_bandwidth",
                      "optimizer_bandwidth", "optimizer_param_latency"):
            if not getattr(self, field) >= 0:
                raise ValueError(f"Device {self.name!r}: {field} must be >= 0 (0: not measured), got "
                                 f"{getattr(self, field)}")
        object.__setattr__(self, "math_variants", tuple((str(k), float(v)) for k, v in self.math_variants))  # JSON
        if not all(v > 0 for _, v in self.math_variants):
            raise ValueError(f"Device {self.name!r}: math_variants rates must be > 0, got {self.math_variants}")
        if not (isinstance(self.host_ranks, int) and self.host_ranks >= 1):
            raise ValueError(f"Device {self.name!r}: host_ranks must be an integer >= 1, got {self.host_ranks!r}")
        if not self.alone_speedup >= 1:
            raise ValueError(f"Device {self.name!r}: alone_speedup must be >= 1 (1: a rank owns its device), got "
                             f"{self.alone_speedup}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"Device {self.name!r}: mfu must be in (0, 1], got {self.mfu}")

    @property
    def achievable_flops(self) -> float:
        """FLOP/s large matmuls reach: ``peak_flops * mfu``."""
        return self.peak_flops * self.mfu

    def __str__(self) -> str:
        return (
            f"{self.name}({self.peak_flops / 1e12:.3g}TFLOP/s x{self.mfu:g}, "
            f"{self.mem_bandwidth / 1e12:.3g}TB/s, {self.memory_bytes / GiB:.3g}GiB)"
        )


@dataclass(frozen=True)
class Cluster:
    """A mesh of identical devices with one ``Link`` per mesh axis (``links[i]`` serves axis ``i``)."""

    name: str
    device: Device
    mesh_shape: tuple[int, ...]
    links: tuple[Link, ...]  # one per mesh axis
    reserve_bytes: int  # device memory the plan may not use: CUDA context, NCCL buffers, fragmentation

    def __post_init__(self) -> None:
        object.__setattr__(self, "mesh_shape", tuple(int(x) for x in self.mesh_shape))
        object.__setattr__(self, "links", tuple(self.links))
        if not self.mesh_shape:
            raise ValueError(f"Cluster {self.name!r}: mesh_shape must have at least one axis, got ()")
        if any(size < 1 for size in self.mesh_shape):
            raise ValueError(f"Cluster {self.name!r}: mesh axis sizes must be >= 1, got mesh_shape {self.mesh_shape}")
        if len(self.links) != len(self.mesh_shape):
            raise ValueError(
                f"Cluster {self.name!r}: need one link per mesh axis, got {len(self.links)} links "
                f"for mesh_shape {self.mesh_shape} ({len(self.mesh_shape)} axes)"
            )
        if not 0 <= self.reserve_bytes < self.device.memory_bytes:
            raise ValueError(
                f"Cluster {self.name!r}: reserve_bytes ({self.reserve_bytes}) must be >= 0 and below the "
                f"device memory ({self.device.memory_bytes})"
            )

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def memory_budget(self) -> int:
        """Bytes per device a plan may fill: device memory minus ``reserve_bytes``."""
        return self.device.memory_bytes - self.reserve_bytes

    def link(self, axis: int) -> Link:
        if not -len(self.mesh_shape) <= axis < len(self.mesh_shape):
            raise ValueError(f"Cluster {self.name!r}: axis {axis} out of range for mesh_shape {self.mesh_shape}")
        return self.links[axis]

    def with_mesh(self, mesh_shape: tuple[int, ...]) -> Cluster:
        """The same machine viewed as another mesh.

        For a preset name the links are re-derived by the preset's placement rule (device and reserve kept);
        otherwise a cluster whose axes all share one link keeps that link on every new axis.
        """
        mesh_shape = tuple(mesh_shape)
        if self.name == CALIBRATED:
            from autopart.calibrate import load_calibration

            return load_calibration(mesh_shape)
        if self.name in PRESETS:
            return replace(self, mesh_shape=mesh_shape, links=PRESETS[self.name].links_for(mesh_shape))
        if len(set(self.links)) == 1:
            return replace(self, mesh_shape=mesh_shape, links=(self.links[0],) * len(mesh_shape))
        raise ValueError(
            f"Cluster {self.name!r} is not a preset and its axes have different links {[str(x) for x in self.links]}: "
            f"cannot tell which link a new axis of mesh_shape {mesh_shape} gets; build the Cluster directly"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device": asdict(self.device),
            "mesh_shape": list(self.mesh_shape),
            "links": [asdict(x) for x in self.links],
            "reserve_bytes": self.reserve_bytes,
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> Cluster:
        return Cluster(
            name=data["name"],
            device=Device(**data["device"]),
            mesh_shape=tuple(data["mesh_shape"]),
            links=tuple(Link(**x) for x in data["links"]),
            reserve_bytes=int(data["reserve_bytes"]),
        )

    def __str__(self) -> str:
        mesh = "x".join(str(x) for x in self.mesh_shape)
        links = ", ".join(str(x) for x in self.links)
        return f"{self.name}[{mesh}] {self.device} links [{links}]"


@dataclass(frozen=True)
class Preset:
    """How to build a ``Cluster`` of any mesh shape for one machine type.

    ``devices_per_node`` None means every rank is on one host (all axes get ``intra_node``).
    """

    device: Device
    intra_node: Link
    inter_node: Link
    devices_per_node: int | None
    reserve_bytes: int

    def links_for(self, mesh_shape: tuple[int, ...]) -> tuple[Link, ...]:
        """Innermost-first rule: axis i is intra-node iff prod(mesh_shape[i:]) <= devices_per_node. An axis that
        spans nodes with g > 1 of its ranks in each (the axes to its right fill less than a node, g = devices per
        node / their product) gets the inter-node link with ``local = g`` over the intra-node link: a 1-D mesh of
        64 GPUs in 8-GPU nodes, or the data-parallel axis of (48, 2) beside tensor parallelism of 2."""
        dpn = self.devices_per_node
        if dpn is None:
            return (self.intra_node,) * len(mesh_shape)
        links = []
        for i, n in enumerate(mesh_shape):
            inner = math.prod(mesh_shape[i + 1:])
            if inner * n <= dpn:
                links.append(self.intra_node)
            elif inner < dpn and dpn % inner == 0 and n % (dpn // inner) == 0:
                links.append(replace(self.inter_node, local=dpn // inner, local_link=self.intra_node))
            else:
                links.append(self.inter_node)
        return tuple(links)


_CPU = Preset(
    device=Device("cpu", peak_flops=50e9, mem_bandwidth=10e9, memory_bytes=4 * GiB, host_bandwidth=10e9, mfu=1.0),
    intra_node=Link(alpha=50e-6, beta=1 / 1.5e9),
    inter_node=Link(alpha=50e-6, beta=1 / 1.5e9),
    devices_per_node=None,
    reserve_bytes=512 * MiB,
)


def _nccl_ll(bandwidth: float, across: bool = False) -> dict:
    """NCCL's low-latency protocol (LL) on a GPU preset's link, from NCCL's tuning model (``src/graph/tuning.cc``,
    v2.19-2.27): a ring collective under LL costs a base of 6.6 µs plus 0.6 µs per step over NVLink, 2.7 µs per
    step over the network, at a bus bandwidth of half the link's, capped at 141 GB/s on Hopper inside a node (87.7
    on Ampere) and at 20.4 GB/s across more than two nodes (``llMaxBws``)."""
    return {"ll_latency": 6.6e-6, "ll_hop": 2.7e-6 if across else 0.6e-6, "ll_bandwidth": bandwidth}


_A100 = Preset(
    device=Device(
        "a100-80gb", peak_flops=312e12, mem_bandwidth=2.039e12, memory_bytes=81920 * MiB, host_bandwidth=25e9, mfu=0.7,
        fp32_flops=19.5e12, tf32_flops=156e12, host_step_bandwidth=0.75 * 409.6e9 / 8, comm_overlap=True,
    ),
    intra_node=Link(alpha=5e-6, beta=1 / 300e9, **_nccl_ll(87.7e9)),
    inter_node=Link(alpha=10e-6, beta=1 / 25e9, tree=True, **_nccl_ll(0.5 * 25e9, across=True)),
    devices_per_node=8,
    reserve_bytes=4 * GiB,
)


def fused_attention_rate(forward_flops: float, backward_flops: float) -> float:
    """FLOP/s of one fused attention call, forward and backward, from a kernel's published forward and backward
    rates: ``autopart.cost.compute`` counts the backward as 2.5 x the forward's FLOPs (as the FlashAttention papers'
    benchmarks do), so the pair takes F / forward + 2.5 F / backward seconds for 3.5 F FLOPs."""
    return 3.5 / (1.0 / forward_flops + 2.5 / backward_flops)


_H100 = Preset(
    device=Device(
        "h100-80gb", peak_flops=989e12, mem_bandwidth=3.35e12, memory_bytes=81559 * MiB, host_bandwidth=50e9, mfu=0.65,
        fp32_flops=67e12, tf32_flops=494.7e12, attention_flops=fused_attention_rate(518e12, 499e12),
        host_step_bandwidth=0.75 * 614.4e9 / 8, comm_overlap=True,
    ),
    intra_node=Link(alpha=5e-6, beta=1 / 450e9, **_nccl_ll(141e9)),
    inter_node=Link(alpha=10e-6, beta=1 / 50e9, tree=True, **_nccl_ll(20.4e9, across=True)),
    devices_per_node=8,
    reserve_bytes=4 * GiB,
)

_H200 = Preset(
    device=replace(_H100.device, name="h200-141gb", mem_bandwidth=4.8e12, memory_bytes=143771 * MiB),
    intra_node=_H100.intra_node,
    inter_node=_H100.inter_node,
    devices_per_node=8,
    reserve_bytes=4 * GiB,
)

CALIBRATED = "calibrated"  # the name of clusters measured by ``autopart.calibrate`` (not a preset)
PRESETS: dict[str, Preset] = {"cpu": _CPU, "a100-80gb": _A100, "h100-80gb": _H100, "h200-141gb": _H200}
_BUILTIN = frozenset(PRESETS)


# unit prefixes of the cluster file's sizes, rates and FLOP/s: case-sensitive ("m" would be milli), binary ones
# for bytes only ("GiB"; "Gib" reads as a typo of either)
_PREFIXES = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_BYTE_UNITS = ("B", "byte", "bytes")
_BIT_UNITS = ("b", "bit", "bits")
_FLOP_UNITS = ("", "FLOP", "FLOPS", "FLOPs", "flop", "flops")
_PRESET_KEYS = {"name", "base", "devices_per_node", "reserve_bytes", "device", "intra_node", "inter_node"}
_DEVICE_KEYS = {"name", "peak_flops", "fp32_flops", "tf32_flops", "mem_bandwidth", "memory_bytes", "host_bandwidth",
                "mfu", "gemm_latency", "gemm_min_flops", "attention_flops", "host_step_bandwidth",
                "optimizer_bandwidth", "optimizer_param_latency", "math_bandwidth", "op_latency", "param_latency",
                "zero3_latency", "host_ranks", "alone_speedup", "comm_overlap"}
_LINK_KEYS = {"alpha", "beta", "bandwidth", "tree", "ll_latency", "ll_hop", "ll_bandwidth"}


def _size(value: Any, where: str, kind: str = "bytes") -> float:
    """A number, or a string of a number and its unit, read as ``kind``: ``"bytes"`` (a size: ``"80GiB"``,
    ``"80GB"``), ``"rate"`` (bytes/s: ``"450GB/s"``, ``"450GB"``, ``"50GBps"``, or bits/s, divided by 8:
    ``"400Gb/s"``, ``"400Gbps"``, ``"400Gbit"``) or ``"flops"`` (FLOP/s: ``"989T"``, ``"989TFLOP/s"``). Units are
    case-sensitive: ``B`` is a byte, ``b`` a bit, decimal prefixes k/K, M, G, T, P, binary Ki, Mi, Gi, Ti for bytes;
    any other unit (``"400gb"``, ``"80G"``, bits for a size) raises, naming ``where`` (the key) and the value."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(\S*?)\s*", value)
        unit = m.group(2) if m else ""
        per_s = unit.endswith(("/s", "bps", "Bps"))
        base = unit[:-2] if per_s else unit
        prefix = next((p for p in (*_BINARY, *_PREFIXES) if p and base.startswith(p)), "")
        rest = base[len(prefix):]
        scale = {**_PREFIXES, **_BINARY}[prefix]
        if kind == "flops":
            ok = prefix in _PREFIXES and rest in _FLOP_UNITS and (rest or not per_s)
        elif rest in _BIT_UNITS:
            ok, scale = kind == "rate" and prefix in _PREFIXES, scale / 8
        else:
            ok = (rest in _BYTE_UNITS or not unit) and (kind == "rate" or not per_s)
        if not m or not ok:
            examples = {"bytes": "'80GiB', '80GB' (bytes)", "flops": "'989T', '989TFLOP/s'",
                        "rate": "'450GB/s', '450GB', '50GBps' (bytes/s) or '400Gb/s', '400Gbps', '400Gbit' "
                                "(bits/s)"}[kind]
            raise ValueError(f"{where}: cannot read {value!r}: write a number or one with a unit such as {examples}; "
                             f"units are case-sensitive (B bytes, b bits), so an ambiguous unit such as 'gb' or 'G' "
                             f"is refused")
        return float(m.group(1)) * scale
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{where}: expected a number or a string such as '80GiB', got {value!r}")
    return float(value)


def load_preset(path: str) -> str:
    """Read a machine description from a JSON or TOML file, register it as a preset, and return its name.

    The file describes one node type the way the built-in presets do (all keys but ``name`` optional when
    ``base`` names a preset to start from). Sizes are numbers of bytes or strings such as ``"80GiB"``, ``"80GB"``;
    rates numbers of bytes/s or strings such as ``"450GB/s"`` (``"450GB"``) or, in bits, ``"400Gb/s"``,
    ``"400Gbps"``, ``"400Gbit"`` (an eighth as many bytes); FLOP/s numbers or strings such as ``"989T"``. Units are
    case-sensitive, ``B`` a byte and ``b`` a bit; one that is neither (``"400gb"``, ``"80G"``) is an error::

        name = "my-h100"               # what plans call the cluster
        base = "h100-80gb"             # optional: start from this preset, override what follows
        devices_per_node = 8           # omit (or 0) for one host holding every rank
        reserve_bytes = "4GiB"         # device memory a plan may not use
        [device]                       # peak_flops (dense FLOP/s of the training dtype), mem_bandwidth,
        peak_flops = 989e12            # memory_bytes, host_bandwidth (device<->host), mfu (fraction of
        memory_bytes = "80GiB"         # peak large matmuls reach), name, comm_overlap (collectives run
        comm_overlap = true            # concurrently with compute: NCCL on GPUs; false for gloo on CPUs),
        gemm_latency = 6.4e-6          # gemm_latency (seconds per GEMM kernel beyond its FLOPs at that rate;
        gemm_min_flops = 0             # below gemm_min_flops FLOPs a kernel runs at that size's rate),
        host_step_bandwidth = "48GB"   # host_step_bandwidth (host memory bytes/s per rank, offloaded steps)
        optimizer_bandwidth = "3TB"    # optimizer_bandwidth (bytes/s of the device's optimizer step; 0:
        fp32_flops = "67T"             # mem_bandwidth), fp32_flops (dense FLOP/s of fp32 matmuls: the CUDA
        tf32_flops = "494.7T"          # cores' unless TF32 is enabled; 0: peak_flops) and tf32_flops (of fp32
                                       # convolutions, TF32 in cuDNN by default; 0: fp32_flops)
        [intra_node]                   # the link inside a node: alpha (s per message) and
        alpha = 5e-6                   # bandwidth (bytes/s) or beta (s per byte); tree = true if the
        bandwidth = 450e9              # library also has a tree all-reduce (NCCL); ll_latency, ll_hop
        ll_latency = 6.6e-6            # (s) and ll_bandwidth (bytes/s, 0: none): its low-latency
        ll_hop = 0.6e-6                # protocol for small messages (NCCL's LL), priced beside the
        ll_bandwidth = "141GB"         # default one and the faster kept (autopart.cost.comm)
        [inter_node]                   # the link between nodes
        alpha = 10e-6
        bandwidth = "400Gb/s"          # one NDR NIC per GPU: 50 GB/s

    JSON takes the same keys as nested objects. After loading, ``preset(name, mesh_shape)``,
    ``autopart.plan(..., cluster=name)`` and ``Cluster.with_mesh`` work as for a built-in preset; passing the
    path itself wherever a preset name is accepted loads it.
    """
    import json
    import os

    if not os.path.isfile(path):
        raise ValueError(f"cluster file {path!r} does not exist; give a preset name {sorted(PRESETS)} or the path "
                         "of a JSON/TOML cluster description (see autopart.cost.cluster.load_preset)")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        if path.endswith(".toml"):
            import tomllib

            data = tomllib.loads(raw.decode())
        else:
            data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"cluster file {path!r} is not valid {'TOML' if path.endswith('.toml') else 'JSON'}: "
                         f"{e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"cluster file {path!r}: expected a table of keys {sorted(_PRESET_KEYS)}")
    bad = set(data) - _PRESET_KEYS
    if bad:
        raise ValueError(f"cluster file {path!r}: unknown keys {sorted(bad)}; allowed: {sorted(_PRESET_KEYS)}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"cluster file {path!r}: give the cluster a name (name = \"my-cluster\")")
    base = data.get("base")
    if base is not None and base not in PRESETS:
        raise ValueError(f"cluster file {path!r}: base {base!r} is not a preset; presets are {sorted(PRESETS)}")
    start = PRESETS[base] if base is not None else None
    for section in ("device", "intra_node", "inter_node"):
        if start is None and section not in data:
            raise ValueError(f"cluster file {path!r}: missing [{section}] (or name a preset to start from with "
                             f"base = \"h100-80gb\")")
        if not isinstance(data.get(section, {}), dict):
            raise ValueError(f"cluster file {path!r}: [{section}] must be a table")
    dev_in = dict(data.get("device", {}))
    bad = set(dev_in) - _DEVICE_KEYS
    if bad:
        raise ValueError(f"cluster file {path!r}: unknown [device] keys {sorted(bad)}; allowed: "
                         f"{sorted(_DEVICE_KEYS)}")
    # without a base, Device's own defaults for what the file leaves out
    dev = asdict(start.device) if start is not None else {f.name: f.default for f in fields(Device)
                                                              if f.default is not MISSING}
    dev["name"] = name
    dev.update(dev_in)
    missing = _DEVICE_KEYS - set(dev)
    if missing:
        raise ValueError(f"cluster file {path!r}: [device] needs {sorted(missing)}")
    for k in ("peak_flops", "fp32_flops", "tf32_flops", "attention_flops", "mem_bandwidth", "memory_bytes",
              "host_bandwidth", "math_bandwidth", "host_step_bandwidth", "optimizer_bandwidth"):
        kind = "flops" if k.endswith("_flops") else "bytes" if k == "memory_bytes" else "rate"
        dev[k] = _size(dev[k], f"cluster file {path!r} [device] {k}", kind)
    dev["memory_bytes"] = int(dev["memory_bytes"])
    if not isinstance(dev["comm_overlap"], bool):
        raise ValueError(f"cluster file {path!r}: [device] comm_overlap must be true or false, got "
                         f"{dev['comm_overlap']!r}")
    device = Device(**dev)

    def link(section: str) -> Link:
        given = data.get(section, {})
        bad = set(given) - _LINK_KEYS
        if bad:
            raise ValueError(f"cluster file {path!r}: unknown [{section}] keys {sorted(bad)}; allowed: "
                             f"alpha and bandwidth (bytes/s) or beta (s/byte), tree, ll_latency, ll_hop, "
                             f"ll_bandwidth")
        if "bandwidth" in given and "beta" in given:
            raise ValueError(f"cluster file {path!r}: [{section}] gives both bandwidth and beta; give one")
        old = getattr(start, section) if start is not None else None
        alpha = given.get("alpha", old.alpha if old else None)
        if "bandwidth" in given:
            beta = 1.0 / _size(given["bandwidth"], f"cluster file {path!r} [{section}] bandwidth", "rate")
        else:
            beta = given.get("beta", old.beta if old else None)
        if alpha is None or beta is None:
            raise ValueError(f"cluster file {path!r}: [{section}] needs alpha and bandwidth (or beta)")
        tree = given.get("tree", old.tree if old else False)
        if not isinstance(tree, bool):
            raise ValueError(f"cluster file {path!r}: [{section}] tree must be true or false, got {tree!r}")
        ll = {}
        for k in ("ll_latency", "ll_hop", "ll_bandwidth"):
            v = given.get(k, getattr(old, k) if old else 0.0)
            ll[k] = _size(v, f"cluster file {path!r} [{section}] {k}", "rate") if k == "ll_bandwidth" else v
            if not isinstance(ll[k], (int, float)) or isinstance(ll[k], bool) or ll[k] < 0:
                raise ValueError(f"cluster file {path!r}: [{section}] {k} must be a number >= 0, got {v!r}")
        return Link(alpha=float(alpha), beta=float(beta), tree=tree, **{k: float(v) for k, v in ll.items()})

    per_node = data.get("devices_per_node", start.devices_per_node if start is not None else None)
    if per_node is not None and (not isinstance(per_node, int) or per_node < 0):
        raise ValueError(f"cluster file {path!r}: devices_per_node must be a whole number >= 1 (or 0 / absent for "
                         f"one host), got {per_node!r}")
    reserve = data.get("reserve_bytes", start.reserve_bytes if start is not None else 0)
    reserve = int(_size(reserve, f"cluster file {path!r} reserve_bytes"))
    if not 0 <= reserve < device.memory_bytes:
        raise ValueError(f"cluster file {path!r}: reserve_bytes ({reserve}) must be >= 0 and below the device memory "
                         f"({device.memory_bytes})")
    spec = Preset(device=device, intra_node=link("intra_node"), inter_node=link("inter_node"),
                  devices_per_node=per_node or None, reserve_bytes=reserve)
    if name in _BUILTIN and PRESETS.get(name) != spec:
        raise ValueError(f"cluster file {path!r}: name {name!r} is a built-in preset; choose another name")
    PRESETS[name] = spec
    return name


def preset(name: str, mesh_shape: tuple[int, ...]) -> Cluster:
    """A ``Cluster`` for a named machine type laid out as ``mesh_shape``.

    Axes are assigned innermost-first (the last axis innermost); axis i lies inside a node, and gets NVLink, iff
    ``prod(mesh_shape[i:]) <= 8``; otherwise it gets InfiniBand. Numbers and their sources:

    - cpu: gloo over loopback TCP on a 2-core box, one rank per core. α = 50 µs and 1.5 GB/s are typical gloo
      small/large all-reduce timings over loopback (measured-ish); 50 GFLOP/s is an achieved large fp32 matmul per
      core with AVX2 (hence mfu 1.0); 10 GB/s is one core's share of DRAM bandwidth; the box's 24 GiB are shared,
      4 GiB per rank assumed, 512 MiB of it reserved for the interpreter and gloo.
    - a100-80gb: DGX/HGX A100 80GB SXM4. A100 datasheet: 312 TFLOP/s dense bf16, 2,039 GB/s HBM2e, 80 GiB
      (nvidia-smi 81920 MiB), PCIe Gen4 x16 (~25 GB/s achieved). NVLink 3: 600 GB/s bidirectional = 300 GB/s per
      direction, taken as bus bandwidth (nccl-tests doc/PERFORMANCE.md), α 5 µs. InfiniBand: 8 HDR 200 Gb/s NICs
      per node, one per GPU = 25 GB/s per GPU, α 10 µs. mfu 0.7: cuBLAS bf16 GEMMs reach ~220-250 TFLOP/s, and
      Megatron reaches ~50-56% MFU end to end (K22). Fused attention keeps the matmul rate (``attention_flops``
      0): FlashAttention-2, what Transformer Engine runs on Ampere, reaches "50-73% of the theoretical maximum" there
      (FlashAttention-2 paper, Dao 2023, arXiv:2307.08691), which brackets 0.7, and its per-configuration bars were
      not found in text form. fp32: 19.5 TFLOP/s on the CUDA cores (``fp32_flops``: PyTorch's matmuls do not use
      TF32 unless ``torch.backends.cuda.matmul.allow_tf32`` is set), 156 TFLOP/s dense TF32 on the tensor cores
      (312 is with sparsity; ``tf32_flops``: cuDNN's convolutions, TF32 by default), both from the A100 datasheet.
    - h100-80gb: DGX/HGX H100 80GB SXM5. H100 datasheet: 989 TFLOP/s dense bf16 (1,979 is with sparsity),
      3.35 TB/s HBM3, 80 GB (nvidia-smi 81559 MiB), PCIe Gen5 x16 (~50 GB/s achieved). NVLink 4: 900 GB/s
      bidirectional = 450 GB/s per direction, α 5 µs. InfiniBand: 8 NDR 400 Gb/s NICs per node = 50 GB/s per GPU,
      α 10 µs. mfu 0.65: large bf16 GEMMs reach ~600-700 TFLOP/s; Megatron-Core measures 41-49% MFU end to end
      (REFERENCE.md). Fused attention (``attention_flops``) runs slower than those GEMMs: 504 TFLOP/s forward and
      backward, from cuDNN's flash attention (bf16, head dim 128, sequence 4096), 518 TFLOP/s forward with a causal
      mask and 499 TFLOP/s backward (FlashAttention-3 paper, Shah et al. 2024, arXiv:2407.08608, its H100 bf16 bar
      charts "forward, with causal mask, head dim 128" and "backward, head dim 128", which has no causal case),
      combined by ``fused_attention_rate``. cuDNN's because Megatron-Core r0.8
      runs attention through Transformer Engine, whose backend selection turns FlashAttention off on Hopper when
      cuDNN's fused attention (``F16_arbitrary_seqlen``) can run ("give FusedAttention preference on Hopper+ for
      performance reasons", ``get_attention_backend``). The same paper's FlashAttention-2 bars (causal forward 319,
      backward 310 TFLOP/s at 4096) give 312; FlashAttention-3 (579 and 542) 552. The papers count FLOPs as
      ``autopart.cost.compute`` does: 4·s²·d per head forward, halved under a causal mask, 2.5x that backward.
      At 16K tokens cuDNN reaches 539 and 516 TFLOP/s (522 combined): the 4096 figure is kept for every length, a
      few percent slow beyond it. fp32: 67 TFLOP/s on the CUDA cores (``fp32_flops``: PyTorch's matmuls do not
      use TF32 unless ``torch.backends.cuda.matmul.allow_tf32`` is set; a cluster file that assumes TF32 sets
      ``fp32_flops = 494.7e12``), 494.7 TFLOP/s dense TF32 (989 is with sparsity; ``tf32_flops``: cuDNN's
      convolutions, TF32 by default), H100 SXM datasheet. fp32 GEMMs and attention keep ``mfu``, and fused
      attention in fp32 runs at ``attention_flops`` scaled by 67/989 (``autopart.cost.compute.dtype_peak_flops``).
    - h200-141gb: HGX H200: the H100 compute and network with 141 GB HBM3e (nvidia-smi 143771 MiB) at 4.8 TB/s
      (H200 datasheet); fused attention and fp32 at the H100's rates (compute-bound: the faster memory does not
      change them; the H200 datasheet gives the same 67 TFLOP/s FP32 and 989 TF32 with sparsity).

    GPU presets price an offloaded optimizer step on the host (``Device.host_step_bandwidth``) at 3/4 of the node's
    peak DRAM bandwidth shared by its 8 ranks (a memory-bound pass reaches about that; assumed, not measured here):
    DGX A100, 2 AMD EPYC 7742 of 8 DDR4-3200 channels, 409.6 GB/s; DGX H100 (and the H200 preset), 2 Xeon
    Platinum 8480C of 8 DDR5-4800 channels, 614.4 GB/s (the systems' and CPUs' datasheets).
    GPU presets reserve 4 GiB per device for the CUDA context, NCCL buffers and allocator fragmentation. Their
    collectives are NCCL's: all-reduce across nodes takes the lower latency of ring and tree (``Link.tree`` on the
    inter-node link; NCCL's tree is a chain inside a node), and communication
    overlaps compute (``Device.comm_overlap``: the gradient buckets reduce while backward runs). The cpu preset has
    neither: gloo rings, and gloo on 2 cores competes with the ranks' compute for the cores.
    ``name`` may also be the path of a ``.json``/``.toml`` file describing another machine (``load_preset``), or
    ``"calibrated"``: this machine as ``autopart.calibrate`` measured it for ``mesh_shape`` (``load_calibration``).
    """
    if name == CALIBRATED:  # measured on this machine by ``autopart.calibrate``, read from its cache
        from autopart.calibrate import load_calibration

        return load_calibration(tuple(mesh_shape))
    if name not in PRESETS and name.endswith((".json", ".toml")):
        name = load_preset(name)
    if name not in PRESETS:
        raise ValueError(f"unknown cluster preset {name!r}; presets are {sorted(PRESETS)}, or give the path of a "
                         ".json/.toml cluster file (autopart.cost.cluster.load_preset)")
    spec = PRESETS[name]
    mesh_shape = tuple(mesh_shape)
    return Cluster(
        name=name,
        device=spec.device,
        mesh_shape=mesh_shape,
        links=spec.links_for(mesh_shape),
        reserve_bytes=spec.reserve_bytes,
    )
