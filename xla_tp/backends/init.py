"""How a module built on ``meta`` initialises its tensors once they exist, sharded, on the device.

A module inside a Hugging Face model uses that model's own ``_init_weights`` (the nearest
``PreTrainedModel`` that holds it: Linear/Embedding normal(0, initializer_range), norms to one,
rotary frequencies computed); any other module its ``reset_parameters()``.

The init runs on the host and each device's block is written into its sharded XLA tensor
(``backends.host``). Random init on the device would not be partitioned: torch_xla's compiled
``normal_`` draws the random bits of the whole tensor on every device before keeping its shard, a
full tensor per device (four bytes per element). An init that fills its tensors element by element
is recorded on ``meta`` and replayed on each block, so one tensor's blocks are on the host at a time;
other inits run on full host twins of one module's tensors. Example::

    init = initializer(model, "model.layers.0.input_layernorm")   # LlamaRMSNorm: HF's _init_weights
    initialise_on_host(model, "model.layers.0.input_layernorm", fresh={id(norm.weight)})
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Collection, Optional

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import PlanError
from ..guard import SHARDING_ATTR
from .host import Block, release_host_memory, write_from_host


def initializer(root: nn.Module, fqn: str) -> Optional[Callable[[], None]]:
    """A call that initialises the module at ``fqn`` in place, or None if it has no way to."""
    mod = root.get_submodule(fqn)
    owner = _hf_owner(root, fqn)
    if owner is not None:
        return lambda: owner._init_weights(mod)
    reset = getattr(mod, "reset_parameters", None)
    return reset if callable(reset) else None


def _hf_owner(root: nn.Module, fqn: str) -> Optional[nn.Module]:
    """The innermost transformers model (``_init_weights`` and a ``config``) containing ``fqn``."""
    parts = fqn.split(".") if fqn else []
    for n in range(len(parts), -1, -1):
        candidate = root.get_submodule(".".join(parts[:n]))
        if callable(getattr(candidate, "_init_weights", None)) and hasattr(candidate, "config"):
            return candidate
    return None


def initialise_on_host(root: nn.Module, fqn: str, fresh: Collection[int]) -> None:
    """Initialise the module at ``fqn``: its tensors whose ``id`` is in ``fresh`` (XLA tensors with no
    values yet) are written from the host, block by block. An init that only fills its tensors
    element by element (``normal_``, ``uniform_``, ``fill_``, ... with plain numbers, as HF's
    ``_init_weights`` and ``reset_parameters`` of Linear/Embedding/norms do) is recorded once on
    ``meta`` twins and replayed on each device's block: one tensor's blocks on the host at a time.
    Any other init (rotary tables, a padding row zeroed, an assigned tensor) runs on full host
    twins. Its other tensors stay in place, so the init updates them on the device as before."""
    mod = root.get_submodule(fqn)
    slots = [(store, name, t) for store in (mod._parameters, mod._buffers)
             for name, t in store.items() if t is not None and id(t) in fresh]
    mixed = len(slots) < sum(1 for _ in itertools.chain(mod.parameters(False), mod.buffers(False)))
    recipes = [None] * len(slots) if mixed else _record(root, fqn, slots)
    whole = [slot for slot, recipe in zip(slots, recipes) if recipe is None]
    values = dict(zip((id(t) for _, _, t in whole), _run_on_twins(root, fqn, whole, lambda t: _twin(t, "cpu"))))
    for (_, name, t), recipe in zip(slots, recipes):
        if recipe is not None:
            write_from_host(t, lambda blocks: [_replay(recipe, b, t.dtype) for b in blocks])
            continue
        value = values.pop(id(t)).detach()
        if value.shape != t.shape:
            raise PlanError(f"the init of {fqn!r} replaced {name!r} of shape {tuple(t.shape)} by one of shape "
                            f"{tuple(value.shape)}; an init must keep its tensors' shapes")
        write_from_host(t, lambda blocks: [value[b] for b in blocks])
        del value
        release_host_memory()
    release_host_memory()


Slot = tuple[dict, str, torch.Tensor]  # (the module's _parameters or _buffers, name, tensor)
Recipe = list[tuple[Any, tuple, dict]]  # in-place element-wise ops: (aten op, its other args, kwargs)
_ELEMENTWISE = {torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default, torch.ops.aten.fill_.Scalar,
                torch.ops.aten.zero_.default, torch.ops.aten.erfinv_.default, torch.ops.aten.mul_.Tensor,
                torch.ops.aten.mul_.Scalar, torch.ops.aten.add_.Tensor, torch.ops.aten.add_.Scalar,
                torch.ops.aten.clamp_.default, torch.ops.aten.exponential_.default}
_ALIASES = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}  # ``.data``, ``.detach()``


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
    it is an in-place element-wise op on the whole tensor with plain-number arguments."""

    def __init__(self):
        super().__init__()
        self.recipes: dict[int, Optional[Recipe]] = {}
        self._by_storage: dict[int, torch.Tensor] = {}

    def watch(self, t: torch.Tensor, into: list) -> torch.Tensor:
        self.recipes[id(t)] = []
        self._by_storage[t.untyped_storage()._cdata] = t
        into.append(t)
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _ALIASES:
            for i, a in enumerate(pytree.tree_leaves((args, kwargs))):
                owner = self._watched(a)
                if owner is None or self.recipes[id(owner)] is None:
                    continue
                whole = (i == 0 and func in _ELEMENTWISE and a.shape == owner.shape and a.stride() == owner.stride()
                         and a.storage_offset() == 0
                         and not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves((args[1:], kwargs))))
                self.recipes[id(owner)] = self.recipes[id(owner)] + [(func, args[1:], kwargs)] if whole else None
        return func(*args, **kwargs)

    def _watched(self, a: Any) -> Optional[torch.Tensor]:
        if not isinstance(a, torch.Tensor) or not a.is_meta:
            return None
        return self._by_storage.get(a.untyped_storage()._cdata)


def _replay(recipe: Recipe, block: Block, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros([s.stop - s.start for s in block], dtype=dtype)
    for func, args, kwargs in recipe:
        func(out, *args, **kwargs)
    return out


def _twin(t: torch.Tensor, device: str) -> torch.Tensor:
    """A zero-filled tensor like ``t`` on ``device`` (a parameter with ``t``'s attributes for a parameter)."""
    twin = torch.zeros(t.shape, dtype=t.dtype, device=device)
    if not isinstance(t, nn.Parameter):
        return twin
    out = nn.Parameter(twin, requires_grad=t.requires_grad)
    out.__dict__.update({k: v for k, v in t.__dict__.items() if k != SHARDING_ATTR})
    return out
