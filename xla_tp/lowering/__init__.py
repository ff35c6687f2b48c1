"""Lowering at run time: a parallelized forward rewritten where that keeps the compiler's shardings.

``install(model, sites, tp)`` puts it in place: attention with visible heads, spelled-out LayerNorm
and clamped slices inside any parallelized forward (``patches``, ``attention``), re-laid packed
projections read in place at their ``sites`` (``mode``, ``packed``), column groups with one fused
input gradient and vocabulary-parallel embeddings with per-device weight gradients (reduced once
with a tied LM head's), found at the first forward (``groups``, ``embedding``, ``tied``,
``sites``), and the per-forward cleanup (``scope``). Example::

    install(model, packed_sites(model), tp=4)
"""
from typing import Any, Optional

from torch import nn

from ..plan.layout import Layout
from . import patches, scope
from .attention import use_flash_attention
from .embedding import install_embedding, uninstall_embeddings
from .groups import install_group, uninstall_groups
from .sites import batch_replicas, packed_sites, trace_groups, vocab_tables
from .tied import install_tie, tied_heads, uninstall_ties


def install(model: nn.Module, sites: set[str], tp: int, groups: bool = True) -> None:
    """The attention wrappers (once per process), hooks for ``sites``, and (``groups``, torch_xla)
    column groups found at the model's first forward."""
    patches.install()
    scope.install(model, sites, _first_forward(tp) if groups else None)


def _first_forward(tp: int):
    def find(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> bool:
        """Discover on a call with XLA inputs and the model's own parameters; True once done. A call on
        tensors swapped in for it (``functional_call``: the audit's unsharded reference) hides the
        parameters' sharding marks, so the tables would not be found: it waits for the next call."""
        from ..plan.applied import layout_of
        if not (args and getattr(args[0], "device", None) is not None and args[0].device.type == "xla"):
            return False
        layout = layout_of(model)
        if layout is not None and not _own_parameters(model, layout):
            return False
        discover(model, args, kwargs, tp, layout)
        return True
    return find


def _own_parameters(model: nn.Module, layout: Layout) -> bool:
    """Whether ``model``'s planned parameters carry their sharding marks (not swapped in for one call)."""
    from ..guard import SHARDING_ATTR
    params = dict(model.named_parameters())
    return all(hasattr(params[name], SHARDING_ATTR) for name in layout.params if name in params)


def discover(model: nn.Module, args: tuple, kwargs: dict[str, Any], tp: int, layout: Optional[Layout] = None,
             embeddings: bool = True) -> None:
    """Install ``model``'s column groups (and, with ``embeddings``, its vocabulary-parallel tables) for
    a call with ``args``/``kwargs`` under ``layout`` (default: every parallelize call on ``model``,
    merged), replacing any found before."""
    from ..plan.applied import layout_of
    _uninstall_found(model)
    layout = layout or layout_of(model)
    if layout is None:
        return
    modules = dict(model.named_modules())
    for table, record in vocab_tables(model, layout, tp) if embeddings else ():
        install_embedding(table, tp, record.mesh, record.spec)
        heads, (axes, replicas) = tied_heads(model, table), batch_replicas(layout, record.mesh, record.spec)
        if heads and replicas > 1:
            install_tie(table, heads, axes, replicas)
    for members in trace_groups(model, layout, args, kwargs, tp):
        install_group([modules[fqn] for fqn in members], tp)


def _uninstall_found(model: nn.Module) -> None:
    uninstall_groups(model)
    uninstall_ties(model)
    uninstall_embeddings(model)


def uninstall(model: nn.Module) -> None:
    """Take the lowering off ``model`` and its submodules."""
    scope.uninstall(model)
    _uninstall_found(model)


__all__ = ["discover", "install", "packed_sites", "uninstall", "use_flash_attention"]
