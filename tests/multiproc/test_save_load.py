"""``pm.save_checkpoint`` / ``pm.load_checkpoint``: atomic saves, resuming on another plan, master weights either
way, the job's extra state, and the errors a wrong checkpoint gets."""

from __future__ import annotations

import os

import pytest
import torch

from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import OPT, batches, make_model

pytestmark = pytest.mark.multiproc


def _parallelize(model, shape: tuple, names: tuple, roles: dict, zero: int, **kw):
    import autopart

    ids0 = batches()[0]
    return autopart.parallelize(model, autopart.mesh(shape, names), (ids0,), {"labels": ids0}, roles=roles,
                                zero=zero, pipeline="off", **kw)


def _perturbed(layers: int = 2):
    """The test model under another initialisation: only a checkpoint can make it the trained one."""
    model = make_model("gpt", layers)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _save_twice_run(path: str) -> list:
    """dp2 ZeRO-1: a checkpoint before any step, one AdamW step, a second checkpoint over the first (with a step
    counter and an LR scheduler)."""
    pm = _parallelize(make_model("gpt", 4), (2,), ("dp",), {"dp": "dp"}, 1)
    opt = pm.optimizer(torch.optim.AdamW, **OPT)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    pm.save_checkpoint(path, opt, extra={"step": 0, "scheduler": sched})
    ids = batches()[0]
    loss = pm.forward_backward(ids, labels=ids).item()
    opt.step()
    sched.step()
    opt.zero_grad()
    pm.save_checkpoint(path, opt, extra={"step": 1, "scheduler": sched})
    return [loss, sorted(os.listdir(os.path.dirname(path)))]


def _resume_run(path: str):
    """tp2 x dp2 ZeRO-2 (another plan and world size), loaded from the checkpoint: two more steps."""
    model = _perturbed(4)  # kept alive: forward-only calls trace it again
    pm = _parallelize(model, (2, 2), ("tp", "dp"), {"tp": "tp", "dp": "dp"}, 2)
    opt = pm.optimizer(torch.optim.AdamW, lr=0.5, eps=1.0)  # hyperparameters come from the checkpoint
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    extra = pm.load_checkpoint(path, opt, extra={"step": -1, "scheduler": sched})
    losses = []
    for ids in batches()[1:]:
        losses.append(pm.forward_backward(ids, labels=ids).item())
        opt.step()
        sched.step()
        opt.zero_grad()
    full = {k: v.clone() for k, v in pm.full_state_dict().items()}
    return losses, full, str(pm.plan), pm.plan.to_json(), pm(batches()[0]).detach(), extra["step"], sched.last_epoch


def test_save_replaces_and_resumes_on_another_plan(tmp_path):
    """A second save over the first replaces it whole (nothing but the checkpoint is left beside it); loaded on
    another plan and world size, the run continues as one process's 3 uninterrupted steps, with its step counter
    and LR scheduler. The saving run checkpoints before its first step too, which must not count as a step."""
    from tests.multiproc.parity import check, reference

    path = str(tmp_path / "ckpt")
    saved = run_ranks(2, _save_twice_run, path)
    ref_losses, ref_params, ref_logits = reference("gpt", 4)
    assert all(abs(loss - ref_losses[0]) <= 1e-5 for loss, _ in saved), saved
    assert all(listing == ["ckpt"] for _, listing in saved), saved  # no .partial, no .old
    results = run_ranks(4, _resume_run, path)
    check("gpt", [r[:5] for r in results], (ref_losses[1:], ref_params, ref_logits))
    assert all(r[5] == 1 and r[6] == 3 for r in results), [r[5:] for r in results]


def _failed_save_run(path: str) -> dict:
    """A checkpoint, one step, a second save whose writes fail on rank 1 (a full disk): the first must survive.
    Then a checkpoint interrupted between its renames, and the errors of a missing checkpoint, a mismatched model,
    extra keys that clash, and a save into a directory that is not a checkpoint (it must not be replaced)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    shape, names, roles = (2,), ("dp",), {"dp": "dp"}
    pm = _parallelize(make_model("gpt"), shape, names, roles, 2)
    opt = pm.optimizer(torch.optim.AdamW, **OPT)
    pm.save_checkpoint(path, opt)
    first = {k: v.clone() for k, v in pm.full_state_dict().items()}
    ids = batches()[0]
    pm.forward_backward(ids, labels=ids)
    opt.step()
    opt.zero_grad()
    out: dict = {}
    write = FileSystemWriter.write_data

    def full_disk(self, plan, planner):
        raise OSError(28, "No space left on device")

    if dist.get_rank() == 1:
        FileSystemWriter.write_data = full_disk
    try:
        pm.save_checkpoint(path, opt)
        out["failed"] = None
    except Exception as e:  # noqa: BLE001 - what each rank saw
        out["failed"] = f"{type(e).__name__}: {e}"
    finally:
        FileSystemWriter.write_data = write
    dist.barrier()
    out["listing"] = sorted(os.listdir(os.path.dirname(path)))
    fresh = _parallelize(_perturbed(), shape, names, roles, 2)
    opt2 = fresh.optimizer(torch.optim.AdamW, **OPT)
    fresh.load_checkpoint(path, opt2)
    out["loaded_first"] = all(torch.equal(v, first[k]) for k, v in fresh.full_state_dict().items())
    dist.barrier()
    if dist.get_rank() == 0:  # a save stopped between its two renames: only <path>.old is there
        os.replace(path, path + ".old")
    dist.barrier()
    with pytest.warns(UserWarning, match="a save was stopped while it replaced it"):
        fresh.load_checkpoint(path, opt2)
    out["loaded_old"] = all(torch.equal(v, first[k]) for k, v in fresh.full_state_dict().items())
    for case, call in [("missing", lambda: fresh.load_checkpoint(path + "-nothing")),
                       ("other model", lambda: _parallelize(make_model("llama"), shape, names, roles, 2)
                        .load_checkpoint(path + ".old")),
                       ("extra clash", lambda: fresh.save_checkpoint(path + "-x", extra={"model": 1})),
                       ("not a checkpoint", lambda: fresh.save_checkpoint(os.path.dirname(path)))]:
        try:
            call()
            out[case] = None
        except (FileNotFoundError, FileExistsError, ValueError) as e:
            out[case] = str(e)
    dist.barrier()
    out["listing_after"] = sorted(os.listdir(os.path.dirname(path)))
    return out


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path):
    """A save that fails on one rank raises on every rank and leaves the previous checkpoint whole and loadable,
    with nothing half-written beside it; the errors of a missing or mismatched checkpoint say what to do."""
    path = str(tmp_path / "ckpt")
    results = run_ranks(2, _failed_save_run, path)
    for out in results:
        assert out["failed"].startswith("RuntimeError: save_checkpoint: writing"), out
        assert "rank(s) [1]" in out["failed"], out
        assert "No space left on device" in out["failed"] and "nothing was replaced" in out["failed"], out
        assert out["listing"] == ["ckpt"], out  # the failed save's .partial removed, the old checkpoint in place
        assert out["loaded_first"] and out["loaded_old"], out
        assert "does not exist" in out["missing"], out
        assert "lacks" in out["other model"] and "model." in out["other model"], out
        assert "name them otherwise" in out["extra clash"], out
        assert "is not a checkpoint" in out["not a checkpoint"], out  # and the directory is still there:
        assert out["listing_after"] == ["ckpt.old"], out


def _master_either_way_run(path: str, saved_with_master: bool):
    """dp2 ZeRO-1, float32 weights: one step with the optimizer as saved (float64 master weights or none), a
    checkpoint, a fresh module loaded from it with the other kind of optimizer, two more steps."""
    from autopart.runtime.module import ShadowOptimizer

    shape, names, roles = (2,), ("dp",), {"dp": "dp"}
    with_master = {"master_dtype": torch.float64}
    pm = _parallelize(make_model("gpt"), shape, names, roles, 1)
    opt = pm.optimizer(torch.optim.AdamW, **OPT, **(with_master if saved_with_master else {}))
    steps = batches()
    losses = [pm.forward_backward(steps[0], labels=steps[0]).item()]
    opt.step()
    opt.zero_grad()
    pm.save_checkpoint(path, opt)
    model = _perturbed()  # kept alive: forward-only calls trace it again
    fresh = _parallelize(model, shape, names, roles, 1)
    opt2 = fresh.optimizer(torch.optim.AdamW, **OPT, **({} if saved_with_master else with_master))
    fresh.load_checkpoint(path, opt2)
    if not saved_with_master:  # the master copies start from the loaded weights, exactly
        assert isinstance(opt2, ShadowOptimizer)
        exact = all(torch.equal(h, p._local_tensor.detach().double() if hasattr(p, "_local_tensor") else
                                p.detach().double()) for p, h in zip(opt2.params, opt2.shadows))
    else:
        exact = True
    for ids in steps[1:]:
        losses.append(fresh.forward_backward(ids, labels=ids).item())
        opt2.step()
        opt2.zero_grad()
    full = {k: v.clone() for k, v in fresh.full_state_dict().items()}
    return losses, full, str(fresh.plan), fresh.plan.to_json(), fresh(steps[0]).detach(), exact


@pytest.mark.parametrize("saved_with_master", [False, True])
def test_master_weights_either_way(tmp_path, saved_with_master):
    """A checkpoint saved without master weights loads into an optimizer with them (their copies start from the
    loaded weights), and one saved with them into an optimizer without (it steps the loaded weights): losses and
    parameters as one process switching at the same step."""
    from tests.multiproc.parity import check, reference, reference_master

    results = run_ranks(2, _master_either_way_run, str(tmp_path / "ckpt"), saved_with_master)
    assert all(r[5] for r in results)
    if saved_with_master:  # float64 copies of float32 weights for one step, then the weights themselves: the
        # float64 step rounds to the same float32 weights within the parity tolerance of a plain run
        ref = reference("gpt")
    else:
        ref = reference_master("gpt", torch.float64, from_step=1)
    check("gpt", [r[:5] for r in results], ref)
