"""Run an audit in a fresh CPU process when this one cannot read partitioned HLO.

The parent sends a CPU copy of the module (weights, xla_tp hooks and attributes stripped), each
parameter's and input's sharding string, the plan layout and the mesh; the child (a new Python
with ``XLA_DUMP_POST_OPTIMIZATIONS=1``, ``PJRT_DEVICE=CPU`` and as many CPU devices as this
process has) re-annotates the same shardings, reinstalls the layout's constraints and audits.
Activation constraints written by hand in hooks are not carried over; a module's class must be
importable by name (not defined in ``__main__``). Example::

    report = audit_in_subprocess(model, (x,), mesh, backward=False, plan_layout=None)
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..plan.layout import Layout
from .params import apply_sharding_string, param_specs, sharding_string
from .report import AuditReport


def audit_in_subprocess(target: Any, args: tuple, xmesh: Any, backward: bool,
                        plan_layout: Optional[Layout]) -> AuditReport:
    """Audit ``target(*args)`` in a child process; raises RuntimeError with its stderr on failure."""
    if not isinstance(target, nn.Module):
        raise RuntimeError("audit of a function needs XLA_DUMP_POST_OPTIMIZATIONS=1 in the environment "
                           "before the process starts (it is read once); pass the nn.Module instead, "
                           "which xla_tp can replay in a fresh process")
    if type(target).__module__ == "__main__":
        raise RuntimeError(f"{type(target).__name__} is defined in __main__, so a fresh process cannot "
                           f"import it: move it to a module, or set XLA_DUMP_POST_OPTIMIZATIONS=1 before start-up")
    payload = {
        "module": cpu_copy(target), "params": param_specs(target),
        "layout": plan_layout or getattr(target, "_xla_tp_layout", None),
        "args": [_cpu(a) for a in args], "arg_specs": [_spec(a) for a in args],
        "mesh": ([int(d) for d in xmesh.device_ids], tuple(int(s) for s in xmesh.mesh_shape),
                 tuple(str(n) for n in xmesh.axis_names)),
        "backward": backward,
    }
    with tempfile.TemporaryDirectory(prefix="xla_tp_audit_") as tmp:
        src, dst = Path(tmp, "in.pt"), Path(tmp, "out.json")
        torch.save(payload, src)
        result = subprocess.run([sys.executable, "-m", "xla_tp.audit.child", str(src), str(dst)],
                                env=_child_env(len(payload["mesh"][0])), capture_output=True, text=True)
        if result.returncode != 0 or not dst.exists():
            raise RuntimeError(f"audit subprocess failed ({result.returncode}):\n{result.stderr[-3000:]}")
        report = AuditReport.from_dict(json.loads(dst.read_text()))
    report.notes.append("audited in a fresh CPU process (XLA_DUMP_POST_OPTIMIZATIONS was not set here)")
    return report


def cpu_copy(module: nn.Module) -> nn.Module:
    """A deep copy on the CPU without hooks, xla_tp attributes or per-instance ``forward``."""
    memo: dict[int, Any] = {}
    for t in [*module.parameters(), *module.buffers()]:
        cpu = t.detach().cpu()
        memo[id(t)] = nn.Parameter(cpu, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else cpu
    clone = copy.deepcopy(module, memo)
    for mod in clone.modules():
        for name in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                     "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
            getattr(mod, name, {}).clear()
        for name in [n for n in vars(mod) if n.startswith("_xla_tp") or n == "forward"]:
            delattr(mod, name)
    return clone


def _cpu(a: Any) -> Any:
    return a.detach().cpu().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a


def _spec(a: Any) -> str:
    return sharding_string(a) if isinstance(a, torch.Tensor) else ""


def _child_env(devices: int) -> dict[str, str]:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), XLA_DUMP_POST_OPTIMIZATIONS="1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def _main(src: str, dst: str) -> None:
    """Child side: rebuild the sharded module and write the report as JSON."""
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs

    from ..constraints import install_constraints
    from ..mesh import ensure_runtime
    from .run import audit_here

    ensure_runtime()
    if "transformers" in sys.modules or _importable("transformers"):
        from ..attention import register
        register()   # a model "auto" switched to einsum attention names it in its config
    payload = torch.load(src, weights_only=False)
    ids, shape, names = payload["mesh"]
    mesh = xs.Mesh(np.asarray(ids), shape, names)
    device = torch_xla.device()
    module = payload["module"].to(device)
    for name, p in module.named_parameters():
        apply_sharding_string(p, payload["params"].get(name, ""))
    if payload["layout"] is not None:
        install_constraints(module, payload["layout"], mesh)
    args = []
    for a, spec in zip(payload["args"], payload["arg_specs"]):
        if isinstance(a, torch.Tensor):
            a = a.to(device).requires_grad_(a.requires_grad)
            apply_sharding_string(a, spec)
        args.append(a)
    report = audit_here(module, tuple(args), mesh, payload["backward"], payload["layout"])
    Path(dst).write_text(json.dumps(report.to_dict()))


def _importable(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
