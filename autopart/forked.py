"""Run independent planning calls in forked processes, several at a time (``advise``'s mesh views, ``sweep``'s
cells, which may fork their views in turn).

A plan is CPU-bound Python and solver work on shapes alone, so on a machine with several cores the views of one
``advise`` run side by side. The children are *forked*: they start with the parent's traced graph, model and
caches, nothing pickled on the way in (a factory given as a lambda works), and send back one pickled result each.
Where the platform has no ``fork`` start method (Windows; macOS keeps it), or one core is all there is, the calls
run one after another in this process, which is also what ``jobs=1`` asks for.

Forking is unsafe once a native library has started worker threads of its own that a child would need: HiGHS
keeps a process-wide pool (half the cores; none on 2 cores), and a child forked after it ran hangs in its first
solve (measured here: a parent solve with 4 HiGHS threads, then 4 forked solves, stuck past 300 s; 41 s without
the parent's). So the solver's calls run under ``watch``, which notes when they leave more native threads than
they found (on Linux; elsewhere every such call counts), and from then on ``jobs_for`` plans in this process.
torch's own thread pools are fork-safe (its DataLoader forks after them).

What comes back is each call's return value or the exception it raised, with the child's traceback as its
``__cause__`` (as ``concurrent.futures`` reports a worker's). A child that dies without answering (killed for
memory, a crash in native code) reports a ``ChildDied``; a call still running when the caller stops listening (a
time cap, Ctrl-C) has its process killed, so no child outlives the loop; on Linux what that process forked in turn
dies with it (``_die_with_parent``). How many run at once: ``jobs_for`` (one per core by default, no more than the
available memory holds where the caller says what one call may take).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait
from typing import Any


class ChildDied(RuntimeError):
    """A forked call's process ended without sending its result (its exit code in the message)."""


class Timeout(TimeoutError):
    """The forked calls ran past ``run``'s ``timeout`` (those still running were killed)."""


class ChildTraceback(Exception):
    """The traceback of an exception raised in a forked call, as text (set as that exception's ``__cause__``)."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


_UNSAFE: list[str] = []  # what started native threads in this process (``watch``): forking is not safe after it


def native_threads() -> int | None:
    """This process's OS threads (Python's and native libraries'), where the platform says (Linux); else None."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


@contextmanager
def watch(what: str) -> Iterator[None]:
    """Run a native library's call (``what`` names it); if it leaves more OS threads than it found (or they cannot
    be counted here), later ``jobs_for`` plan in this process: a forked child would wait on threads it lacks."""
    before = native_threads()
    try:
        yield
    finally:
        after = native_threads()
        if (before is None or after is None or after > before) and what not in _UNSAFE:
            _UNSAFE.append(what)


def can_fork() -> bool:
    """Whether this platform starts processes by ``fork`` (Linux, macOS; not Windows)."""
    return "fork" in mp.get_all_start_methods()


def cpus() -> int:
    """The cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def available_memory() -> int | None:
    """Bytes of memory the system can give new processes without swapping (Linux's MemAvailable); None where the
    platform does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def jobs_for(tasks: int, jobs: int | None, task_bytes: int | None = None) -> int:
    """How many processes run ``tasks`` calls: ``jobs`` (None: one per core, at most one per call, and with
    ``task_bytes`` -- the memory one call may take -- no more than the available memory holds), or 1 where the
    platform cannot fork or a native library has started threads here (``watch``). Bad ``jobs`` raise
    ``ValueError``."""
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"jobs={jobs!r}: give a whole number >= 1 of processes to plan in (1: one after another "
                         "in this process), or None for one per core")
    if not can_fork():
        return 1
    if _UNSAFE and (jobs is None or jobs > 1) and tasks > 1:
        logging.getLogger(__name__).info(
            "planning in this process, not in %s forked ones: %s started threads here that a forked child would "
            "wait on (plan in a fresh process to plan side by side)", jobs or "per-core", " and ".join(_UNSAFE))
        return 1
    n = cpus() if jobs is None else jobs
    if jobs is None and task_bytes:
        free = available_memory()
        if free is not None and free < n * task_bytes:
            logging.getLogger(__name__).info(
                "planning in %d processes, not one per core (%d): %.1f GiB of memory is available and each may take "
                "%.1f GiB (jobs= sets the count)", max(1, free // task_bytes), n, free / 2**30, task_bytes / 2**30)
            n = free // task_bytes
    return max(1, min(tasks, n))


def _die_with_parent(parent: int) -> None:
    """Where Linux's ``prctl`` is (``PR_SET_PDEATHSIG``), have this forked process killed when the process that
    forked it ends, however it ends: a child killed at a time cap (or the main process killed) takes its own forked
    calls with it instead of leaving them planning on as orphans. Elsewhere a no-op."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux (macOS has no prctl)
        return
    if prctl(1, signal.SIGKILL, 0, 0, 0) == 0 and os.getppid() != parent:  # 1: PR_SET_PDEATHSIG
        os._exit(1)  # the parent ended before the request took hold


def _child(conn, fn: Callable[[int], Any], i: int, parent: int) -> None:
    _die_with_parent(parent)
    try:
        out = ("ok", fn(i), "")
    except BaseException as e:  # noqa: BLE001 -- every failure goes back to the parent, which decides
        out = ("err", e, traceback.format_exc())
    try:
        data = pickle.dumps(out)
        pickle.loads(data)  # an exception that pickles but does not rebuild goes back as its text
    except Exception as e:  # noqa: BLE001
        what = out[1] if out[0] == "err" else f"the result of type {type(out[1]).__name__}"
        data = pickle.dumps(("err", RuntimeError(f"{what!r} could not be sent back from the forked process: {e}"),
                             out[2]))
    conn.send_bytes(data)
    conn.close()


def run(fn: Callable[[int], Any], tasks: int, jobs: int, timeout: float | None = None,
        first: Callable[[int], Any] | None = None) -> Iterator[tuple[int, bool, Any]]:
    """Call ``fn(i)`` for i in ``range(tasks)``, ``jobs`` at a time, each in a forked process (``jobs`` 1, or no
    ``fork`` here: in this process, in order). Yields ``(i, ok, value)`` as each call ends: ``ok`` True with its
    return value, False with the exception it raised. Leaving the loop early (break, an exception in the consumer
    or a signal handler) kills the calls still running. ``timeout``: seconds from the first call after which the
    forked calls still running are killed and ``Timeout`` raised (after the calls that ended were yielded); in
    this process it is not applied (a caller's ``signal.alarm`` can). ``first``: a sort key; forked calls start in
    its order (the longest expected first keeps the cores busy to the end), in this process they run in index
    order."""
    if jobs <= 1 or not can_fork():
        for i in range(tasks):
            try:
                value = fn(i)
            except Exception as e:  # noqa: BLE001 -- handed to the caller, as the forked path does
                yield i, False, e
            else:
                yield i, True, value
        return
    ctx = mp.get_context("fork")
    pending, live = sorted(range(tasks), key=first) if first is not None else list(range(tasks)), {}
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while pending or live:
            while pending and len(live) < jobs:
                i = pending.pop(0)
                recv, send = ctx.Pipe(duplex=False)
                # not a daemon, so that it may fork calls of its own (a sweep's cell its mesh views); the loop below
                # kills what still runs when it ends (return, exception, Ctrl-C), and what those forked dies
                # with them (``_die_with_parent``)
                proc = ctx.Process(target=_child, args=(send, fn, i, os.getpid()), name=f"autopart-plan-{i}")
                with warnings.catch_warnings():  # Python >= 3.12 warns of any thread; ``watch`` judged the ones here
                    warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks",
                                            category=DeprecationWarning)
                    proc.start()
                send.close()
                live[recv] = (i, proc)
            left = None if deadline is None else deadline - time.monotonic()
            ready = wait(list(live), timeout=left if left is None else max(0.0, left))
            if not ready:  # only a deadline ends a wait with nothing ready
                raise Timeout(f"planning took more than {timeout:g} s")
            for recv in ready:
                i, proc = live.pop(recv)
                try:
                    status, value, tb = pickle.loads(recv.recv_bytes())
                except EOFError:
                    proc.join()
                    status, value, tb = "err", ChildDied(
                        f"the process planning task {i} ended without a result (exit code {proc.exitcode}; a "
                        "negative code is the signal that ended it, -9 often the kernel's out-of-memory killer): "
                        "run with jobs=1 to plan in this process and see the error"), ""
                recv.close()
                proc.join()
                if status == "err" and tb:
                    value.__cause__ = ChildTraceback(tb)
                yield i, status == "ok", value
    finally:
        for recv, (_, proc) in live.items():
            proc.kill()
            proc.join()
            recv.close()


def call(fn: Callable[[], Any], jobs: int | None = None) -> Any:
    """``fn()`` in one forked child where this process may fork (``jobs_for(2, jobs) > 1``), so that the native
    threads its solves start stay out of this process, which can then go on forking; else here. Returns what it
    returns, raises what it raises."""
    for _, ok, value in run(lambda _: fn(), 1, jobs_for(2, jobs)):
        if not ok:
            raise value
        return value
