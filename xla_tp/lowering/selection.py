"""Selection sites: the MoE modules whose experts pick their tokens by value, and ``torch.where`` there.

``install_sites(root, graph, ...)`` finds, in the planner's trace of ``root``, each module that calls
``torch.where(mask)`` (or ``nonzero(as_tuple=True)``) and reads the positions only to index,
``index_add`` or ``index_select`` (the trace takes each such call at a static size, ``dataflow.trace``),
and hooks its forward: inside it, ``where``/``nonzero`` (``entry``'s handlers of ``torch.where`` and
``torch.nonzero``, the module owning them: ``owners``) return ``selected.select``'s static positions, one group per batch
shard. A loop over only the experts some token chose (``for e in hit.nonzero():``) gets every expert
(``dataflow.positions``). A module whose positions are read otherwise (``token.sort()``,
``hit.flip(0)``) is left data-dependent, with a warning. Each site shares its model's ``MoeOptions``
and reports in ``moe_report``. Example::

    install_sites(model, graph, layout, options, mesh)   # ['layers.0.moe', 'layers.1.moe']
    model(ids)      # each layers.*.moe's torch.where(mask[e]) gives static positions
"""
from __future__ import annotations

import threading
import warnings
from collections import Counter
from typing import Any, Optional

import torch
from torch import nn

from ..adapters import is_xla_mesh
from ..dataflow.graph import Graph, Node
from ..dataflow.positions import every_position
from ..weak import ByModule
from ..dataflow.trace import position_loops, selections
from ..plan.layout import Layout, uses_axis
from .experts import MoeOptions, routing_groups
from .grouped import InstanceForward
from .selected import KEEPS, SelectionSite, select

INDEXED_BY_SECOND = ("index_add", "index_add_", "index_select")  # (self, dim, index, ...)


class _Active(threading.local):
    def __init__(self) -> None:
        self.sites: list[SelectionSite] = []


_active = _Active()


def current() -> Optional[SelectionSite]:
    """The innermost selection site this thread's forward is in."""
    return _active.sites[-1] if _active.sites else None


_installed: ByModule[tuple[SelectionSite, list[Any]]] = ByModule()  # each site's module -> its site and hooks


def install_sites(root: nn.Module, graph: Graph, layout: Layout, options: MoeOptions, mesh: Any) -> list[str]:
    """A selection site on each module of ``root`` whose traced forward (``graph``) picks positions
    by value, one selection group per shard of the batch over ``mesh``; their FQNs."""
    sharder, batch, groups = None, (), 1
    if is_xla_mesh(mesh):
        from ..backends.annotate import XlaSharder
        sharder = XlaSharder(mesh)
        batch, groups = routing_groups(dict(zip(mesh.axis_names, (int(n) for n in mesh.mesh_shape))), layout.batch_axes)
    picks, loops = selections(graph), position_loops(graph)
    unread = {n.module: f"picks tokens with torch.where and reads the positions with '{op}' (not only to index, "
                        f"index_add or index_select)" for n in picks for op in (_other_reader(n),) if op is not None}
    picking = {n.module for n in picks}
    for n in loops:
        op = _other_reader(n, iterated=True)
        if n.module not in unread and (op is not None or n.module not in picking):
            unread[n.module] = "loops over the experts of a 1-D nonzero() and " + (
                f"reads them with '{op}' (not only to iterate and index)" if op else "picks no tokens with torch.where")
    for fqn, why in unread.items():
        warnings.warn(f"xla_tp: {fqn or type(root).__name__} {why}: left data-dependent, the program is compiled "
                      f"again for each routing", stacklevel=4)
    counts = Counter(n.module for n in picks if n.module not in unread)
    for fqn, experts in counts.items():
        module = root.get_submodule(fqn)
        split = any(uses_axis(layout.params.get(f"{fqn}.{n}" if fqn else n, ()), layout.tp_axis)
                    for n, _ in module.named_parameters())
        site = SelectionSite(fqn, experts, "expert-tensor-parallel" if split else "replicated", options, {},
                             sharder, batch, groups)
        _installed[module] = (site, [*_hooks(module, site), _EagerForward(module)])
    return list(counts)


class _EagerForward(InstanceForward):
    """A site's ``forward`` while it is installed: outside ``torch.compile``'s graphs (a graph break
    around the module: dynamo traces no tensor subclass like ``SelectedIndex``); the module's lazy
    tensors still make one program with the rest."""

    @torch._dynamo.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module()
        return type(module).forward(module, *args, **kwargs)


def _other_reader(node: Node, iterated: bool = False) -> Optional[str]:
    """The first op reading the positions ``node`` picked other than as an index (None: every one indexes);
    ``iterated``: positions of experts looped over, also taken one by one (``for e in hit: e[0]``) and
    compared with the routed ids (``ids == e``)."""
    todo = list(node.outputs)
    while todo:
        for reader, pos in todo.pop().consumers:
            if reader.op in ("getitem", "setitem") and pos > 0 or reader.op in INDEXED_BY_SECOND and pos == 1:
                continue
            if iterated and reader.op == "eq":  # ids == e: no token is e where nobody chose e
                continue
            one = iterated and pos == 0 and (reader.op in ("unbind", "iter") or
                                             reader.op == "getitem" and isinstance(reader.args[1], int))
            if reader.op in KEEPS and pos == 0 or one:
                todo.extend(reader.outputs)
                continue
            return reader.op
    return None


def uninstall_sites(root: nn.Module) -> None:
    for module in root.modules():
        site = _installed.pop(module)
        for handle in site[1] if site else ():
            handle.remove()


def site_of(module: nn.Module) -> Optional[SelectionSite]:
    entry = _installed.get(module)
    return entry[0] if entry else None


def _hooks(module: nn.Module, site: SelectionSite) -> list[Any]:
    """Hooks entering ``site`` around ``module``'s forward (left even when it raises); their handles."""
    def enter(_module: nn.Module, _args: Any) -> None:
        site.last = {"routed": 0, "dropped": 0, "route": "looped"}
        _active.sites.append(site)

    def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
        if _active.sites and _active.sites[-1] is site:
            _active.sites.pop()

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]


def where(cond: Any, *rest: Any, **kwargs: Any) -> Any:
    """``torch.where(cond)`` (one argument) in a selection site, on a device tensor: ``select``."""
    if rest or kwargs:  # the three-argument where, on every call of a parallelized forward: first out
        return NotImplemented
    site = _site_for(cond)
    return NotImplemented if site is None or cond.dim() == 0 else select(cond, site)


def nonzero(cond: Any, *, as_tuple: bool = False, **kwargs: Any) -> Any:
    """``nonzero(as_tuple=True)``: as ``where``; ``hit.nonzero()`` of a 1-D device tensor in a selection
    site (the experts it loops over): ``every_position`` of it."""
    if as_tuple:
        return where(cond, **kwargs)
    if kwargs or _site_for(cond) is None or cond.dim() != 1:
        return NotImplemented
    return every_position(cond.shape[0])


def _site_for(cond: Any) -> Optional[SelectionSite]:
    """The site a selection of ``cond`` is made in: a device tensor inside one, not under ``torch.compile``
    (which traces no tensor subclass of ``select``'s kind)."""
    if not isinstance(cond, torch.Tensor) or cond.device.type != "xla" or torch.compiler.is_compiling():
        return None
    return current()
