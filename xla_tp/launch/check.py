"""``--check``: one training step of the sharded model against the same model unsharded on the CPU.

Both copies run in fp32 from the same weights on the same batch: forward, loss, backward and one
SGD step. The check reports the largest difference of the logits, the loss, the gradients and the
updated parameters, and passes when the worst is within the recipe's ``check_tolerance``. It
tests the sharding, not the precision or the optimizer: SGD, because Adam's first step is
``lr * sign(grad)`` and turns float noise on near-zero gradients into full-size differences.
Example::

    errors = compare_one_step(cpu_model, lambda m: xla_tp.parallelize_xla(m, "auto", mesh=mesh),
                              inputs, targets, lambda t: to_device(t, mesh), loss_fn)
    max(errors.values()) <= recipe.check_tolerance      # {"logits": 6e-07, "loss": 0.0, ...}
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch_xla
from torch import nn

import xla_tp

from ..lowering.packed import as_written

StepLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def one_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
             loss_fn: StepLoss) -> dict[str, list[torch.Tensor]]:
    """Logits, loss, gradients and parameters after one SGD step (lr 0.1)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logits, loss = loss_fn(model, inputs, targets)
    loss.backward()
    grads = [as_written(p, p.grad.detach().clone()) for p in model.parameters()]
    opt.step()
    if inputs.device.type == "xla":
        torch_xla.sync()   # one program for everything, not one per .cpu() read
    return {"logits": [logits.detach()], "loss": [loss.detach()], "grads": grads,
            "params": [as_written(p, p.detach()) for p in model.parameters()]}


def parallelizer(plan: Any, mesh: Any) -> Callable[[nn.Module], nn.Module]:
    """``model -> model`` parallelized by ``plan`` on ``mesh`` (MoE layers dropless, the default: the CPU
    model's own results, which the check compares with)."""
    def parallelize(model: nn.Module) -> nn.Module:
        return xla_tp.parallelize_xla(model, plan, mesh=mesh)
    return parallelize


def compare_one_step(reference: nn.Module, parallelize: Callable[[nn.Module], nn.Module],
                     inputs: torch.Tensor, targets: torch.Tensor, place: Callable[[torch.Tensor], torch.Tensor],
                     loss_fn: StepLoss) -> dict[str, float]:
    """Max |sharded - CPU| per quantity, on fp32 copies of ``reference`` (left untouched)."""
    cpu = copy.deepcopy(reference).float()
    sharded = parallelize(copy.deepcopy(cpu))
    ref_run = one_step(cpu, inputs, targets, loss_fn)
    tp_run = one_step(sharded, place(inputs), place(targets), loss_fn)
    return {what: max((r - t.cpu()).abs().max().item() for r, t in zip(ref_run[what], tp_run[what]))
            for what in ref_run}
