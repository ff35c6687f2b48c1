"""Where the lowering runs: hooks on a parallelized module and on its lowering sites.

``install(root, sites)`` puts two kinds of forward hooks on a model (pre-hooks prepended, post-hooks
always called, so an exception never leaves anything entered):

- on ``root``: tracks the outermost parallelized forward of this thread; when it ends, the
  per-forward state (tagged packed outputs, cached group outputs) is dropped;
- on each site (a module whose forward slices a re-laid packed projection): the packed-output
  mode is entered while it runs. The mode costs a Python call on every torch op it sees, so it
  sees only the sites' ops.

``depth()`` says whether this thread is inside a parallelized forward; ``lowering()`` whether the
attention wrappers of ``patches`` act (there, and in a backward pass: recomputed checkpointed
blocks). Example::

    install(model, {"transformer.h.0.attn", "transformer.h.1.attn"})
    depth()          # 0 outside any parallelized forward
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch
from torch import nn

from .mode import active

_ROOT, _SITE = "_xla_tp_scope_root", "_xla_tp_scope_site"  # on a hooked module: its hook handles
_FIRST = "_xla_tp_first_forward"  # on a root: what to do at its first outermost forward, until it is done
_state = threading.local()


def _get(name: str, default: Any) -> Any:
    if not hasattr(_state, name):
        setattr(_state, name, default)
    return getattr(_state, name)


def depth() -> int:
    """How many parallelized roots this thread is inside (1 in the outermost one's own hooks)."""
    return _get("depth", 0)


def lowering() -> bool:
    """Whether the forward running now is lowered: inside a parallelized forward, or in a backward
    pass (activation checkpointing recomputes a block's forward there, outside any root's hooks,
    and must record what the original forward recorded)."""
    return depth() > 0 or torch._C._current_graph_task_id() != -1


def on_exit(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the outermost parallelized forward ends (per-forward caches)."""
    _get("exits", []).append(callback)


def _enter_root(module: nn.Module, args: tuple, kwargs: dict) -> None:
    _state.depth = depth() + 1
    if _state.depth == 1 and _FIRST in vars(module):
        _first(module, args, kwargs)


@torch.compiler.disable  # under torch.compile: run as is, between two compiled graphs (the first step only)
def _first(module: nn.Module, args: tuple, kwargs: dict) -> None:
    first = vars(module).get(_FIRST)
    if first is not None and first(module, args, kwargs):
        vars(module).pop(_FIRST, None)


def _leave_root(module: nn.Module, args: Any, output: Any) -> None:
    _state.depth = depth() - 1
    if _state.depth == 0:
        callbacks, _state.exits = _get("exits", []), []
        for callback in callbacks:
            callback()


def _enter_site(module: nn.Module, args: Any) -> None:
    if _get("sites", 0) == 0:
        active().__enter__()
    _state.sites = _get("sites", 0) + 1


def _leave_site(module: nn.Module, args: Any, output: Any) -> None:
    _state.sites -= 1
    if _state.sites == 0:
        mode = active()
        mode.tagged = False
        mode.__exit__(None, None, None)


def _hook(module: nn.Module, attr: str, enter: Callable, leave: Callable, kwargs: bool = False) -> None:
    if getattr(module, attr, None):
        return
    setattr(module, attr, [module.register_forward_pre_hook(enter, prepend=True, with_kwargs=kwargs),
                           module.register_forward_hook(leave, always_call=True)])


def install(root: nn.Module, sites: set[str], first: Optional[Callable[[nn.Module, tuple, dict], None]] = None) -> None:
    """Hook ``root`` and its sites (see the module docstring); idempotent. ``first(root, args, kwargs)``
    runs when ``root`` next starts an outermost parallelized forward (before its body runs), and on each
    later one until it returns True (done)."""
    _hook(root, _ROOT, _enter_root, _leave_root, kwargs=True)
    if first is not None:
        vars(root)[_FIRST] = first
    for fqn in sorted(sites):
        _hook(root.get_submodule(fqn) if fqn else root, _SITE, _enter_site, _leave_site)


def uninstall(module: nn.Module) -> None:
    """Remove the hooks ``install`` put on ``module`` and its submodules."""
    for mod in module.modules():
        vars(mod).pop(_FIRST, None)
        for attr in (_ROOT, _SITE):
            for handle in vars(mod).pop(attr, None) or []:
                handle.remove()
