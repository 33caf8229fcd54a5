"""The Plan: the contract between planning and running.

A versioned, JSON-serialisable record of the mesh, the cluster, every decision with its predicted cost, and a
fingerprint of the graph it was made for. It prints as a per-layer table, explains any decision beside its
alternatives, diffs against another plan, and loads without executing code (plain JSON, no pickle).
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

PLAN_VERSION = 1


def _fmt_bytes(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


# the moments of a step the planner prices (``planner.MEMORY_ROWS``), by their record key
PEAK_MOMENTS = {"peak_forward": "end of forward", "peak_backward": "end of backward",
                "peak_optimizer": "optimizer step"}


def peak_moment(memory: dict) -> str:
    """The moment of the step whose bytes are the plan's peak (the largest of ``PEAK_MOMENTS`` in ``memory``,
    a plan's ``predicted["memory_bytes"]``), or "" when the record has none (a pipelined plan's stages)."""
    have = [k for k in PEAK_MOMENTS if k in memory]
    return PEAK_MOMENTS[max(have, key=lambda k: memory[k])] if have else ""


def _fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


def _ilp_lines(sol: dict) -> list[str]:
    """Every ILP solve behind the plan (``planner.solve_summary``): statuses, the largest optimality gap, warm
    starts (the hinted assignment's objective and where the solver ended)."""
    ilp = sol.get("ilp")
    if not ilp:
        return []
    screen, cut = ilp.get("screening") or {}, ilp.get("cut_off") or {}
    lines = [f"ILP solves while planning: {ilp['solves']} ({ilp['optimal']} optimal, {ilp['reused']} more answered "
             f"from problems already solved"
             + (f", {cut['solves']} more ended by their LP bound" if cut.get("solves") else "")
             + f"), {ilp['solve_s']:.2f} s; largest optimality gap (best bound vs objective) {ilp['max_gap']:.2%}"
             + (f"; {screen['solves']} more screening solve{'s' if screen['solves'] > 1 else ''} to "
                f"{screen['tolerance']:.0%} (largest gap {screen['max_gap']:.2%})" if screen.get("solves") else "")]
    warm = ilp.get("warm_started", [])
    if warm:
        src = f" (the search from recipe {sol['warm_start_from']})" if sol.get("warm_start_from") else ""
        used = [w for w in warm if w["hint"] == "used"]
        bare = [w for w in warm if w["hint"] == "not needed"]  # presolve and the tree DP, or an integral LP
        lines.append(f"warm starts{src}: {len(warm)} hinted solves, {len(used)} handed the hint to the MIP, "
                     f"{len(bare)} needed no MIP (presolve and the tree DP, or an integral LP relaxation; the hint "
                     f"kept where it ties); hint -> objective: "
                     + ", ".join(f"{_fmt_time(w['hint_objective'])} -> {_fmt_time(w['objective'])}"
                                 for w in (used + bare)[:6]))
    return lines


@dataclass
class Plan:
    fingerprint: str
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    cluster: dict
    options: dict
    nodes: dict[str, dict]  # node name -> {"op", "inputs", "output", "layer", "group"}
    params: dict[str, str]  # parameter FQN -> spec
    inputs: dict[str, str]  # user input placeholder -> spec
    outputs: dict[str, str]  # output node -> spec before the final gather
    reduced: dict[str, list[int]]  # parameter FQN -> mesh axes its gradient is summed over after backward
    collectives: list[dict]
    alternatives: dict[str, dict]
    solver: dict
    predicted: dict
    unsupported_ops: list[str] = field(default_factory=list)
    checkpoint: dict[str, str] = field(default_factory=dict)  # layer -> "full" | "selective" (absent: none)
    zero: dict[str, int] = field(default_factory=dict)  # parameter FQN -> ZeRO level (absent: 0)
    offload: list[str] = field(default_factory=list)  # "optimizer" and/or "activations" kept in host memory
    # pipeline parallelism (empty: none). Placements above are on the stage mesh ``mesh_shape``; the world mesh is
    # ``pipeline["world_mesh_shape"]``, whose axis ``pipeline["axis"]`` is split into ``degree`` stages
    pipeline: dict = field(default_factory=dict)
    # gradient accumulation without stages (empty: one pass): {"micro_batches", "micro_batch_size", "batch"}; the
    # step runs that many micro-batches one after another and reduces the gradients once (``predicted``:
    # ``"accumulation"`` says how its time is made up)
    accumulation: dict = field(default_factory=dict)
    version: int = PLAN_VERSION

    # ---- serialisation -------------------------------------------------------------------------------------
    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(asdict(self), indent=indent, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Plan:
        data = json.loads(text)
        if not isinstance(data, dict) or not {"version", "mesh_shape", "axis_names"} <= set(data):
            raise ValueError("this JSON is not an autopart plan (no version, mesh_shape or axis_names): save one with "
                             "plan.save(path) or autopart plan --out PATH")
        if data.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {data.get('version')} is not supported by this autopart "
                             f"(expects {PLAN_VERSION}); re-plan the model with this version")
        data["mesh_shape"] = tuple(data["mesh_shape"])
        data["axis_names"] = tuple(data["axis_names"])
        try:
            return Plan(**data)
        except TypeError as e:  # a field this version does not know, or one it needs missing
            raise ValueError(f"this JSON is not an autopart plan of version {PLAN_VERSION}: {e}") from e

    def save(self, path: str) -> None:
        import os

        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(self.to_json(indent=1))
        os.replace(tmp, path)

    @staticmethod
    def load(path: str) -> Plan:
        with open(path) as f:
            text = f.read()
        try:
            return Plan.from_json(text)
        except ValueError as e:  # a JSON error, or not a plan: say which file
            raise ValueError(f"{path}: {e}") from e

    # ---- queries -------------------------------------------------------------------------------------------
    def axis_role(self, axis: int) -> str:
        """What the solver made of a mesh axis, by where the parameters' bytes go. Each parameter on the axis is
        split for use (its ops read the shard: tensor parallel), an expert weight split over the experts (expert
        parallel), or whole where it is used (replicated, or a ZeRO-3 shard gathered for each use). The axis is
        'tensor' when a fifth or more of the bytes are split for use, 'expert' when a fifth or more are expert
        weights split there, 'data' when the batch is split on it and a fifth or more are whole or experts'
        (frozen weights too: inference, fine-tuning), 'context' when an attention or scan splits the sequence on
        it; several joined by '+', or 'replicated' (idle).

        By the bytes of the blocks' parameters (of all, in a model without numbered blocks), not by the inputs: a
        plan may keep its token ids whole and slice them at the embedding (free), or split one 128K-row table's
        hidden dim while every block is data parallel; the blocks decide what the axis is. A plan saved before its
        records carried ``numel`` counts each parameter once, and one without ``options["batch_axes"]`` takes the
        batch as split where a gradient is summed or an input split."""
        tags = self.options.get("param_tags") or {}
        numel = {r["param"]: r["numel"] for r in self.nodes.values() if "numel" in r}
        weight = {f: numel.get(f, 0) for f in self.params} if numel else dict.fromkeys(self.params, 1)  # tied: once
        if any(weight[f] and _param_layer(f) for f in weight):  # the blocks decide, not the embedding or head
            weight = {f: w if _param_layer(f) else 0 for f, w in weight.items()}
        gathered = {r["param"]: r["gathered_axes"] for r in self.nodes.values() if "gathered_axes" in r}
        expert = {r["param"] for r in self.nodes.values() if r.get("expert") or r.get("stacked")}
        if "batch_axes" in self.options:
            batch = axis in self.options["batch_axes"]
        else:
            batch = any(axis in v for v in self.reduced.values()) or \
                any(spec_axis(s, axis).startswith("S") for s in self.inputs.values())
        split_use = split_expert = whole = 0
        for f, spec in self.params.items():
            if not spec_axis(spec, axis).startswith("S"):
                whole += weight[f]
            elif f in expert and spec_axis(spec, axis) == "S(0)":  # split over the experts
                split_expert += weight[f]
            elif axis in gathered.get(f, (axis,) if tags.get(f) == "zero3" and batch else ()):  # saved before
                # ``gathered_axes``: ZeRO-3 shards where the batch is split
                whole += weight[f]
            else:
                split_use += weight[f]
        total = sum(weight.values())
        roles = []
        if batch and (whole + split_expert >= 0.2 * total or total == 0):
            roles.append("data")
        if any(r.get("cp_axis") == axis for r in self.nodes.values()):
            roles.append("context")
        if total and split_expert >= 0.2 * total:
            roles.append("expert")
        if total and split_use >= 0.2 * total:
            roles.append("tensor")
        return "+".join(roles) or "replicated"

    def param_pins(self) -> dict[str, str]:
        """Every parameter pinned to this plan's exact option, as ``plan(..., pins=)`` takes them: its placement and
        variant (``"R [zero2]"``; ``"R []"`` for the plain one). A re-solve under these pins (the micro-batch program
        of gradient accumulation or of a pipeline) keeps the plan's ZeRO levels, which the placement alone leaves
        open (ZeRO-0, -1 and -2 all hold ``R``). A plan saved before ``options["param_tags"]`` existed pins the
        placements only."""
        tags = self.options.get("param_tags")
        if tags is None:
            return dict(self.params)
        return {fqn: f"{spec} [{tags.get(fqn, '')}]" for fqn, spec in self.params.items()}

    def collective_counts(self, layer: str | None = None, direction: str = "fwd") -> Counter:
        """Counter of (kind, axis name) over edges (optionally of one layer), forward or backward."""
        c: Counter = Counter()
        for rec in self.collectives:
            if layer is not None and rec["layer"] != layer:
                continue
            for axis, fwd, bwd in rec["steps"]:
                kind = fwd if direction == "fwd" else bwd
                if kind not in ("none", "shard", "mask"):
                    c[(kind, self.axis_names[axis])] += 1
        return c

    def layers(self) -> list[str]:
        seen: dict[str, None] = {}
        for rec in self.nodes.values():
            seen.setdefault(rec["layer"], None)
        return list(seen)

    # ---- printing ------------------------------------------------------------------------------------------
    def __str__(self) -> str:
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.mesh_shape))
        if self.pipeline:
            mesh = f"pp={self.pipeline['degree']} (on {self.pipeline['axis_name']}) x stage " + mesh
        roles = ", ".join(f"{n}: {self.axis_role(i)}" for i, n in enumerate(self.axis_names))
        pred, sol = self.predicted, self.solver
        lines = [
            f"autopart plan  mesh {mesh}  on {self.cluster.get('name')}  (graph {self.fingerprint})",
            f"axes: {roles}",
            f"predicted step {_fmt_time(pred['step_time_s'])} = compute {_fmt_time(pred['compute_s'])} + comm "
            f"{_fmt_time(pred['comm_s'])}" + (f" + optimizer step {_fmt_time(pred['optimizer_step_s'])}"
                                             if pred.get("optimizer_step_s") else "") + ";  memory/device "
            + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in pred["memory_bytes"].items())
            + (f";  peak at the {peak_moment(pred['memory_bytes'])}" if peak_moment(pred["memory_bytes"]) else ""),
            "per layer: predicted time (compute + conversions, forward and backward), placements, collectives; "
            "consecutive blocks planned alike in one row (blocks.1..79: each of them that time)",
            f"solver {sol.get('backend')} {sol.get('status')}: objective {_fmt_time(sol.get('objective', 0))}, "
            f"bound {_fmt_time(sol.get('bound', 0))}, gap {sol.get('gap', 0):.2%}, {sol.get('wall_time_s', 0):.2f} s, "
            f"{sol.get('groups')} decision groups ({sol.get('graph_nodes')} nodes, {sol.get('tied_layers')} tied "
            f"layers), {sol.get('num_variables')} variables",
            *_ilp_lines(sol),
            "",
        ]
        by_layer: dict[str, list[str]] = defaultdict(list)
        for fqn, spec in self.params.items():
            by_layer[_param_layer(fqn)].append(f"{fqn.split('.', 2)[-1] if _param_layer(fqn) else fqn}={spec}")
        acts: dict[str, list[str]] = defaultdict(list)
        for name, rec in self.nodes.items():
            if any(k in rec["op"] for k in ("linear", "addmm", "scaled_dot_product", "embedding", "cross_entropy",
                                            "layer_norm", "mm.default", "token_local")):
                out = rec["output"] if isinstance(rec["output"], str) else ",".join(rec["output"])
                acts[rec["layer"]].append(f"{name}:{out}")
        header = (f"{'layer':<14} {'time':>9} {'weights':<56} {'activations':<44} "
                  f"{'collectives fwd (bwd)':<30}")
        layer_time: dict[str, float] = defaultdict(float)
        for rec in self.nodes.values():
            layer_time[rec["layer"]] += rec.get("compute_s", 0.0)
        for rec in self.collectives:
            layer_time[rec["layer"]] += rec["time_s"]
        lines.append(header)
        lines.append("-" * len(header))
        rows: list[tuple[list[str], tuple, str]] = []  # (layers, what the row says but the layer's name, its text)
        for layer in self.layers():
            fwd, bwd = self.collective_counts(layer, "fwd"), self.collective_counts(layer, "bwd")
            coll = ", ".join(f"{k}@{a}x{v}" for (k, a), v in sorted(fwd.items())) or "-"
            coll += " (" + (", ".join(f"{k}@{a}x{v}" for (k, a), v in sorted(bwd.items())) or "-") + ")"
            w = " ".join(by_layer.get(layer, [])) or "-"
            a = " ".join(acts.get(layer, [])) or "-"
            same = (_layer_run(layer), _fmt_time(layer_time[layer]), w, re.sub(r"_\d+:", ":", a), coll)
            if rows and rows[-1][1] == same and same[0] is not None:  # a repeated block planned the same way
                rows[-1][0].append(layer)
                continue
            rows.append(([layer], same, f"{_fmt_time(layer_time[layer]):>9} {_clip(w, 56):<56} {_clip(a, 44):<44} "
                                        f"{coll}"))
        for layers, _, text in rows:
            name = layers[0] or "(top)"
            if len(layers) > 1:  # blocks.1..79: the first one's activations shown, each of them that time
                name = f"{layers[0]}..{layers[-1].rsplit('.', 1)[1]}"
            lines.append(f"{name:<14} {text}")
        if self.reduced:
            axes = Counter(tuple(self.axis_names[i] for i in v) for v in self.reduced.values())
            lines.append("")
            sizes = self.options.get("bucket_bytes", {})
            lines.append("gradient reduction after backward (bucketed): " + ", ".join(
                f"{n} parameters over {'+'.join(k)}" for k, n in axes.items()) + (
                "; buckets " + ", ".join(f"{_fmt_bytes(b)} over "
                                         f"{'+'.join(self.axis_names[int(i)] for i in a.split(','))}"
                                         for a, b in sizes.items()) + " (latency-bound at the default 25 MiB)"
                if sizes else ""))
        ep = [(r["op"].rpartition("(")[2].rstrip(")"), r["experts"], r["ep_axes"]) for r in self.nodes.values()
              if r.get("ep_axes")]
        if ep:
            lines.append("expert parallel (tokens to their experts' ranks by all-to-all): " + ", ".join(
                f"{path} ({e} experts over {'+'.join(self.axis_names[a] for a in axes)})" for path, e, axes in ep))
        if self.unsupported_ops:
            lines.append("ops without a sharding rule (replicated): " + ", ".join(self.unsupported_ops))
        if self.pipeline:
            lines += ["", *self.pipeline_text().splitlines()]
        if self.accumulation:
            lines += ["", self.accumulation_text()]
        if self.solver.get("recipes"):
            from autopart.recipes import table

            lines += ["", *table(self.solver["recipes"]).splitlines()]
        return "\n".join(lines)

    def pipeline_text(self) -> str:
        """Stages with their layers, time and memory; micro-batches, schedule, bubble; the schedule grid."""
        pp = self.pipeline
        if not pp:
            return "no pipeline"
        sched = pp["schedule"] + (f" (v={pp['virtual']} chunks per rank)" if pp["schedule"] == "interleaved" else "")
        lines = [
            f"pipeline: {pp['degree']} stages on mesh axis {pp['axis_name']} "
            f"(world mesh {tuple(pp['world_mesh_shape'])}, stage mesh {tuple(self.mesh_shape)}); "
            f"{pp['micro_batches']} micro-batches of {pp['micro_batch_size']}"
            f" (batch {pp['batch']}); schedule {sched}; bubble {pp['bubble_fraction']:.1%} of the step"
            + (f"; decoding served continuously: priced with the pipeline kept full (each micro-batch's next token "
               f"enters the first stage as it leaves the last; one call that fills and drains it takes "
               f"{_fmt_time(pp['drained_step_time_s'])})" if pp.get("steady") else ""),
            f"step {_fmt_time(pp['step_time_s'])} = pipeline {_fmt_time(pp['pipeline_s'])} + gradient reduction "
            f"{_fmt_time(pp['gradient_reduction_s'])}" + (f" + optimizer step {_fmt_time(pp['optimizer_step_s'])}"
                                                           if pp.get("optimizer_step_s") else "") +
            f" + parameter gather {_fmt_time(pp.get('param_gather_s', 0.0))}; send/recv per micro-batch and boundary "
            f"{_fmt_time(pp['p2p_s'])}" + _no_pipeline(pp),
            f"{'stage':>5} {'rank':>4} {'layers':<34} {'time/micro-batch':>16} {'in flight':>9} "
            f"{'states+grads':>13} {'activations':>12} {'total':>11}  checkpointed",
        ]
        for st in pp["stages"]:
            lay = st["layers"]
            names = lay[0] if len(lay) == 1 else f"{lay[0]} .. {lay[-1]} ({len(lay)})"
            mem = st["memory_bytes"]
            lines.append(f"{st['index']:>5} {st['rank']:>4} {_clip(names, 34):<34} {_fmt_time(st['time_s']):>16} "
                         f"{st['in_flight']:>9} {_fmt_bytes(mem['states'] + mem['gradients']):>13} "
                         f"{_fmt_bytes(mem['activations']):>12} {_fmt_bytes(mem['total']):>11}  "
                         f"{len(st['checkpointed'])}/{len(lay)}")
        if pp.get("grid"):
            lines += ["schedule (F = forward, B = backward of micro-batch i; c = chunk; '.' idle):", pp["grid"]]
        return "\n".join(lines)

    def accumulation_text(self) -> str:
        """Gradient accumulation: micro-batches, what each pays, and the communication fewer of them hide."""
        acc = self.accumulation
        if not acc:
            return "no gradient accumulation"
        a = self.predicted.get("accumulation", {})
        return (f"gradient accumulation: {acc['micro_batches']} micro-batches of {acc['micro_batch_size']} (batch "
                f"{acc['batch']}), one forward+backward after another, gradients reduced once; step "
                f"{_fmt_time(self.predicted['step_time_s'])} (in one pass {_fmt_time(a.get('one_pass_step_time_s', 0))}"
                f"): {_fmt_time(a.get('per_micro_batch_s', 0))} per micro-batch whatever its size; gradient reduction "
                f"exposed {_fmt_time(a.get('grad_reduction_exposed_s', 0))} behind the last micro-batch's backward "
                f"(in one pass {_fmt_time(a.get('one_pass_grad_reduction_exposed_s', 0))}), ZeRO-1/2 gather exposed "
                f"{_fmt_time(a.get('param_gather_exposed_s', 0))} (in one pass "
                f"{_fmt_time(a.get('one_pass_param_gather_exposed_s', 0))}); activations of one micro-batch "
                f"{_fmt_bytes(a.get('activations_bytes', 0))}")

    def explain(self, node: str) -> str:
        """The option chosen for ``node`` (graph node name or parameter FQN) beside its alternatives and costs."""
        name = node
        if node in self.params:
            name = next((n for n, r in self.nodes.items() if r["op"] == "param" and _fqn_match(n, node)), node)
        if name not in self.nodes:
            close = [n for n in self.nodes if node.replace(".", "_") in n][:5]
            raise ValueError(f"no node or parameter {node!r} in this plan" + (f"; did you mean {close}?" if close
                                                                            else ""))
        rec = self.nodes[name]
        alt = self.alternatives[str(rec["group"])]
        members = alt["members"]
        lines = [f"{name}  ({rec['op']}, layer {rec['layer'] or '-'}; decided together with {len(members)} "
                 f"tied node(s))", f"chosen: {alt['options'][alt['chosen']]}", "",
                 f"{'option (inputs -> output)':<50} {'cost (sum over tied)':>20} {'memory/device':>16}"]
        order = sorted(range(len(alt["options"])), key=lambda i: alt["cost_s"][i])
        for i in order:
            mark = "*" if i == alt["chosen"] else " "
            lines.append(f"{mark}{alt['options'][i]:<49} {_fmt_time(alt['cost_s'][i]):>20} "
                         f"{_fmt_bytes(alt['memory_bytes'][i]):>16}")
        edges = [c for c in self.collectives if c["user"] == name or c["value"] == name]
        if edges:
            lines.append("")
            lines.append("conversions on its edges (axis: forward / backward):")
            for c in edges:
                steps = "; ".join(f"{self.axis_names[a]}: {f} / {b}" for a, f, b in c["steps"])
                lines.append(f"  {c['value']} -> {c['user']}: {steps}  ({_fmt_time(c['time_s'])})")
        if "gather_s" in rec:  # ZeRO-1/2: the node's cost holds the ILP's price of its after-step all-gather
            pred = self.pipeline or self.predicted
            lines += ["", f"ZeRO-1/2 all-gather after the step: its bandwidth {_fmt_time(rec['gather_s'])}, priced "
                      f"{_fmt_time(rec['time_s'] - rec['compute_s'])} (the share the next forward does not hide); "
                      f"the plan's whole gather {_fmt_time(pred.get('param_gather_total_s', 0.0))}, exposed "
                      f"{_fmt_time(pred.get('param_gather_s', 0.0))}"]
        lines.append("")
        lines.append("costs are node costs (compute, output gathers) summed over tied layers; edge conversions are "
                     "priced separately and shared with the neighbours")
        sol = self.solver
        if "gap" in sol:  # how sure the choice is: the solve that made it, and every solve behind the plan
            lines.append(f"decided by {sol.get('backend')} ({sol.get('status')}): objective "
                         f"{_fmt_time(sol.get('objective', 0))}, best bound {_fmt_time(sol.get('bound', 0))}, "
                         f"optimality gap {sol['gap']:.2%}")
        lines += _ilp_lines(sol)
        return "\n".join(lines)

    def diff(self, other: Plan) -> str:
        """What differs between two plans of the same graph: the mesh, the pipeline (stages, schedule,
        micro-batches), gradient accumulation, offload, each parameter's placement and ZeRO level, each layer's
        checkpointing, each node's placement; then the predicted step and peak memory."""
        lines = []
        if self.fingerprint != other.fingerprint:
            lines.append(f"graphs differ ({self.fingerprint} vs {other.fingerprint})")
        if tuple(self.mesh_shape) != tuple(other.mesh_shape):
            lines.append(f"mesh {tuple(self.mesh_shape)} -> {tuple(other.mesh_shape)}")
        for what, key in (("pipeline", lambda p: _pipeline_text(p.pipeline)),
                          ("micro-batches", lambda p: int(p.accumulation.get("micro_batches", 1))),
                          ("offload", lambda p: ", ".join(sorted(p.offload)) or "none")):
            a, b = key(self), key(other)
            if a != b:
                lines.append(f"{what}: {a} -> {b}")
        for fqn in sorted(set(self.params) | set(other.params)):
            a, b = self.params.get(fqn), other.params.get(fqn)
            za, zb = self.zero.get(fqn, 0), other.zero.get(fqn, 0)
            if a != b or za != zb:
                lines.append(f"param {fqn}: " + (f"{a} -> {b}" if a != b else f"{a}")
                             + (f", ZeRO {za} -> {zb}" if za != zb else ""))
        for layer in sorted(set(self.checkpoint) | set(other.checkpoint)):
            a, b = self.checkpoint.get(layer, "none"), other.checkpoint.get(layer, "none")
            if a != b:
                lines.append(f"checkpoint {layer}: {a} -> {b}")
        for n in self.nodes:
            if n in other.nodes and self.nodes[n]["output"] != other.nodes[n]["output"]:
                lines.append(f"node {n}: {self.nodes[n]['output']} -> {other.nodes[n]['output']}")
        pa, pb = (_peak_bytes(p.predicted.get("memory_bytes", {})) for p in (self, other))
        if pa is not None and pb is not None and pa != pb:
            lines.append(f"predicted peak memory per device {_fmt_bytes(pa)} -> {_fmt_bytes(pb)}")
        a, b = self.predicted["step_time_s"], other.predicted["step_time_s"]
        lines.append(f"predicted step {_fmt_time(a)} -> {_fmt_time(b)}")
        return "\n".join(lines)


def _peak_bytes(memory: dict) -> float | None:
    """A record's peak bytes per device: the largest of its moments (``PEAK_MOMENTS``), else its total."""
    have = [memory[k] for k in PEAK_MOMENTS if k in memory]
    return max(have) if have else memory.get("total")


def _pipeline_text(pp: dict) -> str:
    if not pp:
        return "none"
    return (f"{pp.get('degree')} stages, {pp.get('schedule')}"
            + (f" v{pp['virtual']}" if int(pp.get("virtual", 1)) > 1 else "") + f", {pp.get('micro_batches')} "
            "micro-batches")


def _no_pipeline(pp: dict) -> str:
    t = pp.get("no_pipeline_step_time_s")
    if pp.get("no_pipeline_not_planned"):
        return f"; without pipeline: not planned ({pp['no_pipeline_not_planned']})"
    if not t:
        return "; no plan without pipeline fits"
    if pp.get("no_pipeline_is_lower_bound"):  # not solved: the ILP's bound (planner.OBJECTIVE_OVER_RECORD)
        return f"; without pipeline: not solved, its ILP objective >= {_fmt_time(t)}"
    return f"; without pipeline: {_fmt_time(t)}"


def spec_axis(spec: str, axis: int) -> str:
    from autopart.placement import parse_spec

    return str(parse_spec(spec)[axis])


def _layer_run(layer: str) -> str | None:
    """What numbered blocks of one stack share (``blocks.3`` -> ``blocks``); None for a layer that is not one."""
    head, dot, index = layer.rpartition(".")
    return head if dot and index.isdigit() else None


def _param_layer(fqn: str) -> str:
    m = re.match(r"^(.*?)\.(\d+)(?:\.|$)", fqn)
    return f"{m.group(1)}.{m.group(2)}" if m else ""


def _fqn_match(node_name: str, fqn: str) -> bool:
    return node_name == "p_" + fqn.replace(".", "_")


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


