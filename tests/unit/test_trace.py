"""``autopart.trace``: in-place writes into computed values are functionalized, buffer writes kept in place."""

from __future__ import annotations

import torch

from autopart.trace import _mutated_args, trace
from tests.multiproc.parity import _InPlace

aten = torch.ops.aten


def _feeds(traced, model, ids, buffers):
    named = dict(model.named_parameters())
    return [named[traced.params[n.name]] if n.name in traced.params else buffers[traced.buffers[n.name]]
            if n.name in traced.buffers else ids for n in traced.graph.find_nodes(op="placeholder")]


def test_writes_into_views_are_functionalized():
    """``buf[:, 1:] = h[:, :-1]`` (``copy_`` into a slice of a computed tensor) becomes ``slice_scatter``, so no
    op of the graph writes into a value another op may have rewritten (a collective's output); the buffer's
    ``+= 1`` stays a write into its placeholder; the graph computes what the model does, buffer update included."""
    torch.manual_seed(0)
    model = _InPlace(2)
    ids = torch.randint(0, 128, (4, 16))
    traced = trace(model, (ids,), {"labels": ids})
    writes = [(n, a) for n in traced.graph.nodes for a in _mutated_args(n)]
    assert writes and all(a.op == "placeholder" and a.name in traced.buffers for _, a in writes), writes
    targets = {n.target for n in traced.graph.nodes}
    assert aten.slice_scatter.default in targets and aten.copy_.default in targets
    assert len(traced.outputs) == 1  # the loss; the buffer's new value is not an output
    buffers = {"calls": torch.zeros(())}
    got = traced.gm(*_feeds(traced, model, ids, buffers))
    want = model(ids, labels=ids)
    torch.testing.assert_close(got[0], want)
    assert float(buffers["calls"]) == 1.0 and float(model.calls) == 1.0


def test_graphs_without_such_writes_are_not_rewritten():
    """A model without in-place writes keeps the training IR as exported (reshape stays reshape)."""
    from autopart.models import GPT, GPTConfig

    ids = torch.randint(0, 64, (2, 8))
    traced = trace(GPT(GPTConfig(vocab_size=64, max_seq_len=8, n_layer=1, n_head=2, d_model=16)), (ids,),
                   {"labels": ids})
    targets = {n.target for n in traced.graph.nodes}
    assert aten.slice_scatter.default not in targets and aten.linear.default in targets
