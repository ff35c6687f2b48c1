"""Planning time for a Llama-3-70B-shaped model on the ``meta`` device (no weights anywhere).

xla_tp: ``build_layout`` + ``validate`` (what ``parallelize_xla`` does before touching a weight).
torch: ``parallelize_module`` on the same meta model with a 1-process gloo group and a CPU
``DeviceMesh`` of size 1 (the only mesh a single CPU process can build). Example::

    planning_times()   # {"xla_tp_s": 0.05, "torch_s": 1.9, ...}
"""
from __future__ import annotations

import os
import time
from typing import Any

import torch

from xla_tp.plan.normalize import build_layout
from xla_tp.validate import validate
from xla_tp.zoo.llama import Llama, LlamaArgs, megatron_tp_plan

LLAMA3_70B = LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                       multiple_of=4096, ffn_dim_multiplier=1.3, max_seq_len=256)


def _meta_model() -> Llama:
    with torch.device("meta"):
        return Llama(LLAMA3_70B)


def planning_times() -> dict[str, Any]:
    """Seconds to plan the 70B-shaped meta model, xla_tp vs torch (or why torch could not)."""
    model = _meta_model()
    start = time.perf_counter()
    layout = build_layout(model, megatron_tp_plan(), {"model": 8}, "model")
    validate(model, layout, {"model": 8})
    out: dict[str, Any] = {"params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 1),
                           "xla_tp_s": time.perf_counter() - start,
                           "xla_tp_auto_s": _auto_planning_time(model),
                           "torch_how": "parallelize_module, gloo world_size=1, DeviceMesh('cpu', [0])"}
    try:
        out["torch_s"] = _torch_planning_time(_meta_model())
    except Exception as error:  # recorded, not hidden
        out["torch_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return out


def _auto_planning_time(model: Llama) -> float:
    """``plan_for`` (one forward traced on fake tensors, roles, layout) on the meta model, model axis 8."""
    import xla_tp
    start = time.perf_counter()
    xla_tp.plan_for(model, mesh=xla_tp.make_mesh(model=8))
    return time.perf_counter() - start


def _torch_planning_time(model: Llama) -> float:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = DeviceMesh("cpu", [0])
    start = time.perf_counter()
    parallelize_module(model, mesh, megatron_tp_plan())
    return time.perf_counter() - start
