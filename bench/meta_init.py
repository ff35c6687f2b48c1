"""``python -m bench.meta_init``: host memory and time of sharded initialisation and lazy loading.

A Llama-3-8B-shaped model (2 layers, full widths, bf16) is parallelized with "auto" on 8 CPU
devices (model=8) three ways, each in a fresh process: built on ``meta`` (each module's own init,
written shard by shard), built on the CPU and moved by ``parallelize_xla``, and loaded lazily from
safetensors (what the meta route exported) into a meta-built, parallelized model.

On CPU the 8 devices' buffers are host memory, so the sharded model itself shows up in RSS. Each
route reports ``host_peak``: its peak RSS over the process's RSS before the model existed (after
imports, the mesh and one executed program, which starts the runtime), minus what the devices
hold in the end (``device_bytes``: every device's buffer, padding and replicas included). For the
load route the devices already hold the model before the load starts. That is the host memory a
TPU host would need, next to one device's share of the model and its largest tensor. The meta
route also audits the compiled forward (comm, compute and memory ratios) and exports the model
(``export_hf``). Writes ``bench/results/meta_init.json``.
Example: ``python -m bench.meta_init`` (about 3 minutes and 10 GB here), ``--shape small`` (seconds).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import write_result

SHAPES = {  # Llama-3-8B widths, and smaller shapes for quick runs and the test suite
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256),
    "small": dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=16, num_key_value_heads=8,
                  vocab_size=50304),
    "test": dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=16,
                 vocab_size=8192),  # a few hundred MB at 8 layers, its largest tensor a small part, as in real models
}
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=1, vocab_size=128)
ROUTES = ("meta", "cpu", "load")
DEVICES = 8


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM restarts from the current RSS


def _config(shape: str, layers: int):
    import torch
    import transformers
    config = transformers.LlamaConfig(num_hidden_layers=layers, **SHAPES[shape])
    config.dtype = torch.bfloat16
    return config


def device_bytes(model) -> int:
    """Bytes of every device's buffers of ``model``'s tensors: padded shards, replicas counted."""
    import itertools
    import math

    import torch_xla

    from xla_tp.backends.host import device_blocks, is_tiled
    devices = len(torch_xla._XLAC._xla_get_runtime_devices())
    total, seen = 0, set()
    for t in itertools.chain(model.parameters(), model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            if is_tiled(t):
                blocks, size = device_blocks(t)
                total += len(blocks) * math.prod(size) * t.element_size()
            else:
                total += devices * t.numel() * t.element_size()
    return total


def child(route: str, shape: str, layers: int, checkpoint: str, audit: bool = True) -> dict:
    """One route in this process; the measurements as a dict."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs
    import transformers

    import xla_tp

    mesh = xla_tp.make_mesh(model=DEVICES)
    probe = torch.ones(DEVICES, DEVICES, device=torch_xla.device())
    xs.mark_sharding(probe, mesh, ("model", None))
    (probe + 1).cpu()  # the runtime starts: its memory is not the model's
    with torch.device("meta"):  # nor is the code transformers imports on a model's first build
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    config = _config(shape, layers)
    _reset_peak()
    start_rss = _status("VmRSS")
    if route == "cpu":
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    else:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    out = {"route": route, "model_bytes": sum(sizes), "largest_tensor_bytes": max(sizes),
           "device_share_bytes": sum(sizes) // DEVICES}
    if route == "load":
        xla_tp.parallelize_xla(model, "auto", mesh=mesh)
        xm.wait_device_ops()
        _reset_peak()
        start_rss = _status("VmRSS")
    start = time.perf_counter()
    if route == "load":
        xla_tp.load_checkpoint(checkpoint, model)
    else:
        xla_tp.parallelize_xla(model, "auto", mesh=mesh)
    xm.wait_device_ops()
    out["seconds"] = time.perf_counter() - start
    peak, resident = _status("VmHWM"), _status("VmRSS")
    out["device_bytes"] = device_bytes(model)
    added = 0 if route == "load" else out["device_bytes"]
    out["host_peak"] = peak - start_rss - added
    out["host_resident"] = resident - start_rss - added  # runtime caches, compiled programs, heap kept
    out["host_peak_over_largest_tensor"] = out["host_peak"] / out["largest_tensor_bytes"]
    out["host_peak_over_device_share"] = out["host_peak"] / out["device_share_bytes"]
    out["host_peak_over_model"] = out["host_peak"] / out["model_bytes"]
    if route == "meta" and audit:
        start = time.perf_counter()
        tokens = torch.randint(0, config.vocab_size, (1, 16), device=torch_xla.device())
        report = xla_tp.audit(model, tokens, mesh=mesh)
        out.update(comm_ratio=report.comm_ratio, compute_balance=report.compute_balance,
                   param_memory_ratio=report.param_memory_ratio, audit_seconds=time.perf_counter() - start)
    if route == "meta":
        start = time.perf_counter()
        xla_tp.export_hf(model, checkpoint, max_shard_bytes=max(sizes) + 1)
        out["export_seconds"] = time.perf_counter() - start
    out["checksum"] = float(model.model.layers[-1].mlp.down_proj.weight.float().sum().cpu())
    return out


def run_child(route: str, shape: str, layers: int, checkpoint: str, audit: bool = True) -> dict:
    """``child`` in a fresh process whose environment holds only what a user's would."""
    env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(DEVICES), TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-m", "bench.meta_init", "--child", route, "--shape", shape,
                             "--layers", str(layers), "--checkpoint", checkpoint, *([] if audit else ["--no-audit"])],
                            cwd=Path(__file__).parent.parent, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"bench.meta_init {route} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(shape: str, layers: int, routes=ROUTES, audit: bool = True) -> dict:
    """Every route of ``routes`` in its own process (``load`` reads what ``meta`` exported)."""
    with tempfile.TemporaryDirectory() as checkpoint:
        rows = {route: run_child(route, shape, layers, checkpoint, audit) for route in routes}
    result = {"shape": shape, "layers": layers, "mesh": f"model={DEVICES}", "dtype": "bfloat16", "rows": rows}
    if "meta" in rows and "cpu" in rows:
        result["ratio_seconds_meta_vs_cpu"] = rows["meta"]["seconds"] / rows["cpu"]["seconds"]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.meta_init")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--child", choices=ROUTES, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--no-audit", dest="audit", action="store_false", help="skip the audit of the meta route")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.shape, args.layers, args.checkpoint, args.audit)))
        return 0
    result = measure(args.shape, args.layers, audit=args.audit)
    write_result(args.out, "meta_init.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
