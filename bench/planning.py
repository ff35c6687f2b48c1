"""Planning time for a Llama-3-70B-shaped model on the ``meta`` device (no weights anywhere), in one run.

xla_tp: ``build_layout`` + ``validate`` of a plan dict (what ``parallelize_xla`` does before touching a
weight); "auto" (``plan_for``: the trace, the roles, the plan) on the torchtitan-style Llama and on
transformers' ``LlamaForCausalLM``, the mesh made before; "auto" from a trace that records every layer's
calls (``trace(repeats=False)``: what it cost before identical layers were copied); the launcher's mesh
search (``xla-tp launch llama3-70b --topology v5e-8 --dry-run``: refused, every suggestion's mesh planned
and estimated), in this process. torch: ``parallelize_module`` on the same meta model with a 1-process
gloo group and a CPU ``DeviceMesh`` of size 1 (the only mesh a single CPU process can build). Wall times
on a shared CPU (medians of three interleaved rounds): compare the ratios. ``python -m bench.planning``
writes ``bench/results/planning.json``.
Example::

    planning_times()   # {"xla_tp_auto_s": 0.5, "torch_s": 0.2, "ratios": {"auto_vs_torch": 2.5, ...}, ...}
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import time
from pathlib import Path
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


def planning_times(mesh_search: bool = True, rounds: int = 3) -> dict[str, Any]:
    """Seconds to plan the 70B-shaped meta model, xla_tp vs torch (or why torch could not), and their ratios:
    medians of ``rounds`` interleaved rounds of "auto" (both models) and torch (a shared CPU's load comes
    and goes); the every-call trace and the mesh search once."""
    model, hf = _meta_model(), _hf_meta_model()
    start = time.perf_counter()
    layout = build_layout(model, megatron_tp_plan(), {"model": 8}, "model")
    validate(model, layout, {"model": 8})
    out: dict[str, Any] = {"params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 1),
                           "xla_tp_s": time.perf_counter() - start, "rounds": rounds,
                           "torch_how": "parallelize_module, gloo world_size=1, DeviceMesh('cpu', [0])"}
    samples: dict[str, list[float]] = {"xla_tp_auto_s": [], "xla_tp_auto_hf_s": [], "torch_s": []}
    try:
        for _ in range(rounds):
            samples["xla_tp_auto_s"].append(_auto_planning_time(model))
            samples["xla_tp_auto_hf_s"].append(_auto_planning_time(hf))
            samples["torch_s"].append(_torch_planning_time(_meta_model()))
    except Exception as error:  # recorded, not hidden
        out["torch_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    out.update({name: statistics.median(times) for name, times in samples.items() if times})
    out["samples"] = samples
    out["xla_tp_auto_every_call_s"] = _auto_planning_time(model, repeats=False)
    if mesh_search:
        out["launch_mesh_search_s"] = _mesh_search_time()
    if "torch_s" in out:
        out["ratios"] = {"auto_vs_torch": out["xla_tp_auto_s"] / out["torch_s"],
                         "auto_hf_vs_torch": out["xla_tp_auto_hf_s"] / out["torch_s"],
                         "every_call_vs_auto": out["xla_tp_auto_every_call_s"] / out["xla_tp_auto_s"]}
    return out


def _hf_meta_model() -> torch.nn.Module:
    """transformers' ``LlamaForCausalLM`` at Llama-3-70B's shape, on meta."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=256)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def _auto_planning_time(model: torch.nn.Module, repeats: bool = True) -> float:
    """``plan_for`` (one forward traced on fake tensors, roles, layout) on the meta model, model axis 8;
    ``repeats=False``: from a trace that records every layer's calls."""
    import xla_tp
    from xla_tp.dataflow.trace import trace
    mesh = xla_tp.make_mesh(model=8)
    start = time.perf_counter()
    xla_tp.plan_for(model, mesh=mesh, graph=None if repeats else trace(model, repeats=False))
    return time.perf_counter() - start


def _mesh_search_time() -> float:
    """``xla-tp launch llama3-70b --topology v5e-8 --dry-run`` in this process: refused, it plans and
    estimates the model on the meshes its suggestions try."""
    from xla_tp import cli
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        status = cli.main(["launch", "llama3-70b", "--topology", "v5e-8", "--dry-run"])
    assert status == 3, f"the 70B recipe on a v5e-8 is refused (status 3), got {status}"
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


def main(argv=None) -> int:
    from . import write_result
    parser = argparse.ArgumentParser(prog="python -m bench.planning")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    write_result(args.out, "planning.json", planning_times())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
