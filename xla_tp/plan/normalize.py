"""Plan input -> ``Layout``: match keys, lower each style, collect per-parameter specs.

Example:

>>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
>>> mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
>>> layout = build_layout(mlp, {"0": ColwiseParallel(), "2": RowwiseParallel()}, {"model": 4}, "model")
>>> layout.params
{'0.weight': ('model', None), '0.bias': ('model',), '2.weight': (None, 'model'), '2.bias': (None,)}
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from ..axes import batch_axes, param_shard_axis
from ..errors import PlanError
from .layout import Layout, ModuleLayout, Spec, uses_axis
from .match import match_keys, suggest
from .styles import Style
from .hf import lower_hf_style
from .torch_styles import lower_torch_style

PlanInput = Mapping[str, Any]


def build_layout(module: nn.Module, plan: PlanInput | ParallelStyle, mesh_axes: Mapping[str, int],
                 tp_axis: str, strict: bool = True) -> Layout:
    """Normalise ``plan`` for ``module`` on a mesh with ``mesh_axes`` (name -> size)."""
    if tp_axis not in mesh_axes:
        raise PlanError(f"tp_axis {tp_axis!r} is not an axis of the mesh (axes: {list(mesh_axes)}); "
                        f"pass tp_axis= one of them")
    if isinstance(plan, ParallelStyle):
        plan = {"": plan}
    if not isinstance(plan, Mapping):
        raise PlanError(f"plan must be a dict of FQN pattern -> style (or one style), got {type(plan).__name__}")
    modules = dict(module.named_modules())
    params = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    matches, unused = match_keys(list(plan), list(modules))
    param_matches, unused = match_keys(unused, params)
    _report_unused(unused, list(modules) + params, strict)
    layout = Layout(tp_axis=tp_axis, batch_axes=batch_axes(mesh_axes))
    for fqn, key in matches.items():
        layout.modules[fqn] = lower_style(plan[key], fqn, modules[fqn], key, tp_axis)
    for pfqn, key in param_matches.items():
        owner, _, local = pfqn.rpartition(".")
        one = lower_param(plan[key], owner, modules[owner], local, key, tp_axis)
        if owner in layout.modules:
            layout.modules[owner].params.update(one.params)
        else:
            layout.modules[owner] = one
    layout.params = _param_specs(module, layout.modules)
    fsdp = param_shard_axis(mesh_axes)
    if fsdp is not None:
        _add_fsdp(module, layout.params, fsdp, mesh_axes[fsdp])
    return layout


def lower_style(style: Any, fqn: str, module: nn.Module, key: str, tp_axis: str) -> ModuleLayout:
    """Dispatch one plan value to the front-end that understands it."""
    if isinstance(style, ParallelStyle):
        return lower_torch_style(style, fqn, module, key, tp_axis)
    if isinstance(style, str):
        return lower_hf_style(style, fqn, module, key, tp_axis)
    if isinstance(style, Style):
        return style.lower(fqn, module, key, tp_axis)
    raise PlanError(f"plan key {key!r}: {style!r} is not a style; use a torch ParallelStyle such as "
                    f"ColwiseParallel(), a Hugging Face style string such as 'colwise', or ShardParams")


def lower_param(style: Any, fqn: str, module: nn.Module, param: str, key: str, tp_axis: str) -> ModuleLayout:
    """A key that names parameter ``param`` of ``module`` (at ``fqn``): only that parameter is planned.

    An xla_tp ``Style`` decides itself (rule lists refuse ``[i]`` keys); any other style is lowered on
    the owning module and only the parameter's spec is kept, without activation constraints (HF's
    per-parameter rule). Example: ``{"experts.gate_up_proj": "packed_colwise"}``.
    """
    if isinstance(style, Style):
        return style.lower_param(fqn, module, param, key, tp_axis)
    whole = lower_style(style, fqn, module, key, tp_axis)
    params = {param: whole.params[param]} if param in whole.params else {}
    return ModuleLayout(fqn=fqn, source=key, style=whole.style, params=params)


def _report_unused(unused: list[str], names: list[str], strict: bool) -> None:
    if not unused:
        return
    lines = [f"{k!r} (did you mean {', '.join(map(repr, suggest(k, names))) or 'nothing close'}?)"
             for k in unused]
    msg = "plan keys match no module or parameter: " + "; ".join(lines)
    if strict:
        raise PlanError(msg + ". Fix the keys or pass strict=False to skip them")
    warnings.warn(msg, stacklevel=4)


def _param_specs(module: nn.Module, layouts: Mapping[str, ModuleLayout]) -> dict[str, Spec]:
    """Parameter FQN -> spec; a tied parameter takes one spec, or the plan is contradictory."""
    canonical: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)
    specs: dict[str, Spec] = {}
    origin: dict[str, str] = {}
    for fqn, ml in layouts.items():
        mod = module.get_submodule(fqn) if fqn else module
        for local, spec in ml.params.items():
            p = mod.get_parameter(local)
            name = canonical[id(p)]
            if name in specs and specs[name] != spec:
                raise PlanError(f"parameter {name!r} is shared by {origin[name]!r} and {fqn!r}, whose "
                                f"styles shard it differently ({specs[name]} vs {spec}); give both the "
                                f"same layout or untie the weights")
            specs[name], origin[name] = spec, fqn
    return specs


def _add_fsdp(module: nn.Module, specs: dict[str, Spec], axis: str, size: int) -> None:
    """Shard every parameter's first free dimension that ``size`` divides over the fsdp ``axis``."""
    for name, p in module.named_parameters():
        spec = list(specs.get(name, (None,) * p.dim()))
        if uses_axis(spec, axis):
            continue  # the plan placed the fsdp axis itself
        for d, n in enumerate(p.shape):
            if spec[d] is None and n % size == 0:
                spec[d] = axis
                break
        specs[name] = tuple(spec)
