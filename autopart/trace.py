"""Model -> ATen-level ``torch.fx.GraphModule`` with fake-tensor metadata on every tensor node.

Uses ``torch.export.export(strict=False)`` (training IR). Models on the ``meta`` device trace without allocating.
"""

from __future__ import annotations

import hashlib
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx


@dataclass
class Traced:
    """A traced model: the graph plus how its placeholders map to the model's parameters, buffers and inputs."""

    gm: fx.GraphModule
    params: dict[str, str]  # placeholder name -> parameter FQN (one FQN per tensor; tied aliases in ``aliases``)
    buffers: dict[str, str]  # placeholder name -> buffer FQN
    constants: dict[str, str]  # placeholder name -> lifted constant FQN
    user_inputs: list[str]  # placeholder names of user inputs, in call order
    input_paths: list[str]  # "args[0]" / "kwargs['labels']" per user input
    outputs: list[str]  # names of output nodes (tensors)
    aliases: dict[str, list[str]] = field(default_factory=dict)  # FQN used in graph -> other FQNs tying to it
    tied: dict[str, str] = field(default_factory=dict)  # unused placeholder of a tied name -> canonical placeholder
    fingerprint: str = ""
    export_seconds: float = 0.0
    constant_values: dict[str, Any] = field(default_factory=dict)
    frozen: set[str] = field(default_factory=set)  # parameter FQNs with requires_grad=False (no gradient, no state)
    # the forward's output structure (``torch.export``'s pytree spec: a dict, a tuple, a Hugging Face ModelOutput),
    # whose leaves are the graph's outputs in order; the runtime returns its outputs in it
    out_spec: Any = None

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph


def _flat_input_paths(args: tuple, kwargs: dict) -> list[str]:
    paths = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            paths.append(f"args[{i}]")
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            paths.append(f"kwargs[{k!r}]")
    return paths


def graph_fingerprint(gm: fx.GraphModule) -> str:
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        h.update(f"{n.op}|{n.target}|{n.name}|{shape}\n".encode())
    return h.hexdigest()[:16]


def _where(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "site-packages/torch" not in f.filename
              and "/torch/" not in f.filename and "autopart/trace.py" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename}:{f.lineno} ({f.name}): {f.line}"


def _source_line(node: fx.Node) -> str:
    st = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in st.strip().splitlines() if ln.strip().startswith("File")]
    return lines[-1] if lines else "(no source line recorded)"


def _check_static(node: fx.Node, model_name: str) -> None:
    """autopart plans static shapes: a data-dependent size (boolean masks, nonzero) cannot be sharded evenly."""
    vals = node.meta.get("val")
    for v in vals if isinstance(vals, (tuple, list)) else [vals]:
        if isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape):
            module = _innermost_module(node)
            raise ValueError(
                f"{model_name} has a data-dependent shape at node {node.name} ({node.target}), shape "
                f"{tuple(v.shape)}\n  at {_source_line(node)}\n  autopart plans fixed shapes. "
                "Try: replace boolean-mask "
                "indexing / nonzero with a dense formulation (torch.where, masking by multiplication), or move the "
                "code behind a torch.library.custom_op with a fake implementation"
                + (f", or, if {module} computes each token's output from that token's inputs only "
                   "(a mixture-of-experts dispatch), declare its class with autopart.register_token_local"
                   if module else "") + ".")


def _innermost_module(node: fx.Node) -> str:
    """'path (Class)' of the innermost module a node was traced in, from export's ``nn_module_stack``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, cls = list(stack.values())[-1]
    name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1].strip("'>")
    return f"{path.removeprefix('L__self__').strip('.') or 'the model'} ({name})"


def _mutated_args(node: fx.Node) -> list[Any]:
    """The arguments an in-place ATen op (``copy_``, ``masked_fill_``, ``index_put_``, ...) writes into."""
    from autopart._torch_private import op_schema

    schema = op_schema(node.target) if node.op == "call_function" else None
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.append(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
    return out


def _writes_into_intermediates(gm: fx.GraphModule) -> list[fx.Node]:
    """In-place ops of the training IR that write into a value the graph computed (``buf[:, 1:] = x``: ``copy_``
    into a slice of ``buf``), not into a placeholder (a buffer's running statistics). autopart rewrites values on
    their way between ops (a collective may gather ``buf``'s slice into a new tensor), so such a write would land in
    a temporary and be lost: the graph is functionalized first (``_functionalize``)."""
    return [n for n in gm.graph.nodes
            if any(isinstance(a, fx.Node) and a.op != "placeholder" for a in _mutated_args(n))]


def _inline_no_grad(ep) -> bool:
    """Inline ``torch.no_grad()`` blocks of the forward (export's ``wrap_with_set_grad_enabled(False, body, *args)``
    higher-order op) into the graph, each value entering a block detached: the same values, no gradient through
    them, as under ``no_grad``. The block's ops then get sharding rules like any other, and its in-place writes
    (a running statistic updated under ``no_grad``) are seen: as one opaque node without outputs, dead-code
    elimination had dropped such a block and its buffer update with it. A block that turns gradients back on
    inside an outer ``no_grad`` is left as it is. Returns whether anything was inlined."""
    import operator

    gm = ep.graph_module
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    done = False
    for node in list(gm.graph.find_nodes(op="call_function", target=hop)) if hop is not None else ():
        enabled, sub, *operands = node.args
        if enabled or not isinstance(sub, fx.Node) or sub.op != "get_attr":
            continue
        body = getattr(gm, sub.target)
        if any(n.op == "get_attr" for n in body.graph.nodes):  # a block holding another block: left as it is
            continue
        if any(u.op != "call_function" or u.target is not operator.getitem for u in node.users):
            continue  # used whole (not through getitem): the block stays as it is
        env: dict[fx.Node, Any] = {}
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        outputs: Any = ()
        with gm.graph.inserting_before(node):
            for ph, arg in zip(placeholders, operands):
                val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
                if isinstance(val, torch.Tensor) and (arg.op != "placeholder" or val.requires_grad):
                    detached = gm.graph.call_function(torch.ops.aten.detach.default, (arg,))
                    detached.meta.update(arg.meta)
                    env[ph] = detached
                else:  # a buffer, a constant, a number: nothing to cut
                    env[ph] = arg
            for b in body.graph.nodes:
                if b.op == "output":
                    outputs = b.args[0]
                elif b.op != "placeholder":
                    env[b] = gm.graph.node_copy(b, lambda x, env=env: env[x])
        results = [env[o] if isinstance(o, fx.Node) else o for o in (outputs or ())]
        for user in list(node.users):  # each a getitem (checked above)
            user.replace_all_uses_with(results[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not sub.users:
            gm.graph.erase_node(sub)
            delattr(gm, sub.target)
        done = True
    if done:
        gm.recompile()
    return done


def _functionalize(ep):
    """``ep`` with in-place ops replaced by their functional forms (``copy_`` into a slice: ``slice_scatter``), as
    ``ExportedProgram.run_decompositions({})`` gives (no op decomposed). That turns writes into buffers and user
    inputs into extra graph outputs; they are written back in place at the end of the graph (``copy_`` into the
    placeholder, as the training IR did), so the program keeps the model's outputs and its buffers' updates."""
    from torch.export.graph_signature import OutputKind

    ep = ep.run_decompositions({})
    gm, sig = ep.graph_module, ep.graph_signature
    aten = torch.ops.aten
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.copy.default)):
        # copy(self, src), what copy_ becomes, has no derivative: src broadcast to self's shape and dtype does
        dst, src = node.args[0].meta["val"], node.args[1].meta["val"]
        with gm.graph.inserting_before(node):
            x = node.args[1]
            if tuple(src.shape) != tuple(dst.shape):
                x = gm.graph.call_function(aten.expand.default, (x, list(dst.shape)))
                x.meta.update(node.meta, val=src.expand(dst.shape))
            x = gm.graph.call_function(aten._to_copy.default, (x,), {"dtype": dst.dtype}) \
                if src.dtype != dst.dtype else gm.graph.call_function(aten.clone.default, (x,))
            x.meta.update(node.meta)
        node.replace_all_uses_with(x)
        gm.graph.erase_node(node)
    for node in gm.graph.find_nodes(op="call_function", target=aten.view.default):
        node.target = aten.reshape.default  # the functional graph's views (reshapes were among them) on local
        # tensors whose strides a sharded layout may have changed: reshape copies where a view cannot
    out = next(iter(gm.graph.find_nodes(op="output")))
    values = list(out.args[0])
    holder = {spec.target: spec.arg.name for spec in sig.input_specs if spec.target is not None}
    holder.update({spec.arg.name: spec.arg.name for spec in sig.input_specs if spec.target is None})
    placeholders = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
    kept, specs = [], []
    for value, spec in zip(values, sig.output_specs):
        if spec.kind in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION):
            dst = placeholders[holder[spec.target]]
            with gm.graph.inserting_before(out):
                write = gm.graph.call_function(torch.ops.aten.copy_.default, (dst, value))
            write.meta.update(val=dst.meta.get("val"), stack_trace=value.meta.get("stack_trace"))
        else:
            kept.append(value)
            specs.append(spec)
    if len(kept) != len(values):
        out.args = (tuple(kept),)
        sig.output_specs[:] = specs
    gm.recompile()
    return ep


def trace(model: torch.nn.Module, example_inputs: tuple = (), example_kwargs: dict | None = None) -> Traced:
    """Export ``model`` called as ``model(*example_inputs, **example_kwargs)`` to an ATen graph.

    Raises ValueError naming the model's source line when ``torch.export`` fails, with what to try.
    """
    import time

    example_kwargs = dict(example_kwargs or {})
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
    # torch.export merges a tensor passed twice (ids as input and as labels) into one placeholder: clone duplicates.
    seen: set[int] = set()

    def dedup(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            if id(t) in seen:
                return t.clone()
            seen.add(id(t))
        return t

    example_inputs = tuple(dedup(a) for a in example_inputs)
    example_kwargs = {k: dedup(v) for k, v in example_kwargs.items()}
    t0 = time.perf_counter()
    from autopart import regions

    try:
        with regions.opaque_token_local_modules(model):
            ep = torch.export.export(model, example_inputs, example_kwargs, strict=False)
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        where = _where(exc)
        msg = str(exc).strip().splitlines()
        first = msg[0] if msg else type(exc).__name__
        hint = "Try: pass use_cache=False for Hugging Face models; avoid data-dependent Python control flow " \
               "(branching on tensor values, nonzero/boolean-mask indexing) or move it behind a " \
               "torch.library.custom_op with a fake implementation."
        if "DynamicCache" in str(exc):
            hint = "The model returns a KV cache object: build it with use_cache=False (config.use_cache = False)."
        raise ValueError(
            f"autopart could not trace {type(model).__name__} with torch.export: {type(exc).__name__}: {first}\n"
            + (f"  at {where}\n" if where else "")
            + f"  {hint}"
        ) from exc
    _inline_no_grad(ep)
    if _writes_into_intermediates(ep.graph_module):
        ep = _functionalize(ep)
    export_seconds = time.perf_counter() - t0
    for node in ep.graph_module.graph.find_nodes(op="call_function", target=regions.OP):
        regions.measure(node.args[0], [a.meta["val"] for a in node.args[1]])
    gm = ep.graph_module
    sig = ep.graph_signature
    params, buffers, constants, user_inputs = {}, {}, {}, []
    from torch.export.graph_signature import InputKind, TensorArgument

    for spec in sig.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            params[name] = spec.target
        elif spec.kind == InputKind.BUFFER:
            buffers[name] = spec.target
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            constants[name] = spec.target
        elif spec.kind == InputKind.USER_INPUT:
            if isinstance(spec.arg, TensorArgument):
                user_inputs.append(name)
            else:  # a Python number or flag: export baked its value into the graph (the runtime's signature keys it)
                node = next(iter(gm.graph.find_nodes(op="placeholder", target=name)), None)
                if node is not None and not node.users:
                    gm.graph.erase_node(node)
                    gm.recompile()
    outputs = []
    for spec in sig.output_specs:
        arg = spec.arg
        if hasattr(arg, "name"):
            outputs.append(arg.name)
    # tied parameters: export keeps a placeholder per *name* of one tensor (often only one of them used); merge
    # them into one canonical placeholder so the planner prices and the runtime holds a single parameter
    by_id: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(fqn)
    fqn_group = {f: names for names in by_id.values() for f in names}
    placeholders = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
    aliases: dict[str, list[str]] = {}
    tied: dict[str, str] = {}
    groups: dict[tuple, list[str]] = {}
    for ph, fqn in params.items():
        groups.setdefault(tuple(fqn_group.get(fqn, [fqn])), []).append(ph)
    for names, phs in groups.items():
        used = sorted(phs, key=lambda ph: (len(placeholders[ph].users) == 0, ph))
        canon = used[0]
        for other in used[1:]:
            placeholders[other].replace_all_uses_with(placeholders[canon])
            tied[other] = canon
            del params[other]
        aliases[params[canon]] = [f for f in names if f != params[canon]]
    constant_values = {name: ep.constants[t] for name, t in constants.items() if t in ep.constants}
    frozen = {fqn for fqn, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    # values nothing reads (Hugging Face computes a fused kernel's arguments, then falls back to eager code that
    # does not use them): dropped, so that the planner prices and lays out only what runs
    if gm.graph.eliminate_dead_code():
        gm.recompile()
    for node in gm.graph.nodes:
        if node.op == "placeholder" and "val" not in node.meta:
            raise ValueError(f"traced placeholder {node.name} has no fake-tensor metadata")
        _check_static(node, type(model).__name__)
    return Traced(
        gm=gm,
        params=params,
        buffers=buffers,
        constants=constants,
        user_inputs=user_inputs,
        input_paths=_flat_input_paths(example_inputs, example_kwargs),
        outputs=outputs,
        aliases=aliases,
        tied=tied,
        fingerprint=graph_fingerprint(gm),
        export_seconds=export_seconds,
        constant_values=constant_values,
        frozen=frozen,
        out_spec=ep.call_spec.out_spec,
    )
