"""The parity tests on NCCL with one GPU per rank; skipped without at least two CUDA devices."""

from __future__ import annotations

import math

import pytest
import torch

from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import check, distributed, reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


def _on_gpu(*args):
    out = distributed(*args)
    return tuple(o.cpu() if isinstance(o, torch.Tensor) else
                 {k: v.cpu() for k, v in o.items()} if isinstance(o, dict) else o for o in out)


@pytest.mark.parametrize("config", [((2,), ("dp",), {"dp": "dp"}), ((2,), ("tp",), {"tp": "tp"})])
def test_nccl_parity(config):
    shape, names, roles = config
    results = run_ranks(math.prod(shape), _on_gpu, "gpt", shape, names, roles, backend="nccl")
    check("gpt", results, reference("gpt"))
