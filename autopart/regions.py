"""Token-local modules: traced as one opaque node, run on each rank's own tokens.

A mixture-of-experts layer in Hugging Face transformers 5 (``@use_experts_implementation``: Mixtral, Qwen2-MoE,
OLMoE, DeepSeek, ...) dispatches tokens to experts by sorting the expert ids of *all* tokens of the flattened batch,
counting them (``histc``), gathering the tokens in that order, running a grouped matmul per expert and scattering
the results back. No op of that chain can be split along the tokens on its own: a sort or a histogram over half the
tokens is not half of the global one. The layer as a whole is *token-local*, though: the output row of a token
depends only on that token's hidden state, expert ids and weights. Run on any subset of the tokens it gives those
tokens' rows of the full result.

So autopart does not trace into such a module. ``trace`` replaces its forward, for the export only, by one call of
the custom op ``autopart::token_local`` whose inputs are the module's tensor arguments and its parameters. The
tokens form a grid: the first argument's dims less its last (feature) dim. The planner gives the node, per mesh
axis (``autopart.strategy.moe``), everything whole, or the tokens split along one dim of that grid: every argument
and output holding the tokens split with them (``Region.token_dim``), the parameters whole. At run time the node
calls the module's own forward on the rank's local tensors (``run``), with autograd through it as usual, on a copy
of the module whose own weights are meta (``_skeleton``); the parameters' gradients are reduced over the
data-parallel axes like any replicated weight's.

Which modules: Hugging Face's experts classes are recognised by the attributes their decorator sets, and the
region is their whole sparse-MoE block (router, experts, shared expert) where the parent has ``gate`` and
``experts``: its (batch, sequence, hidden) input lets a 2-D plan split the batch on one axis and the sequence on
the other. Any other module class (or a predicate) can be declared with ``autopart.register_token_local``.
Declaring a module that is not token-local (capacity-based token dropping, a norm over the batch, ...) gives wrong
results under a token split: that is the declaration's promise.

The node's price comes from one run of the module's forward and backward on fake tensors at trace time (``measure``):
its FLOPs (autopart's per-op formulas, grouped matmuls included) and the bytes autograd saves, both per token.

Expert parallelism (Hugging Face layers): on an axis its tokens are split over, the node may also take the experts
layer's stacked weights split along dim 0 (``Region.expert_inputs``). ``run`` then swaps the layer's forward, for
the call, for ``_ep_experts``: each (token, expert) pair's hidden row goes to the rank holding that expert (an
uneven all-to-all per axis, nested in mesh order as the weights are chunked), the layer's own forward runs there on
the rows it received with its local experts (one expert per row, weight 1), the rows come back and each token sums
its top-k rows times its routing weights, as the layer does. Router and shared expert run on the rank's tokens with
whole weights. Offered only where ``measure`` saw the layer called as ``experts(hidden (T, h), ids (T, k), weights
(T, k))``; priced by ``planner.ep_comm_time``.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from autopart import _torch_private

_DECLARED: list[Callable[[nn.Module], bool]] = []


def _hf_experts(module: nn.Module | None) -> bool:
    """A Hugging Face experts module (``transformers.integrations.moe.use_experts_implementation`` sets these)."""
    return all(hasattr(module, a) for a in ("_is_expert_parallel", "is_concatenated", "has_gate", "config")) \
        and not getattr(module, "_is_expert_parallel", False)


def register_token_local(kind: type | Callable[[nn.Module], bool]) -> None:
    """Declare modules whose output for each token depends only on that token's inputs (the first dimension of each
    tensor argument and output is the tokens): a module class, or a predicate on module instances. autopart traces
    each such module as one node that runs whole or on each rank's own tokens (``autopart.regions``)."""
    if isinstance(kind, type):
        if not issubclass(kind, nn.Module):
            raise TypeError(f"register_token_local needs an nn.Module subclass or a predicate, got {kind!r}")
        _DECLARED.append(lambda m, k=kind: isinstance(m, k))
    elif callable(kind):
        _DECLARED.append(kind)
    else:
        raise TypeError(f"register_token_local needs an nn.Module subclass or a predicate, got {kind!r}")


def is_token_local(module: nn.Module) -> bool:
    return _hf_experts(module) or any(pred(module) for pred in _DECLARED)


@dataclass
class Region:
    """One call of a token-local module in a traced graph."""

    module: nn.Module
    path: str  # the module's name in the model
    leaves: list[Any]  # the call's (args, kwargs) leaves; tensors replaced by None
    spec: Any  # their pytree spec
    n_args: int  # tensor arguments, before the parameters in the op's input list
    names: list[str]  # parameter and buffer names (relative to the module), after them
    out_spec: Any = None  # the forward's output structure
    hf: bool = False  # a Hugging Face experts layer or its sparse-MoE block
    grid: tuple[int, ...] = ()  # the token dims: the first tensor argument's shape less its last (feature) dim
    flops_per_token: float = 0.0  # forward
    backward_flops_per_token: float = 0.0
    saved_per_token: float = 0.0  # bytes autograd keeps for backward
    measured: str = ""  # why the measurement failed, when it did
    # expert parallelism (a Hugging Face block or experts layer): the experts layer's path in the module ("" for
    # the module itself), its expert count, top-k, the op inputs (indices into its input list) holding one slice
    # per expert along dim 0, and whether the layer was seen called as ``experts(hidden (T, h), ids (T, k),
    # weights (T, k))``, which ``_ep_experts`` dispatches
    experts: str | None = None
    num_experts: int = 0
    top_k: int = 0
    expert_inputs: tuple[int, ...] = ()
    ep_ok: bool = False

    @property
    def experts_layer(self) -> nn.Module:
        """The experts layer in the called copy (``experts`` set): the module itself or its submodule."""
        return self.module.get_submodule(self.experts) if self.experts else self.module

    @property
    def tokens(self) -> int:
        return math.prod(self.grid) if self.grid else 0

    def token_dim(self, v: Any, d: int) -> int | None:
        """The dim of tensor ``v`` that a split of the token grid's dim ``d`` splits: ``d`` where ``v``'s leading
        dims are the grid; 0 for a split of the grid's first dim where ``v`` holds the tokens flattened (batch-major
        rows, as router logits of a (batch, sequence) block); None where ``v`` is not split with the tokens."""
        if not isinstance(v, torch.Tensor) or not self.grid:
            return None
        if tuple(v.shape[: len(self.grid)]) == self.grid:
            return d
        if d == 0 and len(self.grid) > 1 and v.dim() and v.shape[0] == self.tokens:
            return 0
        return None

    def call(self, flat: list[torch.Tensor], hooks: bool = True) -> list[torch.Tensor]:
        """The module's forward on ``flat`` (tensor arguments, then parameters and buffers); outputs flattened.
        ``hooks=False``: its ``forward`` without ``__call__`` (no module hooks; a trace's module-call records stay
        balanced when the forward raises on fake tensors)."""
        tensors = iter(flat[: self.n_args])
        leaves = [next(tensors) if leaf is None else leaf for leaf in self.leaves]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        state = dict(zip(self.names, flat[self.n_args:]))
        if hooks:
            out = torch.func.functional_call(self.module, state, tuple(args), dict(kwargs), strict=False)
        else:
            with _torch_private.reparametrize(self.module, state):
                out = type(self.module).forward(self.module, *args, **kwargs)
        outs, spec = pytree.tree_flatten(out)
        if self.out_spec is None:
            self.out_spec = spec
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise TypeError(f"token-local module {self.path} returned {type(out).__name__} with non-tensor leaves; "
                            "only tensors (in any nesting) can be returned")
        return list(outs)


_REGIONS: list[Region] = []


def region(key: int) -> Region:
    return _REGIONS[key]


@torch.library.custom_op("autopart::token_local", mutates_args=())
def token_local(key: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The opaque node of a token-local module call (``Region``); eagerly, its forward without autograd through it
    (the runtime calls ``run`` instead)."""
    return [o.clone() for o in _REGIONS[key].call(list(inputs))]


@token_local.register_fake
def _(key: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    r = _REGIONS[key]

    def like_first() -> list[torch.Tensor]:
        # a Hugging Face MoE block or experts layer returns one tensor shaped as its hidden states; so must a
        # declared module whose forward cannot run on fake tensors
        if r.out_spec is None:
            r.out_spec = pytree.tree_flatten(inputs[0])[1]
        return [torch.empty_like(inputs[0])]

    if r.hf:  # not run: an eager experts loop (nonzero) would fail inside a submodule's call, which export's
        return like_first()  # module-call records cannot unwind
    try:
        # sizes the forward computes from data (nonzero) stay inside it: token-local outputs are sized by the tokens
        with _torch_private.ignore_fresh_unbacked_symbols(inputs[0]):
            return [o.clone() for o in r.call(list(inputs), hooks=False)]
    except Exception as exc:  # noqa: BLE001 - e.g. a data-dependent shape (nonzero) the fake tensors cannot follow
        r.measured = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return like_first()


def _setup(ctx, inputs, output) -> None:
    ctx.key = inputs[0]
    ctx.save_for_backward(*inputs[1])


def _backward(ctx, *grads):
    """Recompute the forward with autograd and differentiate it (only when the op itself runs eagerly)."""
    grads = grads[0] if len(grads) == 1 and isinstance(grads[0], (list, tuple)) else grads
    flat = [t.detach().requires_grad_(t.is_floating_point()) for t in ctx.saved_tensors]
    with torch.enable_grad():
        outs = _REGIONS[ctx.key].call(flat)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    wrt = [t for t in flat if t.requires_grad]
    got = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
               if pairs else [None] * len(wrt))
    return None, [next(got) if t.requires_grad else None for t in flat]


token_local.register_autograd(_backward, setup_context=_setup)
OP = torch.ops.autopart.token_local.default


def _flops(args: tuple, kwargs: dict, out: Any) -> int:
    """Forward FLOPs of a token-local node: measured per token (``measure``) times its tokens."""
    r = _REGIONS[args[0]]
    return int(r.flops_per_token * math.prod(args[1][0].shape[: len(r.grid)]))


def _backward_ratio(args: tuple) -> float:
    """Backward over forward FLOPs of a token-local node, as ``measure`` counted them on its module (2.0 for Hugging
    Face's experts: grouped matmuls); 2.0 where nothing was measured (a module whose fake run failed)."""
    r = _REGIONS[args[0]] if args and isinstance(args[0], int) and 0 <= args[0] < len(_REGIONS) else None
    if r is None or r.measured or r.flops_per_token <= 0:
        return 2.0
    return r.backward_flops_per_token / r.flops_per_token


def _install_formulas() -> None:
    from autopart.cost.compute import _FORMULAS, BACKWARD_RATIO

    _FORMULAS[OP.overloadpacket] = _flops
    BACKWARD_RATIO[OP] = _backward_ratio


_install_formulas()


def describe(node: Any) -> str:
    """How a plan names a token-local node: the op and the module it stands for."""
    return f"{OP}({_REGIONS[node.args[0]].path})"


def run(key: int, inputs: list[torch.Tensor], ep_axes: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """The runtime's target for a token-local node: the module's forward on this rank's tensors, autograd through
    it (no recomputation). ``ep_axes``: the mesh axes its expert weights are split over (dim 0, in axis order):
    the experts layer then sends each (token, expert) pair to the rank holding the expert and back
    (``_ep_experts``)."""
    r = _REGIONS[key]
    # a split along the sequence leaves a rank's hidden states strided; the module may view them
    inputs = [t.contiguous() if i < r.n_args else t for i, t in enumerate(inputs)]
    if not ep_axes:
        return r.call(inputs)
    experts = r.experts_layer
    forward = type(experts).forward

    def dispatched(*args, **kwargs):
        got = _experts_call(args, kwargs)
        return _ep_experts(experts, forward, *got[:3], tuple(ep_axes), r.num_experts)

    experts.forward = dispatched
    try:
        return r.call(inputs)
    finally:
        del experts.forward


def _experts_call(args: tuple, kwargs: dict) -> list[Any]:
    """An experts layer's call arguments in order (hidden states, expert ids, routing weights), positional or not."""
    return list(args) + [kwargs[n] for n in ("hidden_states", "top_k_index", "top_k_weights") if n in kwargs]


def _ep_experts(experts: nn.Module, forward: Callable, hidden: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor, axes: tuple[int, ...], num_experts: int) -> torch.Tensor:
    """An experts layer's ``forward(hidden (T, h), ids (T, k), weights (T, k))`` with its experts split over
    ``axes`` (this rank holds experts ``[c * E/n, (c+1) * E/n)`` of the first axis, and so on within them): each
    (token, expert) pair's hidden row goes to its expert's rank (an all-to-all per axis), the rank's experts run
    the layer's own forward on what it received (each row with one expert, weight 1), the rows come back, and
    each token sums its k rows times its routing weights, as the layer does."""
    if ids.shape != weights.shape or ids.dim() != 2 or hidden.dim() != 2 or ids.shape[0] != hidden.shape[0]:
        raise NotImplementedError(
            f"expert parallelism of {type(experts).__name__}: its call passed hidden {tuple(hidden.shape)}, ids "
            f"{tuple(ids.shape)}, weights {tuple(weights.shape)}; only experts(hidden (T, h), ids (T, k), "
            "weights (T, k)) is dispatched. Pin its weights whole: pins={'<experts weight>': 'R'}")
    tokens, k = ids.shape
    rows = hidden.repeat_interleave(k, dim=0)  # pair (t, j) at row t*k + j
    out = _ep_rows(experts, forward, rows, ids.reshape(-1), axes, num_experts)
    return (out.view(tokens, k, -1) * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1).to(hidden.dtype)


def _ep_rows(experts: nn.Module, forward: Callable, rows: torch.Tensor, ids: torch.Tensor, axes: tuple[int, ...],
             num_experts: int) -> torch.Tensor:
    """Expert ``ids[i]`` applied to ``rows[i]``, the experts split over ``axes``."""
    from autopart.runtime import collectives as C

    if not axes:  # this rank's experts: the layer's own forward, one expert per row
        own = [p for _, p in experts.named_parameters(recurse=False)]
        saved = experts.num_experts
        experts.num_experts = num_experts
        try:
            out = forward(experts, rows, ids.unsqueeze(1), rows.new_ones((rows.shape[0], 1)))
        finally:
            experts.num_experts = saved
        # the output depends on the rows received and on every expert weight even where no row came (an eager
        # loop then touches neither): each backward all-to-all runs on every rank, each rank reduces every weight's
        # gradient (zeros here)
        return out + sum((t.reshape(-1)[:1].sum() * 0 for t in [rows, *own] if t.requires_grad), out.new_zeros(()))
    n = C.axis_size(axes[0])
    per = num_experts // n
    owner = torch.div(ids, per, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)
    send_counts = torch.bincount(owner, minlength=n)
    recv_counts = C.exchange_counts(send_counts, axes[0])
    send, recv = send_counts.tolist(), recv_counts.tolist()
    local_ids = C.exchange_rows((ids - owner * per)[order], axes[0], send, recv)
    got = C.all_to_all_rows(rows[order], axes[0], send, recv)
    done = _ep_rows(experts, forward, got, local_ids, axes[1:], per)
    back = C.all_to_all_rows(done, axes[0], recv, send)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return back.index_select(0, inverse)


def _skeleton(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device: what a region calls with the
    rank's tensors in their place, without keeping the user's full-size weights alive (``ParallelModule`` holds
    the model only weakly)."""
    memo: dict[int, torch.Tensor] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _find_experts(r: Region, module: nn.Module) -> None:
    """Where a Hugging Face region's experts are: the layer (the module or its ``experts``), its expert count and
    top-k, and the inputs stacked per expert (the layer's own parameters with the experts along dim 0)."""
    path = "" if _hf_experts(module) else "experts"
    experts = module if not path else getattr(module, "experts", None)
    e = getattr(experts, "num_experts", 0)
    if not _hf_experts(experts) or not isinstance(e, int) or e < 2:
        return
    cfg = experts.config
    r.experts, r.num_experts = path, e
    r.top_k = int(getattr(cfg, "num_experts_per_tok", 0) or getattr(cfg, "top_k", 0) or 0)
    prefix = f"{path}." if path else ""
    own = {prefix + n for n, _ in experts.named_parameters(recurse=False)}
    state = dict(itertools.chain(module.named_parameters(remove_duplicate=False), module.named_buffers()))
    r.expert_inputs = tuple(r.n_args + i for i, name in enumerate(r.names)
                            if name in own and state[name].dim() and state[name].shape[0] == e)


def _wrapped_forward(module: nn.Module, path: str, forward: Callable, hf: bool) -> Callable:
    """``module``'s forward for the export: one ``autopart::token_local`` call (``hf``: a Hugging Face block or
    experts layer). The region calls a meta-weight copy of it, made now, before the forward is replaced."""
    skeleton = _skeleton(module)

    def wrapper(*args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if not tensors:
            return forward(*args, **kwargs)
        state = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers())
        first = tuple(int(d) for d in tensors[0].shape)
        r = Region(module=skeleton, path=path, leaves=[None if isinstance(x, torch.Tensor) else x for x in leaves],
                   spec=spec, n_args=len(tensors), names=[n for n, _ in state],
                   grid=first[:-1] if len(first) > 1 else first, hf=hf)
        if hf:
            _find_experts(r, module)
        key = len(_REGIONS)
        _REGIONS.append(r)
        outs = token_local(key, [*tensors, *(t for _, t in state)])
        return pytree.tree_unflatten(list(outs), r.out_spec)

    return wrapper


class opaque_token_local_modules:
    """Context manager: within it, every token-local module of ``model`` calls ``autopart::token_local``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.patched: list[nn.Module] = []

    def __enter__(self) -> opaque_token_local_modules:
        modules = dict(self.model.named_modules())
        chosen: dict[str, tuple[nn.Module, bool]] = {}
        for path, m in modules.items():
            if m is self.model or not is_token_local(m):
                continue
            hf = _hf_experts(m)
            parent_path = path.rpartition(".")[0]
            parent = modules.get(parent_path)
            if hf and parent is not None and parent is not self.model and \
                    getattr(parent, "experts", None) is m and hasattr(parent, "gate"):
                # the whole sparse-MoE block (router, experts, shared expert): its (batch, sequence, hidden)
                # input and output let a plan split the tokens by batch on one axis and by sequence on another
                path, m = parent_path, parent
            chosen.setdefault(path, (m, hf))
        for path, (m, hf) in sorted(chosen.items()):
            if any(path.startswith(p + ".") for p in chosen if p != path):
                continue  # inside another token-local module
            m._autopart_path = path
            m.forward = _wrapped_forward(m, path, m.forward, hf)
            self.patched.append(m)
        return self

    def __exit__(self, *exc) -> None:
        for m in self.patched:
            del m.forward
            del m._autopart_path


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: Any) -> tuple[tuple[int, ...], int] | None:
    """Output shape and FLOPs of ``_grouped_mm(a, b, offs)``: (S, K) rows by (E, K, N) groups -> (S, N), each row
    meeting one group (2·S·K·N); (M, K) by (K, N) grouped along K -> (E, M, N) (a weight's gradient, 2·M·K·N); or a
    batch (E, M, K) by (E, K, N) -> (E, M, N). None for other layouts."""
    if a.dim() == 2 and b.dim() == 3:
        return (a.shape[0], b.shape[-1]), 2 * a.shape[0] * a.shape[1] * b.shape[-1]
    if a.dim() == 2 and b.dim() == 2 and offs is not None:
        return (offs.shape[0], a.shape[0], b.shape[1]), 2 * a.shape[0] * a.shape[1] * b.shape[1]
    if a.dim() == 3 and b.dim() == 3:
        return (a.shape[0], a.shape[1], b.shape[2]), 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    return None


def _grouped_mm_flops(args: tuple, kwargs: dict, out: Any) -> int:
    got = _grouped_mm_shape(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("offs"))
    if got is None:
        raise ValueError(f"grouped matmul of shapes {tuple(args[0].shape)} and {tuple(args[1].shape)}")
    return got[1]


def _grouped_mm_backward_flops(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * _grouped_mm_flops(args, kwargs, out)


def _register_grouped_mm_formulas() -> None:
    """FLOPs of grouped matmuls (PyTorch's and transformers' fallback op), when they exist."""
    from autopart.cost.compute import _FORMULAS

    if hasattr(torch.ops.aten, "_grouped_mm"):
        _FORMULAS[torch.ops.aten._grouped_mm] = _grouped_mm_flops
    try:
        ns = torch.ops.transformers
        _FORMULAS[ns.grouped_mm_fallback] = _grouped_mm_flops
        _FORMULAS[ns.grouped_mm_fallback_backward] = lambda a, k, o: _grouped_mm_backward_flops((a[0], a[1]), k, o)
    except (AttributeError, RuntimeError):
        pass


class _Counter(_torch_private.dispatch_mode_class()):
    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from autopart.cost.compute import node_flops

        kwargs = kwargs or {}
        got = _grouped_mm_shape(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("offs")) \
            if func._overloadpacket is getattr(torch.ops.aten, "_grouped_mm", None) else None
        if got is not None:  # its meta kernel wants CUDA's bf16: only the shape matters here
            self.flops += got[1]
            return torch.empty(got[0], dtype=kwargs.get("out_dtype") or args[0].dtype, device=args[0].device)
        out = func(*args, **kwargs)
        try:
            self.flops += node_flops(func, args, kwargs, out)
        except ValueError:
            pass
        return out


def _watch_experts(r: Region, vals: list[Any]):
    """A hook that sets ``r.ep_ok`` when the experts layer is called as ``_ep_experts`` can dispatch (run before
    its forward, so an experts loop that fails on fake tensors is still seen); None for other regions."""
    if r.experts is None or not r.expert_inputs:
        return None
    experts = r.experts_layer

    def check(module, args, kwargs):
        got = _experts_call(args, kwargs)
        if len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got):
            x, ids, w = got
            r.ep_ok = (x.dim() == 2 and ids.dim() == 2 and not ids.is_floating_point() and w.shape == ids.shape
                       and ids.shape[0] == x.shape[0])

    r.ep_ok = False
    if not r.experts:  # the region is the layer: its own call, which ``measure`` makes without hooks
        check(experts, tuple(vals[: r.n_args]), {})
        return None
    return experts.register_forward_pre_hook(check, with_kwargs=True)


def measure(key: int, vals: list[Any]) -> None:
    """Price region ``key`` from one forward and backward of its module on fake tensors shaped as ``vals`` (the
    traced node's inputs): FLOPs per token each way and the bytes autograd saves per token. On failure (a
    data-dependent shape in the module) the region keeps zeros and ``measured`` says why."""
    r = _REGIONS[key]
    _register_grouped_mm_formulas()
    tokens = max(1, r.tokens)
    try:
        with _torch_private.fake_mode():
            flat = [torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="cpu")
                    .requires_grad_(v.dtype.is_floating_point) for v in vals]
            params = flat[r.n_args:]
            saved: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                base = t._base if t._base is not None else t
                if not any(base is p for p in params):
                    saved[id(base)] = base.numel() * base.element_size()
                return t

            fwd = _Counter()
            seen = _watch_experts(r, vals)
            try:
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fwd:
                    outs = r.call(flat, hooks=False)
            finally:
                if seen is not None:
                    seen.remove()
            grads = [torch.ones_like(o) for o in outs if o.requires_grad]
            bwd = _Counter()
            wrt = [t for t in flat if t.requires_grad]
            if grads and wrt:
                with bwd:
                    torch.autograd.grad([o for o in outs if o.requires_grad], wrt, grads, allow_unused=True)
        r.flops_per_token = fwd.flops / tokens
        r.backward_flops_per_token = bwd.flops / tokens
        r.saved_per_token = sum(saved.values()) / tokens
        r.measured = ""
    except Exception as exc:  # noqa: BLE001 - a price is best effort; the node still runs
        r.measured = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        # estimate: each token meets top-k of the experts' weights once (a dense module: all of them), and keeps
        # its inputs and one hidden row per weight matrix it meets
        params = sum(v.numel() for v in vals[r.n_args:])
        experts = getattr(r.module, "experts", r.module)  # a Hugging Face block's experts layer
        cfg = getattr(experts, "config", None)
        k, e = getattr(cfg, "num_experts_per_tok", 1), getattr(experts, "num_experts", 0) or 1
        share = k / e if _hf_experts(experts) and e > 1 else 1.0
        r.flops_per_token = 2 * params * share
        r.backward_flops_per_token = 2 * r.flops_per_token
        r.saved_per_token = sum(v[0].numel() * v.element_size() for v in vals[: r.n_args] if v.dim()) * (1 + k)
