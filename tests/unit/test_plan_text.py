"""``print(plan)``: consecutive blocks planned alike print as one row (an 80-layer model's table was 80 rows)."""

from __future__ import annotations

import re

import torch

import autopart
from autopart.models import GPT, GPTConfig


def _rows(plan: autopart.Plan) -> list[str]:
    lines = str(plan).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layer ")) + 2
    return [line.split()[0] for line in lines[start:] if line.strip()][: len(plan.layers())]


def test_blocks_planned_alike_share_a_row_and_a_different_one_does_not() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, max_seq_len=32, n_layer=5, n_head=4, d_model=32))
    ids = torch.randint(0, 128, (8, 16))
    mesh = autopart.mesh((2, 2), ("dp", "tp"))
    plan = autopart.plan(model, mesh, (ids,), {"labels": ids}, roles={"dp": "dp", "tp": "tp"}, pipeline="off")
    rows = [r for r in _rows(plan) if re.match(r"blocks\.|\(top\)", r)]
    assert rows == ["(top)", "blocks.0..4"], rows
    # one block's weight pinned otherwise: its row stands apart, the others around it keep theirs
    plan = autopart.plan(model, mesh, (ids,), {"labels": ids}, roles={"dp": "dp", "tp": "tp"}, pipeline="off",
                         pins={"blocks.2.mlp.fc.weight": "RR"})
    assert plan.params["blocks.2.mlp.fc.weight"] == "RR" and plan.params["blocks.1.mlp.fc.weight"] != "RR"
    rows = [r for r in _rows(plan) if r.startswith("blocks.")]
    assert "blocks.2" in rows and rows[0].startswith("blocks.0") and rows[-1].endswith("4"), rows
    covered = sum(int(r.split("..")[1]) - int(r.split("..")[0].rsplit(".", 1)[1]) + 1 if ".." in r else 1
                  for r in rows)
    assert covered == 5, rows
