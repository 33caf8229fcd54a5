"""Run a function on N real gloo processes (torch.multiprocessing spawn) and collect per-rank results."""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks are forked from a server process that imported these once (``forkserver``), not started as fresh
# interpreters that each import torch, autopart and transformers again (``spawn``: 3 s for 2 ranks and 6-7 s for 4
# on 2 cores, against ~0.1 s once the server runs). The server imports only: it holds no thread, process group or
# CUDA context a child could inherit. Modules missing here are skipped by the server.
# torch.export (with dynamo and AOTAutograd), the solvers, networkx and DCP are imported on first use: preloaded
# too, they cost each rank ~3 s of imports less (a rank traces the model, rank 0 plans).
multiprocessing.set_forkserver_preload([
    "torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint",
    "torch.distributed.pipelining", "torch.export", "torch.export._trace", "networkx", "ortools.sat.python.cp_model",
    "ortools.math_opt.python.mathopt", "ortools.math_opt.core.python.solver", "autopart", "transformers",
    "tests.multiproc.harness", "tests.multiproc.parity"])


def _worker(rank: int, world: int, fn, args, outdir: str, backend: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # rendezvous through a file in the world's own directory, not a TCP port: worlds started at once by parallel
    # test workers cannot collide (a free port found by one can be taken by another before its store listens)
    dist.init_process_group(backend, init_method=f"file://{os.path.join(outdir, 'store')}", rank=rank,
                            world_size=world)
    try:
        result = fn(*args)
        torch.save({"ok": True, "result": result}, os.path.join(outdir, f"{rank}.pt"))
    except Exception:  # noqa: BLE001 - reported to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(outdir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # The outcome is on disk; leave without interpreter teardown. Destroying torch's static objects at exit
    # sometimes finds a C++ thread still joinable ("terminate called without an active exception", SIGABRT),
    # seen in CI after the rank had passed and written its result.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world: int, fn, *args, backend: str = "gloo"):
    """``fn(*args)`` on every rank of a fresh gloo (or NCCL) world; returns the list of per-rank results."""
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(world, fn, args, d, backend), nprocs=world,
                           start_method="forkserver")
        out, errs = [], []
        for r in range(world):
            res = torch.load(os.path.join(d, f"{r}.pt"), weights_only=False)
            if not res["ok"]:
                errs.append(f"rank {r} failed:\n{res['error']}")
            else:
                out.append(res["result"])
        if errs:  # the root cause first: a rank whose peer crashed only reports a closed connection
            errs.sort(key=lambda e: "closed by peer" in e or "Connection reset" in e)
            raise AssertionError("\n".join(errs))
        return out
