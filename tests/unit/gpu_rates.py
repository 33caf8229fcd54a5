"""A fixture for tests that stand for bf16 training on GPU presets with small fp32 models."""

from __future__ import annotations

import dataclasses

import pytest


@pytest.fixture(autouse=True)
def fp32_at_the_bf16_rate(monkeypatch):
    """These cases stand for bf16 training with small fp32 models (their plans, memory and micro-batches were
    tuned so): the GPU presets price fp32 matmuls at the bf16 rate here, as before fp32 had its own. Import it into
    a test module to apply it there."""
    from autopart.cost import cluster as C

    for name in ("a100-80gb", "h100-80gb", "h200-141gb"):
        p = C.PRESETS[name]
        dev = dataclasses.replace(p.device, fp32_flops=p.device.peak_flops, tf32_flops=p.device.peak_flops)
        monkeypatch.setitem(C.PRESETS, name, dataclasses.replace(p, device=dev))
