"""Sharding rules on real traced graphs and on hand-built nodes."""

from __future__ import annotations

import pytest
import torch

from autopart.models import GPT, GPTConfig, Llama, LlamaConfig
from autopart.placement import Partial, Replicate, Shard, parse_spec, spec_str
from autopart.strategy import options_for
from autopart.strategy.matrix import einsum_options
from autopart.strategy.views import view_groups
from autopart.trace import trace

aten = torch.ops.aten
R, P = Replicate(), Partial()


@pytest.fixture(scope="module")
def gpt_graph():
    ids = torch.randint(0, 64, (4, 8))
    return trace(GPT(GPTConfig(vocab_size=64, max_seq_len=8, n_layer=1, n_head=4, d_model=16)), (ids,),
                 {"labels": ids})


def _node(traced, target):
    return next(n for n in traced.graph.nodes if n.target == target)


def test_einsum_mm_rule():
    opts = einsum_options("mk,kn->mn")
    assert ((Shard(0), R), Shard(0)) in opts  # rows
    assert ((R, Shard(1)), Shard(1)) in opts  # columns
    assert ((Shard(1), Shard(0)), P) in opts  # contraction -> Partial
    assert ((P, R), P) in opts and ((R, P), P) in opts  # linear in each operand
    assert ((P, P), P) not in opts  # product of two partial sums is not a partial sum


def test_linear_megatron_options(gpt_graph):
    opts, known = options_for(_node(gpt_graph, aten.linear.default), (2,))
    assert known
    got = {(tuple(spec_str(s) for s in o.inputs), spec_str(o.output)) for o in opts}
    assert (("R", "S(0)", "S(0)"), "S(2)") in got  # column parallel: weight rows, bias sharded with them
    assert (("S(2)", "S(1)", "P"), "P") in got  # row parallel: bias added once (Partial)
    assert (("S(0)", "R", "R"), "S(0)") in got  # data parallel
    assert not any(o[1] == "P" and o[0][2] != "P" for o in got), "a Partial output needs a Partial bias"


def test_view_groups():
    assert view_groups((4, 16, 32), (4, 16, 4, 8)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]
    assert view_groups((4, 16, 64), (-1, 64)) == [([0, 1], [0]), ([2], [1])]


def test_view_maps_sharded_dims(gpt_graph):
    view = next(n for n in gpt_graph.graph.nodes if n.target == aten.view.default
                and len(n.meta["val"].shape) == 4)  # [b, s, h] -> [b, s, heads, hd]
    got = {(spec_str(o.inputs[0]), spec_str(o.output)) for o in options_for(view, (2,))[0]}
    assert ("S(2)", "S(2)") in got  # hidden split maps to heads
    assert ("S(0)", "S(0)") in got
    assert ("S(2)", "S(3)") not in got  # never the inner dim of a split group


def test_uneven_heads_option_excluded():
    """6 heads on tp=4: splitting attention by heads is not legal and is excluded, never a crash."""
    ids = torch.randint(0, 64, (4, 8))
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=8, n_layer=1, n_head=6, d_model=24))
    t = trace(model, (ids,), {"labels": ids})
    sdpa = _node(t, aten.scaled_dot_product_attention.default)
    opts = options_for(sdpa, (4,))[0]
    assert all(not isinstance(o.output[0], Shard) or o.output[0].dim != 1 for o in opts)
    assert any(o.output == (Shard(0),) for o in opts)  # batch 4 splits evenly
    assert options_for(sdpa, (2,))[0] and any(o.output == (Shard(1),) for o in options_for(sdpa, (2,))[0])


def _gqa_sdpa(heads: int, kv: int, batch: int = 2):
    ids = torch.randint(0, 64, (batch, 8))
    t = trace(Llama(LlamaConfig(vocab_size=64, max_seq_len=8, n_layer=1, n_head=heads, n_kv_head=kv,
                                d_model=8 * heads, d_ff=64)), (ids,), {"labels": ids})
    return _node(t, aten.scaled_dot_product_attention.default)


def _heads_splits(sdpa, mesh) -> set[tuple[str, ...]]:
    """The input specs (q, k, v) of the options that split the heads on the last axis."""
    return {tuple(spec_str(p) for p in o.inputs) for o in options_for(sdpa, mesh)[0]
            if o.output[-1] == Shard(1)}


def test_gqa_heads_split_wider_than_kv_heads_keeps_kv_whole():
    """4 query heads, 2 K/V heads: on 2 devices both split alike; on 4 only the query heads split, K and V whole
    (each device reads the head its query head uses: ``strategy.context.gqa_split``); 8 devices have no query
    head each. 12 query heads and 4 K/V heads on 6 devices: a device's 2 query heads would straddle two K/V heads
    (groups of 3), so no heads split at all; on 8 (16 heads, 4 K/V) one K/V head per pair of devices."""
    sdpa = _gqa_sdpa(4, 2)
    assert _heads_splits(sdpa, (2,)) == {("S(1)", "S(1)", "S(1)")}
    assert _heads_splits(sdpa, (4,)) == {("S(1)", "R", "R")}
    assert _heads_splits(sdpa, (8,)) == set()
    assert _heads_splits(_gqa_sdpa(12, 4), (6,)) == set()
    assert _heads_splits(_gqa_sdpa(16, 4), (8,)) == {("S(1)", "R", "R")}
    # with the batch split on a first axis
    assert ("S(0)S(1)", "S(0)R", "S(0)R") in _heads_splits(sdpa, (2, 4))


def test_gqa_split_reads_one_head_on_one_axis():
    """``gqa_split`` on hand-made specs (16 query heads, 4 K/V heads, mesh (2, 4)): K/V split on the first axis
    (2 heads each) then whole on the second (each device reads one of its 2); the other way round a later axis
    would cut K/V against the one head each device reads: refused. A later axis splitting the query heads alone
    keeps a device's query heads in its group (nested splits of the heads are not offered by the rules yet)."""
    from autopart.strategy import tensor_inputs
    from autopart.strategy.context import gqa_split

    sdpa = _gqa_sdpa(16, 4)
    ins = tensor_inputs(sdpa)
    S1, R_ = Shard(1), Replicate()
    got = gqa_split(sdpa, ins, ((S1, S1), (S1, R_), (S1, R_)), (2, 4))
    assert got and (got.axis, got.kv_heads, got.key, got.value) == (1, 2, 1, 2)
    assert gqa_split(sdpa, ins, ((S1, S1), (R_, S1), (R_, S1)), (2, 4)) is False
    assert gqa_split(sdpa, ins, ((S1, S1), (S1, S1), (S1, S1)), (2, 2)) is None  # alike: no K/V held whole
    assert gqa_split(sdpa, ins, ((S1,), (R_,), (R_,)), (2,)) is False  # 4 K/V heads split 2 ways: alike only
    got = gqa_split(sdpa, ins, ((S1, S1), (R_, R_), (R_, R_)), (8, 2))
    assert got and (got.axis, got.kv_heads) == (0, 4)


def test_cross_entropy_batch_split_is_partial(gpt_graph):
    ce = _node(gpt_graph, aten.cross_entropy_loss.default)
    got = {(tuple(spec_str(s) for s in o.inputs), spec_str(o.output)) for o in options_for(ce, (2,))[0]}
    assert (("S(0)", "S(0)"), "P") in got
    assert (("S(1)", "R"), "R") in got  # vocab-parallel: every rank gets the full loss


def test_unknown_op_is_replicated():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 4, device="meta")
    y = g.call_function(aten.cumprod.default, (x, 0))
    y.meta["val"] = torch.empty(4, 4, device="meta")
    opts, known = options_for(y, (2, 2))
    assert not known
    assert [spec_str(o.output) for o in opts] == ["RR"]


def test_spec_parse_roundtrip():
    for text in ("S(0)R", "RP", "S(2)S(0)", "R"):
        assert spec_str(parse_spec(text)) == text


def test_pointwise_partial_needs_each_operand_once():
    """``x * x`` and ``x / x`` are not linear in x: no option takes a Partial x (the addends' squares do not sum
    to the square), while ``x * y`` and ``x / y`` keep theirs and ``x + x`` its sum of partials."""
    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    for v in (x, y):
        v.meta["val"] = torch.empty(4, 6, device="meta")

    def outputs(target, *args):
        node = g.call_function(target, args)
        node.meta["val"] = torch.empty(4, 6, device="meta")
        return {(tuple(spec_str(s) for s in o.inputs), spec_str(o.output)) for o in options_for(node, (2,))[0]}

    for target in (aten.mul.Tensor, aten.div.Tensor):
        assert not any("P" in ins[0] for ins, _ in outputs(target, x, x)), target
        assert (("P", "R"), "P") in outputs(target, x, y)
    assert (("R", "P"), "P") in outputs(aten.mul.Tensor, x, y)
    assert (("P",), "P") in outputs(aten.add.Tensor, x, x)


def test_embedding_scale_grad_by_freq_keeps_rows_and_ids_whole():
    """``scale_grad_by_freq`` scales each row's gradient by its id's count in the batch: split rows (vocab
    parallel) or ids (data parallel) would count each rank's alone, so only the embedding dim splits."""
    g = torch.fx.Graph()
    w, ids = g.placeholder("w"), g.placeholder("ids")
    w.meta["val"] = torch.empty(16, 8, device="meta")
    ids.meta["val"] = torch.empty(4, 6, device="meta", dtype=torch.int64)
    got = {}
    for freq in (False, True):
        node = g.call_function(aten.embedding.default, (w, ids, 3, freq))
        node.meta["val"] = torch.empty(4, 6, 8, device="meta")
        got[freq] = {(tuple(spec_str(s) for s in o.inputs), spec_str(o.output)) for o in options_for(node, (2,))[0]}
    assert (("S(0)", "R"), "P") in got[False] and (("R", "S(0)"), "S(0)") in got[False]
    assert got[True] == {(("R", "R"), "R"), (("S(1)", "R"), "S(2)")}


def _options(target, args, out_shape, *shapes, int_inputs=()):
    """Options of ``target(*args)`` where the ints in ``args`` that are < 0 name placeholders of ``shapes``
    (-1: the first)."""
    g = torch.fx.Graph()
    xs = []
    for i, s in enumerate(shapes):
        x = g.placeholder(f"x{i}")
        x.meta["val"] = torch.empty(s, device="meta", dtype=torch.int64 if i in int_inputs else torch.float32)
        xs.append(x)

    def sub(a):
        if isinstance(a, list):
            return [sub(b) for b in a]
        return xs[-a - 1] if isinstance(a, int) and not isinstance(a, bool) and a < 0 else a

    node = g.call_function(target, tuple(sub(a) for a in args))
    node.meta["val"] = torch.empty(out_shape, device="meta")
    return {(tuple(spec_str(s) for s in o.inputs), spec_str(o.output)) for o in options_for(node, (2,))[0]}


def test_layout_rules_for_hugging_face_graphs():
    """Rules the Hugging Face zoo needed (tests/multiproc/test_parity.py::test_more_architectures): list indexing
    ``x[:, :, idx]``, ``weight.T``, ``stack``, zero pads, ``type_as``, ``gather``."""
    got = _options(aten.index.Tensor, (-1, [None, None, -2]), (4, 6, 2, 8), (4, 6, 10, 8), (2,), int_inputs=(1,))
    assert {(("S(0)", "R"), "S(0)"), (("S(3)", "R"), "S(3)"), (("P", "R"), "P")} <= got
    assert not any(ins[0] == "S(2)" for ins, _ in got)  # the indexed dim itself does not split
    got = _options(aten.index.Tensor, (-1, [-2]), (6, 4, 8), (10, 8), (6, 4), int_inputs=(1,))
    assert (("R", "S(0)"), "S(0)") in got and (("R", "S(1)"), "S(1)") in got and (("S(1)", "R"), "S(2)") in got
    assert _options(aten.numpy_T.default, (-1,), (8, 4), (4, 8)) >= {(("S(0)",), "S(1)"), (("S(1)",), "S(0)")}
    assert (("S(0)", "S(0)"), "S(0)") in _options(aten.stack.default, ([-1, -2], 1), (4, 2, 6), (4, 6), (4, 6))
    assert (("S(1)", "S(1)"), "S(2)") in _options(aten.stack.default, ([-1, -2], 1), (4, 2, 6), (4, 6), (4, 6))
    pads = _options(aten.constant_pad_nd.default, (-1, [0, 0, 2, 0]), (4, 8, 6), (4, 6, 6))
    assert (("S(2)",), "S(2)") in pads and (("S(0)",), "S(0)") in pads and not any(i == ("S(1)",) for i, _ in pads)
    assert (("S(1)", "R"), "S(1)") in _options(aten.type_as.default, (-1, -2), (4, 6), (4, 6), (1,))
    got = _options(aten.gather.default, (-1, 1, -2), (4, 3), (4, 10), (4, 3), int_inputs=(1,))
    assert (("S(0)", "S(0)"), "S(0)") in got and not any("S(1)" in ins for ins, _ in got)


def _hand_sdpa(b: int, hq: int, hk: int):
    """A hand-built ``sdpa(q, k, v, enable_gqa=True)`` node on meta values (no trace: many shapes are cheap)."""
    g = torch.fx.Graph()
    ins = []
    for name, h in (("q", hq), ("k", hk), ("v", hk)):
        x = g.placeholder(name)
        x.meta["val"] = torch.empty(b, h, 4, 8, device="meta")
        ins.append(x)
    out = g.call_function(aten.scaled_dot_product_attention.default, tuple(ins), {"enable_gqa": True})
    out.meta["val"] = torch.empty(b, hq, 4, 8, device="meta")
    return out


def _held(size: int, spec, dim: int, coord, mesh) -> list[int] | None:
    """The indices of dim ``dim`` a device at ``coord`` holds under per-axis ``spec`` (shards nest in mesh order);
    None where a shard does not divide evenly."""
    idx = list(range(size))
    for p, c, n in zip(spec, coord, mesh):
        if isinstance(p, Shard) and p.dim == dim:
            if len(idx) % n:
                return None
            idx = idx[c * len(idx) // n:(c + 1) * len(idx) // n]
    return idx


def _check_gqa_devices(hq: int, hk: int, b: int, specs, split, mesh) -> bool:
    """Simulate every device of ``mesh`` running SDPA on its pieces under ``specs`` (q, k, v, output), K/V narrowed to
    one head on ``split``'s axis as ``runtime.context.kv_heads_for_rank`` does: each local query head must attend
    with its group's K/V head (global query head i with K/V head i // (H / hk)), batch rows alike everywhere, the
    output holding the query's heads. False where a shard is uneven (not a layout); raises where it is wrong."""
    import itertools

    for coord in itertools.product(*(range(n) for n in mesh)):
        rows = [_held(b, s, 0, coord, mesh) for s in specs]
        heads = [_held(h, s, 1, coord, mesh) for h, s in zip((hq, hk, hk, hq), specs)]
        if None in rows or None in heads:
            return False
        assert all(r == rows[0] for r in rows), (specs, mesh, coord)
        q, k, v, out = heads
        assert k == v and out == q, (specs, mesh, coord)
        if split:  # the runtime narrows K/V to one head on that axis
            n = mesh[split.axis]
            assert len(k) == split.kv_heads and n % len(k) == 0, (specs, mesh, coord, k, split)
            k = [k[coord[split.axis] // (n // len(k))]]
        assert q and len(q) % len(k) == 0, (specs, mesh, coord)
        group = len(q) // len(k)  # local query head j attends with local K/V head j // group
        assert all(qh // (hq // hk) == k[j // group] for j, qh in enumerate(q)), (specs, mesh, coord, q, k)
    return True


@pytest.mark.parametrize("seed", range(4))
def test_grouped_query_layouts_give_each_device_its_query_heads_kv_heads(seed):
    """Grouped-query attention on random head counts and meshes of 1-3 axes, simulated device by device as the
    runtime runs it (``_check_gqa_devices``): (1) every option the SDPA rule offers; (2) every combination of
    per-axis heads layouts (q and K/V split alike, q split with K/V whole, neither), nested over several axes where
    the rules do not offer it yet, that ``gqa_split`` does not refuse."""
    import itertools
    import random

    from autopart.strategy import tensor_inputs
    from autopart.strategy.context import GqaSplit, gqa_split

    rng = random.Random(seed)
    offered = wide = nested = 0
    for _ in range(16):
        hk = rng.choice((1, 2, 2, 3, 4, 8))  # fewer K/V heads than an axis' devices more often than not
        hq = hk * rng.choice((1, 2, 3, 4, 8))
        b = rng.choice((1, 2, 4))
        mesh = tuple(rng.choice((1, 2, 3, 4, 8)) for _ in range(rng.randint(1, 3)))
        sdpa = _hand_sdpa(b, hq, hk)
        ins = tensor_inputs(sdpa)
        for o in options_for(sdpa, mesh)[0]:
            specs = (*o.inputs, o.output)
            if any(isinstance(p, Shard) and p.dim >= 2 for s in specs for p in s):
                continue  # the sequence split: context parallelism's own lowering (test_context)
            split = gqa_split(sdpa, ins, o.inputs, mesh)
            assert split is not False, f"an illegal combination offered: {o} on {mesh}"
            assert _check_gqa_devices(hq, hk, b, specs, split, mesh), f"an uneven option offered: {o} on {mesh}"
            offered += 1
            wide += bool(split)
        S1 = Shard(1)
        for per_axis in itertools.product(((R, R), (S1, S1), (S1, R), (R, S1)), repeat=len(mesh)):
            q, kv = tuple(p[0] for p in per_axis), tuple(p[1] for p in per_axis)
            specs = (q, kv, kv, q)
            split = gqa_split(sdpa, ins, (q, kv, kv), mesh)
            if split is not False and _check_gqa_devices(hq, hk, b, specs, split, mesh):
                nested += sum(isinstance(p, Shard) for p in q) > 1
            if split is False:  # refused: no layout of these pieces would run, unless the alike split does it too
                for cand in [None] + [GqaSplit(i, len(_held(hk, kv[:i], 1, (0,) * i, mesh[:i]) or [0]), 1, 2)
                                      for i in range(len(mesh)) if q[i] == S1 and kv[i] == R and mesh[i] > 1]:
                    try:
                        runs = _check_gqa_devices(hq, hk, b, specs, cand, mesh)
                    except AssertionError:
                        continue
                    assert not runs or (cand and cand.kv_heads % mesh[cand.axis] == 0), \
                        f"refused a layout that runs: {specs} on {mesh}, {hq}/{hk} heads, K/V read as {cand}"
    assert offered > 20 and wide > 0 and nested > 0, (offered, wide, nested)
