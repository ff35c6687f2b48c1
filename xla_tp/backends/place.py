"""Put every parameter and buffer of a module on the XLA device with its sharding.

CPU tensors are copied over; ``meta`` tensors become XLA tensors with their sharding and no values
yet, and are then initialised by their module's own init (``backends.init``: a Hugging Face
model's ``_init_weights``, else ``reset_parameters()``), one module at a time, each device computing
its own block, so the model never exists whole on the host or on a device.
Tied parameters stay tied. Each sharded parameter remembers its sharding for the optimizer
guard (``xla_tp.guard``).

Example::

    place_module(model, layout.params, mesh, shard_mark)
"""
from __future__ import annotations

from typing import Collection, Mapping

import torch
import torch_xla
import torch_xla.distributed.spmd as xs
from torch import nn

from ..guard import forget_sharding, remember_sharding, restore_sharding
from ..plan.layout import Spec
from .spmd import ShardFn
from .init import initialise
from .submesh import resolve


def place_module(module: nn.Module, specs: Mapping[str, Spec], mesh: xs.Mesh, shard: ShardFn,
                 stale: Collection[str] = ()) -> None:
    """Move/materialise ``module`` onto the XLA device and shard the parameters in ``specs``.

    Parameters in ``stale`` (sharded by an earlier call on ``module`` that this plan overrides)
    go back to replicated."""
    device = torch_xla.device()
    memo: dict[int, torch.Tensor] = {}
    to_init: dict[str, None] = {}
    fresh: set[int] = set()  # ids of the XLA tensors made for meta tensors
    for mfqn, mod in module.named_modules(remove_duplicate=False):
        had_meta = False
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                had_meta |= p.is_meta
                fqn = f"{mfqn}.{name}" if mfqn else name
                memo[id(p)] = _place_param(p, fqn, specs.get(fqn), mesh, shard, device, fqn in stale)
                if p.is_meta:
                    fresh.add(id(memo[id(p)]))
            mod._parameters[name] = memo[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is None:
                continue
            if id(b) not in memo:
                had_meta |= b.is_meta
                memo[id(b)] = _to_device(b, device)
                if b.is_meta:
                    fresh.add(id(memo[id(b)]))
            mod._buffers[name] = memo[id(b)]
        if had_meta:
            to_init.setdefault(mfqn)
    for mfqn in to_init:
        initialise(module, mfqn, fresh)
        for p in module.get_submodule(mfqn).parameters(recurse=False):
            restore_sharding(p)  # an init that updates a tensor on the device may leave it replicated
        torch_xla.sync()  # one module's init programs at a time: the devices hold one tensor's temporaries
    torch_xla.sync()


def _place_param(p: nn.Parameter, fqn: str, spec, mesh, shard: ShardFn, device, stale: bool) -> nn.Parameter:
    t = p if p.device.type == "xla" else _to_device(p.detach(), device)
    if spec is not None:
        if _is_sharded(t):
            t = xs.clear_sharding(t)
        mesh, spec = resolve(mesh, spec)  # a sub-axis: the same devices, the axis split in two
        t = shard(t, mesh, spec)
    elif stale and forget_sharding(t) and _is_sharded(t):
        t = xs.clear_sharding(t)
    new = p if t is p else nn.Parameter(t, requires_grad=p.requires_grad)
    if new is not p:
        new.__dict__.update(p.__dict__)  # the module's own attributes, and xla_tp's ParamState (a re-laid packing)
    if spec is not None:
        remember_sharding(new, fqn, mesh, spec)
    return new


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    if t.device.type == "xla":
        return t
    if t.is_meta:
        return torch.empty(t.shape, dtype=t.dtype, device=device)
    return t.to(device)


def _is_sharded(t: torch.Tensor) -> bool:
    return torch_xla._XLAC._get_xla_sharding_spec(t) not in ("", "{replicated}")
