"""Lowering at run time: a parallelized forward rewritten where that keeps the compiler's shardings.

``install(root, state)`` puts it in place for one parallelized module: the scope hooks (``scope``:
where ``entry``'s rewrites act, and the packed-output mode around the modules that slice a re-laid
packed projection), and what the model's dataflow says about it (``find``): column groups with one
fused input gradient (``groups``) and vocabulary-parallel embeddings with per-device weight gradients,
reduced once with a tied LM head's (``embedding``, ``tied``), and mixture-of-experts layers run in
static slots split as their weights are (``routed``, ``experts``; those that loop over per-expert
modules, at static positions: ``selection``, ``selected``), attention run one chunk at a time with chunks of
equal length as one batch of them (``chunks``). ``find`` reads a forward of the model
traced on fake tensors: the planner's, or one on a synthesised input; a model whose forward cannot be
traced without its real arguments is found at its first call (``state.pending``), from a trace of
that call that leaves the arguments untouched. Example::

    install(model, state)          # parallelize_xla does this
    state.groups                   # [('model.layers.0.self_attn.q_proj', '...k_proj', '...v_proj'), ...]
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import nn

from ..axes import sequence_axes
from ..dataflow.graph import Graph
from ..dataflow.trace import trace
from ..errors import PlanError
from ..state import ModelState, layout_of, states_under
from . import owners, scope
from .attention import use_flash_attention
from .chunks import install_chunks, uninstall_chunks
from .embedding import install_embedding, uninstall_embeddings
from .groups import install_group, uninstall_groups
from .experts import MoeOptions
from .routed import install_experts, uninstall_experts
from .selection import install_sites, uninstall_sites
from .sites import batch_replicas, find_groups, packed_sites, vocab_tables
from .tied import install_tie, tied_heads

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.Tensor)


def enter(root: nn.Module, state: ModelState, embeddings: bool = True) -> None:
    """The first hook on ``root``: where its lowering starts (before any other hook xla_tp adds)."""
    scope.install_root(root, state, _at_forward(embeddings))


def install(root: nn.Module, state: ModelState, graph: Optional[Graph] = None, embeddings: bool = True,
            find_now: bool = True) -> None:
    """The rest, after ``enter`` and the constraints: the sites' hooks, ``root``'s last hook, and
    (``find_now``) its lowering found from ``graph`` (or a trace on a synthesised input), or at its
    first forward when it cannot be traced without its arguments."""
    owners.install(root, state, {}, state.sites)
    scope.install_exit(root, state)
    if not find_now:
        return
    graph = graph if graph is not None else traced(root)
    if graph is None:
        state.pending = True
    else:
        find(root, state, graph, embeddings)


def traced(root: nn.Module, args: Optional[tuple] = None, kwargs: Optional[Mapping[str, Any]] = None) -> Optional[Graph]:
    """A forward of ``root`` on fake tensors (on a synthesised input without ``args``); None if it
    cannot be traced so."""
    try:
        return trace(root, args, kwargs)
    except PlanError:
        return None


def _at_forward(embeddings: bool):
    def first(root: nn.Module, state: ModelState, args: tuple, kwargs: dict) -> None:
        find_at_call(root, state, args, kwargs, embeddings)
    return first


def find_at_call(root: nn.Module, state: ModelState, args: tuple, kwargs: dict, embeddings: bool = True) -> None:
    """A pending lowering, found from a trace on a synthesised input, else of this call (its inputs
    never reach the model: a cache object is left out, tensors are copied as fakes)."""
    graph = traced(root) or _traced_call(root, args, kwargs)
    if graph is not None:
        find(root, state, graph, embeddings)
    else:  # no column groups or tables; grouped experts come from the layout alone; the mode around everything
        state.experts = install_experts(root, state, None, layout_of(root))
        owners.install(root, state, owners.find_owners(root, None), state.sites)
    state.pending = False  # found, or not to be found: the plain program, one reduction per projection


def _traced_call(root: nn.Module, args: tuple, kwargs: dict) -> Optional[Graph]:
    if not all(isinstance(a, _PLAIN) for a in args):
        return None
    return traced(root, args, {k: v for k, v in kwargs.items() if isinstance(v, _PLAIN)})


def find(root: nn.Module, state: ModelState, graph: Graph, embeddings: bool = True) -> None:
    """Install ``root``'s column groups (and, with ``embeddings``, its vocabulary-parallel tables and
    their ties) for the forward ``graph``, under every layout applied to ``root`` merged; what was
    found before under ``root`` is replaced."""
    uninstall(root)
    layout = layout_of(root)
    tables = vocab_tables(root, layout, state.tp) if embeddings else []
    for _, table, record in tables:
        from ..backends.annotate import XlaSharder  # a vocabulary table split on torch_xla
        install_embedding(table, state.tp, XlaSharder(record.mesh), record.spec)
        axes, replicas = batch_replicas(layout, record.mesh, record.spec)
        if tied_heads(root, table) and replicas > 1:
            install_tie(table, axes, replicas)
    modules = dict(root.named_modules())
    groups = find_groups(root, layout, state.tp, graph)
    for members in groups:
        install_group([modules[fqn] for fqn in members], state.tp)
    state.experts = install_experts(root, state, graph, layout)
    state.moe_options = state.moe_options or MoeOptions()
    picking = install_sites(root, graph, layout, state.moe_options, state.mesh)
    state.experts += picking
    install_chunks(root, graph)
    context = state.sharder is not None and bool(sequence_axes(state.sharder.sizes))
    owners.install(root, state, owners.find_owners(root, graph, tuple(picking), context), state.sites)
    state.groups, state.tables, state.pending = [tuple(g) for g in groups], [fqn for fqn, _, _ in tables], False


def uninstall(root: nn.Module) -> None:
    """Take the groups, tables and ties found for ``root`` (or any parallelized module in it) off."""
    uninstall_groups(root)
    uninstall_embeddings(root)
    uninstall_experts(root)
    uninstall_sites(root)
    uninstall_chunks(root)
    owners.remove_within(root)
    for _, _, state in states_under(root):
        state.groups, state.tables, state.experts = [], [], []


__all__ = ["enter", "find", "find_at_call", "install", "packed_sites", "traced", "uninstall", "use_flash_attention"]
