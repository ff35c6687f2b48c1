"""``trace``: record one forward of a model on fake tensors, as a ``Graph`` of torch function calls.

Nothing real is computed or allocated: parameters, buffers and inputs are ``FakeTensor``s (shapes
and dtypes only) swapped in with ``torch.func.functional_call``, so a model on ``meta``, on the CPU
or already on the XLA device traces the same way and is left exactly as it was. A
``TorchFunctionMode`` records every call with its module scope. transformers recognises fake
tensors and skips its data-dependent checks. Without ``example_inputs`` an input is synthesised from
what the model declares (``inputs.synthesize``: a Hugging Face model's main input and config, else
token ids, images or floats for its first layer); the integer inputs of a made-up image call beside the tokens
(a vision tower's grid of patches, which the model reads on the host with ``.tolist()``) stay real tensors,
and what is computed from them alone (or from numbers) runs for real. Example:

>>> graph = trace(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)))
>>> [(n.op, n.module) for n in graph.nodes]
[('linear', '0'), ('relu', '1'), ('linear', '2')]
>>> graph.params["0.weight"].consumers[0][0].op, graph.inputs[0].shape
('linear', (2, 8, 16))
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                          FakeTensorMode, unset_fake_temporarily)
from torch.func import functional_call
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import PlanError
from .graph import Graph, Node, Value
from .inputs import MadeUpInputError, host_values, synthesize, takes_images
from .positions import every_position
from .repeats import Diverged, Span, call_key, structures
from .routing import batched_experts


def op_name(func: Any) -> str:
    """Short name of a torch function.

    >>> op_name(torch.Tensor.__radd__), op_name(torch.nn.functional.linear), op_name(torch.Tensor.T.__get__)
    ('radd', 'linear', 'T')
    """
    name = resolve_name(func) or getattr(func, "__name__", repr(func))
    name = name.removesuffix(".__get__").rsplit(".", 1)[-1]
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    return name


class _Recorder(TorchFunctionMode):
    """Records each torch function call that touches or makes a tensor."""

    def __init__(self, graph: Graph, known: dict[int, Value], scope: list[str], host: Sequence[torch.Tensor] = ()):
        super().__init__()
        self.graph, self.known, self.scope = graph, known, scope
        self.keep: list[torch.Tensor] = list(host)  # keeps traced tensors alive so their ids stay unique
        self.host = {id(t) for t in host}  # real tensors: values the model reads on the host (``_on_host``)

    def value_of(self, t: torch.Tensor) -> Value:
        v = self.known.get(id(t))
        if v is None:  # a tensor made outside the trace (a plain tensor attribute, a constant)
            v = self.graph.new_value(t, "const")
            self.known[id(t)] = v
            self.keep.append(t)
        return v

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        flat_in, _ = tree_flatten((args, kwargs))
        tensors_in = [t for t in flat_in if isinstance(t, torch.Tensor)]
        real = self._on_host(tensors_in)
        with unset_fake_temporarily() if real else contextlib.nullcontext():
            out = _call(func, name, args, kwargs)
        flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if real:
            self.host.update(id(t) for t in flat_out)
        elif tensors_in and (name == "setitem" or name.endswith("_")):  # a host value written with a traced one
            self.host.discard(id(tensors_in[0]))
        if not flat_out and name != "setitem":
            return out
        in_values = tuple(self.value_of(t) for t in tensors_in)
        swap = {id(t): v for t, v in zip(tensors_in, in_values)}
        node_args, node_kwargs = tree_map(lambda a: swap.get(id(a), a) if isinstance(a, torch.Tensor) else a,
                                          (tuple(args), dict(kwargs)))
        node = Node(len(self.graph.nodes), name, func, node_args, node_kwargs, in_values, (), self.scope[-1])
        for pos, v in enumerate(in_values):
            v.consumers.append((node, pos))
        dynamic = any(v.dynamic for v in in_values) and not _shape_only(name)
        if name == "setitem" and in_values:  # in place on args[0]: a new version of it
            flat_out = [args[0]]
        outs = []
        for t in flat_out:
            v = self.graph.new_value(t, "act" if dynamic else "const", producer=node, dynamic=dynamic)
            self.known[id(t)] = v
            self.keep.append(t)
            outs.append(v)
        node.outputs = tuple(outs)
        self.graph.nodes.append(node)
        return out


    def _on_host(self, tensors: list[torch.Tensor]) -> bool:
        """Whether a call computes on values read on the host alone (inputs given as real tensors, what is
        computed from them alone, and, beside them, tensors made from numbers): it runs for real, so the
        model can read its result (``.tolist()``: a vision tower's grid of patches)."""
        return bool(self.host) and all(id(t) in self.host for t in tensors)


SELECTIONS = ("where", "nonzero")  # one-argument where / nonzero(as_tuple=True): positions chosen by value


def is_selection(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a call picks positions by value (``torch.where(mask)``, ``mask.nonzero(as_tuple=True)``)."""
    return name in SELECTIONS and len(args) == 1 and (name == "where" and not kwargs or
                                                       name == "nonzero" and kwargs == {"as_tuple": True})


def selections(graph: Graph) -> list[Node]:
    """The calls of ``graph`` that pick positions by value (``is_selection``)."""
    return [n for n in graph.nodes if is_selection(n.op, n.args, n.kwargs)]


def is_position_loop(name: str, args: tuple, kwargs: dict, rank: int) -> bool:
    """Whether a call is ``hit.nonzero()`` of a 1-D ``hit`` (of ``rank`` 1): the experts an MoE layer loops over."""
    return name == "nonzero" and len(args) == 1 and rank == 1 and kwargs in ({}, {"as_tuple": False})


def position_loops(graph: Graph) -> list[Node]:
    """The calls of ``graph`` that are ``is_position_loop``."""
    return [n for n in graph.nodes if n.tensors and is_position_loop(n.op, n.args, n.kwargs, len(n.tensors[0].shape))]


def _call(func: Any, name: str, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)``; a histogram of integers (MoE routers count expert choices so; fake
    tensors, like the CPU, count floats only) as one of floats; positions picked by value (an MoE
    layer looping over its experts) as every position of the mask, ordered by it: the shape the
    lowering's dropless selection has (``lowering.selected``); the experts a layer loops over
    (``hit.nonzero()``) as every one of them (``positions``)."""
    first = args[0] if args else None
    if isinstance(first, torch.Tensor) and is_selection(name, args, kwargs):
        order = torch.argsort((first.reshape(-1) == 0).to(torch.uint8), stable=True)
        return torch.unravel_index(order, tuple(first.shape))
    if isinstance(first, torch.Tensor) and is_position_loop(name, args, kwargs, first.dim()):
        return every_position(first.shape[0])
    if name == "_is_all_true" or name == "item" and not isinstance(first, FakeTensor):
        with unset_fake_temporarily():  # a check of values (``torch._check_tensor_all``): the real call checks them
            return torch.tensor(True) if name == "_is_all_true" else func(*args, **kwargs)
    if name == "histc" and isinstance(first, torch.Tensor) and not first.is_floating_point():
        return func(first.float(), *args[1:], **kwargs).to(first.dtype)
    return func(*args, **kwargs)


def _shape_only(name: str) -> bool:
    """Ops whose output depends on an input's shape only (``new_ones``, ``zeros_like``, ...)."""
    return name.startswith("new_") or name in ("zeros_like", "ones_like", "empty_like", "full_like",
                                               "rand_like", "randn_like", "randint_like")


def trace(model: nn.Module, example_inputs: Optional[Sequence[Any]] = None,
          example_kwargs: Optional[Mapping[str, Any]] = None, *,
          swap: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None,
          modes: Sequence[TorchFunctionMode] = (), repeats: bool = True) -> Graph:
    """Record one forward of ``model`` on fake tensors; raise ``PlanError`` if it cannot run.

    ``swap(fqn, fake)`` may replace a parameter's fake tensor (another shape: a re-laid weight);
    ``modes`` are entered around the forward, beneath the recorder (the lowering's own modes).
    ``repeats``: a stack's identical blocks are traced once and copied (``repeats``; not with ``swap``
    or ``modes``); False records every call (the same graph, slower)."""
    if example_inputs is None and takes_images(model):
        try:  # a vision tower reached only by an image call: traced with images, in the form it takes them
            args, made = synthesize(model, images=True)
            return _traced(model, args, {**made, **(example_kwargs or {})}, swap, modes, repeats, host_values(model, made))
        except PlanError as error:  # the tower did not run on the images made up: tokens alone, the tower unplanned
            cause = error.__cause__ or error
            reason = f"{type(cause).__name__}: {str(cause).splitlines()[0][:160]}" if str(cause) else type(cause).__name__
            warnings.warn(f"xla_tp: {type(model).__name__} takes images, but its vision tower did not run on the "
                          f"images xla_tp made up ({reason}); it is planned from a text call, and the parameters "
                          f"that call does not reach stay whole on every device (explain() lists them): pass an "
                          f"image call's inputs as example_kwargs to plan the tower", stacklevel=2)
    return _traced(model, example_inputs, example_kwargs, swap, modes, repeats)


def _traced(model: nn.Module, example_inputs: Optional[Sequence[Any]], example_kwargs: Optional[Mapping[str, Any]],
            swap: Optional[Callable[[str, torch.Tensor], torch.Tensor]], modes: Sequence[TorchFunctionMode],
            repeats: bool, host: frozenset[str] = frozenset()) -> Graph:
    """``trace`` of the inputs given, ``host`` (keywords) kept as real tensors (``_Recorder._on_host``)."""
    if repeats and swap is None and not modes:
        try:
            return _record(model, example_inputs, example_kwargs, swap, modes, structures(model), host)
        except Diverged:  # the stack's last block did not do what the first ones did: every call recorded
            pass
    return _record(model, example_inputs, example_kwargs, swap, modes, {}, host)


def _record(model: nn.Module, example_inputs: Optional[Sequence[Any]], example_kwargs: Optional[Mapping[str, Any]],
            swap: Optional[Callable[[str, torch.Tensor], torch.Tensor]], modes: Sequence[TorchFunctionMode],
            blocks: dict[str, int], host: frozenset[str] = frozenset()) -> Graph:
    """``trace`` with the blocks ``blocks`` (FQN -> structure) copied after two equal calls (``_copied``), the
    keyword inputs ``host`` as real tensors."""
    made_up = example_inputs is None
    if made_up:
        example_inputs, made = synthesize(model)
        example_kwargs = {**made, **(example_kwargs or {})}
    graph, known, scope = Graph(), {}, [""]
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    real = {k: example_kwargs[k].detach().cpu() for k in host}
    fqns = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    with fake:
        state, names = _fake_state(model)
        if swap is not None:
            state = {n: (kind, swap(n, t) if kind == "param" else t) for n, (kind, t) in state.items()}
        inputs = tree_map(lambda a: _fake_like(a) if isinstance(a, torch.Tensor) else a,
                          (tuple(example_inputs), {k: a for k, a in (example_kwargs or {}).items() if k not in host}))
        inputs = (inputs[0], {k: real[k] if k in host else inputs[1][k] for k in example_kwargs or {}})
    for fqn_list, (kind, t) in zip(names, state.values()):
        v = graph.new_value(t, kind, fqn_list[0])
        known[id(t)] = v
        if kind == "param":
            graph.params.update({n: v for n in fqn_list})
    for pos, t in enumerate(a for a in tree_flatten(inputs)[0] if isinstance(a, torch.Tensor)):
        v = graph.new_value(t, "input", f"input {pos}", dynamic=True)
        known[id(t)] = v
        graph.inputs.append(v)
    recorder = _Recorder(graph, known, scope, list(real.values()))
    leaves = {n: known[id(t)] for fqn_list, (_, t) in zip(names, state.values()) for n in fqn_list}
    with _own_hooks_only(model), _unchanged_conversions_skipped(model), _copied(model, blocks, recorder, leaves):
        handles = _scope_hooks(model, fqns, scope, graph.callers)
        try:
            with fake, batched_experts(model), contextlib.ExitStack() as stack:
                for mode in (*modes, recorder):
                    stack.enter_context(mode)
                out = functional_call(model, {n: t for n, (_, t) in state.items()}, inputs[0], inputs[1], strict=False)
        except (PlanError, Diverged):
            raise
        except (DynamicOutputShapeException, DataDependentOutputException) as e:  # what example inputs cannot fix
            raise (MadeUpInputError if made_up else PlanError)(f"could not trace one forward of {type(model).__name__} on fake tensors to find its "
                            f"layout: {e.func} in {_last_module(graph)} needs the tensors' values (a shape from "
                            f"nonzero() or a boolean mask, a number from .tolist()/.item(): tokens counted per "
                            f"expert); pass a plan instead of 'auto', or pick each expert's tokens with "
                            f"torch.where(mask) (or nonzero(as_tuple=True)), or hold the experts in [experts, ...] "
                            f"weights indexed by the router's top-k ids, as transformers' MoE models do") from e
        except Exception as e:  # the model's own error, surfaced with what to do
            error = MadeUpInputError if made_up else PlanError
            raise error(f"could not trace one forward of {type(model).__name__} on fake tensors to find its "
                        f"layout: {type(e).__name__}: {e}. Pass example_inputs=(...) (and example_kwargs=) "
                        f"that the model accepts, or pass a plan instead of 'auto'") from e
        finally:
            for h in handles:
                h.remove()
    graph.outputs = [recorder.value_of(t) for t in tree_flatten(_plain(out))[0] if isinstance(t, torch.Tensor)]
    return graph


@contextlib.contextmanager
def _copied(model: nn.Module, blocks: dict[str, int], recorder: _Recorder, leaves: dict[str, Value]) -> Iterator[None]:
    """The forwards of ``blocks`` (FQN -> structure, ``repeats.structures``): the first of each structure
    recorded for real, copied for the others called with the same arguments (``call_key``; ``Span.replay``)
    but the last, recorded for real again: ``Diverged`` if it did something else than the first."""
    graph, source = recorder.graph, {}
    last = {number: fqn for fqn, number in blocks.items()}

    def make(v: Value, like: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            t = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype).requires_grad_(like.requires_grad)
        recorder.known[id(t)] = v
        recorder.keep.append(t)
        return t

    def wrapped(fqn: str, number: int, forward: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            flat = tree_flatten((args, kwargs))[0]
            tensors = [t for t in flat if isinstance(t, torch.Tensor)]
            values = [recorder.value_of(t) for t in tensors]
            call = call_key(flat, values)
            if source.get(number) is not None and fqn != last[number] and call == source[number].call:
                out, exits, copy = source[number].replay(graph, fqn, values, leaves, make)
                recorder.known.update({id(t): v for t, v in zip(tensors, exits)})
                graph.copies.append(copy)
                return out
            span = Span(fqn, len(graph.nodes), len(graph.values), values, call)
            out = forward(*args, **kwargs)
            span.out_leaves, span.out_spec = tree_flatten(out)
            span.out_values = [recorder.value_of(t) if isinstance(t, torch.Tensor) else None for t in span.out_leaves]
            span.node1, span.value1 = len(graph.nodes), len(graph.values)
            span.exits = [recorder.known[id(t)] for t in tensors]
            span.callers = {k: set(v) for k, v in graph.callers.items() if k.startswith(f"{fqn}.")}
            if number not in source:
                source[number] = span if span.copyable() else None
            elif fqn == last[number] and source[number] is not None and source[number].signature(graph) != span.signature(graph):
                raise Diverged(fqn)
            return out
        return call

    modules = dict(model.named_modules())
    for fqn, number in blocks.items():
        vars(modules[fqn])["forward"] = wrapped(fqn, number, modules[fqn].forward)  # on the instance, taken off below
    try:
        yield
    finally:
        for fqn in blocks:
            del vars(modules[fqn])["forward"]


def _last_module(graph: Graph) -> str:
    """The module of the last call recorded (where a trace stopped)."""
    return graph.nodes[-1].module if graph.nodes and graph.nodes[-1].module else "the model's own forward"


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="cpu").requires_grad_(t.requires_grad)


def _fake_state(model: nn.Module) -> tuple[dict[str, tuple[str, torch.Tensor]], list[list[str]]]:
    """One fake tensor per distinct parameter/buffer (tied ones share it), keyed by its first FQN."""
    state: dict[str, tuple[str, torch.Tensor]] = {}
    names: list[list[str]] = []
    seen: dict[int, int] = {}
    for kind, items in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in items:
            if id(t) in seen:
                names[seen[id(t)]].append(name)
                continue
            seen[id(t)] = len(names)
            names.append([name])
            state[name] = (kind, _fake_like(t))
    return state, names


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")


@contextlib.contextmanager
def _own_hooks_only(model: nn.Module) -> Iterator[None]:
    """The model's forward hooks (xla_tp's constraints, an audit's recorder, ...) set aside while it
    is traced: the trace records the model's own computation, and nothing else sees the fake call.
    Transformers' output capture (``output_hidden_states``: a vision tower's features) is the model's
    own and stays; hooks the model installs on itself during the call (that capture, once) are kept."""
    saved = [(mod, name, getattr(mod, name)) for mod in model.modules() for name in _HOOK_DICTS]
    for mod, name, hooks in saved:  # not Module.__setattr__: a thousand modules, each checked
        vars(mod)[name] = type(hooks)((k, h) for k, h in hooks.items() if _models_own(h))
    try:
        yield
    finally:
        for mod, name, hooks in saved:
            hooks.update((k, h) for k, h in vars(mod)[name].items() if k not in hooks)
            vars(mod)[name] = hooks


def _models_own(hook: Any) -> bool:
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing"


@contextlib.contextmanager
def _unchanged_conversions_skipped(model: nn.Module) -> Iterator[None]:
    """``module.to(...)`` inside a forward (SwitchTransformers' and NLLB-MoE's routers cast their
    classifier to the dtype it has) skipped while the model is traced when it changes no tensor: torch
    swaps a fake parameter for its converted copy, which a functional call's parameters cannot be."""
    def skipping(module: nn.Module, convert: Callable) -> Callable:
        def _apply(fn: Callable, recurse: bool = True) -> nn.Module:
            with torch.no_grad():
                if all(fn(t) is t for t in (*module.parameters(recurse), *module.buffers(recurse))):
                    return module
            return convert(fn, recurse)
        return _apply

    modules = list(model.modules())
    for module in modules:
        vars(module)["_apply"] = skipping(module, module._apply)  # on the instance, taken off below
    try:
        yield
    finally:
        for module in modules:
            del vars(module)["_apply"]


def _scope_hooks(model: nn.Module, fqns: dict[int, str], scope: list[str], callers: dict[str, set[str]]) -> list:
    def enter(mod: nn.Module, args: Any) -> None:
        fqn = fqns.get(id(mod), scope[-1])
        callers.setdefault(fqn, set()).add(scope[-1])
        scope.append(fqn)

    def leave(mod: nn.Module, args: Any, out: Any) -> None:
        scope.pop()

    handles = []
    for mod in model.modules():
        handles.append(mod.register_forward_pre_hook(enter, prepend=True))
        handles.append(mod.register_forward_hook(leave, always_call=True))
    return handles


def _plain(out: Any) -> Any:
    """Model outputs as plain containers (``ModelOutput`` and dataclasses become tuples)."""
    if isinstance(out, Mapping):
        return tuple(_plain(v) for v in out.values())
    if isinstance(out, (tuple, list)):
        return tuple(_plain(v) for v in out)
    if hasattr(out, "__dataclass_fields__"):
        return tuple(_plain(getattr(out, f)) for f in out.__dataclass_fields__)
    return out
