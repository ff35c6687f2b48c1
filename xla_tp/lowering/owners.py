"""The modules that own a rewrite, and how each one carries it.

A module owns a rewrite when its own forward calls a torch function ``entry`` rewrites on what the
rewrite concerns: attention (``scaled_dot_product_attention``, a 4-D ``matmul``, ``nn.MultiheadAttention``'s
``multi_head_attention_forward``), ``layer_norm``, an expert pick (``where``/``nonzero`` in a selection
site), the ``repeat`` of split stacked experts' tokens (``dataflow.stacked``) or into new leading dims, or a projection or lookup of a parameter xla_tp marked (a column group's member, a tied head, a
re-laid packed weight, a vocabulary table). ``find_owners`` reads that from the model's trace (each call
knows the innermost module that made it, and each module the one that called it). ``install`` gives each
owner its rewrite the cheapest way that sees the call:

- an ``nn.Linear`` or ``nn.Embedding`` (their forward is torch's own) runs as a subclass whose forward calls
  the rewrite (torch's ``fully_shard`` swaps classes the same way): one Python call, no hook, no mode;
- a transformers attention module calls its attention function from ``AttentionInterface``: that function
  runs inside the lowering mode (``attention_interface``, a ``compat`` effect on the registry);
- any other owner, and each packed-output site (``sites``), gets hooks that enter the mode
  (``mode.Lowering``) around the outermost of them and leave it after, even when the forward raises; a
  projection whose module is not torch's own is seen from the module that calls it (one mode for q/k/v).

A checkpointed block recomputed in the backward runs its owners again. Anywhere else torch's functions run
untouched. Without a trace (a model whose forward could not be traced) the root owns everything: the mode is
entered around its whole forward. Example::

    owners = find_owners(model, graph)   # {'model.layers.0.self_attn.q_proj': 'marked parameters (its ...)', ...}
    install(model, state, owners, sites=set())
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..dataflow.graph import Graph, Node
from ..dataflow.stacked import find_stacked
from ..state import ModelState, all_states, param_state, record_of
from . import context, scope
from ..weak import ByModule
from .embedding import lookup
from .entry import ATTENTION_OPS, REPEAT, WEIGHT_OPS, linear as entry_linear
from .mode import active


_TRANSPOSES = frozenset({"T", "t", "mT", "transpose"})  # ``x @ w.T`` (Falcon's FalconLinear) reads w so


def _owned_weight(node: Node, params: Mapping[str, nn.Parameter]) -> bool:
    """A projection or lookup whose parameter (or its transpose) carries a rewrite (a group, a tie, a packing,
    a table)."""
    for v in node.tensors:
        while v.kind != "param" and v.producer is not None and v.producer.op in _TRANSPOSES and v.producer.tensors:
            v = v.producer.tensors[0]
        p = params.get(v.name) if v.kind == "param" else None
        ps = param_state(p) if p is not None else None
        if ps is not None and (ps.group or ps.tie or ps.packing or ps.vocab):
            return True
    return False


def _split(p: nn.Parameter) -> bool:
    """Whether xla_tp laid ``p`` out over any mesh axis."""
    record = record_of(p)
    return record is not None and any(a is not None for a in record.spec)


def _attention_matmul(node: Node) -> bool:
    return node.op == "matmul" and len(node.tensors) == 2 and all(len(v.shape) >= 4 for v in node.tensors)


def find_owners(root: nn.Module, graph: Optional[Graph], selection_sites: tuple[str, ...] = (),
                context: bool = False) -> dict[str, str]:
    """Module FQN -> the kind of rewrite it owns (see the module docstring); ``{"": "everything"}`` without
    a trace. With ``context`` (a mesh with a context axis) every projection is owned: it keeps the sequence
    dimension its input is split along (``context.linear``)."""
    if graph is None:
        return {"": "everything"}
    params = dict(root.named_parameters(remove_duplicate=False))
    modules = dict(root.named_modules(remove_duplicate=False))
    kinds: dict[str, set[str]] = {fqn: {"expert picks"} for fqn in selection_sites}
    for layer in find_stacked(graph):
        if layer.repeats is not None and _split(root.get_parameter(layer.weights[0].param.name)):
            kinds.setdefault(layer.repeats, set()).add("stacked experts' tokens")
    for node in graph.nodes:
        if node.op in ATTENTION_OPS or _attention_matmul(node):
            kind = "norms" if node.op == "layer_norm" else "attention"
            if kind == "attention" and through_interface(modules.get(node.module)):
                kind = TRANSFORMERS_ATTENTION
            kinds.setdefault(node.module, set()).add(kind)
        elif node.op == REPEAT and node.outputs and len(node.outputs[0].shape) > len(node.tensors[0].shape):
            kinds.setdefault(node.module, set()).add("repeats")
        elif node.op in WEIGHT_OPS and (_owned_weight(node, params) or context and node.op == "linear"):
            plain = _PLAIN_FORWARDS.get(type(modules.get(node.module)).forward)
            kinds.setdefault(node.module if plain else _caller(graph, node), set()).add(
                CLASS_OWNED if plain else "marked parameters")
    return {fqn: ", ".join(sorted(k)) for fqn, k in kinds.items()}


TRANSFORMERS_ATTENTION = "attention (transformers' AttentionInterface)"
CLASS_OWNED = "marked parameters (its lowered class)"


# what makes transformers' cache keep a window of a layer's keys (``DynamicSlidingWindowLayer``: Mistral's,
# Gemma's sliding windows, Llama 4's attention chunks), whose update slices past a short sequence's start
_WINDOWS = ("sliding_window", "attention_chunk_size")


def through_interface(module: Optional[nn.Module]) -> bool:
    """A transformers attention module that calls its attention function from ``AttentionInterface``
    (``ALL_ATTENTION_FUNCTIONS.get_interface``), without a windowed cache (its update slices in the module's
    own forward, which torch_xla refuses past the start: the mode's ``x[i]`` clamps it): the mode goes around
    that function only (``compat``'s ``attention_interface``)."""
    if module is None or "get_interface" not in type(module).forward.__code__.co_names:
        return False
    config = getattr(module, "config", None)
    return all(getattr(module, a, None) is None and getattr(config, a, None) is None for a in _WINDOWS)


def _caller(graph: Graph, node: Node) -> str:
    """Where the mode goes for a projection: around the one module whose forward calls the projection's module
    (attention around q/k/v, the MLP around gate/up: one entry for the group, not one per member), unless that
    is the root (the mode would see its whole forward) or the module is called from several places."""
    callers = graph.callers.get(node.module, set())
    if node.op == "embedding" or len(callers) != 1 or "" in callers:
        return node.module
    return next(iter(callers))


def _hooks(site: bool) -> tuple[Any, Any]:
    def enter(module: nn.Module, args: Any) -> None:
        first = scope.enter_mode(site)
        if site:
            active().sites(True)
        if first:
            active().__enter__()

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        last = scope.leave_mode(site)
        if site and not scope.in_site():
            active().sites(False)
        if last:
            mode = active()
            mode.tagged = False
            mode.__exit__(None, None, None)
    return enter, leave


def _linear_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    if scope.mode_entered():  # inside an owner's mode: the mode hands F.linear to the same handler
        return F.linear(input, self.weight, self.bias)
    out = entry_linear(input, self.weight, self.bias)
    return F.linear(input, self.weight, self.bias) if out is NotImplemented else out


def _embedding_forward(self: nn.Embedding, input: torch.Tensor) -> torch.Tensor:
    args = (self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse)
    if scope.mode_entered() or not scope.lowering():
        return F.embedding(input, self.weight, *args)
    out = lookup(input, self.weight, *args)
    return F.embedding(input, self.weight, *args) if out is NotImplemented else out


# a module whose class forward is torch's own: its rewrite is its class's forward (a subclass made for it, as
# torch's fully_shard does), not a mode: one Python call, no hooks
_PLAIN_FORWARDS = {nn.Linear.forward: _linear_forward, nn.Embedding.forward: _embedding_forward}
_CLASSES: dict[type, type] = {}


class _Swap:
    """A module's class swapped for its lowered subclass; ``remove()`` puts the class back."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self.base = weakref.ref(module), type(module)
        lowered = _CLASSES.get(self.base)
        if lowered is None:
            lowered = _CLASSES[self.base] = type(self.base.__name__, (self.base,), {
                "forward": _PLAIN_FORWARDS[self.base.forward], "__module__": self.base.__module__})
        module.__class__ = lowered

    def remove(self) -> None:
        module = self.module()
        if module is not None and type(module).__bases__ == (self.base,):
            module.__class__ = self.base


def install(root: nn.Module, state: ModelState, owners: Mapping[str, str], sites: set[str]) -> None:
    """Hook ``owners`` and ``sites`` (FQNs under ``root``): the mode around each one's forward, or, for a module
    whose class forward is torch's own, its lowered subclass; for transformers' attention modules, the
    ``AttentionInterface`` function they call. Replaces what an earlier call installed for ``root``."""
    for _, handles in state.owner_handles:
        for handle in handles:
            handle.remove()
    state.owner_handles, state.owners = [], dict(owners)
    for fqn in sorted(set(owners) | sites):
        module = root.get_submodule(fqn) if fqn else root
        kind = owners.get(fqn, "")
        if kind == CLASS_OWNED and fqn not in sites:
            state.owner_handles.append((weakref.ref(module), (_Swap(module),)))
            continue
        if kind == TRANSFORMERS_ATTENTION and fqn not in sites:
            state.owner_handles.append((weakref.ref(module), (_InterfaceOwned(module),)))
            continue
        enter, leave = _hooks(fqn in sites)
        state.owner_handles.append((weakref.ref(module), (module.register_forward_pre_hook(enter),
                                                          module.register_forward_hook(leave, always_call=True))))
        if not fqn and scope.depth() > 0:  # found in the root's first forward, past its pre-hooks: enter now
            enter(root, ())


_INTERFACE_OWNED: ByModule[bool] = ByModule()  # transformers attention modules whose attention function is lowered


class _InterfaceOwned:
    """A transformers attention module whose ``AttentionInterface`` function runs inside the mode."""

    def __init__(self, module: nn.Module) -> None:
        self.module = weakref.ref(module)
        _INTERFACE_OWNED[module] = True

    def remove(self) -> None:
        module = self.module()
        if module is not None:
            _INTERFACE_OWNED.pop(module)


def attention_interface(original: Any) -> Any:
    """``AttentionInterface.get_interface`` (a ``compat`` effect): the function it returns runs inside the
    lowering mode when its module is a parallelized model's attention (``install``); untouched otherwise."""
    def in_mode(function: Any, implementation: str) -> Any:
        def split(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if implementation == "sdpa" or len(args) < 4 or not all(isinstance(a, torch.Tensor) for a in args[:3]):
                return function(module, *args, **kwargs)  # SDPA splits a context itself (attention.sdpa)
            with context.split_attention(*args[:4]) as inputs:
                return function(module, *inputs, *args[4:], **kwargs)

        def attention(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if module not in _INTERFACE_OWNED:  # in the mode of its whole module, or not parallelized
                return split(module, *args, **kwargs) if scope.lowering() else function(module, *args, **kwargs)
            enter, leave = _MODE_HOOKS
            enter(module, ())
            try:
                return split(module, *args, **kwargs)
            finally:
                leave(module, (), None)
        return attention

    @functools.wraps(original)
    def get_interface(self: Any, attn_implementation: str, default: Any) -> Any:
        # a new closure per call, not a cache: torch.compile guards on a cache's contents, and the first compiled
        # call filling it would recompile the next one
        return in_mode(original(self, attn_implementation, default), attn_implementation)
    return get_interface


def remove_within(model: nn.Module) -> None:
    """Take the hooks any parallelized model put on ``model`` or a module inside it off (``unparallelize`` of a
    block: the model around it finds its owners again at its next forward)."""
    inside = set(map(id, model.modules()))
    for _, state in all_states():
        kept = []
        for ref, handles in state.owner_handles:
            if id(ref()) in inside:
                for handle in handles:
                    handle.remove()
            else:
                kept.append((ref, handles))
        state.owner_handles = kept


_MODE_HOOKS = _hooks(False)
