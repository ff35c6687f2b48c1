"""Check a normalised ``Layout`` against the model and the mesh before anything is mutated.

Example::

    validate(model, layout, mesh_axes={"data": 2, "model": 4})   # raises PlanError or returns None
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, Optional

import torch
from torch import nn

from .backends.init import initializer
from .errors import PlanError
from .plan.layout import Layout, ModuleLayout, Spec


def validate(module: nn.Module, layout: Layout, mesh_axes: Mapping[str, int],
             check_spec: Callable[[Spec], Optional[str]] = lambda spec: None) -> None:
    """Raise ``PlanError`` naming the first parameter, axis or module the layout cannot shard.

    ``check_spec`` is the backend's own test of a spec (a message when it cannot apply it).
    """
    params = dict(module.named_parameters())
    for name, spec in layout.params.items():
        p = params[name]
        if len(spec) != p.dim():
            raise PlanError(f"{_owner(layout, name)}: parameter {name!r} has {p.dim()} dims {tuple(p.shape)} "
                            f"but the spec {spec} has {len(spec)}")
        problem = _spec_problem(spec, tuple(p.shape), mesh_axes) or check_spec(spec)
        if problem:
            raise PlanError(f"{_owner(layout, name)}: parameter {name!r} {tuple(p.shape)}: {problem}")
    for fqn, ml in layout.modules.items():
        for spec in _explicit_specs(ml):
            problem = _spec_problem(spec, None, mesh_axes)
            if problem:
                raise PlanError(f"plan key {ml.source!r} (module {fqn or '<root>'!r}) activation: {problem}")
    _check_meta(module)


def _spec_problem(spec: Spec, shape: Optional[tuple[int, ...]], mesh_axes: Mapping[str, int]) -> Optional[str]:
    """What is wrong with ``spec`` for a tensor of ``shape`` (None: sizes unknown), rank aside."""
    used = [a for axes in spec if axes is not None for a in (axes if isinstance(axes, tuple) else (axes,))]
    unknown = [a for a in used if a not in mesh_axes]
    if unknown:
        return f"spec {spec} uses axis {unknown[0]!r}, which the mesh lacks (axes: {list(mesh_axes)})"
    repeated = sorted({a for a in used if used.count(a) > 1})
    if repeated:
        return f"spec {spec} uses axis {repeated[0]!r} on more than one dimension; use it once"
    for dim, axes in enumerate(spec):
        names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
        n = math.prod(mesh_axes[a] for a in names)
        if shape is not None and shape[dim] % n:
            return (f"dim {dim} has size {shape[dim]}, not divisible by {n} (axis {axes!r}); pick a mesh "
                    f"whose {axes!r} size divides {shape[dim]} or leave this module out of the plan")
    return None


def _explicit_specs(ml: ModuleLayout) -> list[Spec]:
    chains = [*ml.inputs, *ml.kwarg_inputs.values(), *ml.outputs]
    return [p for c in chains for p in c if isinstance(p, tuple)]


def _owner(layout: Layout, param_fqn: str) -> str:
    for fqn, ml in layout.modules.items():
        prefix = f"{fqn}." if fqn else ""
        if param_fqn.startswith(prefix) and param_fqn[len(prefix):] in ml.params:
            return f"plan key {ml.source!r} ({ml.style} on {fqn or '<root>'!r})"
    return "fsdp sharding"


def _check_meta(module: nn.Module) -> None:
    """A meta tensor can only be materialised by its module's own init (``backends.init``)."""
    for fqn, mod in module.named_modules():
        meta = [n for n, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]
                if t is not None and t.device == torch.device("meta")]
        if meta and initializer(module, fqn) is None:
            raise PlanError(f"module {fqn or '<root>'!r} ({type(mod).__name__}) has tensors {meta} on the "
                            f"meta device and no reset_parameters() to initialise them; add one or "
                            f"materialise the module before parallelize_xla")
