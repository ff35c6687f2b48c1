"""``parallelize_dtensor``: a plan run by torch's own DTensor tensor parallelism: TorchTPU, CUDA, CPU with gloo.

TorchTPU (``torch_tpu``, torch >= 2.11, the backend that replaces torch_xla) runs PyTorch natively on TPU, one
process per chip, with DTensor; torch's ``parallelize_module`` works there, so this entry point adds no lowering:
"auto" becomes torch's styles (``planners.torch_plan``), a plan dict of torch styles passes through, and torch
applies it on ``device_mesh`` (default: a 1-D mesh over every process of the default process group, on
``device_type()``: ``"tpu"`` where ``torch_tpu`` imports, ``"cuda"`` with GPUs, else ``"cpu"``). Needs torch only,
and an initialised process group. Example::

    torch.distributed.init_process_group("gloo")      # torchrun: one process per device
    model = xla_tp.parallelize_dtensor(model, "auto")
"""
from __future__ import annotations

import importlib.util
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from ..errors import PlanError
from ..planners.torch_plan import torch_plan


def device_type() -> str:
    """The device type of torch's mesh here: ``"tpu"`` (TorchTPU), ``"cuda"``, else ``"cpu"``."""
    if importlib.util.find_spec("torch_tpu") is not None:
        return "tpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def parallelize_dtensor(model: nn.Module, plan: Union[str, Mapping[str, ParallelStyle]] = "auto",
                        device_mesh: Optional[Any] = None, *, loss_parallel: bool = False) -> nn.Module:
    """Apply ``plan`` to ``model`` with torch's ``parallelize_module`` (see the module docstring); returns
    ``model``. ``plan``: ``"auto"`` (``torch_plan``: what torch's styles cannot say stays whole) or a dict of
    torch ``ParallelStyle``s. ``loss_parallel``: the output head's logits stay split for torch's
    ``loss_parallel()``. Example: ``parallelize_dtensor(model, "auto", init_device_mesh("cuda", (8,)))``."""
    if not isinstance(model, nn.Module):
        raise PlanError(f"parallelize_dtensor takes an nn.Module, got {type(model).__name__}")
    if device_mesh is None:
        if not dist.is_initialized():
            raise PlanError("parallelize_dtensor: no process group; call torch.distributed.init_process_group first "
                            "(torchrun starts one process per device) or pass device_mesh=")
        from torch.distributed.device_mesh import init_device_mesh
        device_mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    if plan == "auto":
        plan = dict(torch_plan(model, device_mesh, loss_parallel=loss_parallel))
    elif isinstance(plan, str) or not isinstance(plan, Mapping):
        raise PlanError(f"parallelize_dtensor: plan {plan!r} is not a plan; pass 'auto' or a dict of FQN pattern -> "
                        f"torch ParallelStyle")
    return parallelize_module(model, device_mesh, dict(plan))
