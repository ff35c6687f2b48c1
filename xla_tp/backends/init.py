"""How a module built on ``meta`` initialises its tensors once they exist, sharded, on the device.

A module inside a Hugging Face model uses that model's own ``_init_weights`` (the nearest
``PreTrainedModel`` that holds it: Linear/Embedding normal(0, initializer_range), norms to one,
rotary frequencies computed); any other module its ``reset_parameters()``.

An init that fills its tensors element by element (``normal_``, ``uniform_``, ``fill_``, ``zero_``,
``mul_``, ... with plain numbers, on the whole tensor or on a view of it such as a padding row) is
recorded once on ``meta`` and replayed on the sharded XLA tensor itself: each device computes its
own shard (random fills by ``backends.rng``, which GSPMD partitions; torch_xla's own are not), and
the host never holds the tensor. Any other init (rotary tables computed, a tensor assigned) runs on
full host twins of one module's tensors, written to each device's block (``backends.host``).
Example::

    init = initializer(model, "model.layers.0.input_layernorm")   # LlamaRMSNorm: HF's _init_weights
    initialise(model, "model.layers.0.input_layernorm", fresh={id(norm.weight)})
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Collection, Optional

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import PlanError
from ..validate import initializer
from ..state import PARAM_ATTR
from .host import release_host_memory, write_from_host
from .rng import FILLS


def initialise(root: nn.Module, fqn: str, fresh: Collection[int]) -> None:
    """Initialise the module at ``fqn``: its tensors whose ``id`` is in ``fresh`` (sharded XLA tensors
    with no values yet). An init that only fills its tensors element by element (``normal_``,
    ``uniform_``, ``fill_``, ... with plain numbers, on the whole tensor or a view of it, as HF's
    ``_init_weights`` and ``reset_parameters`` of Linear/Embedding/norms do) is recorded once on
    ``meta`` twins and replayed on the XLA tensor: every device computes its own shard. Any other
    init (rotary tables, an assigned tensor) runs on full host twins, written block by block. Its
    other tensors stay in place, so the init updates them on the device as before."""
    mod = root.get_submodule(fqn)
    slots = [(store, name, t) for store in (mod._parameters, mod._buffers)
             for name, t in store.items() if t is not None and id(t) in fresh]
    mixed = len(slots) < sum(1 for _ in itertools.chain(mod.parameters(False), mod.buffers(False)))
    recipes = [None] * len(slots) if mixed else _record(root, fqn, slots)
    whole = [slot for slot, recipe in zip(slots, recipes) if recipe is None]
    values = dict(zip((id(t) for _, _, t in whole), _run_on_twins(root, fqn, whole, lambda t: _twin(t, "cpu"))))
    for (_, name, t), recipe in zip(slots, recipes):
        if recipe is not None:
            with torch.no_grad():
                _replay(recipe, t)
            continue
        value = values.pop(id(t)).detach()
        if value.shape != t.shape:
            raise PlanError(f"the init of {fqn!r} replaced {name!r} of shape {tuple(t.shape)} by one of shape "
                            f"{tuple(value.shape)}; an init must keep its tensors' shapes")
        write_from_host(t, lambda blocks, value=value: [value[b] for b in blocks])
        del value
        release_host_memory()
    release_host_memory()


Slot = tuple[dict, str, torch.Tensor]  # (the module's _parameters or _buffers, name, tensor)
Step = tuple[Any, tuple, dict]  # an aten op, its arguments after the tensor, its kwargs
Recipe = list[tuple[list[Step], Step]]  # in-place element-wise ops, each on a view (its path of view ops)
_ELEMENTWISE = {torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default, torch.ops.aten.fill_.Scalar,
                torch.ops.aten.zero_.default, torch.ops.aten.erfinv_.default, torch.ops.aten.mul_.Tensor,
                torch.ops.aten.mul_.Scalar, torch.ops.aten.add_.Tensor, torch.ops.aten.add_.Scalar,
                torch.ops.aten.clamp_.default, torch.ops.aten.exponential_.default}
_VIEWS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default,  # ``.data``, ``.detach()``
          torch.ops.aten.select.int, torch.ops.aten.slice.Tensor, torch.ops.aten.view.default,
          torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.permute.default,
          torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim}


def _run_on_twins(root: nn.Module, fqn: str, slots: list[Slot], twin: Callable[[torch.Tensor], torch.Tensor]
                  ) -> list[torch.Tensor]:
    """Run the module's init with each slot's tensor swapped for ``twin(tensor)``; the slots' values
    afterwards (an init may assign new tensors). The module is left as it was."""
    try:
        for store, name, t in slots:
            store[name] = twin(t)
        with torch.no_grad():
            initializer(root, fqn)()
        return [store[name] for store, name, _ in slots]
    finally:
        for store, name, t in slots:
            store[name] = t


def _record(root: nn.Module, fqn: str, slots: list[Slot]) -> list[Optional[Recipe]]:
    """Each slot's init as a recipe replayable on any block, or None where it is not one."""
    recorder = _Recorder()
    twins: list[torch.Tensor] = []
    try:
        with recorder:
            values = _run_on_twins(root, fqn, slots, lambda t: recorder.watch(_twin(t, "meta"), twins))
    except Exception:  # an init that needs real values: every slot runs on full host twins
        return [None] * len(slots)
    return [recorder.recipes.get(id(twin)) if value is twin else None for twin, value in zip(twins, values)]


class _Recorder(TorchDispatchMode):
    """Records the ops that touch watched (meta) tensors: a tensor keeps a recipe while every op on
    it is a view or an in-place element-wise op on a view, with plain-number arguments."""

    def __init__(self):
        super().__init__()
        self.recipes: dict[int, Optional[Recipe]] = {}
        self._by_storage: dict[int, torch.Tensor] = {}
        self._paths: dict[int, tuple[torch.Tensor, list[Step]]] = {}  # id(view) -> (view, view ops from its base)

    def watch(self, t: torch.Tensor, into: list) -> torch.Tensor:
        self.recipes[id(t)] = []
        self._by_storage[t.untyped_storage()._cdata] = t
        self._paths[id(t)] = (t, [])
        into.append(t)
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for i, a in enumerate(pytree.tree_leaves((args, kwargs))):
            owner = self._watched(a)
            if owner is None or self.recipes[id(owner)] is None:
                continue
            path = self._path(a, owner)
            step = (func, args[1:], kwargs)
            plain = not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves((args[1:], kwargs)))
            if i == 0 and plain and path is not None and func in _VIEWS and isinstance(out, torch.Tensor):
                self._paths[id(out)] = (out, path + [step])
            elif i == 0 and plain and path is not None and func in _ELEMENTWISE:
                self.recipes[id(owner)].append((path, step))
            else:
                self.recipes[id(owner)] = None
        return out

    def _watched(self, a: Any) -> Optional[torch.Tensor]:
        if not isinstance(a, torch.Tensor) or not a.is_meta:
            return None
        return self._by_storage.get(a.untyped_storage()._cdata)

    def _path(self, a: torch.Tensor, owner: torch.Tensor) -> Optional[list[Step]]:
        """The view ops that make ``a`` from ``owner``: recorded, or none if ``a`` is all of it."""
        known = self._paths.get(id(a))
        if known is not None and known[0] is a:
            return known[1]
        whole = a.shape == owner.shape and a.stride() == owner.stride() and a.storage_offset() == 0
        return [] if whole else None


def _replay(recipe: Recipe, t: torch.Tensor) -> None:
    """Apply ``recipe`` to the XLA tensor ``t``: random fills by ``backends.rng``, on the device."""
    for path, (func, args, kwargs) in recipe:
        view = t
        for view_func, view_args, view_kwargs in path:
            view = view_func(view, *view_args, **view_kwargs)
        FILLS.get(func, func)(view, *args, **kwargs)


def _twin(t: torch.Tensor, device: str) -> torch.Tensor:
    """A zero-filled tensor like ``t`` on ``device`` (a parameter with ``t``'s attributes for a parameter)."""
    twin = torch.zeros(t.shape, dtype=t.dtype, device=device)
    if not isinstance(t, nn.Parameter):
        return twin
    out = nn.Parameter(twin, requires_grad=t.requires_grad)
    out.__dict__.update({k: v for k, v in t.__dict__.items() if k != PARAM_ATTR})
    return out
