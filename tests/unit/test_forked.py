"""``autopart.forked``: calls run side by side in forked processes, their results, errors, deaths and time cap."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from autopart import forked

pytestmark = pytest.mark.skipif(not forked.can_fork(), reason="no fork start method on this platform")


class NeedsTwo(Exception):  # pickles, but its pickle does not rebuild: __init__ takes two arguments
    def __init__(self, a, b):
        super().__init__(f"{a} {b}")


def _task(i: int):
    if i == 2:
        raise ValueError(f"task {i} refused")
    if i == 3:
        raise NeedsTwo("x", "y")
    return i * i, os.getpid()


def test_results_and_errors_come_back_from_each_process() -> None:
    got = {i: (ok, v) for i, ok, v in forked.run(_task, 5, jobs=2)}
    assert sorted(got) == [0, 1, 2, 3, 4]
    for i in (0, 1, 4):
        ok, (square, pid) = got[i]
        assert ok and square == i * i and pid != os.getpid()
    ok, e = got[2]
    assert not ok and isinstance(e, ValueError) and str(e) == "task 2 refused"
    assert isinstance(e.__cause__, forked.ChildTraceback) and "in _task" in str(e.__cause__)
    ok, e = got[3]  # an exception that does not rebuild from its pickle comes back as its text
    assert not ok and isinstance(e, RuntimeError) and "NeedsTwo" in str(e) and "could not be sent back" in str(e)
    assert not multiprocessing.active_children()


def test_in_process_gives_the_same_results_in_order() -> None:
    got = list(forked.run(_task, 5, jobs=1))
    assert [i for i, _, _ in got] == [0, 1, 2, 3, 4]
    assert got[1][2] == (1, os.getpid()) and isinstance(got[3][2], NeedsTwo)


def _die(i: int):
    if i == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return i


def test_a_process_that_dies_is_reported() -> None:
    got = {i: (ok, v) for i, ok, v in forked.run(_die, 3, jobs=3)}
    assert got[0] == (True, 0) and got[2] == (True, 2)
    ok, e = got[1]
    assert not ok and isinstance(e, forked.ChildDied) and "exit code -9" in str(e)


def _slow(i: int):
    if i:
        time.sleep(60)
    return i


def test_the_time_cap_kills_the_calls_still_running() -> None:
    t0, seen = time.monotonic(), []
    with pytest.raises(forked.Timeout, match="more than 2 s"):
        for i, ok, v in forked.run(_slow, 3, jobs=3, timeout=2.0):
            seen.append((i, ok, v))
    assert seen == [(0, True, 0)] and time.monotonic() - t0 < 30
    assert not multiprocessing.active_children()


def test_leaving_the_loop_early_kills_the_calls_still_running() -> None:
    for i, _, _ in forked.run(_slow, 4, jobs=2):
        assert i == 0
        break
    assert not multiprocessing.active_children()


def test_jobs() -> None:
    assert forked.jobs_for(3, 1) == 1 and forked.jobs_for(3, 8) == 3
    assert forked.jobs_for(64, None) == min(64, forked.cpus())
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="whole number >= 1"):
            forked.jobs_for(3, bad)


def test_jobs_fit_the_available_memory(monkeypatch) -> None:
    """One per core asked (jobs=None) with the memory each call may take: no more calls than the memory holds;
    jobs given is kept (the user decided); memory not known: one per core."""
    monkeypatch.setattr(forked, "cpus", lambda: 16)
    monkeypatch.setattr(forked, "available_memory", lambda: 5 * 2**30)
    assert forked.jobs_for(64, None, task_bytes=2**30) == 5
    assert forked.jobs_for(64, None, task_bytes=8 * 2**30) == 1
    assert forked.jobs_for(64, None) == 16 and forked.jobs_for(64, 12, task_bytes=2**30) == 12
    monkeypatch.setattr(forked, "available_memory", lambda: None)
    assert forked.jobs_for(64, None, task_bytes=2**30) == 16


def test_available_memory_is_read_where_the_platform_says() -> None:
    free = forked.available_memory()
    if os.path.exists("/proc/meminfo"):
        assert free is not None and 0 < free <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _nested(i: int):
    return i, os.getpid(), [(j, pid) for j, ok, (j, pid) in forked.run(lambda j: (j, os.getpid()), 2, jobs=2)]


def test_a_forked_call_may_fork_its_own() -> None:
    """A sweep's cell, planned in a forked process, forks its mesh views: the children are not daemons (which may
    not have children), and each level's results come back."""
    out = {i: v for i, ok, v in forked.run(_nested, 2, jobs=2)}
    pids = {os.getpid()}
    for i, (k, pid, inner) in out.items():
        assert k == i and pid not in pids and [j for j, _ in inner] == [0, 1]
        pids.add(pid)
        for _, p in inner:
            assert p not in pids
            pids.add(p)
    assert len(pids) == 1 + 2 + 4


def _forks_a_sleeper(path: str):
    def sleeper(_):
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)

    for _ in forked.run(sleeper, 1, jobs=2):
        pass


def _gone(pid: int) -> bool:  # ended: no such process, or a zombie its new parent has not reaped
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")
def test_a_killed_call_takes_the_calls_it_forked_with_it(tmp_path) -> None:
    """The time cap kills a call that had forked one of its own (a sweep cell's mesh view): that one dies too
    instead of planning on as an orphan."""
    path = str(tmp_path / "grandchild")
    with pytest.raises(forked.Timeout):
        for _ in forked.run(lambda _: _forks_a_sleeper(path), 1, jobs=2, timeout=3):
            pass
    pid = int(open(path).read())
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid)


def _started(i: int):
    t = time.monotonic()
    time.sleep(0.5)
    return t


def test_first_orders_the_forked_starts() -> None:
    assert [i for i, _, _ in forked.run(_started, 3, jobs=1, first=lambda i: -i)] == [0, 1, 2]  # here: in order
    # two processes, started in first's order (2, 1, then 0 once one of them has ended)
    start = {i: t for i, _, t in forked.run(_started, 3, jobs=2, first=lambda i: -i)}
    assert start[0] > max(start[1], start[2])
    start = {i: t for i, _, t in forked.run(_started, 3, jobs=2)}
    assert start[2] > max(start[0], start[1])


_HIGHS_THEN_FORK = """
import datetime, random, sys
from ortools.math_opt.python import mathopt
from ortools.math_opt.solvers import highs_pb2
from autopart import forked

def solve(seed):
    random.seed(seed)
    m = mathopt.Model()
    xs = [m.add_binary_variable() for _ in range(300)]
    for _ in range(150):
        m.add_linear_constraint(sum(random.random() * xs[k] for k in random.sample(range(300), 12)) >= 1.7)
    m.minimize(sum(random.random() * x for x in xs))
    params = mathopt.SolveParameters(time_limit=datetime.timedelta(seconds=2),
                                     highs=highs_pb2.HighsOptionsProto(int_options={"threads": 4}))
    with forked.watch("HiGHS"):  # as autopart.solver.ilp runs it
        return mathopt.solve(m, mathopt.SolverType.HIGHS, params=params).objective_value()

solve(0)  # HiGHS starts its process-wide pool of 4 threads here
jobs = forked.jobs_for(2, None)
got = [ok for _, ok, _ in forked.run(solve, 2, jobs, timeout=60)]  # forked after the pool: the children hang
print(jobs, got, forked._UNSAFE)
"""


@pytest.mark.skipif(forked.native_threads() is None, reason="threads are counted on Linux only")
def test_no_fork_after_the_solver_started_its_threads() -> None:
    """A process whose HiGHS started worker threads plans in itself: forked, its children would hang in their first
    solve (without the guard this script's two forked solves time out)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _HIGHS_THEN_FORK], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "1 [True, True] ['HiGHS']"


@pytest.mark.skipif(forked.native_threads() is None, reason="threads are counted on Linux only")
def test_watch_notes_only_calls_that_start_threads(monkeypatch) -> None:
    import threading

    monkeypatch.setattr(forked, "_UNSAFE", [])
    with forked.watch("nothing"):
        sum(range(1000))
    assert forked._UNSAFE == [] and forked.jobs_for(2, None) == min(2, forked.cpus())
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    try:
        with forked.watch("a pool"):
            worker.start()
        assert forked._UNSAFE == ["a pool"] and forked.jobs_for(2, None) == 1 and forked.jobs_for(2, 2) == 1
    finally:
        stop.set()
        worker.join()


def test_call_runs_in_a_child_and_hands_back_its_value_or_error() -> None:
    assert forked.call(os.getpid) != os.getpid() or forked.jobs_for(2, None) == 1
    assert forked.call(os.getpid, jobs=1) == os.getpid()
    with pytest.raises(ValueError, match="task 2 refused") as e:
        forked.call(lambda: _task(2))
    assert forked.jobs_for(2, None) == 1 or isinstance(e.value.__cause__, forked.ChildTraceback)


@pytest.mark.skipif(forked.cpus() < 2, reason="one core: advise plans in its own process")
def test_advise_solves_nothing_in_its_own_process(monkeypatch) -> None:
    """Forked, advise leaves the solves (and the threads a solver starts) to its children, even with one view, so
    the process can go on forking; ``jobs=1`` solves here."""
    import importlib
    from contextlib import contextmanager

    adv = importlib.import_module("autopart.advise")  # the module (``autopart.advise`` is the function)
    here = []

    @contextmanager
    def watch(what):
        here.append(what)
        yield

    monkeypatch.setattr(forked, "_UNSAFE", [])
    monkeypatch.setattr(forked, "watch", watch)
    a = adv.advise("gpt", "125m", layers=2, seq=128, views=False)
    assert a.fits and here == []
    adv.advise("gpt", "125m", layers=2, seq=128, views=False, jobs=1)
    assert here and set(here) <= {"highs", "scip"}
