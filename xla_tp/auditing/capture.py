"""The per-device program XLA compiles for pending XLA tensors, read without executing it.

Two routes (the SPMD partitioner is GSPMD in both):

- torch_xla compiles the program itself, with the device's own compiler, and returns the
  partitioned HLO. It does when ``XLA_DUMP_POST_OPTIMIZATIONS=1`` is set at the process's first HLO
  query (torch_xla reads it then, once: docs/torch_xla.md). When the variable is not
  set, the first capture sets it for that query (``os.environ`` is as it was after; ``compat.SETTINGS``):
  every later HLO query of the process then returns partitioned programs too.
- Otherwise (the process queried HLO before with the variable unset, or set it to ``0``) torch_xla
  hands out the program it would compile: pre-optimisation HLO carrying
  every parameter's and constraint's sharding, with weights as parameters (no values). jaxlib's
  XLA compiles that text for as many partitions as torch_xla has devices, on its own CPU client.
  Nothing of the process changes and no tensor is read or copied: only the program travels, so
  it works at any model size and from any script. It needs ``jaxlib`` (``pip install
  'xla_tp[jax]'``); on TPU it shows what the CPU compiler makes of the program (the same
  partitioning; reduce-scatters may appear as all-reduce + dynamic-slice). jaxlib's XLA is not
  torch_xla's: it partitions some programs differently (the scatters and gathers of a
  mixture-of-experts layer's slots, all-gathered there), which is why the first route is taken
  wherever it can be. ``route()`` says which one the process takes.

Example::

    text = capture_partitioned_hlo([model(x)])
    parse_collectives(text)
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

_ENTRY_RE = re.compile(r"^ENTRY\s+%?([\w.\-]+)", re.M)
POST_OPTIMIZATIONS = "XLA_DUMP_POST_OPTIMIZATIONS"
_route: list[str] = []  # "device" or "jaxlib", once the process's first capture knows
JAXLIB_HINT = ("install jaxlib (pip install 'xla_tp[jax]', which pins jax==0.7.1 jaxlib==0.7.1), or set "
               "XLA_DUMP_POST_OPTIMIZATIONS=1 in the environment before the process starts")


def post_optimization_hlo_enabled() -> bool:
    """True when torch_xla's HLO queries return partitioned HLO (the variable is set)."""
    return os.environ.get(POST_OPTIMIZATIONS, "").lower() in ("1", "true")


def route() -> str:
    """``"device"`` when torch_xla's own compiler partitions the captured programs, ``"jaxlib"`` when
    jaxlib's XLA does, ``"unknown"`` before the first capture."""
    return _route[0] if _route else "unknown"


def _torch_xla_hlo(tensors: list) -> str:
    """torch_xla's HLO of ``tensors``, asking for the partitioned program (see the module docstring)."""
    import torch_xla  # lazy, as in capture_partitioned_hlo
    if POST_OPTIMIZATIONS in os.environ:
        return torch_xla._XLAC._get_xla_tensors_hlo(tensors)
    os.environ[POST_OPTIMIZATIONS] = "1"
    try:
        return torch_xla._XLAC._get_xla_tensors_hlo(tensors)
    finally:
        del os.environ[POST_OPTIMIZATIONS]


@dataclass(frozen=True)
class Program:
    """A captured per-device program: its HLO text, and (jaxlib's route only: torch_xla does not hand
    out its compiler's statistics) the peak temporary memory per device XLA's buffer assignment gives it."""

    text: str
    temp_bytes: Optional[int] = None


def capture_partitioned_hlo(tensors: list) -> str:
    """Per-device HLO after SPMD partitioning of the pending computation of ``tensors``.

    Needs SPMD on (``torch_xla.runtime.use_spmd()``, done by ``make_mesh``). Compiles, does not
    execute. Example: ``parse_collectives(capture_partitioned_hlo([model(x)]))``.
    """
    return capture_program(tensors).text


def capture_program(tensors: list) -> Program:
    """``capture_partitioned_hlo``'s program, with its compiled memory statistics where the route has them."""
    import torch_xla.runtime as xr  # lazy: keep the audit's parsing modules importable without torch_xla

    if not xr.is_spmd():
        raise RuntimeError("not SPMD: call torch_xla.runtime.use_spmd() (or xla_tp.make_mesh) before "
                           "creating XLA tensors, then capture the partitioned program")
    text = _torch_xla_hlo(list(tensors))
    if not text.strip():
        raise RuntimeError("no pending computation: the tensors are already materialised; capture the HLO "
                           "before .cpu() or torch_xla.sync()")
    entry = _ENTRY_RE.search(text)
    partitioned = bool(entry and "_spmd" in entry.group(1))
    _route[:] = ["device" if partitioned else "jaxlib"]
    if partitioned:
        return Program(text)
    if post_optimization_hlo_enabled():
        raise RuntimeError(f"torch_xla returned HLO that is not partitioned (ENTRY {entry.group(1) if entry else '?'}) "
                           f"although XLA_DUMP_POST_OPTIMIZATIONS is set: it must be set before the "
                           f"process's first HLO query (it is read once)")
    executable = _jaxlib_executable(text, xr.global_runtime_device_count())
    try:
        temp = executable.get_compiled_memory_stats().temp_size_in_bytes
    except Exception:  # a jaxlib or backend without compiled memory statistics: the audit goes on without them
        temp = None
    return Program(executable.hlo_modules()[0].to_string(), temp)


def partition_with_jaxlib(hlo_text: str, partitions: int) -> str:
    """Compile pre-optimisation, sharding-annotated ``hlo_text`` for ``partitions`` devices with
    jaxlib's XLA (GSPMD, outputs' shardings propagated as torch_xla does); the partitioned HLO."""
    return _jaxlib_executable(hlo_text, partitions).hlo_modules()[0].to_string()


def _jaxlib_executable(hlo_text: str, partitions: int) -> Any:
    try:
        from jaxlib import _jax, xla_client
    except ImportError as error:
        raise RuntimeError(f"xla_tp.audit reads the partitioned program: {JAXLIB_HINT}") from error
    client = _cpu_client(partitions)
    options = xla_client.CompileOptions()
    build = options.executable_build_options
    build.num_partitions, build.num_replicas = partitions, 1
    build.use_spmd_partitioning, build.use_shardy_partitioner = True, False
    build.allow_spmd_sharding_propagation_to_output = [True]
    devices = client.devices()[:partitions]
    build.device_assignment = _jax.DeviceAssignment.create(np.array([[d.id for d in devices]]))
    try:
        module = _jax.hlo_module_from_text(hlo_text)
        mlir = _jax.mlir.hlo_to_stablehlo(module.as_serialized_hlo_module_proto())
        executable = client.compile_and_load(mlir, _jax.DeviceList(tuple(devices)), options)
    except Exception as error:  # jaxlib raises its own XlaRuntimeError / ValueError types
        raise RuntimeError(f"jaxlib's XLA could not compile the program torch_xla produced ({error}); set "
                           f"XLA_DUMP_POST_OPTIMIZATIONS=1 before the process starts so torch_xla compiles "
                           f"it itself") from error
    return executable


@functools.lru_cache(maxsize=None)
def _cpu_client(devices: int) -> Any:
    """jaxlib's CPU client with ``devices`` devices, separate from any jax backend in the process."""
    from jaxlib import xla_client
    return xla_client.make_cpu_client(num_devices=devices)
