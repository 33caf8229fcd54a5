"""The MoE reference model (dense GShard routing: capacity, dropping, auxiliary loss), the einsum/topk/one_hot
rules and FLOP count it needs, and the structure of an expert-parallel plan (no process group)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopart
from autopart.cost import node_flops
from autopart.models.moe import MoE, MoEConfig, MoELayer, expert_nodes
from autopart.placement import Partial, Replicate, Shard, parse_spec
from autopart.strategy import options_for
from autopart.trace import trace

aten = torch.ops.aten
CFG = MoEConfig(vocab_size=128, max_seq_len=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, n_expert=8,
                top_k=2)


def _ids(b: int = 4, s: int = 16) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (b, s), generator=torch.Generator().manual_seed(1))


def test_config_checks_its_numbers():
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(n_expert=4, top_k=5)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoEConfig(capacity_factor=0.0)
    assert CFG.capacity(16) == 5  # ceil(1.25 * 2 * 16 / 8)


def test_routing_keeps_capacity_and_drops_in_order():
    """A router sending every token to experts 0 (first choice) and 1 (second): each expert fills its C slots with
    the first C tokens of the sequence, one token per slot; the rest are dropped (no dispatch, zero combine)."""
    torch.manual_seed(0)
    layer = MoELayer(CFG)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0], layer.router.weight[1, 0] = 2.0, 1.0
    x = torch.zeros(3, 16, CFG.d_model)
    x[..., 0] = 1.0
    dispatch, combine, _ = layer.route(x)
    c = CFG.capacity(16)
    assert dispatch.shape == combine.shape == (3, 16, CFG.n_expert, c)
    per_token = dispatch.sum(dim=(2, 3))
    assert torch.equal(per_token[:, :c], torch.full((3, c), 2.0)) and not per_token[:, c:].any()
    for e in (0, 1):  # slot j of expert e holds token j
        assert torch.equal(dispatch[:, :c, e, :], torch.eye(c).expand(3, c, c))
    assert not dispatch[:, :, 2:].any()
    assert torch.allclose(combine.sum(dim=(2, 3))[:, :c], torch.ones(3, c))  # top-2 gates renormalised
    y, _ = layer(x)
    assert y[:, c:].abs().max() == 0 and y[:, :c].abs().max() > 0  # dropped tokens: zero (the residual carries)


def test_test_data_overflows_capacity():
    """The parity tests' batches really exercise dropping: some expert gets more than C tokens of a sequence."""
    model = MoE(CFG)
    seen = []
    model.blocks[0].moe.register_forward_hook(lambda m, args, out: seen.append(m.route(args[0])[0]))
    model(_ids())
    assigned = seen[0].sum()
    assert assigned < 4 * 16 * CFG.top_k, "no token was dropped: raise the load or lower the capacity factor"


def test_aux_loss_is_added_with_its_coefficient():
    auxes = []
    model = MoE(dataclasses.replace(CFG, aux_loss_coef=0.0))
    for b in model.blocks:
        b.moe.register_forward_hook(lambda m, args, out: auxes.append(out[1].detach()))
    ids = _ids()
    base = model(ids, labels=ids)
    coef = 0.5
    model.cfg = dataclasses.replace(CFG, aux_loss_coef=coef)
    with_aux = model(ids, labels=ids)
    layer_aux = auxes[2] + auxes[3]
    assert layer_aux > 0
    torch.testing.assert_close(with_aux - base, coef * layer_aux)
    # the aux loss trains the router: its gradient changes with the coefficient
    grads = []
    for c in (0.0, coef):
        model.cfg = dataclasses.replace(CFG, aux_loss_coef=c)
        model.zero_grad()
        model(ids, labels=ids).backward()
        grads.append(model.blocks[0].moe.router.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])


def test_exports_with_static_shapes():
    t = trace(MoE(CFG), (_ids(),), {"labels": _ids()})
    targets = {n.target for n in t.graph.nodes if n.op == "call_function"}
    assert aten.nonzero.default not in targets and aten.index.Tensor not in targets
    nodes = expert_nodes(t.graph)
    assert [len(nodes[k]) for k in ("dispatch", "experts", "combine")] == [2, 6, 2]


def test_expert_flops_are_priced_at_capacity():
    """The expert einsums cost 2·E·G·C·d·f whatever the routing: the capacity factor is what imbalance costs."""
    ids = _ids()
    for cf in (1.0, 2.0):
        cfg = dataclasses.replace(CFG, capacity_factor=cf)
        t = trace(MoE(cfg), (ids,), {"labels": ids})
        first = next(n for n in t.graph.nodes if n.name == expert_nodes(t.graph)["experts"][0])
        vals = [a.meta["val"] for a in first.args[1]]
        flops = node_flops(first.target, (first.args[0], vals), {}, first.meta["val"])
        assert flops == 2 * cfg.n_expert * ids.shape[0] * cfg.capacity(ids.shape[1]) * cfg.d_model * cfg.d_ff


def test_einsum_rule():
    """Each letter of the equation is one sharding; equations the rule does not read run replicated."""
    t = trace(MoE(CFG), (_ids(),), {"labels": _ids()})
    dispatch = next(n for n in t.graph.nodes if n.name == expert_nodes(t.graph)["dispatch"][0])
    opts, known = options_for(dispatch, (2,))
    pairs = {(o.inputs, o.output) for o in opts}  # inputs: (mask [g, s, e, c], x [g, s, d]); output [e, g, c, d]
    assert known
    R = Replicate()
    assert (((Shard(0),), (Shard(0),)), (Shard(1),)) in pairs  # g: split groups, the data-parallel layout
    assert (((Shard(2),), (R,)), (Shard(0),)) in pairs  # e: x has no e, it stays whole
    assert (((R,), (Shard(2),)), (Shard(3),)) in pairs  # d
    assert (((Shard(1),), (Shard(1),)), (Partial(),)) in pairs  # s is contracted: partial sums
    both = {(a[0].dim, b[0].dim) for (a, b), _ in pairs if isinstance(a[0], Shard) and isinstance(b[0], Shard)}
    assert both == {(0, 0), (1, 1)}  # only the letters both operands hold split both

    class Diag(torch.nn.Module):
        def forward(self, x):
            return torch.einsum("...ii->...i", x)

    t = trace(Diag(), (torch.randn(4, 6, 6),))
    node = next(n for n in t.graph.nodes if n.target == aten.einsum.default)
    opts, known = options_for(node, (2,))
    assert known and all(str(o) == "R -> R" for o in opts)


def _pins(t, names: tuple[str, ...]) -> dict[str, str]:
    nodes = expert_nodes(t.graph)
    pins = {"ids": "S(0)"} | {n: "S(1)" for n in nodes["dispatch"]}
    return pins | {n: "S(0)" for n in nodes["experts"] + nodes["combine"]}


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_plan_structure(ep: int):
    """Tokens split on the batch, experts on the expert dim: per MoE layer one all-to-all to the experts and one
    back, forward and backward, nothing else; expert weights stored as their shard; the aux loss is planned as a
    partial mean over the split groups."""
    model, ids = MoE(CFG), _ids()
    t = trace(model, (ids,), {"labels": ids})
    plan = autopart.plan(model, autopart.mesh((ep,), ("ep",)), (ids,), {"labels": ids}, pins=_pins(t, ("ep",)),
                         traced=t, pipeline="off")
    for i in range(CFG.n_layer):
        for w in ("w_gate", "w_up", "w_down"):
            assert parse_spec(plan.params[f"blocks.{i}.moe.{w}"]) == (Shard(0),)
        assert plan.params[f"blocks.{i}.moe.router.weight"] == "R"
        assert plan.collective_counts(f"blocks.{i}", "fwd") == {("all_to_all", "ep"): 2}
        assert plan.collective_counts(f"blocks.{i}", "bwd") == {("all_to_all", "ep"): 2}
        aux_means = [r for r in plan.nodes.values()
                     if r["layer"] == f"blocks.{i}" and r["op"] == str(aten.mean.default)]
        assert [r["output"] for r in aux_means] == ["P"], aux_means
    a2a = [c for c in plan.collectives if any(s[1] == "all_to_all" for s in c["steps"])]
    assert {(c["value"], c["user"]) for c in a2a} == {
        (d, e) for d, e in zip(expert_nodes(t.graph)["dispatch"], expert_nodes(t.graph)["experts"][::3])
    } | {(e, c) for e, c in zip(expert_nodes(t.graph)["experts"][2::3], expert_nodes(t.graph)["combine"])}
    assert not plan.unsupported_ops or set(plan.unsupported_ops) <= {"aten.arange.default", "aten.arange.start_step"}
    # the axis splits the tokens (data) and the experts (expert): not tensor parallel, though most bytes are split
    assert plan.axis_role(0) == "data+expert" and "axes: ep: data+expert" in str(plan)


def test_all_to_all_is_priced_at_the_ranks_shard():
    """Shard(1) -> Shard(0) of the expert input: each rank sends (n-1)/n of its own 1/n of the array, forward and
    (the gradient) backward: ``all_to_all_time`` of the local bytes, not of the whole array."""
    from autopart.cost import all_to_all_time, preset
    from autopart.planner import transition_time

    val = torch.empty(8, 4, 5, 32, device="meta")  # [E, G, C, d]
    for n in (2, 4):
        cluster = preset("h100-80gb", (n,))
        t = transition_time(val, (Shard(1),), (Shard(0),), (True,), True, cluster)
        local = val.numel() * 4 / n
        assert t == pytest.approx(2 * all_to_all_time(local, n, cluster.link(0)))
