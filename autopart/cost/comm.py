"""Collective times under the ring alpha-beta model (REFERENCE.md "Collectives"; nccl-tests doc/PERFORMANCE.md).

``nbytes`` (S) is the size of the WHOLE array: the gathered output of an all-gather, the input of a reduce-scatter,
the array being all-reduced, the full send buffer of an all-to-all. ``n`` is the number of ranks in the group and
``link`` the link the group communicates over (``Cluster.link(axis)``). A group of one rank costs nothing.

    all-gather, reduce-scatter, all-to-all   (n-1) α + (n-1)/n · S β
    all-reduce                               2(n-1) α + 2(n-1)/n · S β   (ring)
                                             2⌈log2 n⌉ α + 2(n-1)/n · S β   (tree, ``Link.tree``: the lower wins)
    send/recv                                α + S β
    each, on a link with a low-latency protocol (``Link.ll_bandwidth``), at most
                                             ll_latency + steps · ll_hop + bus bytes / ll_bandwidth

NCCL runs all-reduce as a ring or a double binary tree and picks by size (NCCL's tuning model: a tree's latency
grows with log2 of the nodes, a ring's linearly; inside a node the tree is a chain; docs "Environment Variables",
NCCL_ALGO). ``Link.tree`` is set on the GPU presets' inter-node link only. Both move the same bytes
per rank at large sizes (nccl-tests doc/PERFORMANCE.md reports one bus bandwidth, 2(n-1)/n of the algorithm's), so
the tree changes only the latency term: ``min`` of the two, which is what NCCL's choice approximates.

Small messages: NCCL also runs every collective under its low-latency protocol (LL: each 8-byte store carries its
own flag, so a step needs no handshake; NCCL's tuning model, ``src/graph/tuning.cc``, prices it at a base of 6.6 µs
and 0.6 µs per NVLink ring step at about half the bandwidth, capped at 141 GB/s of bus bandwidth on Hopper and 87.7
on Ampere) and picks the faster protocol per call. A link with ``Link.ll_bandwidth`` prices both and keeps the
lower: ``ll_latency + steps · ll_hop + bus bytes / ll_bandwidth`` beside the ring's ``steps · α + bus bytes · β``
(``steps`` = 2(n-1) for an all-reduce, n-1 for the others, 1 for send/recv). An 8-way all-reduce of a decoding
step's 8 KiB activation on the H100 preset: 15 µs, where the ring's 2(n-1) α is 70 µs; from ~6 MB up (an 8-way
all-reduce or all-gather) the default protocol wins and nothing changes.

A calibrated link (``autopart.calibrate``) carries α and β measured per collective (``Link.for_collective``):
gloo and NCCL implement each collective with its own algorithm, so one pair does not fit them all. A measured
all-reduce keeps the ring parametrization it was fitted in.

``hierarchical_time`` prices one collective over the ranks of several mesh axes (a data-parallel gradient summed over
nodes and the GPUs in each): as NCCL runs it on one group spanning them and autopart's runtime runs it axis by axis
(``runtime/grads.py``), the bytes shrink outward, so the slow inter-node link carries 1/(GPUs per node) of them.

A mesh axis that spans nodes with several of its ranks in each (``Link.local``: the data-parallel axis of a 1-D
mesh over 8-GPU nodes, or of (48, 2) beside tensor parallelism of 2) is priced the same way, as two levels: inside
the node over ``Link.local_link``, then across nodes with the bytes divided by the ranks per node.

``exposed_after`` prices collectives that run concurrently with compute (the data-parallel gradient buckets on a
device whose collectives overlap, ``Device.comm_overlap``): what finishes after the compute window.
``exposed_before`` prices the other way round: collectives launched ahead of compute that waits for each of them
(ZeRO-1/2's parameter all-gather after the step, waited for by the next forward).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autopart.cost.cluster import Link

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def _check(nbytes: float, n: int) -> None:
    if nbytes < 0:
        raise ValueError(f"message size must be >= 0 bytes, got {nbytes}")
    if n < 1:
        raise ValueError(f"a collective needs at least 1 rank, got n={n}")


def _spans_nodes(n: int, link: Link) -> bool:
    """A group of ``n`` ranks on an axis with ``link.local`` of them in each node (``Link.local``)."""
    return link.local > 1 and n > link.local and n % link.local == 0


def _node_levels(n: int, link: Link) -> list[tuple[int, Link]]:
    return [(link.local, link.local_link), (n // link.local, link.across())]


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather of an S-byte result: (n-1) α + (n-1)/n · S β; over nodes, hierarchical (``Link.local``)."""
    if _spans_nodes(n, link):
        return hierarchical_time("all_gather", nbytes, _node_levels(n, link))
    return _ring(nbytes, n, link.for_collective("all_gather"))


def _ring(nbytes: float, n: int, link: Link) -> float:
    _check(nbytes, n)
    if n == 1:
        return 0.0
    bus = (n - 1) / n * nbytes
    return min((n - 1) * link.alpha + bus * link.beta, link.low_latency(n - 1, bus))


def reduce_scatter_time(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter of an S-byte input: (n-1) α + (n-1)/n · S β; over nodes, hierarchical."""
    if _spans_nodes(n, link):
        return hierarchical_time("reduce_scatter", nbytes, _node_levels(n, link))
    return _ring(nbytes, n, link.for_collective("reduce_scatter"))


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce (reduce-scatter then all-gather): 2(n-1) α + 2(n-1)/n · S β; on a link whose library also
    has a tree all-reduce (``Link.tree``, NCCL) and no measured all-reduce, 2 min(n-1, ⌈log2 n⌉) α + 2(n-1)/n · S β;
    over nodes, hierarchical (``Link.local``)."""
    if _spans_nodes(n, link):
        return hierarchical_time("all_reduce", nbytes, _node_levels(n, link))
    measured = link.for_collective("all_reduce")
    _check(nbytes, n)
    if n == 1:
        return 0.0
    bus = 2 * (n - 1) / n * nbytes
    steps = 2 * (min(n - 1, math.ceil(math.log2(n))) if link.tree and measured is link else n - 1)
    return min(steps * measured.alpha + bus * measured.beta, measured.low_latency(2 * (n - 1), bus))


def all_to_all_time(nbytes: float, n: int, link: Link) -> float:
    """All-to-all of an S-byte buffer per rank, each rank keeping 1/n: (n-1) α + (n-1)/n · S β. Over nodes with g
    ranks in each (``Link.local``): the (g-1)/n of the buffer for the rank's node over the node's link, the (n-g)/n
    for the others over the rank's own link between nodes."""
    if _spans_nodes(n, link):
        g = link.local
        inner, outer = link.local_link.for_collective("all_to_all"), link.across().for_collective("all_to_all")
        return ((g - 1) * inner.alpha + (g - 1) / n * nbytes * inner.beta
                + (n - g) * outer.alpha + (n - g) / n * nbytes * outer.beta)
    return _ring(nbytes, n, link.for_collective("all_to_all"))


def send_recv_time(nbytes: float, link: Link) -> float:
    """Point-to-point transfer of S bytes: α + S β (on an axis spanning nodes, the link between them: some pairs
    of neighbours cross a node boundary and the step waits for them)."""
    _check(nbytes, 1)
    link = link.across().for_collective("send_recv")
    return min(link.alpha + nbytes * link.beta, link.low_latency(1, nbytes))


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Time of collective ``kind`` (one of ``COLLECTIVES``); 0.0 for a group of one rank, send/recv included."""
    if kind == "send_recv":
        _check(nbytes, n)
        return 0.0 if n == 1 else send_recv_time(nbytes, link)
    fn = _TIMES.get(kind)
    if fn is None:
        raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")
    return fn(nbytes, n, link)


_TIMES = {"all_reduce": all_reduce_time, "all_gather": all_gather_time, "reduce_scatter": reduce_scatter_time,
          "all_to_all": all_to_all_time}


def hierarchical_time(kind: str, nbytes: float, levels: Sequence[tuple[int, Link]]) -> float:
    """One all-reduce, reduce-scatter or all-gather of S bytes over the ranks of several mesh axes, ``levels`` =
    ``(n, link)`` per axis, innermost (fastest) first: sum over axes k of the collective on that axis of
    S_k = S / (n_1 ... n_(k-1)) bytes.

    * reduce-scatter: over the innermost axis first, each rank keeping 1/n_1, whose sum it scatters on the next;
    * all-gather: the mirror, outermost first (gathered size S_k on axis k);
    * all-reduce: reduce-scatter over every axis but the outermost, all-reduce of S / (n_1 ... n_(K-1)) there,
      all-gather back; a ring all-reduce is a reduce-scatter and an all-gather, so each inner axis costs an
      all-reduce of S_k.

    On equal links this is the ring over all n_1 ... n_K ranks (the bandwidth terms sum to 2(N-1)/N S β for an
    all-reduce), with fewer latency steps; across nodes it is what NCCL's rings achieve through the node's NICs
    (each ring crosses a node boundary once per channel, the channels spread over the NICs): the inter-node link
    carries S / (GPUs per node), not S, per GPU."""
    if kind not in ("all_reduce", "reduce_scatter", "all_gather"):
        raise ValueError(f"hierarchical_time: {kind!r} is not a reduction or a gather")
    t, size = 0.0, float(nbytes)
    for n, link in levels:
        t += collective_time(kind, size, n, link)
        size /= n
    return t


def exposed_after(ready: Sequence[float], cost: Sequence[float], window: float) -> float:
    """Seconds a chain of asynchronous collectives adds after ``window`` seconds of compute they overlap.

    Collective ``k`` is launched when its input is ready, ``ready[k]`` seconds into the window, and runs after
    collective ``k-1`` (one process group: in launch order), taking ``cost[k]``; the step waits for the last. This is
    the runtime's data-parallel gradient reduction: buckets in backward order, each launched as its last gradient is
    produced, concurrently with the rest of backward, all waited on at the end. Returns ``max(0, end - window)``:
    at least the last bucket (ready only when backward ends), more when the reduction is slower than the backward
    left to hide it.
    """
    if len(ready) != len(cost):
        raise ValueError(f"exposed_after: {len(ready)} ready times for {len(cost)} collectives")
    end = 0.0
    for r, c in zip(ready, cost):
        end = max(end, r) + c
    return max(0.0, end - window)


def exposed_before(deadline: Sequence[float], cost: Sequence[float], in_flight: int) -> float:
    """Seconds a chain of asynchronous collectives launched ahead of compute stalls that compute.

    Collective ``k`` takes ``cost[k]`` after collective ``k-1`` (one process group: in launch order); the compute
    waits for it when it has done ``deadline[k]`` seconds of work (its first use), and waits for them in order, so
    ``k`` must be complete by the earliest deadline of ``k`` and the later ones. At most ``in_flight`` are
    outstanding: the first ``in_flight`` are launched at time 0, collective ``k + in_flight`` when the compute has
    waited for ``k``. This is the runtime's ZeRO-1/2 parameter gather (``runtime/zero1.py``): buckets launched
    after the step, each waited for by the next forward before its parameters' first use. Returns the total stall:
    at least the first collective when the compute needs it at once (``deadline[0] == 0``). With ``in_flight`` at
    least the number of collectives it is the latest ``exposed_after(zeros, cost[:k+1], deadline[k])``.
    """
    if len(deadline) != len(cost):
        raise ValueError(f"exposed_before: {len(deadline)} deadlines for {len(cost)} collectives")
    if in_flight < 1:
        raise ValueError(f"exposed_before: in_flight must be >= 1, got {in_flight}")
    due = list(deadline)
    for k in range(len(due) - 2, -1, -1):  # completed in order: by the time any later one is needed
        due[k] = min(due[k], due[k + 1])
    launch = [0.0] * len(cost)
    link = stall = 0.0
    for k, c in enumerate(cost):
        link = max(link, launch[k]) + c
        waited = due[k] + stall  # wall time the compute reaches the first use
        stall += max(0.0, link - waited)
        if k + in_flight < len(cost):
            launch[k + in_flight] = max(link, waited)
    return stall
