"""Lowering at run time: a parallelized forward rewritten where that keeps the compiler's shardings.

``install(model, sites, tp)`` puts it in place: attention with visible heads, spelled-out LayerNorm
and clamped slices inside any parallelized forward (``patches``, ``attention``), re-laid packed
projections read in place at their ``sites`` (``mode``, ``packed``), column groups with one fused
input gradient and vocabulary-parallel embeddings with per-device weight gradients, found at the
first forward (``groups``, ``embedding``, ``sites``), and the per-forward cleanup (``scope``). Example::

    install(model, packed_sites(model), tp=4)
"""
from typing import Any

from torch import nn

from . import patches, scope
from .attention import use_flash_attention
from .embedding import install_embedding, uninstall_embeddings
from .groups import install_group, uninstall_groups
from .sites import packed_sites, trace_groups, vocab_tables


def install(model: nn.Module, sites: set[str], tp: int, groups: bool = True) -> None:
    """The attention wrappers (once per process), hooks for ``sites``, and (``groups``, torch_xla)
    column groups found at the model's first forward."""
    patches.install()
    scope.install(model, sites, _first_forward(tp) if groups else None)


def _first_forward(tp: int):
    def find(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        from ..plan.applied import layout_of
        if not args or getattr(args[0], "device", None) is None or args[0].device.type != "xla":
            return
        _uninstall_found(model)
        layout = layout_of(model)  # every parallelize call on model, merged
        if layout is None:
            return
        modules = dict(model.named_modules())
        for table, record in vocab_tables(model, layout, tp):
            install_embedding(table, tp, record.mesh, record.spec)
        for members in trace_groups(model, layout, args, kwargs, tp):
            install_group([modules[fqn] for fqn in members], tp)
    return find


def _uninstall_found(model: nn.Module) -> None:
    uninstall_groups(model)
    uninstall_embeddings(model)


def uninstall(model: nn.Module) -> None:
    """Take the lowering off ``model`` and its submodules."""
    scope.uninstall(model)
    _uninstall_found(model)


__all__ = ["install", "packed_sites", "uninstall", "use_flash_attention"]
