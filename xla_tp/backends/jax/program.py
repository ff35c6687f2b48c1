"""A torch module as a pure JAX function: torchax traces it, the layout constrains its activations.

``Program.run(fn, state, args, kwargs)`` calls ``fn(module, *args, **kwargs)`` inside a JAX trace
with the module's parameters and buffers taken from ``state`` (jax arrays, through
``torch.func.functional_call``, so tied weights stay tied). While it runs, every activation chain
of the layout is a ``jax.lax.with_sharding_constraint`` (forward hooks, removed afterwards): the
same constraints the torch_xla backend installs, and like those they hold for the gradient too
(the transpose of a sharding constraint is the same constraint).

Arguments cross the jit boundary as ``Inputs``: the array leaves (dynamic) and everything else
(static, part of the cache key); outputs as flat arrays plus a ``torch.utils._pytree`` spec, so a
Hugging Face ``ModelOutput`` comes back as one. Example::

    program = Program(model, layout, mesh)
    out = jax.jit(lambda state, x: program.run(call_module, state, (x,), {}))(state, x)
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from torch import nn
from torch.func import functional_call
from torch.utils import _pytree as torch_pytree

from ...constraints import Constrainer, register_hooks
from ...dataflow.routing import batched_experts
from ...plan.layout import Layout
from ...state import PARAM_ATTR, param_state
from ..torchax import import_torchax
from .runtime import torchax_tracing

torchax = import_torchax()
from torchax.interop import call_jax, jax_view, torch_view  # noqa: E402
from torchax.view import View  # noqa: E402

_ARRAY = "<array>"  # marks where an array leaf goes in a static description
_PLAIN = (type(None), bool, int, float, str)


def call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The ``fn`` of a plain forward: ``module(*args, **kwargs)``."""
    return module(*args, **kwargs)


class Inputs(NamedTuple):
    """The static half of a call's arguments: their tree and non-array leaves (hashable)."""

    treedef: Any
    leaves: tuple

    @staticmethod
    def split(args: tuple, kwargs: dict, to_array: Callable[[Any], jax.Array]) -> tuple[tuple, "Inputs"]:
        """``(arrays, static)``: tensors and arrays converted by ``to_array``, the rest kept."""
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        arrays = tuple(to_array(x) for x in leaves if is_array(x))
        static = tuple(_ARRAY if is_array(x) else x for x in leaves)
        for x in static:
            if not isinstance(x, _PLAIN):
                raise TypeError(f"argument of type {type(x).__name__} cannot be passed to a jitted model; "
                                f"pass tensors, arrays, numbers, strings or None (in tuples, lists, dicts)")
        return arrays, Inputs(treedef, static)

    def merge(self, arrays: tuple) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with ``arrays`` put back in their places."""
        it = iter(arrays)
        leaves = [next(it) if x is _ARRAY else x for x in self.leaves]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def is_array(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, jax.Array, np.ndarray))


def signature(arrays: tuple, static: Inputs) -> tuple:
    """What a jit cache entry depends on: the static inputs and each array's shape and dtype."""
    return static, tuple((tuple(a.shape), str(a.dtype)) for a in arrays)


class Outputs(NamedTuple):
    """How flat output arrays become the module's output again."""

    spec: Any
    leaves: tuple

    @staticmethod
    def split(out: Any) -> tuple[list, "Outputs"]:
        """``(jax arrays, structure)`` of a torch-side output; a non-plain, non-tensor leaf is an error."""
        leaves, spec = torch_pytree.tree_flatten(out)
        for x in leaves:
            if not isinstance(x, (torch.Tensor, *_PLAIN)):
                raise TypeError(f"the model returned a {type(x).__name__}, which cannot leave a jitted "
                                f"function (a KV cache?); return tensors (for Hugging Face models pass "
                                f"use_cache=False)")
        arrays = [jax_view(x) for x in leaves if isinstance(x, torch.Tensor)]
        return arrays, Outputs(spec, tuple(_ARRAY if isinstance(x, torch.Tensor) else x for x in leaves))

    def merge(self, tensors: list) -> Any:
        it = iter(tensors)
        return torch_pytree.tree_unflatten([next(it) if x is _ARRAY else x for x in self.leaves], self.spec)


class JaxSharder:
    """The JAX side of the ``Sharder`` interface: ``with_sharding_constraint`` on torchax tensors (its
    transpose is the same constraint, so the gradient is laid out alike)."""

    def __init__(self, mesh: Mesh):
        self.mesh, self.sizes = mesh, dict(mesh.shape)

    def applies(self, x: Any) -> bool:
        return isinstance(x, (torchax.tensor.Tensor, View))

    def constrain(self, x: torch.Tensor, spec: tuple) -> torch.Tensor:
        return call_jax(jax.lax.with_sharding_constraint, x, NamedSharding(self.mesh, PartitionSpec(*spec)))


class _Bound(nn.Module):
    """``fn(module, ...)`` as a module, so ``functional_call`` can swap the state in."""

    def __init__(self, module: nn.Module, fn: Callable[..., Any]):
        super().__init__()
        self.module, self.fn = module, fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(self.module, *args, **kwargs)


class Program:
    """``module`` under ``layout`` on ``mesh``, callable inside JAX traces."""

    def __init__(self, module: nn.Module, layout: Layout, mesh: Mesh):
        self.module, self.layout = module, layout
        self.constrainer = Constrainer(JaxSharder(mesh), layout)

    def run(self, fn: Callable[..., Any], state: dict[str, jax.Array], args: tuple, kwargs: dict,
            constrained: bool = True) -> Any:
        """``fn(module, *args, **kwargs)`` on torchax views of ``state``/``args``; a torch-side result.

        ``constrained=False`` leaves the layout's activation constraints out (the unsharded program).
        """
        state, args, kwargs = torch_view((state, args, kwargs))
        found = {n: ps for n, t in self.module.named_parameters() if (ps := param_state(t)) is not None}
        for name, view in state.items():  # what the lowering knows of each parameter (packings, groups)
            if name in found:
                setattr(view, PARAM_ATTR, found[name])
        handles = register_hooks(self.module, self.layout, self.constrainer) if constrained else []
        try:
            with torchax.default_env(), torchax_tracing(), batched_experts(self.module):  # static shapes under jit
                bound = _Bound(self.module, fn)
                return functional_call(bound, {f"module.{k}": v for k, v in state.items()}, args, kwargs)
        finally:
            for handle in handles:
                handle.remove()
