"""Keep every sharded parameter sharded across optimizer steps, for every optimizer.

An update that goes through ``view(dtype)`` bitcasts (fp32 -> bf16 stochastic rounding, as
torchao's low-precision optimizers do) and then ``param.copy_(...)`` leaves the parameter
replicated: a silent per-device memory blow-up. ``parallelize_xla`` records each parameter's
sharding; a global ``Optimizer`` step post-hook compares and re-applies it, so user code does
not change. Example::

    opt = MyBitcastAdamW(model.parameters())
    opt.step()          # shardings checked and restored here
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
import torch_xla
import torch_xla.distributed.spmd as xs

from .plan.layout import Spec

log = logging.getLogger(__name__)
SHARDING_ATTR = "_xla_tp_sharding"
_hook_handle = None


@dataclass(frozen=True)
class ParamSharding:
    fqn: str
    mesh: xs.Mesh
    spec: Spec
    expected: str  # the HLO sharding string right after annotation


def sharding_of(t: torch.Tensor) -> str:
    """The HLO sharding string of an XLA tensor (``'{devices=[4,1]0,1,2,3}'``, ``''`` if none)."""
    return torch_xla._XLAC._get_xla_sharding_spec(t)


def remember_sharding(p: torch.nn.Parameter, fqn: str, mesh: xs.Mesh, spec: Spec) -> None:
    """Record ``p``'s sharding (right after annotation) so optimizer steps can restore it."""
    setattr(p, SHARDING_ATTR, ParamSharding(fqn, mesh, spec, sharding_of(p)))
    _install_hook()


def forget_sharding(p: torch.Tensor) -> bool:
    """Drop ``p``'s record; True if it had one."""
    return p.__dict__.pop(SHARDING_ATTR, None) is not None


def restore_sharding(p: torch.Tensor) -> bool:
    """Re-apply ``p``'s recorded sharding if an update dropped it; True if it had to."""
    rec: ParamSharding | None = getattr(p, SHARDING_ATTR, None)
    if rec is None or sharding_of(p) == rec.expected:
        return False
    xs.clear_sharding(p)
    xs.mark_sharding(p, rec.mesh, rec.spec)
    return True


def _after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    restored = [getattr(p, SHARDING_ATTR).fqn for g in optimizer.param_groups for p in g["params"]
                if restore_sharding(p)]
    if restored:
        log.info("xla_tp: %s.step() dropped the sharding of %d parameters (%s); restored",
                 type(optimizer).__name__, len(restored), ", ".join(restored[:3]))


def _install_hook() -> None:
    global _hook_handle
    if _hook_handle is None:
        _hook_handle = register_optimizer_step_post_hook(_after_step)
