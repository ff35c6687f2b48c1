"""Keep every sharded parameter, and every optimizer state shaped like it, sharded across steps.

An update that goes through ``view(dtype)`` bitcasts (fp32 -> bf16 stochastic rounding, as
torchao's low-precision optimizers do) and then ``param.copy_(...)`` leaves the parameter
replicated: a silent per-device memory blow-up. Optimizer states (``exp_avg``, ``exp_avg_sq``,
momentum buffers) are created by the optimizer and get whatever layout the compiler picks, often
replicated. ``parallelize_xla`` records each parameter's sharding; a global ``Optimizer`` step
post-hook re-applies it to the parameter and to each state tensor of the same shape (still lazy
at that point, so the compiled step produces them sharded), for any optimizer, without a change
to user code. A pre-hook adapts or refuses optimizers that cannot run on XLA as they are
(``xla_tp.optim``). The two hooks are a ``compat`` effect (``register``): they act on parameters
xla_tp sharded only, and are removed when no parallelized model remains.
Example::

    opt = torch.optim.AdamW(model.parameters())
    opt.step()          # parameter and state shardings checked and restored here
"""
from __future__ import annotations

import logging

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
import torch_xla
import torch_xla.distributed.spmd as xs

from . import compat, optim
from .plan.layout import Spec
from .state import ParamSharding, ensure_param_state, param_state, record_of

log = logging.getLogger(__name__)


def sharding_of(t: torch.Tensor) -> str:
    """The HLO sharding string of an XLA tensor (``'{devices=[4,1]0,1,2,3}'``, ``''`` if none)."""
    return torch_xla._XLAC._get_xla_sharding_spec(t)


def remember_sharding(p: torch.nn.Parameter, fqn: str, mesh: xs.Mesh, spec: Spec) -> ParamSharding:
    """Record ``p``'s sharding (right after annotation) so optimizer steps can restore it."""
    record = ensure_param_state(p).sharding = ParamSharding(fqn, mesh, spec, sharding_of(p))
    return record


def forget_sharding(p: torch.Tensor) -> bool:
    """Drop ``p``'s record; True if it had one."""
    ps = param_state(p)
    had = ps is not None and ps.sharding is not None
    if had:
        ps.sharding = None
    return had


def restore_sharding(t: torch.Tensor, like: torch.Tensor | None = None) -> bool:
    """Re-apply the sharding recorded on ``like`` (default: ``t`` itself) to ``t`` if it differs;
    True if it had to. ``restore_sharding(exp_avg, like=param)`` shards a state like its parameter."""
    owner = t if like is None else like
    rec = record_of(owner)
    if rec is None or t.device.type != "xla" or t.shape != owner.shape or sharding_of(t) == rec.expected:
        return False
    xs.clear_sharding(t)
    xs.mark_sharding(t, rec.mesh, rec.spec)
    return True


def _state_tensors(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> list[torch.Tensor]:
    """Plain tensors in ``p``'s optimizer state (tensor subclasses are refused by ``xla_tp.optim``)."""
    return [v for v in optimizer.state.get(p, {}).values() if type(v) is torch.Tensor]


@torch.compiler.disable  # reads shardings (pybind): under torch.compile it runs after the compiled step
def _after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    optim.after_step(optimizer)
    params, states = [], 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if restore_sharding(p):
                params.append(record_of(p).fqn)
            states += sum(restore_sharding(s, like=p) for s in _state_tensors(optimizer, p))
    if params:
        log.info("xla_tp: %s.step() dropped the sharding of %d parameters (%s); restored",
                 type(optimizer).__name__, len(params), ", ".join(params[:3]))
    if states:
        log.debug("xla_tp: %d optimizer states of %s sharded like their parameters",
                  states, type(optimizer).__name__)


@torch.compiler.disable
def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    compat.refresh()  # an optional package (torchao) loaded since the model was parallelized
    optim.before_step(optimizer)


def register() -> compat.Undo:
    """Register the step hooks for every optimizer (a ``compat`` effect); returns their removal."""
    handles = (register_optimizer_step_pre_hook(_before_step), register_optimizer_step_post_hook(_after_step))

    def remove() -> None:
        for handle in handles:
            handle.remove()
    return remove
