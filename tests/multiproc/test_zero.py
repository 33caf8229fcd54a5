"""ZeRO (sharded data parallelism) on real gloo processes: parity with one process, and the plan's layout."""

from __future__ import annotations

import math

import pytest
import torch

from tests.multiproc.harness import run_ranks
from tests.multiproc.parity import OPT, batches, check, make_model, reference, train

pytestmark = pytest.mark.multiproc


def _zero_run(name: str, shape: tuple, names: tuple, roles: dict, zero: int, micro_batches: int = 1):
    import autopart
    from autopart.runtime import collectives as C
    from autopart.runtime import grads, zero1

    model = make_model(name)
    mesh = autopart.mesh(shape, names)
    ids0 = batches()[0]
    pipeline = {"stages": 1, "micro_batches": micro_batches} if micro_batches > 1 else None
    pm = autopart.parallelize(model, mesh, (ids0,), {"labels": ids0}, roles=roles, zero=zero, pipeline=pipeline)
    opt = pm.optimizer(torch.optim.AdamW, **OPT)
    losses = []
    C.REGATHER_STATS["packed"] = 0
    zero1.STATS["all_gathers"] = 0
    grads.STATS.update(launched_in_backward=0, launched_at_end=0)
    for ids in batches():
        losses.append(pm.forward_backward(ids, labels=ids).item())
        opt.step()
        opt.zero_grad()
    # optimizer states live only for this rank's shard
    state_numel = sum((v.to_local() if hasattr(v, "to_local") else v).numel()
                      for s in opt.state.values() for k, v in s.items() if k == "exp_avg")
    full = {k: v.clone() for k, v in pm.full_state_dict().items()}
    return (losses, full, str(pm.plan), pm.plan.to_json(), pm(batches()[0]).detach(), state_numel,
            C.REGATHER_STATS["packed"], zero1.STATS["all_gathers"], getattr(opt, "autopart_zero1_buckets", []),
            dict(grads.STATS), len(pm._grads.buckets()))


# (model, mesh shape, axis names, roles, ZeRO level[, gradient-accumulation micro-batches])
CASES = [("gpt", (2,), ("dp",), {"dp": "dp"}, 2), ("gpt", (2,), ("dp",), {"dp": "dp"}, 3),
         ("llama", (2,), ("dp",), {"dp": "dp"}, 1), ("gpt", (2, 2), ("dp", "tp"), {"dp": "dp", "tp": "tp"}, 3),
         ("llama", (2, 2), ("dp", "tp"), {"dp": "dp", "tp": "tp"}, 2),
         ("gpt", (2, 2), ("dp", "tp"), {"dp": "dp", "tp": "tp"}, 1),
         ("gpt", (2,), ("dp",), {"dp": "dp"}, 0, 2), ("llama", (2, 2), ("dp", "tp"), {"dp": "dp", "tp": "tp"}, 1, 2)]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{'x'.join(c[2])}-zero{c[4]}" + (f"-accum{c[5]}" if c[5:] else "")
                                             for c in CASES])
def test_zero_parity(case):
    """Parity with one process; with gradient accumulation (m micro-batches of the batch, ``plan.accumulation``)
    too, where every bucket must be reduced once per step, launched from the last micro-batch's backward."""
    from autopart.plan import Plan

    name, shape, names, roles, zero = case[:5]
    micro = case[5] if case[5:] else 1
    results = run_ranks(math.prod(shape), _zero_run, name, shape, names, roles, zero, micro)
    check(name, [r[:5] for r in results], reference(name))
    plan = Plan.from_json(results[0][3])
    assert plan.accumulation.get("micro_batches", 1) == micro, plan.accumulation
    if micro > 1:
        launched, buckets = results[0][9], results[0][10]
        assert launched == {"launched_in_backward": len(batches()) * buckets, "launched_at_end": 0}, (launched, buckets)
        assert "gradient accumulation: 2 micro-batches of 2 (batch 4)" in results[0][2]
    if not zero:
        return
    assert plan.zero and set(plan.zero.values()) == {zero}, plan.zero
    from autopart.placement import Replicate, Shard, parse_spec

    # ZeRO-1/2 keep parameters replicated on dp (optimizer states, and ZeRO-2's gradients, are sliced); ZeRO-3
    # shards them along a dim
    kind = Replicate if zero in (1, 2) else Shard
    assert all(isinstance(parse_spec(plan.params[k])[names.index("dp")], kind) for k in plan.zero)
    n_params = sum(p.numel() for p in make_model(name).parameters())
    dp = shape[names.index("dp")]
    tp = shape[names.index("tp")] if "tp" in names else 1
    # each rank holds optimizer states for about 1/(dp*tp) of the parameters (small ones may stay replicated)
    assert results[0][5] < n_params / dp * 1.05 / (1 if tp == 1 else tp / 1.6), (results[0][5], n_params)
    if zero == 3:
        from autopart.planner import saves_input
        from autopart.strategy import tensor_inputs
        from autopart.trace import trace

        ids = batches()[0]
        t = trace(make_model(name), (ids,), {"labels": ids})
        kept = sum(saves_input(n, j) for n in t.graph.nodes if n.op == "call_function"
                   for j, a in enumerate(tensor_inputs(n)) if a.name in t.params)
        # a ZeRO-3 parameter is kept as its shard (and gathered again in backward) by each op that saves it, as the
        # planner prices it (``saves_input``: not a bias, not an embedding table): once per forward with autograd,
        # the training steps' and the last call's
        assert results[0][6] == (len(batches()) + 1) * kept, (results[0][6], kept)
    else:
        assert results[0][6] == 0
        # the after-step gather: one all-gather per bucket per axis, each step; fewer than one per parameter
        gathers, buckets = results[0][7], results[0][8]
        assert gathers == len(batches()) * sum(len(axes) for axes, _ in buckets), (gathers, buckets)
        assert len(buckets) < sum(n for _, n in buckets), buckets
        if zero == 1 and len(shape) == 2:  # gpt on dp2 x tp2: parameters replicated on both axes gathered twice
            assert any(len(axes) == 2 for axes, _ in buckets), buckets


def _zero2_accumulate_clip_run(bucket_bytes: int):
    import autopart
    from autopart.runtime import grads, zero1

    grads.BUCKET_BYTES = bucket_bytes  # several buckets on the tiny model: launched from backward one by one
    model = make_model("gpt")
    mesh = autopart.mesh((2,), ("dp",))
    ids0 = batches()[0]
    pm = autopart.parallelize(model, mesh, (ids0,), {"labels": ids0}, roles={"dp": "dp"}, zero=2)
    opt = pm.optimizer(torch.optim.AdamW, **OPT)
    out, kept = [], []
    zero1.STATS["all_gathers"] = 0
    for ids in batches():
        for half in ids.chunk(2):  # gradient accumulation: the slices add up over the two calls
            out.append(pm.forward_backward(half, labels=half).item())
            kept.append(sum(pm._params[pm._key_of[f]].grad is not None for f in pm.plan.zero))
        out.append(float(pm.clip_grad_norm_(0.5)))
        opt.step()
        opt.zero_grad()
    full = {k: v.clone() for k, v in pm.full_state_dict().items()}
    return (out, full, kept, dict(grads.STATS), len(pm._grads.buckets()), zero1.STATS["all_gathers"],
            opt.autopart_zero1_buckets)


def test_zero2_accumulation_clipping_and_overlap():
    """ZeRO-2 on dp2 with 16 KiB buckets: two accumulated forward_backward calls per step, then the module's
    clip_grad_norm_ (norms combined over the gradient slices), 3 AdamW steps: losses, norms and parameters match
    one process; no whole ZeRO-2 gradient survives backward; buckets were launched from gradient hooks while
    backward was running; the parameters were all-gathered after each step in several flat buckets (the same
    limit), one all-gather per bucket."""
    results = run_ranks(2, _zero2_accumulate_clip_run, 16 * 2**10)
    model = make_model("gpt")
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    ref = []
    for ids in batches():
        for half in ids.chunk(2):
            loss = model(half, labels=half)
            loss = loss if isinstance(loss, torch.Tensor) else loss.loss
            loss.backward()
            ref.append(loss.item())
        ref.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)))
        opt.step()
        opt.zero_grad()
    for out, params, kept, stats, n_buckets, gathers, gather_buckets in results:
        assert out == pytest.approx(ref, abs=1e-5), (out, ref)
        for k, v in model.named_parameters():
            torch.testing.assert_close(params[k], v.detach(), rtol=0, atol=1e-5)
        assert kept == [0] * len(kept), kept
        assert n_buckets >= 4, n_buckets
        # each of the 6 backwards launched every bucket from a gradient hook, none waited for the end of backward
        assert stats == {"launched_in_backward": 6 * n_buckets, "launched_at_end": 0}, (stats, n_buckets)
        assert 2 <= len(gather_buckets) < sum(n for _, n in gather_buckets), gather_buckets
        assert all(axes == (0,) for axes, _ in gather_buckets), gather_buckets
        assert gathers == len(batches()) * len(gather_buckets), (gathers, gather_buckets)


def _zero1_read_between_steps_run(bucket_bytes: int):
    import autopart
    from autopart.runtime import grads, zero1

    grads.BUCKET_BYTES = bucket_bytes  # several gather buckets on the tiny model: more than GATHER_IN_FLIGHT
    model = make_model("gpt")
    mesh = autopart.mesh((2,), ("dp",))
    ids0 = batches()[0]
    pm = autopart.parallelize(model, mesh, (ids0,), {"labels": ids0}, roles={"dp": "dp"}, zero=1)
    opt = pm.optimizer(torch.optim.AdamW, **OPT)
    losses, states, pending, logits = [], [], [], []
    zero1.STATS["all_gathers"] = 0
    for step, ids in enumerate(batches()):
        losses.append(pm.forward_backward(ids, labels=ids).item())
        opt.step()
        pm.zero_grad()  # gradients only: it leaves the gathers running
        pending.append(pm._param_gather.pending)  # the step left the gathers running
        if step == 0:  # forward only, a signature not traced yet: its program waits for the buckets too
            logits.append(pm(batches()[0]).detach())
        elif step == 1:  # nn.Module.state_dict: this rank's shards of the whole parameters
            states.append({k: v.to_local().clone() for k, v in pm.state_dict().items() if k.startswith("_params.")})
        states.append({k: v.clone() for k, v in pm.full_state_dict().items()})
    graph = next(marked for _, marked in pm._marked.values()).graph
    # between the first and the last wait, forward computes: the waits are spread over it, not at its start
    kinds = [n.target is zero1.param_ready for n in graph.nodes if n.op == "call_function"]
    first, last = kinds.index(True), len(kinds) - 1 - kinds[::-1].index(True)
    spread = kinds[first:last].count(False)
    return losses, states, pending, logits, spread, zero1.STATS["all_gathers"], opt.autopart_zero1_buckets


def test_zero1_parameters_read_between_steps():
    """ZeRO-1 on dp2 with 16 KiB buckets: after each step (and the module's ``zero_grad``) the gathers still run
    (the next forward waits for each bucket before its parameters' first use, spread over the graph); whatever
    reads the parameters before that forward sees the gathered values: a forward-only call of a new signature after
    step 1, ``state_dict`` after step 2, ``full_state_dict`` after every step -- each equal to one process after
    the same steps, within 1e-5. One all-gather per bucket per step."""
    results = run_ranks(2, _zero1_read_between_steps_run, 16 * 2**10)
    model = make_model("gpt")
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    ref_losses, ref_states, ref_logits = [], [], None
    for step, ids in enumerate(batches()):
        loss = model(ids, labels=ids)
        loss = loss if isinstance(loss, torch.Tensor) else loss.loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
        ref_states.append({k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)})
        if step == 0:
            with torch.no_grad():
                out = model(batches()[0])
            ref_logits = out if isinstance(out, torch.Tensor) else out.logits
    for losses, states, pending, logits, spread, gathers, buckets in results:
        assert losses == pytest.approx(ref_losses, abs=1e-5), (losses, ref_losses)
        assert pending == [True] * len(batches()), pending
        assert len(buckets) > 2 and spread > 0, (buckets, spread)
        torch.testing.assert_close(logits[0], ref_logits, rtol=1e-5, atol=5e-5)
        full = [s for s in states if "_params." not in next(iter(s))]
        assert len(full) == len(batches())
        for got, ref in zip(full, ref_states):
            for k, v in ref.items():
                torch.testing.assert_close(got[k], v, rtol=0, atol=1e-5)
        shards = next(s for s in states if "_params." in next(iter(s)))
        assert len(shards) >= len(ref_states[1]) - 1, shards.keys()  # tied names once
        for k, v in shards.items():  # replicated on dp: each rank's shard is the whole parameter
            torch.testing.assert_close(v, ref_states[1][k.removeprefix("_params.").replace("__", ".")], rtol=0,
                                       atol=1e-5)
        assert gathers == len(batches()) * len(buckets), (gathers, buckets)


def _pipeline_zero1_run():
    import autopart
    from autopart.runtime import grads

    model = make_model("gpt", 4)
    mesh = autopart.mesh((2, 2), ("pp", "dp"))
    ids0 = batches()[0]
    pm = autopart.parallelize(model, mesh, (ids0,), {"labels": ids0}, roles={"pp": "pp", "dp": "dp"}, zero=1,
                              pipeline={"schedule": "1f1b", "micro_batches": 2})
    grads.STATS.update(launched_in_backward=0, launched_at_end=0)
    losses, full = train(pm, pm.optimizer(torch.optim.AdamW, **OPT))
    launched = sum(not b.deferred for b in pm._grads.buckets())
    return losses, full, str(pm.plan), pm.plan.to_json(), pm(batches()[0]).detach(), dict(grads.STATS), launched


def test_pipeline_zero1_parity():
    """pp2 x dp2 with ZeRO-1, 1F1B over 2 micro-batches: each stage's forward waits for the gathers of its own
    parameters (the stage graphs are marked like the whole program); the gradients were reduce-scattered from the
    schedule's backward (the tied embedding/head after it); losses, parameters and forward-only logits match one
    process."""
    from autopart.plan import Plan

    results = run_ranks(4, _pipeline_zero1_run)
    check("gpt", [r[:5] for r in results], reference("gpt", 4))
    plan = Plan.from_json(results[0][3])
    assert plan.pipeline["degree"] == 2 and set(plan.zero.values()) == {1}, (plan.pipeline, plan.zero)
    for *_, stats, launched in results:
        assert launched >= 1 and stats == {"launched_in_backward": len(batches()) * launched, "launched_at_end": 0}


def _plan_bucket_sizes_run(floor: int, planned: int):
    import autopart
    from autopart.runtime import grads, zero1

    grads.BUCKET_BYTES = floor  # the runtime's default: several buckets on the tiny model
    model = make_model("gpt")
    mesh = autopart.mesh((2,), ("dp",))
    ids0 = batches()[0]
    kw = dict(roles={"dp": "dp"}, zero=1)
    pm = autopart.parallelize(model, mesh, (ids0,), {"labels": ids0}, **kw)
    pm.optimizer(torch.optim.AdamW, **OPT)
    default = (len(pm._grads.buckets()), len(pm._param_gather.buckets))
    plan = pm.plan
    plan.options["bucket_bytes"] = {"0": planned}  # as the planner records a latency-bound axis' larger size
    pm = autopart.parallelize(model, mesh, (ids0,), {"labels": ids0}, plan=plan, **kw)
    opt = pm.optimizer(torch.optim.AdamW, **OPT)
    zero1.STATS["all_gathers"] = 0
    sizes = [sum(grads._local(e.param).nbytes for e in b.entries) for b in pm._grads.buckets()]
    losses, full = train(pm, opt)
    return (losses, full, str(pm.plan), pm.plan.to_json(), pm(batches()[0]).detach(), default, sizes,
            opt.autopart_zero1_buckets, zero1.STATS["all_gathers"])


def test_plan_bucket_sizes_fill_the_runtime_buckets():
    """The plan's bucket size for an axis (``plan.options["bucket_bytes"]``, what ``planner.bucket_bytes`` records
    where the links make the default latency-bound) is what the runtime fills to, for the gradient reduce-scatter and
    ZeRO-1's after-step gather alike, over the default (``grads.BUCKET_BYTES``): fewer buckets, none past the size but
    a parameter larger alone, parity with one process over 3 AdamW steps."""
    floor, planned = 8 * 2**10, 48 * 2**10
    results = run_ranks(2, _plan_bucket_sizes_run, floor, planned)
    ref = reference("gpt")
    check("gpt", [r[:5] for r in results], ref)
    for *_, default, sizes, gather_buckets, gathers in results:
        assert len(sizes) < default[0] and len(gather_buckets) < default[1], (sizes, gather_buckets, default)
        assert max(sizes) > floor and all(s <= planned for s in sizes), sizes
        assert gathers == len(batches()) * len(gather_buckets), (gathers, gather_buckets)
