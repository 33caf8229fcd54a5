"""Token-local modules (``autopart.regions``): traced as one node, priced from a fake run, split on the tokens."""

from __future__ import annotations

import pytest
import torch

import autopart
from autopart import regions
from autopart.strategy import options_for
from autopart.trace import trace
from tests.multiproc.parity import LoopExperts, batches, make_model

aten = torch.ops.aten


def _local_nodes(traced):
    return list(traced.gm.graph.find_nodes(op="call_function", target=regions.OP))


def test_hf_moe_block_traces_as_one_node_priced_per_token() -> None:
    pytest.importorskip("transformers")
    ids = batches()[0]
    traced = trace(make_model("hf-mixtral"), (ids,), {"labels": ids})
    nodes = _local_nodes(traced)
    assert len(nodes) == 2
    targets = {n.target for n in traced.gm.graph.nodes if n.op == "call_function"}
    assert aten.sort.default not in targets and aten.histc.default not in targets  # the dispatch stays inside
    r = regions.region(nodes[0].args[0])
    # the experts' sparse-MoE block (router and experts), on its (batch, sequence) grid of tokens
    assert r.path == "model.layers.0.mlp" and r.grid == tuple(ids.shape) and not r.measured
    # the region calls a copy of the block whose weights are meta: the user's full-size weights are not kept
    assert all(t.is_meta for t in r.module.parameters()) and len(list(r.module.parameters())) == 3
    h, inter, k, e = 32, 64, 2, 4  # the router (h -> e); each token meets k experts: h -> 2 inter, inter -> h
    assert r.flops_per_token == 2 * h * e + k * (2 * h * 2 * inter + 2 * inter * h)
    assert r.backward_flops_per_token == 2 * r.flops_per_token
    assert r.saved_per_token > 0
    # the node's inputs: the hidden states, then the router's weight and the two stacked expert weights
    shapes = [tuple(a.meta["val"].shape) for a in nodes[0].args[1]]
    assert shapes == [(4, 16, 32), (4, 32), (4, 128, 32), (4, 32, 64)]
    from autopart.cost.compute import backward_flops, node_flops

    vals = [a.meta["val"] for a in nodes[0].args[1]]
    fwd = node_flops(regions.OP, (nodes[0].args[0], vals), {}, None)
    assert fwd == r.flops_per_token * 64 and backward_flops(regions.OP, fwd) == 2 * fwd


def test_rule_splits_tokens_and_offers_expert_parallelism() -> None:
    pytest.importorskip("transformers")
    ids = batches()[0]
    traced = trace(make_model("hf-mixtral", layers=1), (ids,), {"labels": ids})
    (node,) = _local_nodes(traced)
    r = regions.region(node.args[0])
    assert (r.experts, r.num_experts, r.top_k, r.ep_ok) == ("experts", 4, 2, True)
    assert [r.names[i - r.n_args] for i in r.expert_inputs] == ["experts.gate_up_proj", "experts.down_proj"]
    opts, ruled = options_for(node, (2,))
    specs = {(tuple(str(p[0]) for p in o.inputs), tuple(str(p[0]) for p in o.output)) for o in opts}
    S0, S1, R = "S(0)", "S(1)", "R"  # whole, split by batch, split by sequence
    # the tokens split with the weights whole (data parallel), or with the 4 experts split 2 ways too (expert
    # parallel); the router's weight (input 1) always whole
    assert ruled and specs == {((R,) * 4, (R,)), ((S0, R, R, R), (S0,)), ((S1, R, R, R), (S1,)),
                               ((S0, R, S0, S0), (S0,)), ((S1, R, S0, S0), (S1,))}
    opts3, _ = options_for(node, (3,))  # neither 4 sequences nor 16 positions split 3 ways: whole only
    assert len(opts3) == 1 and all(str(p[0]) == R for p in opts3[0].inputs)
    opts8, _ = options_for(node, (8,))  # 16 positions split 8 ways; 4 experts cannot be
    assert {tuple(str(p[0]) for p in o.inputs) for o in opts8} == {(R,) * 4, (S1, R, R, R)}


def test_expert_parallel_all_to_alls_priced() -> None:
    """An expert-parallel option pays two all-to-alls of its (token, expert) rows forward and two backward; the
    data-parallel option of the same tokens pays none inside the node."""
    pytest.importorskip("transformers")
    from autopart.cost.comm import collective_time
    from autopart.planner import ep_axes, internal_comm_time

    ids = batches()[0]
    traced = trace(make_model("hf-mixtral", layers=1), (ids,), {"labels": ids})
    (node,) = _local_nodes(traced)
    cluster = autopart.preset("h100-80gb", (2, 4))
    opts, _ = options_for(node, (2, 4))
    by_axes = {}
    for o in opts:
        by_axes.setdefault(ep_axes(node, o.inputs), []).append(o)
    assert set(by_axes) == {(), (0,), (1,)}  # 4 experts split over 2 or 4 ranks; not 8 (both axes)
    assert all(internal_comm_time(node, o, cluster) == 0 for o in by_axes[()])
    for o in by_axes[(0,)] + by_axes[(1,)]:
        split = 1
        for a, n in enumerate((2, 4)):
            split *= n if str(o.inputs[0][a]).startswith("S") else 1
        rows = 4 * 16 // split * 2 * 32 * 4  # tokens on the rank x top-2 x hidden 32 x fp32
        (a,) = ep_axes(node, o.inputs)
        one = collective_time("all_to_all", rows, (2, 4)[a], cluster.link(a))
        assert internal_comm_time(node, o, cluster) == pytest.approx(4 * one)
        assert internal_comm_time(node, o, cluster, with_backward=False) == pytest.approx(2 * one)


class _Block(torch.nn.Module):
    """Returns its (batch, sequence, hidden) output and per-token router logits flattened (b*s, experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(32, 4)

    def forward(self, x):
        logits = self.router(x).flatten(0, 1)
        return x * torch.sigmoid(logits.sum(-1)).view(x.shape[:2] + (1,)), logits


class _WithBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(128, 32)
        self.block = _Block()

    def forward(self, ids):
        y, logits = self.block(self.emb(ids))
        return y.sum() + logits.square().mean()


def test_flattened_token_outputs_split_with_the_batch_only() -> None:
    """An output holding the grid's tokens flattened (batch-major) splits with the batch (its rows of a batch
    split are contiguous) but not with the sequence."""
    autopart.register_token_local(_Block)
    (node,) = _local_nodes(trace(_WithBlock(), (batches()[0],)))
    opts, _ = options_for(node, (2,))
    specs = {(tuple(str(p[0]) for p in o.inputs), tuple(str(p[0]) for p in o.output)) for o in opts}
    assert specs == {(("R",) * 3, ("R", "R")), (("S(0)", "R", "R"), ("S(0)", "S(0)"))}


def test_plans_split_the_tokens_on_dp_and_the_experts_on_tp() -> None:
    pytest.importorskip("transformers")
    ids = batches()[0]
    model = make_model("hf-mixtral", layers=1)
    dp = autopart.plan(model, autopart.mesh((2,), ("dp",)), (ids,), {"labels": ids}, roles={"dp": "dp"})
    (rec,) = [r for r in dp.nodes.values() if "token_local" in r["op"]]
    assert rec["output"] == ["S(0)"] and rec["op"].endswith("(model.layers.0.mlp)")
    assert all(v == "R" for k, v in dp.params.items() if "experts" in k)
    # before, a dp role had no plan: the dispatch's sort/histc/index over all tokens had no batch-split option.
    # Under a tp role the experts split over the axis (expert parallelism, tokens split with them); the router's
    # weight, which the token-local node takes whole, stays whole instead of having no plan
    tp = autopart.plan(model, autopart.mesh((2,), ("tp",)), (ids,), {"labels": ids}, roles={"tp": "tp"})
    experts = {k: v for k, v in tp.params.items() if "experts" in k}
    assert len(experts) == 2 and all(v == "S(0)" for v in experts.values()), experts
    assert tp.params["model.layers.0.mlp.gate.weight"] == "R"
    assert "model.layers.0.mlp (4 experts over tp)" in str(tp)
    assert any("S" in v for k, v in tp.params.items() if "self_attn" in k)  # the attention weights still shard


class _Undeclared(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(128, 32)
        self.experts = torch.nn.Sequential()  # replaced below
        self.head = torch.nn.Linear(32, 128)

    def forward(self, ids):
        x = self.emb(ids)
        return self.head(x + self.experts(x.flatten(0, 1)).view_as(x)).sum()


class _Plain(torch.nn.Module):  # LoopExperts' code, not declared token-local
    forward = LoopExperts.forward

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(32, 4, bias=False)
        self.w = torch.nn.Parameter(torch.randn(4, 32, 32) / 32 ** 0.5)


def test_declared_module_with_data_dependent_shapes_traces_as_one_node() -> None:
    ids = batches()[0]
    model = _Undeclared()
    model.experts = _Plain()
    with pytest.raises(ValueError, match="data-dependent shape(.|\n)*register_token_local"):  # nonzero
        trace(model, (ids,))
    model.experts = LoopExperts()
    (node,) = _local_nodes(trace(model, (ids,)))
    r = regions.region(node.args[0])
    # its forward cannot run on fake tensors either: priced as a dense module (each token meets every weight)
    assert r.measured and r.flops_per_token == 2 * (32 * 4 + 4 * 32 * 32)
    assert isinstance(node.meta["val"], list) and tuple(node.meta["val"][0].shape) == (64, 32)


def test_register_token_local_checks_its_argument() -> None:
    with pytest.raises(TypeError, match="nn.Module subclass or a predicate"):
        autopart.register_token_local(int)
    with pytest.raises(TypeError, match="nn.Module subclass or a predicate"):
        autopart.register_token_local("experts")


def test_the_op_run_eagerly_differentiates_its_module() -> None:
    """``autopart::token_local`` called as an op (not through the runtime's ``run``) recomputes the module's forward
    in backward: its gradients equal the module's own."""
    torch.manual_seed(0)
    m = LoopExperts()
    x = torch.randn(16, 32, requires_grad=True)
    m(x).square().sum().backward()
    want = [x.grad.clone(), m.router.weight.grad.clone(), m.w.grad.clone()]
    x.grad = None
    m.zero_grad()
    leaves, spec = torch.utils._pytree.tree_flatten(((x,), {}))
    r = regions.Region(module=m, path="m", leaves=[None], spec=spec, n_args=1, names=["router.weight", "w"],
                       grid=(16,))
    regions._REGIONS.append(r)
    key = len(regions._REGIONS) - 1
    (out,) = regions.token_local(key, [x, m.router.weight, m.w])
    out.square().sum().backward()
    for got, ref in zip([x.grad, m.router.weight.grad, m.w.grad], want):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


def test_experts_split_over_data_parallel_ranks() -> None:
    """On a dp axis the stacked expert weights may stay split along the expert dim (expert parallelism over the
    data-parallel ranks): not ZeRO (their gradients are complete on their rank, never reduced or gathered), under
    any ZeRO level of the other weights. Other weights on a dp axis stay whole or ZeRO-sharded."""
    pytest.importorskip("transformers")
    ids = batches()[0]
    model = make_model("hf-mixtral", layers=1)
    experts = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    for zero in (None, 1, 3):
        plan = autopart.plan(model, autopart.mesh((2,), ("dp",)), (ids,), {"labels": ids}, roles={"dp": "dp"},
                             zero=zero, pins=dict.fromkeys(experts, "S(0)"))
        assert [plan.params[k] for k in experts] == ["S(0)", "S(0)"], (zero, plan.params)
        assert not set(experts) & set(plan.reduced) and not set(experts) & set(plan.zero), (zero, plan.zero)
        assert "model.layers.0.mlp (4 experts over dp)" in str(plan)
        if zero == 3:
            assert plan.zero["model.layers.0.self_attn.q_proj.weight"] == 3
    # the router's weight is not an expert weight: split on the dp axis it is ZeRO-3, gathered for its use
    router = "model.layers.0.mlp.gate.weight"
    plan = autopart.plan(model, autopart.mesh((2,), ("dp",)), (ids,), {"labels": ids}, roles={"dp": "dp"},
                         pins={router: "S(0)"})
    assert plan.zero[router] == 3


def test_experts_nest_over_two_axes_and_never_convert() -> None:
    """On a 2x2 mesh the expert weights may be split over both axes (a nested layout): the token-local node offers
    it with the tokens split on both axes, and a plan uses such a weight as stored: no per-axis step converts a
    nested layout, so no collective touches it."""
    pytest.importorskip("transformers")
    from autopart.planner import ep_axes

    ids = batches()[0]
    model = make_model("hf-mixtral", layers=1)
    traced = trace(model, (ids,), {"labels": ids})
    (node,) = _local_nodes(traced)
    opts, _ = options_for(node, (2, 2))
    both = [o for o in opts if ep_axes(node, o.inputs) == (0, 1)]
    assert both and all(all(str(p).startswith("S") for p in o.inputs[0]) for o in both)
    experts = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    plan = autopart.plan(model, autopart.mesh((2, 2), ("dp", "tp")), (ids,), {"labels": ids},
                         roles={"dp": "dp", "tp": "tp"}, pins=dict.fromkeys(experts, "S(0)S(0)"))
    (rec,) = [r for r in plan.nodes.values() if "token_local" in r["op"]]
    assert rec["inputs"][2:] == ["S(0)S(0)", "S(0)S(0)"] and rec["ep_axes"] == [0, 1], rec
    touched = {c["value"] for c in plan.collectives}
    assert not any("experts" in v for v in touched), touched


class _DetachedMiddle(torch.nn.Module):
    """A token-local block whose backward is not 2x its forward: the second projection's input is detached, so
    backward runs its weight gradient only (one product of the forward's two)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 32, bias=False)
        self.b = torch.nn.Linear(32, 32, bias=False)

    def forward(self, x):
        return self.b(self.a(x).detach())


class _WithDetached(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(128, 32)
        self.block = _DetachedMiddle()

    def forward(self, ids):
        return self.block(self.emb(ids)).square().mean()


def test_backward_priced_at_the_measured_ratio() -> None:
    """A token-local node's backward FLOPs are its module's own, measured at trace time, not a fixed 2x."""
    from autopart.cost.compute import backward_flops, node_flops

    autopart.register_token_local(_DetachedMiddle)
    (node,) = _local_nodes(trace(_WithDetached(), (batches()[0],)))
    r = regions.region(node.args[0])
    assert not r.measured and r.flops_per_token == 2 * (2 * 32 * 32)
    assert r.backward_flops_per_token == 2 * 32 * 32  # b's weight gradient only
    vals = [a.meta["val"] for a in node.args[1]]
    fwd = node_flops(regions.OP, (node.args[0], vals), {}, None)
    assert backward_flops(regions.OP, fwd, node.args) == fwd // 2
