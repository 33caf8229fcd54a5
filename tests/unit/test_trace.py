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


class RunningMean(torch.nn.Module):
    """A running statistic updated under ``torch.no_grad()`` (export: a ``wrap_with_set_grad_enabled`` block with no
    output), and a no-grad value the loss uses (a block with one)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.fc = torch.nn.Linear(16, 64)
        self.register_buffer("running", torch.zeros(16))

    def forward(self, ids, labels):
        h = self.emb(ids)
        with torch.no_grad():
            self.running.mul_(0.5).add_(0.5 * h.mean(dim=(0, 1)))
        with torch.no_grad():
            scale = 1.0 + h.pow(2).mean(-1, keepdim=True)
        logits = self.fc(h / scale)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_no_grad_blocks_are_inlined_and_keep_their_buffer_writes():
    """The block without outputs was an opaque node dead-code elimination dropped, with the buffer update in it
    (the run's statistic stayed at zero); the other ran as one replicated node. Inlined, each value entering a
    block detached, the graph computes the same loss, gradients and buffer as the module."""
    torch.manual_seed(0)
    model = RunningMean()
    ids = torch.randint(0, 64, (4, 8))
    t = trace(model, (ids,), {"labels": ids.clone()})
    targets = [str(n.target) for n in t.gm.graph.nodes]
    assert not any("wrap_with_set_grad_enabled" in s for s in targets), targets
    writes = [n for n in t.gm.graph.nodes if _mutated_args(n)]
    assert [a.name for n in writes for a in _mutated_args(n)] == ["b_running"]
    # the graph, run eagerly with autograd, against the module: loss, gradients and the buffer's update
    ref = RunningMean()
    ref.load_state_dict(model.state_dict())
    loss = ref(ids, ids.clone())
    loss.backward()
    params = {ph: torch.nn.Parameter(dict(model.named_parameters())[fqn].detach().clone())
              for ph, fqn in t.params.items()}
    running = torch.zeros(16)
    feed = [params[n.name] if n.name in params else running if n.name == "b_running" else
            {"ids": ids, "labels": ids.clone()}[n.name] for n in t.gm.graph.nodes if n.op == "placeholder"]
    out = t.gm(*feed)
    out = out[0] if isinstance(out, (tuple, list)) else out
    out.backward()
    torch.testing.assert_close(out, loss)
    torch.testing.assert_close(running, ref.running)
    for ph, fqn in t.params.items():
        torch.testing.assert_close(params[ph].grad, dict(ref.named_parameters())[fqn].grad)
