"""Pipelined execution: the rank's rewritten graph split into stage modules, run by torch.distributed.pipelining.

``split_stages`` cuts one rank's program (the micro-batch graph, already tensor/data parallel inside) into one
``fx.GraphModule`` per pipeline chunk: chunk ``k`` takes the values live across boundary ``k`` (activations, and
inputs such as labels or rotary tables used later, passed along stage by stage) and returns those live across
boundary ``k+1``; the last returns the graph's outputs. ``PipelinedModule`` holds only its stages' parameters (as
DTensors on the stage mesh), runs them on ``PipelineStage`` with ``ScheduleGPipe`` / ``Schedule1F1B`` /
``ScheduleInterleaved1F1B`` over the micro-batches of the global batch, and sums the gradient of a parameter held
by several stages (a tied embedding and head) over the ranks that hold it. The data-parallel gradient reduction is
launched from the schedule's backward, each bucket once the last micro-batch's backward has finalised its
gradients, and waited for after the schedule (``runtime/grads.py``); a parameter held by several stages is
reduced after its stages' sum.

Loss: each micro-batch's loss is divided by the number of micro-batches before backward, so the gradients are those
of the mean of the micro-batch losses -- the global batch's loss when each micro-batch averages over the same
number of elements (true for a mean-reduced loss with no ignored targets; with ignored targets, the mean of the
micro-batch means, as Megatron-LM without per-token loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from autopart.placement import local_shape, parse_spec
from autopart.runtime.module import ParallelModule, Program
from autopart.runtime.optim_state import unpermute


@dataclass
class StageGraph:
    index: int
    gm: fx.GraphModule
    feeds: list[tuple[str, str]]  # per placeholder: ("param"|"buffer"|"constant"|"live", name)
    live_in: list[str]
    live_out: list[str]


def split_stages(prog: Program, stage_of: dict[str, int], chunks: int) -> list[StageGraph]:
    gm = prog.gm
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out_node = next(n for n in nodes if n.op == "output")
    user = [n.name for n in placeholders if n.name in prog.user_inputs]
    made = {name: -1 for name in user}  # user inputs enter at the first stage
    for n in nodes:
        if n.op == "call_function":
            made[n.name] = stage_of[n.name]
    last_use: dict[str, int] = {}
    for n in nodes:
        if n.op == "call_function":
            for a in n.all_input_nodes:
                if a.name in made:
                    last_use[a.name] = max(last_use.get(a.name, -1), stage_of[n.name])
    outputs = [a for a in torch.utils._pytree.tree_leaves(out_node.args) if isinstance(a, fx.Node)]
    for a in outputs:
        last_use[a.name] = chunks  # needed after the last stage
    live = []  # live[k]: values crossing into chunk k
    for k in range(chunks):
        if k == 0:
            live.append(list(user))
        else:
            live.append([v for v in made if made[v] < k <= last_use.get(v, -1)])
    by_name = {n.name: n for n in nodes}
    stages = []
    for k in range(chunks):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        feeds: list[tuple[str, str]] = []
        body = [n for n in nodes if n.op == "call_function" and stage_of[n.name] == k]
        needed_ph = []
        for n in body:
            for a in n.all_input_nodes:
                if a.op == "placeholder" and a.name not in user and a not in needed_ph:
                    needed_ph.append(a)
        for ph in needed_ph:
            name = prog.tied.get(ph.name, ph.name)
            kind = "param" if name in prog.params else "buffer" if name in prog.buffers else "constant"
            env[ph] = g.placeholder(ph.name)
            env[ph].meta = dict(ph.meta)
            feeds.append((kind, name))
        for v in live[k]:
            src = by_name[v]
            env[src] = g.placeholder(v if src.op == "placeholder" else f"in_{v}")
            env[src].meta = dict(src.meta)
            feeds.append(("live", v))
        for n in body:
            for a in n.all_input_nodes:
                if a.op == "get_attr" and a not in env:  # a checkpointed region's submodule
                    env[a] = g.get_attr(a.target)
            env[n] = g.node_copy(n, env.__getitem__)
        outs = [by_name[v] for v in live[k + 1]] if k + 1 < chunks else outputs
        missing = [o.name for o in outs if o not in env]
        if missing:
            raise AssertionError(f"pipeline stage {k}: values {missing} are needed later but not available")
        g.output(tuple(env[o] for o in outs))
        sgm = fx.GraphModule(gm, g)
        sgm.graph.eliminate_dead_code()
        sgm.recompile()
        stages.append(StageGraph(k, sgm, feeds, list(live[k]),
                                 [o.name for o in outs]))
    return stages


class _Stage(nn.Module):
    """One chunk as a module: its parameters are the owning ``PipelinedModule``'s (shared objects)."""

    def __init__(self, owner: PipelinedModule, sg: StageGraph, prog: Program, first: bool) -> None:
        super().__init__()
        self.sg = sg
        self.gm = sg.gm
        self._owner = [owner]  # not a submodule: the owner is not part of this stage
        self._prog = prog
        self.first = first
        self.params = nn.ParameterList([owner.param(prog.params[name]) for kind, name in sg.feeds
                                        if kind == "param"])

    def forward(self, *live: torch.Tensor) -> tuple[torch.Tensor, ...]:
        owner = self._owner[0]
        if self.first:  # the user inputs of one micro-batch, whole: keep this rank's pieces
            live = tuple(owner._bind_inputs(self._prog, list(live)))
        it = iter(live)
        feed = [next(it) if kind == "live" else owner._state_value(self._prog, name) for kind, name in self.sg.feeds]
        out = owner._call(self._prog, self.gm, feed)
        return tuple(o if o.is_contiguous() else o.contiguous() for o in out)


class PipelinedModule(ParallelModule):
    """A ``ParallelModule`` whose program runs as pipeline stages (see the module docstring)."""

    overlap_grads = False  # not from one backward: the schedule's last accumulation launches (``setup_sharing``)
    _buffer_owner: dict = {}  # persistent buffer -> (first stage holding it, shape, dtype), set by parallelize

    def __init__(self, *args, pipeline: dict, pp_group, p2p_group, pp_rank: int, stage_of_layer: dict[str, int],
                 world_mesh, **kwargs) -> None:
        self.pipeline = pipeline
        self.pp_group = pp_group
        self.p2p_group = p2p_group
        self.pp_rank = pp_rank
        self.pp_size = int(pipeline["degree"])
        self.virtual = int(pipeline.get("virtual", 1))
        self.chunks = self.pp_size * self.virtual
        self.world_mesh = world_mesh
        self._stage_of_layer = stage_of_layer
        super().__init__(*args, **kwargs)
        # every set of mesh axes a gradient is summed over, on any stage (the micro-batch plan holds all parameters)
        self._reduce_axes = {tuple(axes) for axes in self.plan.reduced.values()}

    # ---- construction of the schedule per program ----------------------------------------------------------
    def _my_chunks(self) -> list[int]:
        return [self.pp_rank + v * self.pp_size for v in range(self.virtual)]

    def _runner(self, prog: Program, n_micro: int, train: bool):
        key = (id(prog), n_micro, train)
        cache = self.__dict__.setdefault("_runners", {})
        if key in cache:
            return cache[key]
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleLoopedBFS,
        )

        from autopart.pipelining import assign_stages

        stage_of = assign_stages(prog.gm, prog.plan, self._stage_of_layer)
        graphs = split_stages(prog, stage_of, self.chunks)
        by_name = {n.name: n for n in prog.gm.graph.nodes}
        mesh = tuple(prog.plan.mesh_shape)
        grad: set[str] = set()  # values that carry a gradient (depend on a trainable parameter)
        for n in prog.gm.graph.nodes:
            if n.op == "placeholder":
                name = prog.tied.get(n.name, n.name)
                val = n.meta.get("val")
                if name in prog.params and isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
                    grad.add(n.name)
            elif n.op == "call_function" and any(a.name in grad for a in n.all_input_nodes):
                grad.add(n.name)

        def example(name: str, first: bool, train: bool) -> torch.Tensor:
            """A tensor of the local shape and dtype the value has on this rank (static stage metadata: torch's
            runtime shape inference would run the stage on uninitialised inputs, e.g. out-of-range labels)."""
            node = by_name[name]
            val = node.meta["val"]
            if node.op == "placeholder":
                spec = None if first or name not in prog.plan.inputs else parse_spec(prog.plan.inputs[name])
            else:
                spec = node.meta.get("autopart.output")
            shape = tuple(val.shape) if spec is None else local_shape(tuple(val.shape), spec, mesh)
            t = torch.empty(shape, dtype=val.dtype, device=self._device)
            return t.requires_grad_(train and name in grad and val.dtype.is_floating_point and not first)

        stages, mods = [], []
        for c in self._my_chunks():
            g = graphs[c]
            mod = _Stage(self, g, prog, first=c == 0)
            mods.append(mod)
            ins = tuple(example(v, c == 0, train) for v in g.live_in)
            outs = tuple(example(v, False, train) for v in g.live_out)
            stages.append(PipelineStage(mod, c, self.chunks, self._device, input_args=ins, output_args=outs,
                                        group=self.p2p_group))
        sched = self.pipeline["schedule"] if train else "gpipe"

        def loss_fn(out: Any, target: Any = None) -> torch.Tensor:
            return self._loss_of(out) / n_micro

        kw = dict(n_microbatches=n_micro, loss_fn=loss_fn if train else None, scale_grads=False)
        if sched == "interleaved":
            schedule = ScheduleInterleaved1F1B(stages, **kw)
        elif len(stages) > 1:  # forward only with several chunks per rank: breadth-first, GPipe's order
            schedule = ScheduleLoopedBFS(stages, **kw)
        elif sched == "1f1b" and n_micro >= self.chunks:
            schedule = Schedule1F1B(stages[0], **kw)
        else:  # GPipe; also 1F1B with fewer micro-batches than stages, whose every forward fits in its warm-up:
            # the same order, which torch's Schedule1F1B refuses to run
            schedule = ScheduleGPipe(stages[0], **kw)
        cache[key] = (schedule, graphs, mods)
        return cache[key]

    # ---- running ---------------------------------------------------------------------------------------------
    def _micro(self, args: tuple, kwargs: dict) -> tuple[Program, int, list[torch.Tensor]]:
        """The program of one micro-batch for these inputs, the number of micro-batches, the flat inputs."""
        # with local_batch=True, this rank's share of each micro-batch (the ranks of the data axes split it)
        b = int(self.pipeline["micro_batch_size"]) // math.prod(self._sizes[i] for i in self.local_batch_axes)
        batch = next((a.shape[0] for a in list(args) + list(kwargs.values())
                      if isinstance(a, torch.Tensor) and a.dim() > 0), None)
        if batch is None or batch % b:
            local = " (this rank's slice: local_batch=True)" if self.local_batch_axes else ""
            raise ValueError(f"the pipeline runs micro-batches of {b}{local} (plan: {self.pipeline['micro_batches']} "
                             f"of batch {self.pipeline['batch']}); got a batch of {batch}, not a multiple of {b}")
        margs, mkw = first_micro_batch(args, kwargs, batch, b)
        prog = self._program(margs, mkw)
        return prog, batch // b, [t.to(self._device) for t in self._user_tensors(prog, args, kwargs)]

    def forward_backward(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward of the global batch through the pipeline schedule; returns the loss (on every
        rank), gradients in ``.grad`` of this rank's stage parameters (accumulated onto what is there)."""
        prog, n, flat = self._micro(args, kwargs)
        schedule, _, mods = self._runner(prog, n, train=True)
        held = {}
        for key, p in self._params.items():
            if p.grad is not None:
                held[key], p.grad = p.grad, None
        losses: list = []
        is_first, is_last = self.pp_rank == 0, self.pp_rank == (self.chunks - 1) % self.pp_size
        target = torch.zeros(len(flat[0]), device=self._device) if is_last else None
        uses: dict[str, int] = {}  # a gradient is final after n accumulations per chunk of this rank using it
        for mod in mods:
            for key in {self._key(prog.params[name]) for kind, name in mod.sg.feeds if kind == "param"}:
                uses[key] = uses.get(key, 0) + n
        self._grads.begin_schedule(uses)
        if is_first:
            schedule.step(*flat, target=target, losses=losses, return_outputs=False)
        else:
            schedule.step(target=target, losses=losses, return_outputs=False)
        self._finish_param_gathers()  # the stages waited for the buckets they use; those of unused parameters
        loss = torch.zeros((), device=self._device, dtype=torch.float32)
        if is_last:
            loss = torch.stack([x.detach().float() for x in losses]).sum()
        last_global = dist.get_global_rank(self.pp_group, (self.chunks - 1) % self.pp_size)
        dist.broadcast(loss, src=last_global, group=self.pp_group)
        self.reduce_gradients()
        for key, g in held.items():
            p = self._params[key]
            p.grad = g if p.grad is None else p.grad + g
        return loss

    def forward(self, *args, **kwargs):
        """Forward only, through the stages (GPipe order); the outputs are returned on every rank."""
        prog, n, flat = self._micro(args, kwargs)
        schedule, _, _ = self._runner(prog, n, train=False)
        last = (self.chunks - 1) % self.pp_size
        with torch.no_grad():
            out = schedule.eval(*flat) if self.pp_rank == 0 else schedule.eval()
        self._finish_param_gathers()
        objs = [None]
        if self.pp_rank == last:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            objs = [[(tuple(o.shape), o.dtype) for o in outs]]
        dist.broadcast_object_list(objs, src=dist.get_global_rank(self.pp_group, last), group=self.pp_group)
        result = []
        for i, (shape, dtype) in enumerate(objs[0]):
            t = outs[i].contiguous() if self.pp_rank == last else torch.empty(shape, dtype=dtype, device=self._device)
            dist.broadcast(t, src=dist.get_global_rank(self.pp_group, last), group=self.pp_group)
            result.append(t)
        return prog.structured(result)

    # ---- gradients and state ---------------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Wait for the data-parallel reduction the schedule launched (which may keep only this rank's ZeRO slice
        of a gradient). A parameter held by several stages first sums its stages' gradients, then its data-parallel
        reduction runs here, after the schedule, not overlapped."""
        self._grads.end_schedule()
        for fqn, group in self._shared_groups:
            p = self._params[self._key_of[fqn]]
            if p.grad is not None:
                dist.all_reduce(p.grad._local_tensor, group=group)
        self._grads.post_backward(deferred=True)

    @property
    def _stage_group(self):
        """``ParallelModule.clip_grad_norm_`` sums the stages' norms over the pipeline."""
        return self.pp_group

    def _counts_in_norm(self, fqn: str) -> bool:
        return self._owner_rank[fqn] == self.pp_rank  # a parameter several stages hold counted once

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of every stage gathered to its full shape on every rank (tied names too)."""
        self._finish_param_gathers()
        out = {}
        for fqn in sorted(self._all_params):
            owner = self._owner_rank[fqn]
            if owner == self.pp_rank:
                key = self._key_of[fqn]
                full = unpermute(self._params[key].detach(), self._permuted.get(key, ())).full_tensor().contiguous()
            else:
                shape, dtype = self._all_params[fqn]
                full = torch.empty(shape, dtype=dtype, device=self._device)
            dist.broadcast(full, src=dist.get_global_rank(self.pp_group, owner), group=self.pp_group)
            out[fqn] = full
            for alias in self._aliases.get(fqn, []):
                out[alias] = full
        for fqn, (owner, shape, dtype) in self._buffer_owner.items():  # persistent buffers, from their first stage
            t = self._buffers_local[fqn].clone() if owner == self.pp_rank else \
                torch.empty(shape, dtype=dtype, device=self._device)
            dist.broadcast(t, src=dist.get_global_rank(self.pp_group, owner), group=self.pp_group)
            out[fqn] = t
        return out

    def setup_sharing(self, users: dict[str, list[int]], shapes: dict[str, tuple]) -> None:
        """``users``: parameter FQN -> chunks using it. Builds the groups that sum a shared parameter's gradient
        over the pipeline ranks holding it (every rank calls ``new_group`` in the same order)."""
        self._all_params = shapes
        self._owner_rank = {fqn: min(c % self.pp_size for c in cs) for fqn, cs in users.items()}
        self._shared_groups = []
        world_ranks = self.world_mesh  # tensor (pp, *stage) of global ranks
        stage_cells = world_ranks.reshape(self.pp_size, -1)
        for fqn in sorted(users):
            holders = sorted({c % self.pp_size for c in users[fqn]})
            if len(holders) < 2:
                continue
            mine = None
            for cell in range(stage_cells.shape[1]):
                ranks = [int(stage_cells[h, cell]) for h in holders]
                g = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    mine = g
            if mine is not None and fqn in self._key_of:
                self._shared_groups.append((fqn, mine))
        # the data-parallel reduction from the schedule's backward; a bucket holds one chunk's parameters, the
        # chunk whose backward finalises them (the rank's first using them: backward runs the chunks in reverse)
        mine_of = {self._key_of[f]: min(c for c in cs if c % self.pp_size == self.pp_rank)
                   for f, cs in users.items() if f in self._key_of}
        self._grads.in_schedule(world_ranks, self._reduce_axes, {self._key_of[f] for f, _ in self._shared_groups},
                                mine_of)


def first_micro_batch(args: tuple, kwargs: dict, batch: int, b: int) -> tuple[tuple, dict]:
    """The inputs cut to their first ``b`` rows along a batch dimension of size ``batch`` (others unchanged)."""
    def cut(x: Any) -> Any:
        return x[:b] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch else x

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def world_layout(world_shape: tuple[int, ...], axis: int, degree: int) -> torch.Tensor:
    """Global ranks as a (pp, *stage mesh) tensor: axis ``axis`` of the world mesh split pipeline-outermost."""
    ranks = torch.arange(math.prod(world_shape)).reshape(world_shape)
    n = world_shape[axis]
    shape = list(world_shape[:axis]) + [degree, n // degree] + list(world_shape[axis + 1:])
    ranks = ranks.reshape(shape)
    return ranks.movedim(axis, 0).contiguous()
