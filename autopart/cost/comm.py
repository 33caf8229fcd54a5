"""Collective times under the ring alpha-beta model (REFERENCE.md "Collectives"; nccl-tests doc/PERFORMANCE.md).

``nbytes`` (S) is the size of the WHOLE array: the gathered output of an all-gather, the input of a reduce-scatter,
the array being all-reduced, the full send buffer of an all-to-all. ``n`` is the number of ranks in the group and
``link`` the link the group communicates over (``Cluster.link(axis)``). A group of one rank costs nothing.

    all-gather, reduce-scatter, all-to-all   (n-1) α + (n-1)/n · S β
    all-reduce                               2(n-1) α + 2(n-1)/n · S β
    send/recv                                α + S β

A calibrated link (``autopart.calibrate``) carries α and β measured per collective (``Link.for_collective``):
gloo and NCCL implement each collective with its own algorithm, so one pair does not fit them all.
"""

from __future__ import annotations

from autopart.cost.cluster import Link

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def _check(nbytes: float, n: int) -> None:
    if nbytes < 0:
        raise ValueError(f"message size must be >= 0 bytes, got {nbytes}")
    if n < 1:
        raise ValueError(f"a collective needs at least 1 rank, got n={n}")


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather of an S-byte result: (n-1) α + (n-1)/n · S β."""
    return _ring(nbytes, n, link.for_collective("all_gather"))


def _ring(nbytes: float, n: int, link: Link) -> float:
    _check(nbytes, n)
    if n == 1:
        return 0.0
    return (n - 1) * link.alpha + (n - 1) / n * nbytes * link.beta


def reduce_scatter_time(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter of an S-byte input: (n-1) α + (n-1)/n · S β."""
    return _ring(nbytes, n, link.for_collective("reduce_scatter"))


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce (reduce-scatter then all-gather): 2(n-1) α + 2(n-1)/n · S β."""
    return 2 * _ring(nbytes, n, link.for_collective("all_reduce"))


def all_to_all_time(nbytes: float, n: int, link: Link) -> float:
    """All-to-all of an S-byte buffer per rank, each rank keeping 1/n: (n-1) α + (n-1)/n · S β."""
    return _ring(nbytes, n, link.for_collective("all_to_all"))


def send_recv_time(nbytes: float, link: Link) -> float:
    """Point-to-point transfer of S bytes: α + S β."""
    _check(nbytes, 1)
    link = link.for_collective("send_recv")
    return link.alpha + nbytes * link.beta


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Time of collective ``kind`` (one of ``COLLECTIVES``); 0.0 for a group of one rank, send/recv included."""
    if kind == "send_recv":
        _check(nbytes, n)
        return 0.0 if n == 1 else send_recv_time(nbytes, link)
    fns = {
        "all_reduce": all_reduce_time,
        "all_gather": all_gather_time,
        "reduce_scatter": reduce_scatter_time,
        "all_to_all": all_to_all_time,
    }
    if kind not in fns:
        raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")
    return fns[kind](nbytes, n, link)
