"""Measure this machine and describe it as a ``Cluster``: the numbers plans are priced with, from the real backend.

``calibrate()`` runs on every rank of an initialised process group (``torchrun``, or spawned ranks:
``calibrate_spawn`` / ``autopart calibrate --nproc 4``) and measures, all ranks at once, so that ranks sharing a
host share its cores and memory as they will in training:

* every collective (all-reduce, all-gather, reduce-scatter, all-to-all, send/recv) on every mesh axis, all the
  axis's groups at once, at a few message sizes S (the whole array, as ``autopart.cost.comm`` counts it); the time
  of one call at each size is the median of a few blocks of back-to-back calls (on a CPU, each after a burst of
  compute, less the burst: ``_measure_links``), the slowest rank's; a weighted least squares fit ``T(S) = a + b·S``
  (weights 1/T: every size counts by its relative error) gives the collective's latency a and cost per byte b,
  converted to the ring model's link α and β (all-reduce: a = 2(n-1)α,
  b = 2(n-1)/n·β; all-gather, reduce-scatter, all-to-all: a = (n-1)α, b = (n-1)/n·β; send/recv: a = α, b = β,
  ping-pong in every pair of the axis' ranks at once);
* the device: a GEMM's rate and per-GEMM latency (``gemm_form``: the fit of a linear layer's forward and backward,
  the three GEMMs of training on operands from memory, at a few shapes: ``_linear_rate``; priced from the
  smallest shape up), fused attention FLOP/s (``scaled_dot_product_attention``
  forward, causal, FLOPs counted as ``autopart.cost.compute`` counts them) and memory-bound bandwidth (a large
  elementwise add: 3 arrays' bytes moved), and the optimizer step's (AdamW, foreach: its bytes as
  ``planner.optimizer_step_seconds`` counts them; on a CPU its arithmetic bounds it, not the DRAM);
* the framework time the roofline does not see, per graph op and per parameter (``_runtime_overhead``: autopart's
  runtime stepping models too small to compute), and, where ranks share a host's cores, how much faster a rank
  computes while the others idle (``Device.alone_speedup``: a pipeline's fill and drain).

The result is a ``Cluster`` named ``"calibrated"`` (``Device.peak_flops`` the measured matmul rate with ``mfu`` 1,
``mem_bandwidth`` the measured one; each axis's ``Link`` carries the all-reduce's α and β and every collective's
own in ``Link.per_collective``), cached as JSON under ``$AUTOPART_CACHE`` (default ``~/.cache/autopart``), one file
per fingerprint: device model, device count, torch version, backend, world size and mesh shape.
``autopart.plan(..., cluster="calibrated")`` and ``load_calibration(mesh_shape)`` read it back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from autopart.cost.cluster import CALIBRATED, Cluster, Device, GiB, Link, MiB
from autopart.cost.comm import COLLECTIVES
from autopart.cost.compute import backward_flops, node_flops

VERSION = 7  # 2: the runtime's overhead per op and per parameter, core sharing; 3: tanh gelu's rate; 4: chained links;
# 5: the optimizer step's rate; 6: send/recv in every pair of ranks at once, the matmul rate of linear layers'
# forward and backward on cold operands; 7: the device and the runtime measured with one training process's groups
# (the links' own destroyed, the three models' shared)
# message sizes in bytes: latency-bound to bandwidth-bound on loopback TCP and NVLink alike
SIZES = (4 * 2**10, 64 * 2**10, 512 * 2**10, 2 * MiB, 8 * MiB)
QUICK_SIZES = (4 * 2**10, 256 * 2**10, 2 * MiB)
# (tokens, in, out) of the linear layers whose forward and backward give the matmul rate (``_linear_rate``): on a CPU
# the widths and per-rank token counts of the models a CPU host trains (256-2048 tokens, 256-1024 wide), on a GPU an
# LLM's (4096-8192 tokens, 4096-16384 wide); ``quick`` measures the first two. Their times give the rate and the
# per-GEMM latency of the size-dependent form ``roofline_time`` prices GEMMs with (``gemm_form``)
GEMMS = ((256, 256, 256), (256, 256, 1024), (256, 1024, 256), (1024, 512, 512), (1024, 1024, 1024), (2048, 256, 1024),
         (2048, 1024, 256))
GEMMS_CUDA = ((4096, 4096, 4096), (8192, 4096, 4096), (4096, 4096, 16384), (8192, 16384, 4096))
# (m, k, n) of the compute a collective follows where ranks share a CPU host's cores (``_measure_links``): a few
# milliseconds, as between two of tensor parallelism's collectives in a small model
_BURST = (512, 512, 512)
# ring parametrization: T = steps·(n-1)·α + steps·(n-1)/n·S·β (send/recv: T = α + S·β)
_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Least squares ``T = a + b·S`` weighted by 1/T (relative error), with ``a >= 0`` and ``b > 0``.

    Returns ``(a, b)``: seconds per call and seconds per byte. If the free fit gives a negative intercept the
    fit through the origin is returned; if the slope is not positive (noise on tiny messages), the slope through the
    largest message's time."""
    s, t = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    if s.shape != t.shape or len(s) < 2 or len(set(s.tolist())) < 2:
        raise ValueError(f"fit_alpha_beta needs times at >= 2 distinct sizes, got sizes {list(s)}, times {list(t)}")
    if not np.all(t > 0):
        raise ValueError(f"fit_alpha_beta: times must be > 0 seconds, got {list(t)}")
    w = 1.0 / t
    design = np.stack([np.ones_like(s), s], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    if a < 0:
        a, b = 0.0, float(np.sum(w * w * s * t) / np.sum(w * w * s * s))
    if b <= 0:
        i = int(np.argmax(s))
        a = float(max(0.0, min(a, t[i] * 0.5)))
        b = max((t[i] - a) / s[i], 1e-18)
    return float(a), float(b)


def link_params(kind: str, a: float, b: float, n: int) -> tuple[float, float]:
    """Fitted per-call latency ``a`` and per-byte cost ``b`` of collective ``kind`` over ``n`` ranks -> the ring
    model's link ``(alpha, beta)`` (``autopart.cost.comm``)."""
    if kind == "send_recv":
        return a, b
    if n < 2:
        raise ValueError(f"a {kind} over {n} rank measures no link")
    k = _STEPS[kind]
    return a / (k * (n - 1)), b * n / (k * (n - 1))


def fingerprint(backend: str, world_size: int, mesh_shape: Sequence[int]) -> dict[str, Any]:
    """What a calibration is valid for: device model and count, torch version, backend, world size, mesh."""
    if backend == "nccl" and torch.cuda.is_available():
        model, count = torch.cuda.get_device_name(), torch.cuda.device_count()
    else:
        model, count = _cpu_model(), os.cpu_count() or 1
    return {"device": model, "device_count": count, "torch": torch.__version__, "backend": backend,
            "world_size": int(world_size), "mesh_shape": [int(x) for x in mesh_shape]}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _key(fp: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def cache_dir(path: str | None = None) -> str:
    """``path``, else ``$AUTOPART_CACHE``, else ``~/.cache/autopart``."""
    return path or os.environ.get("AUTOPART_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "autopart")


def cache_path(fp: dict[str, Any], directory: str | None = None) -> str:
    return os.path.join(cache_dir(directory), f"calibration-{_key(fp)}.json")


def save_calibration(cluster: Cluster, fp: dict[str, Any], measurements: dict[str, Any],
                     directory: str | None = None) -> str:
    """Write ``cluster`` with its fingerprint and raw measurements as JSON; returns the path."""
    path = cache_path(fp, directory)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    doc = {"version": VERSION, "fingerprint": fp, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "cluster": cluster.to_json(), "measurements": measurements}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
    return path


def load_calibration(mesh_shape: Sequence[int] | None = None, *, backend: str | None = None,
                     directory: str | None = None, path: str | None = None) -> Cluster:
    """The calibrated ``Cluster`` of this machine for ``mesh_shape`` (default: the most recent calibration).

    Looks up the cache for this hardware (device model and count, torch version, ``backend``: default gloo
    without CUDA, NCCL with it), world size ``prod(mesh_shape)`` and the mesh itself. Without an exact match, a
    calibration of the same hardware and world size on another mesh serves if it measured an axis of every size
    ``mesh_shape`` needs (one host: a group's link depends on its size, not its name). ``path`` reads one file.
    Raises ``ValueError`` naming the command to run when nothing fits."""
    if path is not None:
        with open(path) as f:
            return Cluster.from_json(json.load(f)["cluster"])
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    directory = cache_dir(directory)
    docs = []
    if os.path.isdir(directory):
        for name in sorted(os.listdir(directory)):
            if name.startswith("calibration-") and name.endswith(".json"):
                try:
                    with open(os.path.join(directory, name)) as f:
                        docs.append(json.load(f))
                except (OSError, ValueError):
                    continue
    older = sorted({d.get("version", 0) for d in docs if d.get("version") != VERSION})
    docs = [d for d in docs if d.get("version") == VERSION]
    docs.sort(key=lambda d: d.get("created", ""), reverse=True)
    if mesh_shape is None:
        mine = [d for d in docs if _same_hardware(d["fingerprint"], fingerprint(backend, 1, ()))]
        if mine:
            return Cluster.from_json(mine[0]["cluster"])
    else:
        mesh_shape = tuple(int(x) for x in mesh_shape)
        want = fingerprint(backend, math.prod(mesh_shape), mesh_shape)
        for d in docs:
            if d["fingerprint"] == want:
                return Cluster.from_json(d["cluster"])
        for d in docs:
            fp = d["fingerprint"]
            if not _same_hardware(fp, want) or fp["world_size"] != want["world_size"]:
                continue
            c = Cluster.from_json(d["cluster"])
            by_size = {n: link for n, link in zip(c.mesh_shape, c.links) if n > 1}
            if all(n == 1 or n in by_size for n in mesh_shape):
                any_link = next(iter(by_size.values()), c.links[0])
                links = tuple(by_size.get(n, any_link) for n in mesh_shape)
                return Cluster(CALIBRATED, c.device, mesh_shape, links, c.reserve_bytes)
    where = f"mesh {tuple(mesh_shape)}" if mesh_shape is not None else "any mesh"
    nproc = math.prod(mesh_shape) if mesh_shape is not None else 4
    mesh_arg = f" --mesh {'x'.join(str(x) for x in mesh_shape)}" if mesh_shape is not None else ""
    # caches an earlier autopart measured differently (``VERSION``) are not used: say so, or the user who ran
    # ``autopart calibrate`` last week reads that there is none
    stale = (f" (it holds calibrations of an earlier format, version {', '.join(map(str, older))}, which this "
             f"autopart measures differently (version {VERSION}) and does not use)") if older else ""
    raise ValueError(f"no calibration of this machine ({backend}, {where}) in {directory}{stale}: run "
                     f"`autopart calibrate --nproc {nproc}{mesh_arg}` (or autopart.calibrate() under torchrun), "
                     f"or plan with a preset cluster")


def _same_hardware(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in ("device", "device_count", "torch", "backend"))


def _median_blocks(fn: Callable[[], Any], blocks: int, seconds: float, sync: Callable[[], None]) -> float:
    """Seconds per call: the median over ``blocks`` of (back-to-back calls after a barrier, for about ``seconds``)
    divided by the number of calls, which every rank takes the same (the slowest rank's probe decides).

    Blocks last ``seconds``, not a few calls: a process waking from a barrier is favoured by the OS scheduler for a
    moment, so a burst of a few milliseconds sees a whole core where a step sharing the host with other ranks sees
    its fair share (measured on a 2-core host, 2 ranks: 100 GFLOP/s in 2-call bursts, ~2x less sustained)."""
    return statistics.median(_paired_blocks([fn], blocks, seconds, sync)[0])


def _timed_loop(fn: Callable[[], Any], seconds: float, sync: Callable[[], None]) -> float:
    """Seconds per call of ``fn`` called back to back for about ``seconds`` (at least once)."""
    sync()
    t0, calls = time.perf_counter(), 0
    while calls == 0 or time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
    sync()
    return (time.perf_counter() - t0) / calls


def _busy_blocks(fn: Callable[[], Any], blocks: int, seconds: float, sync: Callable[[], None],
                 barrier: bool = True) -> float:
    """Seconds per call of a rank-local ``fn`` (no collective inside) with every rank busy throughout: the median
    over ``blocks`` of (calls back to back for ``seconds`` after a barrier). Unlike ``_median_blocks`` every rank
    stops at the same time, not after the same number of calls: where ranks share a host's cores, ranks that finish
    a fixed count first leave the rest the cores, and the rate measured is not the all-busy rate a step sees. Only
    for work without collectives: ranks may run different numbers of calls. ``barrier=False``: this rank alone
    (the others wait elsewhere)."""
    out = []
    for _ in range(blocks):
        if barrier:
            dist.barrier()
        out.append(_timed_loop(fn, seconds, sync))
    return statistics.median(out)


def _collective(kind: str, nbytes: int, group: Any, n: int, local: int, ranks: list[int], device: str,
                dtype: torch.dtype) -> Callable[[], Any]:
    """A closure running one ``kind`` of ``nbytes`` (the whole array) on ``group``."""
    numel = max(n, nbytes // dtype.itemsize // n * n)
    full = torch.ones(numel, dtype=dtype, device=device)
    part = torch.ones(numel // n, dtype=dtype, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if kind == "all_gather":  # the calls autopart's runtime makes (autopart.runtime.collectives)
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: all_gather(full, part, group=group)
    if kind == "reduce_scatter":
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: reduce_scatter(part, full, group=group)
    if kind == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    # send/recv: ping-pong within pairs of the axis' ranks (local 0-1, 2-3, ...), half a round trip per call, every
    # pair at once, as a pipeline's stages all exchange at once; an odd rank out waits. Where ranks share a host's
    # cores, one pair pinging while the others idle has the cores to itself and measures a latency no pipeline
    # sees (4 gloo ranks on 2 cores: 76 us a transfer so, against ~1 ms on the (2, 2) mesh, where both axes' pairs
    # ran at once; the pipelined tiny GPT paid ~2.8 ms a micro-batch beyond its prediction at the 76 us)
    mate = local ^ 1
    if mate >= n:
        return lambda: None
    peer = ranks[mate]
    buf = torch.ones(max(1, nbytes // dtype.itemsize), dtype=dtype, device=device)

    def pingpong() -> None:
        if local % 2 == 0:
            dist.send(buf, peer, group=group)
            dist.recv(buf, peer, group=group)
        else:
            dist.recv(buf, peer, group=group)
            dist.send(buf, peer, group=group)
    return pingpong


def _axis_groups(mesh_shape: tuple[int, ...], rank: int) -> list[tuple[Any, list[int]]]:
    """Per mesh axis: this rank's process group along it and the global ranks in it (every group created on every
    rank, in the same order, as ``new_group`` requires)."""
    grid = np.arange(math.prod(mesh_shape)).reshape(mesh_shape)
    mine = []
    for axis in range(len(mesh_shape)):
        moved = np.moveaxis(grid, axis, -1).reshape(-1, mesh_shape[axis])
        found = None
        for row in moved:
            ranks = [int(r) for r in row]
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                found = (g, ranks)
        mine.append(found)
    return mine


def _measure_links(mesh_shape: tuple[int, ...], sizes: Sequence[int], blocks: int, seconds: float, device: str,
                   dtype: torch.dtype, sync: Callable[[], None]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Seconds per call of every collective on every axis at each of ``sizes``, the slowest rank's: as a step
    pays it, and back to back.

    On a CPU the ranks share the host's cores, and a collective in a step follows compute: the OS scheduler has
    left the ranks at different points of their share of the cores, and the collective waits for the last one to
    arrive. Called back to back, the ranks run in lockstep and never pay that (4 gloo ranks on 2 cores: a 64 KiB
    all-reduce took 5 ms back to back, 6-14 ms after a 2-30 ms GEMM burst). There each call of a collective of
    the whole group is timed after a burst of compute, the same GEMM on every rank (``_BURST``), less the burst
    alone, in paired blocks with the back-to-back calls (what the calibration's tiny models, whose collectives
    follow no compute, are priced with: ``_runtime_overhead``). Send/recv is timed back to back only: a
    pipeline's receiver waits for its sender's compute, which the schedule prices (``solver.pipeline``), so its
    link is the transfer alone. Elsewhere (GPUs) both are the back-to-back time."""
    rank = dist.get_rank()
    groups = _axis_groups(mesh_shape, rank)
    burst = None
    if device == "cpu":
        a, b = (torch.randn(m, n, dtype=dtype) for m, n in (_BURST[:2], _BURST[1:]))
        burst = lambda: torch.mm(a, b)  # noqa: E731
    raw: dict[str, Any] = {}
    lockstep: dict[str, Any] = {}
    for axis, n in enumerate(mesh_shape):
        if n < 2:
            continue
        group, ranks = groups[axis]
        local = ranks.index(rank)
        for kind in COLLECTIVES:
            times, back_to_back = [], []
            for nbytes in sizes:
                fn = _collective(kind, nbytes, group, n, local, ranks, device, dtype)
                fn()  # warm-up: connection set-up, buffers
                if burst is None or kind == "send_recv":
                    t = t0 = _median_blocks(fn, blocks, seconds, sync)
                else:
                    alone, after, plain = _paired_blocks([burst, lambda fn=fn: (burst(), fn()), fn], blocks,
                                                         seconds, sync)
                    t = max(1e-7, statistics.median(y - x for x, y in zip(alone, after)))
                    t0 = statistics.median(plain)
                times.append(t / 2 if kind == "send_recv" else t)
                back_to_back.append(t0 / 2 if kind == "send_recv" else t0)
            raw[f"{axis}/{kind}"] = times
            lockstep[f"{axis}/{kind}"] = back_to_back
    out = _slowest(raw, len(sizes)), _slowest(lockstep, len(sizes))
    # gone before the rest is measured: each gloo group keeps a thread that wakes ~100 times a second, idle, and
    # where ranks share a host's cores those wake-ups keep its cores from sleeping. A step's process has its own
    # groups only, and its blocking collectives pay the wake-up of a sleeping core (4 ranks on 2 cores: ZeRO-3 on
    # 4 ranks, ~200 collectives a step, 1.40-1.46 s with its one group, 1.12-1.17 s with 8 idle groups beside)
    for found in groups:
        if found is not None and found[0] is not None:
            dist.destroy_process_group(found[0])
    return out


def _slowest(raw: dict[str, list[float]], n_sizes: int) -> dict[str, list[float]]:
    """Per key, the slowest rank's seconds at each size (every rank calls it)."""
    keys = sorted(raw)
    local_t = torch.tensor([raw[k] for k in keys], dtype=torch.float64).reshape(len(keys), n_sizes)
    slowest = local_t
    if keys:
        gathered = [torch.zeros_like(local_t) for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, local_t)  # object: gloo and NCCL alike, tiny
        stack = torch.stack(gathered)
        slowest = stack.max(dim=0).values  # send/recv: idle ranks report ~0, the measuring pair's time wins
    return {k: [float(x) for x in slowest[i]] for i, k in enumerate(keys)}


def _linear_rate(tokens: int, d_in: int, d_out: int, dtype: torch.dtype, device: str, blocks: int, seconds: float,
                 sync: Callable[[], None], alone: bool = False) -> dict[str, Any]:
    """FLOP/s of a linear layer's forward and backward under autograd, the three GEMMs a training step runs per
    linear in their layouts (output x W^T, grad input dy W, grad weight dy^T x: 6 tokens d_in d_out FLOPs, as
    ``cost.compute`` counts a linear with its backward), each call on the next of enough copies of its operands that
    they come from memory, not the cache, as a model's layer finds its weights and activations. An isolated GEMM
    repeated on hot operands overstates this: on this repository's 2-core CPU host (one rank), 175-191 GFLOP/s for
    the hot ``torch.mm`` of 512-2048 square-ish shapes, 127 GFLOP/s for the fidelity GPT's linears at 256 tokens and
    144 at 1024 (measured in the model, forward and backward), 119-137 and 137-151 by this measurement.
    ``alone``: timed on this rank without barriers (the others wait), for ``Device.alone_speedup``."""
    per_set = (tokens * d_in + d_out * d_in + tokens * d_out) * dtype.itemsize
    copies = 2 if device == "cuda" else min(16, max(2, math.ceil(32 * MiB / per_set)))
    xs = [torch.randn(tokens, d_in, dtype=dtype, device=device, requires_grad=True) for _ in range(copies)]
    ws = [torch.randn(d_out, d_in, dtype=dtype, device=device, requires_grad=True) for _ in range(copies)]
    gys = [torch.randn(tokens, d_out, dtype=dtype, device=device) for _ in range(copies)]
    turn = [0]

    def step() -> None:
        j = turn[0] = (turn[0] + 1) % copies
        torch.autograd.grad(torch.nn.functional.linear(xs[j], ws[j]), (xs[j], ws[j]), gys[j])

    step()
    t = _busy_blocks(step, blocks, seconds, sync, barrier=not alone)
    return {"tokens": tokens, "in": d_in, "out": d_out, "seconds": t, "flops": 6 * tokens * d_in * d_out / t}


def _measure_device(device: str, dtype: torch.dtype, sync: Callable[[], None], quick: bool) -> dict[str, Any]:
    """Per-rank achieved rates with every rank computing at once. Returns FLOP/s and bytes/s."""
    blocks, seconds = (3, 0.1) if quick else (5, 0.25)
    shapes = GEMMS_CUDA if device == "cuda" else GEMMS
    gemms = [_linear_rate(t, i, o, dtype, device, blocks, seconds, sync) for t, i, o in (
        shapes[:2] if quick else shapes)]
    # the same on rank 0 alone, the others waiting in a barrier: where ranks share cores (more ranks than cores),
    # what a rank computes while others idle (a pipeline's fill and drain: ``Device.alone_speedup``)
    dist.barrier()
    alone = 0.0
    if dist.get_rank() == 0:
        alone = _linear_rate(*shapes[0], dtype, device, blocks, seconds, sync, alone=True)["flops"]
    dist.barrier()
    # fused attention, forward and backward, FLOPs as the planner counts them (causal: half; backward 2.5x)
    b, h, s, d = (2, 8, 256, 64) if device == "cpu" else (8, 16, 2048, 128)
    q, kk, v = (torch.randn(b, h, s, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    target = torch.ops.aten.scaled_dot_product_attention.default
    fwd = node_flops(target, (q, kk, v), {"is_causal": True}, None)
    grad = torch.ones(b, h, s, d, dtype=dtype, device=device)

    def attention() -> None:
        torch.autograd.grad(sdpa(q, kk, v, is_causal=True), (q, kk, v), grad)

    t = _busy_blocks(attention, blocks, seconds, sync)
    flops = fwd + backward_flops(target, fwd)
    attn = {"shape": [b, h, s, d], "seconds": t, "flops": flops / t}
    # elementwise op with transcendental math, forward and backward (gelu): bytes as the planner counts them
    n_math = (4 * MiB if device == "cpu" else 64 * MiB)
    xg = torch.randn(n_math, dtype=dtype, device=device, requires_grad=True)
    gg = torch.ones(n_math, dtype=dtype, device=device)
    t = _busy_blocks(lambda: torch.autograd.grad(torch.nn.functional.gelu(xg), xg, gg), blocks, seconds, sync)
    math_bytes = 3 * 2 * n_math * dtype.itemsize
    gelu = {"elements": n_math, "seconds": t, "bandwidth": math_bytes / t}
    # its variants of other math (``autopart.cost.compute.math_variant``), the same bytes: GPT-2's tanh gelu
    variants = {}
    for key, approximate in (("gelu:tanh", "tanh"),):
        t = _busy_blocks(lambda a=approximate: torch.autograd.grad(
            torch.nn.functional.gelu(xg, approximate=a), xg, gg), blocks, seconds, sync)
        variants[key] = {"elements": n_math, "seconds": t, "bandwidth": math_bytes / t}
    numel = (32 * MiB if device == "cpu" else 256 * MiB) // dtype.itemsize
    x, y = torch.ones(numel, dtype=dtype, device=device), torch.ones(numel, dtype=dtype, device=device)
    z = torch.empty_like(x)
    torch.add(x, y, out=z)
    t = _busy_blocks(lambda: torch.add(x, y, out=z), blocks, seconds, sync)
    bw = {"bytes": 3 * numel * dtype.itemsize, "seconds": t, "bandwidth": 3 * numel * dtype.itemsize / t}
    # the optimizer step: AdamW (foreach, as ``pm.optimizer`` builds it) over 8 tensors, its bytes as the planner
    # counts them (``planner.optimizer_step_seconds``: weight and two states read and written, gradient read)
    n_opt = (MiB if quick else 4 * MiB) // 8 if device == "cpu" else 32 * MiB
    params = [torch.zeros(n_opt, dtype=dtype, device=device, requires_grad=True) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    opt.step()
    t = _busy_blocks(opt.step, blocks, seconds, sync)
    opt_bytes = 7 * 8 * n_opt * dtype.itemsize
    optimizer = {"class": "AdamW(foreach=True)", "elements": 8 * n_opt, "seconds": t, "bandwidth": opt_bytes / t}
    del params, opt
    host = bw["bandwidth"]
    if device == "cuda":
        pinned = torch.empty(numel, dtype=dtype).pin_memory()
        t = _busy_blocks(lambda: x.copy_(pinned, non_blocking=True), blocks, seconds, sync)
        host = numel * dtype.itemsize / t
    return {"gemm": gemms, "gemm_alone_flops": alone, "attention": attn, "transcendental": gelu,
            "transcendental_variants": variants, "elementwise": bw, "optimizer": optimizer, "host_bandwidth": host}


def _runtime_overhead(cluster: Cluster, device: str, blocks: int, seconds: float, sync: Callable[[], None],
                      layers: int = 4) -> dict[str, Any]:
    """Framework time per graph op and per parameter, the work the roofline does not see: ATen dispatch and
    autograd per op, and the runtime's per parameter (its DTensor unwrapped for the program and the gradient
    wrapped back, the accumulation hook, the bucket's bookkeeping).

    Steps ``ParallelModule.forward_backward`` of two reference GPTs too small for their arithmetic to count
    (``layers`` blocks, d_model 8, 8 tokens a rank) on the mesh of ``cluster`` (calibrated but for these terms, its
    links back to back: these steps' collectives follow no compute),
    every axis data parallel: the same graph ops, one with biases (twice the parameters), one without. Each
    step's time less what ``cluster`` predicts for its plan is ``ops * per_op + params * per_param``: the two
    models' paired difference gives ``per_param``, the one without biases then ``per_op`` (clipped at 0). The
    batch is split over the ranks, as in a data-parallel step: what is subtracted is the roofline's microseconds
    and the step's collectives (the loss's all-reduce, the gradient reduction) on those links. A third step, the
    model with biases under ZeRO-3, less the first and less the difference of
    their predictions (its gathers and reduce-scatters on the calibrated links), gives ``per_zero3_param`` per
    ZeRO-3 parameter. The slowest rank's time counts, as in a step."""
    import autopart
    from autopart.models.gpt import GPT, GPTConfig

    shape = cluster.mesh_shape
    names = tuple(f"dp{i}" for i in range(len(shape)))
    world = math.prod(shape)
    rows, steps, opt_params = [], [], []
    # one mesh for the three models, whose runtimes share its gradient groups (``runtime.grads``): the process
    # groups, and their threads, of one training process
    mesh = autopart.mesh(shape, names)
    for bias, zero in ((True, 0), (False, 0)) + (((True, 3),) if world > 1 else ()):  # ZeRO-3: 2+ ranks
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=16, max_seq_len=8, n_layer=layers, n_head=2, d_model=8, bias=bias)).to(device)
        ids = torch.randint(0, 16, (world, 8), device=device)
        pm = autopart.parallelize(model, mesh, (ids,), {"labels": ids}, cluster=cluster,
                                  roles={n: "dp" for n in names}, zero=zero, pipeline="off")
        params = list(pm.parameters())

        def step(pm=pm, ids=ids, params=params) -> None:
            pm.forward_backward(ids, labels=ids)
            for p in params:  # as an optimizer's zero_grad: no accumulation into last step's gradients
                p.grad = None

        step()
        steps.append(step)
        if not zero:  # the two models whose optimizer steps are paired below
            opt_params.append((pm.optimizer(torch.optim.AdamW, lr=0.0), params))
        recs = pm.plan.nodes.values()
        rows.append({"bias": bias, "zero": zero, "ops": sum(1 for r in recs if r["op"] not in (
                         "param", "buffer", "constant", "input")), "params": sum(1 for r in recs if r["op"] == "param"),
                     "zero3_params": sum(1 for level in pm.plan.zero.values() if level == 3),
                     # forward and backward: the step timed here runs no optimizer (timed apart, below)
                     "predicted_s": pm.plan.predicted["step_time_s"] - pm.plan.predicted.get("optimizer_step_s", 0.0),
                     "predicted_optimizer_s": pm.plan.predicted.get("optimizer_step_s", 0.0)})
    # blocks of the two models in turn, so that drift on a shared machine hits both alike; the slowest rank's
    times = torch.tensor(_paired_blocks(steps, blocks, seconds, sync), dtype=torch.float64,
                         device="cuda" if device == "cuda" else "cpu")
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    with_bias, without, *zero3 = times.tolist()
    for r, t in zip(rows, times.tolist()):
        r["seconds"] = statistics.median(t)
    (o1, p1, pr1), (o2, p2, pr2) = ((r["ops"], r["params"], r["predicted_s"]) for r in rows[:2])
    if o1 != o2 or p1 <= p2:
        raise RuntimeError(f"calibration's two models should differ in parameters only; got {rows}")
    # the parameters' share from the paired differences (robust to drift), the ops' from the rest
    per_param = max(0.0, statistics.median(a - b for a, b in zip(with_bias, without)) - (pr1 - pr2)) / (p1 - p2)
    per_op = max(0.0, rows[1]["seconds"] - pr2 - p2 * per_param) / o2
    # ZeRO-3: the same model with its parameters sharded and gathered, less what its collectives are priced at
    n3 = rows[2]["zero3_params"] if zero3 else 0
    per_zero3 = max(0.0, statistics.median(a - b for a, b in zip(zero3[0], with_bias)) - (
        rows[2]["predicted_s"] - pr1)) / n3 if n3 else 0.0
    # the optimizer step's time per parameter beyond its bytes (a foreach kernel's per-tensor work; on DTensor
    # parameters, their dispatch): the two models' steps, paired as above, less their predicted bytes' time
    for _, params in opt_params:
        for p in params:
            p.grad = torch.zeros_like(p)
    opt_times = torch.tensor(_paired_blocks([o.step for o, _ in opt_params], blocks, seconds, sync),
                             dtype=torch.float64, device=times.device)
    dist.all_reduce(opt_times, op=dist.ReduceOp.MAX)
    o_bias, o_without = opt_times.tolist()
    for r, t in zip(rows, (o_bias, o_without)):
        r["optimizer_seconds"] = statistics.median(t)
    per_step_param = max(0.0, statistics.median(a - b for a, b in zip(o_bias, o_without)) - (
        rows[0]["predicted_optimizer_s"] - rows[1]["predicted_optimizer_s"])) / (p1 - p2)
    return {"models": rows, "per_op": per_op, "per_param": per_param, "per_zero3_param": per_zero3,
            "per_optimizer_param": per_step_param}


def _paired_blocks(fns: Sequence[Callable[[], Any]], blocks: int, seconds: float,
                   sync: Callable[[], None]) -> list[list[float]]:
    """Seconds per call of each of ``fns``, per block: ``blocks`` rounds, each running every function back to back
    for about ``seconds`` (the same number of calls on every rank: the slowest rank's probe decides)."""
    inner = []
    for fn in fns:
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        probe = torch.tensor([time.perf_counter() - t0], dtype=torch.float64,
                             device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(probe, op=dist.ReduceOp.MAX)
        inner.append(max(1, min(1000, math.ceil(seconds / max(float(probe), 1e-7)))))
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(blocks):
        for fn, n, times in zip(fns, inner, out):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            times.append((time.perf_counter() - t0) / n)
    return out


def _memory_per_rank(device: str, world: int) -> tuple[int, int]:
    """(memory_bytes, reserve_bytes) per rank: the GPU's memory, or the host's RAM shared by its ranks."""
    if device == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory, 4 * GiB
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    per = total // max(1, local)
    return per, min(512 * MiB, per // 4)


def build_cluster(mesh_shape: Sequence[int], links_raw: dict[str, list[float]], sizes: Sequence[int],
                  dev: dict[str, Any], memory_bytes: int, reserve_bytes: int, name: str = "cpu") -> Cluster:
    """A ``Cluster`` from raw measurements (``links_raw[f"{axis}/{kind}"]``: seconds at each of ``sizes``;
    ``dev`` as ``_measure_device`` returns it)."""
    mesh_shape = tuple(int(x) for x in mesh_shape)
    links = []
    fallback = None
    for axis, n in enumerate(mesh_shape):
        per = []
        for kind in COLLECTIVES:
            key = f"{axis}/{kind}"
            if key in links_raw:
                a, b = fit_alpha_beta(sizes, links_raw[key])
                alpha, beta = link_params(kind, a, b, n)
                per.append((kind, alpha, beta))
        if per:
            ar = next(p for p in per if p[0] == "all_reduce")
            links.append(Link(alpha=ar[1], beta=ar[2], per_collective=tuple(per)))
            fallback = fallback or links[-1]
        else:
            links.append(None)
    fallback = fallback or Link(alpha=50e-6, beta=1 / 1.5e9)  # no axis of 2+ ranks: the link is never used
    links = [x if x is not None else fallback for x in links]
    matmul, gemm_latency, gemm_min = gemm_form(dev["gemm"])
    device = Device(name=f"{name} (calibrated)", peak_flops=matmul, mem_bandwidth=dev["elementwise"]["bandwidth"],
                    gemm_latency=gemm_latency, gemm_min_flops=gemm_min,
                    memory_bytes=int(memory_bytes), host_bandwidth=dev["host_bandwidth"], mfu=1.0,
                    attention_flops=dev.get("attention", {}).get("flops", 0.0),
                    math_bandwidth=dev.get("transcendental", {}).get("bandwidth", 0.0),
                    optimizer_bandwidth=dev.get("optimizer", {}).get("bandwidth", 0.0),
                    optimizer_param_latency=dev.get("runtime", {}).get("per_optimizer_param", 0.0),
                    math_variants=tuple((k, v["bandwidth"]) for k, v in sorted(
                        dev.get("transcendental_variants", {}).items())),
                    op_latency=dev.get("runtime", {}).get("per_op", 0.0),
                    param_latency=dev.get("runtime", {}).get("per_param", 0.0),
                    zero3_latency=dev.get("runtime", {}).get("per_zero3_param", 0.0),
                    host_ranks=int(dev.get("host_ranks", 1)), alone_speedup=_alone_speedup(dev),
                    comm_overlap=dev.get("device") == "cuda")  # NCCL runs beside the compute stream; gloo on the cores
    return Cluster(CALIBRATED, device, mesh_shape, tuple(links), int(reserve_bytes))


def gemm_form(gemms: Sequence[dict[str, Any]]) -> tuple[float, float, float]:
    """(rate, latency, smallest FLOPs) of GEMMs from the linear layers ``_linear_rate`` timed: the weighted least
    squares fit (``fit_alpha_beta``) of each GEMM's seconds (a third of the linear's forward and backward) to
    ``F / rate + latency`` over their FLOPs F = 2 tokens in out, the form ``cost.compute.roofline_time`` prices a
    GEMM with, valid from the smallest F measured up. On this repository's CPU host, one rank, the rate per GEMM
    fell from 136 GFLOP/s at 2 GFLOP to 96-111 at 17-134 MFLOP (the shapes of a tensor-parallel micro-batch of the
    fidelity GPT), which one median rate would price alike. Fewer than two sizes (or measurements without their
    shapes): the median rate, no latency."""
    flops = [2 * g["tokens"] * g["in"] * g["out"] for g in gemms if {"tokens", "in", "out"} <= set(g)]
    if len(flops) == len(gemms) and len(set(flops)) >= 2:
        a, b = fit_alpha_beta(flops, [f / g["flops"] for f, g in zip(flops, gemms)])
        return 1.0 / b, a, float(min(flops))
    return statistics.median(g["flops"] for g in gemms), 0.0, 0.0


def _alone_speedup(dev: dict[str, Any]) -> float:
    """A rank's matmul rate with the other ranks of its host idle over its rate with all busy (the same GEMM),
    between 1 and the host's ranks; 1 where a rank owns its device (GPUs) or is alone on its host."""
    if dev.get("device") == "cuda" or dev.get("host_ranks", 1) < 2 or not dev.get("gemm_alone_flops"):
        return 1.0
    # at most the ranks sharing the host (a measurement under foreign load can exceed it)
    return min(float(dev["host_ranks"]), max(1.0, dev["gemm_alone_flops"] / dev["gemm"][0]["flops"]))


def calibrate(mesh_shape: Sequence[int] | None = None, *, quick: bool = False, directory: str | None = None,
              save: bool = True, dtype: torch.dtype | None = None) -> Cluster:
    """Measure this machine on every rank of the current process group (call it on all of them) and return the
    calibrated ``Cluster`` for ``mesh_shape`` (default: one axis of all ranks), the same on every rank.

    Rank 0 caches it (``save``) under ``directory`` (``$AUTOPART_CACHE``, ``~/.cache/autopart``), keyed by
    ``fingerprint``. ``quick`` measures fewer sizes and shapes (a few seconds; tests). ``dtype``: float32 on CPU,
    bfloat16 on GPU by default. Under ``torchrun`` without a process group, one is initialised from the
    environment; with no process group and no ``torchrun``, only the device is measured (one rank)."""
    if not dist.is_initialized() and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from autopart.runtime.mesh import init_from_env

        init_from_env()
    single = not dist.is_initialized()
    if single:  # one rank, no links to measure: a store-less group of one for the barriers
        import tempfile

        with tempfile.NamedTemporaryFile(delete=False) as f:
            dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
    try:
        return _calibrate(mesh_shape, quick, directory, save, dtype)
    finally:
        if single:
            dist.destroy_process_group()


def _calibrate(mesh_shape, quick, directory, save, dtype) -> Cluster:
    t0 = time.perf_counter()
    world = dist.get_world_size()
    mesh_shape = tuple(int(x) for x in (mesh_shape or (world,)))
    if math.prod(mesh_shape) != world:
        raise ValueError(f"mesh {mesh_shape} holds {math.prod(mesh_shape)} ranks but the world size is {world}")
    backend = dist.get_backend()
    if world == 1 and torch.cuda.is_available():  # one process on a GPU host: the GPU (the group is a stand-in)
        backend = "nccl"
    device = "cuda" if backend == "nccl" else "cpu"
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sizes = QUICK_SIZES if quick else SIZES
    links_raw, lockstep_raw = _measure_links(mesh_shape, sizes, 3 if quick else 5, 0.02 if quick else 0.05, device,
                                             dtype, sync)
    dev = _measure_device(device, dtype, sync, quick)
    # per-rank device rates -> the median rank's (ranks on one host may see different shares of it)
    variants = sorted(dev["transcendental_variants"])
    rates = torch.tensor([g["flops"] for g in dev["gemm"]] + [dev["transcendental_variants"][k]["bandwidth"]
                                                              for k in variants] + [
                         dev["attention"]["flops"], dev["transcendental"]["bandwidth"], dev["elementwise"]["bandwidth"],
                         dev["optimizer"]["bandwidth"], dev["host_bandwidth"]], dtype=torch.float64)
    everyone = [torch.zeros_like(rates) for _ in range(world)]
    dist.all_gather_object(everyone, rates)
    med = torch.stack(everyone).quantile(0.5, dim=0).tolist()
    for g, f in zip(dev["gemm"], med):
        g["flops"] = f
    for k, f in zip(variants, med[len(dev["gemm"]):]):
        dev["transcendental_variants"][k]["bandwidth"] = f
    (dev["attention"]["flops"], dev["transcendental"]["bandwidth"], dev["elementwise"]["bandwidth"],
     dev["optimizer"]["bandwidth"], dev["host_bandwidth"]) = med[-5:]
    alone = [0.0] * world  # rank 0 measured it
    dist.all_gather_object(alone, dev["gemm_alone_flops"])
    dev["gemm_alone_flops"] = max(alone)
    dev["device"] = device
    dev["host_ranks"] = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if device == "cpu" else 1
    memory, reserve = _memory_per_rank(device, world)
    fp = fingerprint(backend, world, mesh_shape)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    # the runtime's own time per op and per parameter: its steps less what the cluster measured so far predicts,
    # their collectives priced back to back, as they run there (one after another, no compute between)
    lockstep = build_cluster(mesh_shape, lockstep_raw, sizes, dev, memory, reserve, name=name)
    dev["runtime"] = _runtime_overhead(lockstep, device, 3 if quick else 5, 0.1 if quick else 0.25, sync,
                                       2 if quick else 4)
    cluster = build_cluster(mesh_shape, links_raw, sizes, dev, memory, reserve, name=name)
    if device == "cpu":  # collectives issued back to back (ZeRO-3's, an op apart) pay those (``Link.in_chain``)
        cluster = dataclasses.replace(cluster, links=tuple(
            dataclasses.replace(x, chained=y.per_collective) for x, y in zip(cluster.links, lockstep.links)))
    measurements = {"sizes": list(sizes), "collective_seconds": links_raw,
                    "collective_seconds_back_to_back": lockstep_raw, "device": dev,
                    "dtype": str(dtype).removeprefix("torch."), "seconds": time.perf_counter() - t0}
    if save and dist.get_rank() == 0:
        save_calibration(cluster, fp, measurements, directory)
    return cluster


def describe(cluster: Cluster) -> str:
    """A few lines: the device's rates and every axis's measured collectives."""
    d = cluster.device
    form = (f" + {d.gemm_latency * 1e6:.3g} us per GEMM (from {d.gemm_min_flops / 1e6:.3g} MFLOP)"
            if d.gemm_latency else "")
    lines = [f"device {d.name}: matmul {d.achievable_flops / 1e9:.3g} GFLOP/s{form}, attention "
             f"{(d.attention_flops or d.achievable_flops) / 1e9:.3g} GFLOP/s, memory-bound {d.mem_bandwidth / 1e9:.3g} "
             f"GB/s, transcendental elementwise {(d.math_bandwidth or d.mem_bandwidth) / 1e9:.3g} GB/s"
             f"{''.join(f' ({k}: {v / 1e9:.3g})' for k, v in d.math_variants)}, "
             f"optimizer step {(d.optimizer_bandwidth or d.mem_bandwidth) / 1e9:.3g} GB/s and "
             f"{d.optimizer_param_latency * 1e6:.3g} us per parameter, "
             f"{d.op_latency * 1e6:.3g} us per op, {d.param_latency * 1e6:.3g} us per parameter "
             f"(ZeRO-3: {d.zero3_latency * 1e6:.3g} more), "
             f"{d.host_ranks} ranks per host ({d.alone_speedup:.3g}x faster alone), "
             f"{d.memory_bytes / GiB:.3g} GiB ({cluster.reserve_bytes / GiB:.3g} reserved)"]
    for axis, (n, link) in enumerate(zip(cluster.mesh_shape, cluster.links)):
        if n < 2:
            continue
        per = ", ".join(f"{k} {a * 1e6:.3g}us {1 / b / 1e9:.3g}GB/s" for k, a, b in link.per_collective)
        chained = ", ".join(f"{k} {a * 1e6:.3g}us {1 / b / 1e9:.3g}GB/s" for k, a, b in link.chained)
        lines.append(f"axis {axis} ({n} ranks): {per or link}" + (f"; back to back: {chained}" if chained else ""))
    return "\n".join(lines)


def _spawn_worker(rank: int, world: int, store: str, mesh_shape, quick: bool, directory, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    # rendezvous through a file: no TCP port to race for with another job starting on this host
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        cluster = calibrate(mesh_shape, quick=quick, directory=directory)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(cluster.to_json(), f)
    finally:
        dist.destroy_process_group()


def calibrate_spawn(nproc: int, mesh_shape: Sequence[int] | None = None, *, quick: bool = False,
                    directory: str | None = None) -> Cluster:
    """``calibrate`` on ``nproc`` freshly spawned gloo ranks on this host (one thread each, as
    ``autopart``'s multi-process runs use); returns the calibrated ``Cluster`` (and caches it)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "cluster.json")
        mp.start_processes(_spawn_worker, args=(nproc, os.path.join(d, "store"), tuple(mesh_shape) if mesh_shape
                                                else None, quick,
                                                directory, out), nprocs=nproc, start_method="spawn")
        with open(out) as f:
            return Cluster.from_json(json.load(f))


def _check_writable(directory: str) -> None:
    """Raise ``ValueError`` (what, why, how to fix) unless a calibration can be cached under ``directory``."""
    import tempfile

    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ValueError(f"cannot cache a calibration in {directory!r}: {e.strerror or e}; give a folder you can "
                         "write with --cache DIR (without it: $AUTOPART_CACHE, else ~/.cache/autopart)") from e


def cli(args: Any) -> int:
    """``autopart calibrate --nproc N [--mesh AxB] [--quick] [--cache DIR]``: spawn N gloo ranks on this host,
    calibrate, cache, and print what was measured."""
    if args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc}: give the number of gloo ranks to spawn, >= 1")
    mesh = args.mesh
    if isinstance(mesh, str):
        mesh = tuple(int(x) for x in mesh.lower().split("x"))
    mesh_shape = tuple(mesh) if mesh else (args.nproc,)
    if math.prod(mesh_shape) != args.nproc:
        raise ValueError(f"--mesh {'x'.join(map(str, mesh_shape))} holds {math.prod(mesh_shape)} ranks, --nproc is "
                         f"{args.nproc}")
    _check_writable(cache_dir(args.cache))  # before a minute of measuring, not after it in a rank
    t0 = time.perf_counter()
    cluster = calibrate_spawn(args.nproc, mesh_shape, quick=args.quick, directory=args.cache)
    fp = fingerprint("gloo", args.nproc, mesh_shape)
    print(f"calibrated {args.nproc} gloo ranks, mesh {'x'.join(map(str, mesh_shape))}, in "
          f"{time.perf_counter() - t0:.1f} s (spawning included)")
    print(describe(cluster))
    print(f"cached: {cache_path(fp, args.cache)}\nuse: autopart.plan(..., cluster=\"calibrated\") on mesh "
          f"{mesh_shape}, or cluster=autopart.load_calibration({mesh_shape})")
    return 0
