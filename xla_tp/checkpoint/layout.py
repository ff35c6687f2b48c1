"""What a checkpoint holds: the model's own ``state_dict`` layout, kept sharded, plus optimizer state.

Keys and shapes are those of ``model.state_dict()``, so state-dict hooks run: a packed projection
that a planner re-laid (``[in, 3, E]`` in the model) is saved in its original layout (``[in, 3E]``)
and loads into a model laid out either way. Optimizer states shaped like their parameter go
through the same hooks (the model's ``state_dict``/``load_state_dict`` run with the state swapped
in for the parameter), so they reshard and re-lay exactly like the weights. A value that is not the
model's own tensor (a hook's reshape) is annotated with a sharding of the same memory per device
as its parameter's (``spec_for_shape``), so nothing is ever gathered whole. Example::

    flat = model_state(model)             # {"model.layers.0.mlp.up_proj.weight": <sharded tensor>, ...}
    flat.update(optimizer_state(model, opt))
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Mapping, Optional

import torch
import torch_xla.distributed.spmd as xs
from torch import nn

from ..guard import restore_sharding
from ..state import ParamSharding, record_of
from ..plan.layout import Spec

MODEL, OPTIM = "model.", "optim."
GROUPS = OPTIM + "param_groups"
STATE = OPTIM + "state."


def spec_for_shape(shape: tuple[int, ...], mesh: xs.Mesh, spec: Spec) -> Spec:
    """A spec for a tensor of ``shape`` holding values laid out elsewhere as ``spec``, with the same
    memory per device: each mesh axis ``spec`` uses goes on the first dimension of ``shape`` it divides.

    ``spec_for_shape((64, 192), mesh, (None, None, "model")) == ("model", None)`` (re-laid ``[64, 3, 64]``).
    """
    sizes = dict(zip(mesh.axis_names, (int(s) for s in mesh.mesh_shape)))
    axes = [a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))]
    out: list[tuple[str, ...]] = [() for _ in shape]
    for axis in axes:
        for d, size in enumerate(shape):
            if size % (math.prod(sizes[a] for a in out[d]) * sizes[axis]) == 0:
                out[d] = (*out[d], axis)
                break
    return tuple(None if not s else s[0] if len(s) == 1 else s for s in out)


def shard_like(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Annotate ``t`` (an XLA tensor holding values of ``param``, possibly re-laid) like ``param``."""
    rec: Optional[ParamSharding] = record_of(param)
    if rec is None or t.device.type != "xla":
        return t
    if t.shape == param.shape:
        restore_sharding(t, like=param)
    else:
        xs.mark_sharding(t, rec.mesh, spec_for_shape(tuple(t.shape), rec.mesh, rec.spec))
    return t


def param_names(model: nn.Module) -> dict[int, str]:
    """``id(param) -> FQN``, the first name of a tied parameter."""
    return {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``"model." + key -> tensor`` for every ``state_dict`` entry; the model's own parameters and
    buffers themselves where the layout is theirs (loading writes into them in place)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if key in params and value is not params[key]:
            value = shard_like(value.detach(), params[key])
        out[MODEL + key] = value
    return out


@contextlib.contextmanager
def swapped(model: nn.Module, tensors: Mapping[int, torch.Tensor]) -> Iterator[None]:
    """Within the block, parameter ``p`` of ``model`` is replaced by ``tensors[id(p)]``."""
    saved = []
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None and id(p) in tensors:
                saved.append((mod, name, p))
    try:
        for mod, name, p in saved:
            mod._parameters[name] = tensors[id(p)]
        yield
    finally:
        for mod, name, p in saved:
            mod._parameters[name] = p


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``"optim.state.<param FQN>.<state key>" -> value`` plus ``"optim.param_groups"`` (hyper-
    parameters, parameters named by FQN). States shaped like their parameter are in the model's
    ``state_dict`` layout and sharded."""
    names = param_names(model)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    strangers = [tuple(p.shape) for p in params if id(p) not in names]
    if strangers:
        from ..errors import CheckpointError
        raise CheckpointError(f"the optimizer holds {len(strangers)} tensors that are not parameters of the model "
                              f"(shapes {strangers[:3]}); build it from model.parameters() after parallelize_xla")
    out: dict[str, Any] = {GROUPS: [{**{k: v for k, v in g.items() if k != "params"},
                                     "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]}
    for key in sorted({k for p in params for k in optimizer.state.get(p, {})}):
        owners = [p for p in params if key in optimizer.state.get(p, {})]
        shaped = {id(p): optimizer.state[p][key] for p in owners
                  if isinstance(optimizer.state[p][key], torch.Tensor) and optimizer.state[p][key].shape == p.shape}
        with swapped(model, shaped):
            laid = model.state_dict(keep_vars=True)
        for p in owners:
            name = names[id(p)]
            out[f"{STATE}{name}.{key}"] = (shard_like(laid[name].detach(), p) if id(p) in shaped
                                           else optimizer.state[p][key])
    return out
