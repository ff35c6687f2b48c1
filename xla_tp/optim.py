"""Optimizers that cannot run on XLA as they are: adapted or refused at their first step.

torchao's low-precision AdamW (``torchao.optim._AdamW(..., bf16_stochastic_round=True)``) compiles
its per-parameter update with ``torch.compile`` for inductor, which has no XLA backend
(``InductorError: KeyError: 'xla'``). On XLA the update is traced lazily anyway and compiled
whole by XLA with the rest of the step, so xla_tp runs torchao's step under
``torch.compiler.set_stance("force_eager")`` when its parameters are on XLA (the stance is
restored right after the step); the step guard then keeps every state sharded like its parameter.
Its fp32 -> bf16 stochastic rounding reinterprets bits with ``Tensor.view(dtype)``, which torch_xla
2.9 does not trace: every call executes the pending graph (two device round trips per parameter per
step). For XLA tensors xla_tp performs the same rounding with XLA's ``BitcastConvert`` as a lazy op,
so the whole optimizer step stays one compiled program (``lazy_rounding``, a ``compat`` effect).
torchao's 8-bit, 4-bit and FP8 optimizers keep their states in tensor subclasses, which
torch_xla's functionalization cannot hold: they are refused with ``OptimizerError`` before the
first step touches anything. torch's fused kernels (``Adam``/``AdamW``/``SGD``/``Adagrad`` with
``fused=True``, the default of transformers' ``Trainer``: ``optim="adamw_torch_fused"``) exist for CUDA,
CPU, MPS, XPU and HPU, and refuse XLA parameters at the first step; on XLA the whole update is traced and
compiled by XLA into the step's program, which fuses it anyway, so a group of XLA parameters runs the same
update unfused (``fused`` set to False: the same arithmetic, nothing lost). The step pre-hook of
``xla_tp.guard`` calls ``before_step``. Example::

    opt = torchao.optim._AdamW(model.parameters(), bf16_stochastic_round=True)
    opt.step()      # runs; exp_avg / exp_avg_sq sharded like each parameter
"""
from __future__ import annotations

import logging
import sys
import weakref
from typing import Callable

import torch

from .bitcast import f32_as_i32, i32_as_f32
from .errors import OptimizerError
from .state import param_state

log = logging.getLogger(__name__)

_stances: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> the stance its step runs under
_unfused: weakref.WeakSet = weakref.WeakSet()  # optimizers told they run unfused (said once each)


def before_step(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that cannot run on XLA parameters (``OptimizerError``, nothing changed);
    put torchao's compiled update into eager mode for the step. ``after_step`` undoes the latter."""
    after_step(optimizer)  # a step that raised left its stance behind
    _unfuse(optimizer)
    adam = sys.modules.get("torchao.optim.adam")
    if adam is None or not isinstance(optimizer, adam._AdamBase):
        return
    if not any(param_state(p) is not None for g in optimizer.param_groups for p in g["params"]):
        return  # no parameter of a parallelized model
    if type(optimizer)._subclass_zeros is not adam._AdamBase._subclass_zeros:
        raise OptimizerError(
            f"{type(optimizer).__name__} keeps its states in torchao's quantized tensor subclasses, "
            f"which torch_xla 2.9 cannot functionalize (an INTERNAL ASSERT in the first step). Use "
            f"torchao.optim._AdamW(params, bf16_stochastic_round=True) with bf16 parameters, or "
            f"torch.optim.AdamW: xla_tp shards their states like the parameters, which divides "
            f"optimizer memory by the mesh size")
    _stances[optimizer] = torch.compiler.set_stance("force_eager")


def _unfuse(optimizer: torch.optim.Optimizer) -> None:
    """``fused=False`` for the parameter groups of ``optimizer`` that ask for a fused kernel and hold XLA
    parameters (see the module docstring)."""
    for group in optimizer.param_groups:
        if group.get("fused") and any(p.device.type == "xla" for p in group["params"]):
            group["fused"] = False
            if optimizer not in _unfused:
                _unfused.add(optimizer)
                log.info("xla_tp: %s(fused=True) runs unfused on XLA (XLA compiles and fuses the whole step)",
                         type(optimizer).__name__)


def after_step(optimizer: torch.optim.Optimizer) -> None:
    """Restore the compiler stance ``before_step`` set, if any."""
    stance = _stances.pop(optimizer, None)
    if stance is not None:
        stance.__exit__(None, None, None)


def stochastic_round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, rounding away from zero with probability (dropped low 16 bits) / 2**16, traced
    lazily on XLA. Example: ``stochastic_round_to_bf16(torch.full((4,), 1.00001, device=xla))``."""
    bits = f32_as_i32(x.float())
    dropped = bits & 0xFFFF
    toward_zero = bits & -0x10000
    noise = torch.randint(0, 1 << 16, x.shape, device=x.device, dtype=torch.int32)
    return i32_as_f32(torch.where(noise < dropped, toward_zero + 0x10000, toward_zero)).bfloat16()


def lazy_rounding(original: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """torchao's rounding function for other devices, ``stochastic_round_to_bf16`` for XLA tensors."""
    def rounding(x: torch.Tensor) -> torch.Tensor:
        return stochastic_round_to_bf16(x) if x.device.type == "xla" else original(x)
    return rounding
