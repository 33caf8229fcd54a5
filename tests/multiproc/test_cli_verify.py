"""``autopart verify``: a model's plan trained on gloo ranks (torchrun) against one process. It says parity where
the plan computes what the model does, and MISMATCH (exit status 3) where the run cannot match: a model with dropout
draws other random masks on every rank."""

from __future__ import annotations

import pytest
import torch

from autopart.cli import VERIFY_MISMATCH, main


def dropout_gpt():
    """A factory whose model trains with dropout (randomness the ranks and the single process draw differently)."""
    from autopart.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=128, max_seq_len=32, n_layer=2, n_head=4, d_model=32, dropout=0.3))


def test_verify_says_parity_for_tensor_and_data_parallel_llama(capfd) -> None:
    rc = main(["verify", "--model", "llama:tiny", "--role", "dp=dp", "--role", "tp=tp", "--zero", "1", "--steps", "2"])
    out, err = capfd.readouterr()
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "axes: dp: data, tp: tensor" in out  # the plan it ran, printed by rank 0
    last = out.strip().splitlines()[-1]
    assert last.endswith("parity") and "max |difference| after 2 steps" in last, last


def running_mean():
    """A buffer updated under ``torch.no_grad()`` from a batch mean (the runtime had dropped the update)."""
    from tests.unit.test_trace import RunningMean

    torch.manual_seed(0)
    return RunningMean()


def test_verify_compares_buffers_and_a_no_grad_update_matches(capfd) -> None:
    """Tensor parallel on one axis, the other left to the solver (a model without blocks: no pipeline tried)."""
    rc = main(["verify", "--factory", "tests.multiproc.test_cli_verify:running_mean", "--mesh", "2x2", "--role",
               "tp=tp", "--steps", "2"])
    out, err = capfd.readouterr()
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "parameters and 1 buffers" in out and out.strip().endswith("parity"), out[-2000:]


def test_a_nan_or_a_shape_is_never_equal() -> None:
    from autopart.cli import _differs

    a = torch.zeros(3)
    assert _differs(a, torch.tensor([0.0, float("nan"), 0.0])) == float("inf")
    assert _differs(a, torch.zeros(4)) == float("inf")
    assert _differs(a, a + 1e-7) == pytest.approx(1e-7)


def test_verify_catches_a_run_that_differs(capfd) -> None:
    rc = main(["verify", "--factory", "tests.multiproc.test_cli_verify:dropout_gpt", "--mesh", "2", "--steps", "2"])
    out, err = capfd.readouterr()
    assert rc == VERIFY_MISMATCH, out[-3000:] + err[-3000:]
    assert "MISMATCH" in out and "dropout" in err


def test_verify_checks_its_flags_before_starting_ranks(capfd) -> None:
    assert main(["verify", "--pipeline", "stages=2,micro_batches=3"]) == 2  # planned before any rank starts
    assert "no plan fits" in capfd.readouterr().err
    assert main(["verify", "--steps", "0"]) == 1
    assert main(["verify", "--role", "zz=tp"]) == 1
    assert main(["verify", "--model", "llama:70b"]) == 1  # refused before building it: 70B fp32 copies per rank
    err = capfd.readouterr().err
    assert "--steps 0" in err and "the mesh's axes are ['dp', 'tp']" in err and "--layers 2 --hidden 256" in err
