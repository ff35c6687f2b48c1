"""Check a normalised ``Layout`` against the model and the mesh before anything is mutated.

A dimension that its axes do not divide is sharded unevenly, as torch's DTensor does: XLA pads
it (``[50257, 64]`` over 8 devices holds 6283 rows per device, the last device 6276 and padding).
That is allowed, with one warning naming the padded parameters. Example::

    validate(model, layout, mesh_axes={"data": 2, "model": 4})   # raises PlanError or returns None
"""
from __future__ import annotations

import math
import warnings
from typing import Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from .errors import PlanError
from .plan.layout import Layout, ModuleLayout, Spec, spec_axes
from .plan.subaxis import axis_size, split_sub_axis


def validate(module: nn.Module, layout: Layout, mesh_axes: Mapping[str, int],
             check_spec: Callable[[Spec], Optional[str]] = lambda spec: None) -> None:
    """Raise ``PlanError`` naming the first parameter, axis or module the layout cannot shard.

    ``check_spec`` is the backend's own test of a spec (a message when it cannot apply it).
    """
    params = dict(module.named_parameters())
    padded = []
    for name, spec in layout.params.items():
        p = params[name]
        if len(spec) != p.dim():
            raise PlanError(f"{_owner(layout, name)}: parameter {name!r} has {p.dim()} dims {tuple(p.shape)} "
                            f"but the spec {spec} has {len(spec)}")
        problem = _spec_problem(spec, mesh_axes) or check_spec(spec)
        if problem:
            raise PlanError(f"{_owner(layout, name)}: parameter {name!r} {tuple(p.shape)}: {problem}")
        padded += [f"{name} dim {d} ({n} -> {padded_size(n, k)} over {k})" for d, n, k in uneven_dims(p.shape, spec, mesh_axes)]
    if padded:
        warnings.warn(f"xla_tp: {len(padded)} parameter(s) shard unevenly and XLA pads them: "
                      f"{'; '.join(padded[:4])}{' ...' if len(padded) > 4 else ''}", stacklevel=3)
    for fqn, ml in layout.modules.items():
        for spec in _explicit_specs(ml):
            problem = _spec_problem(spec, mesh_axes)
            if problem:
                raise PlanError(f"plan key {ml.source!r} (module {fqn or '<root>'!r}) activation: {problem}")
    _check_meta(module)


def _spec_problem(spec: Spec, mesh_axes: Mapping[str, int]) -> Optional[str]:
    """What is wrong with ``spec`` on this mesh (unknown or repeated axes), rank aside."""
    used = [a for axes in spec for a in spec_axes(axes)]
    unknown = [a for a in used if axis_size(mesh_axes, a) is None]
    if unknown:
        return f"spec {spec} uses axis {unknown[0]!r}, which the mesh lacks (axes: {list(mesh_axes)})"
    bases = [split_sub_axis(a)[0] for a in used]
    repeated = sorted({a for a in bases if bases.count(a) > 1})
    if repeated:
        return f"spec {spec} uses axis {repeated[0]!r} on more than one dimension; use it once"
    return None


def uneven_dims(shape: Sequence[int], spec: Spec, mesh_axes: Mapping[str, int]) -> list[tuple[int, int, int]]:
    """(dim, size, ways) for each dimension its axes do not divide.

    >>> uneven_dims((50257, 64), ("model", None), {"model": 8})
    [(0, 50257, 8)]
    """
    out = []
    for dim, axes in enumerate(spec):
        ways = math.prod(axis_size(mesh_axes, a, 1) for a in spec_axes(axes))
        if shape[dim] % ways:
            out.append((dim, int(shape[dim]), ways))
    return out


def padded_size(n: int, ways: int) -> int:
    """What XLA allocates for ``n`` split ``ways`` ways.

    >>> padded_size(50257, 8)
    50264
    """
    return -(-n // ways) * ways


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
