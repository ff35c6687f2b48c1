"""Whether this process has torch_xla, and the error of an entry point that needs it when it has not.

xla_tp's core (plan formats, layout, validation, the dataflow planner, ``torch_plan``, the audit's HLO
reading) needs torch only; torch_xla (``parallelize_xla`` and everything that runs on XLA devices) and
JAX (``parallelize_jax``) are adapters. torch_xla is found by importing it, not from package metadata
(a source tree on the path has none; a wheel's metadata can outlive its files). Example::

    if has_torch_xla(): ...
    parallelize_xla = needs_torch_xla("parallelize_xla")      # where it has not: an error when called
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable

EXTRA = ("install torch_xla 2.9.0 with torch 2.9.0 (pip install 'xla_tp[tpu]' on a TPU VM, or torch==2.9.0 "
         "torch_xla==2.9.0); plan_for, torch_plan, the plan formats and parallelize_jax work without it")


@functools.lru_cache(maxsize=None)
def has_torch_xla() -> bool:
    """Whether ``import torch_xla`` works in this process."""
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return False
    return True


def is_xla_mesh(mesh: Any) -> bool:
    """Whether ``mesh`` is torch_xla's ``xs.Mesh`` (never imports torch_xla: none exists before it is imported)."""
    spmd = sys.modules.get("torch_xla.distributed.spmd")
    return spmd is not None and isinstance(mesh, spmd.Mesh)


def needs_torch_xla(name: str) -> Callable[..., Any]:
    """A stand-in for the entry point ``name`` where torch_xla cannot be imported: it raises, saying what to do."""
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"xla_tp.{name} runs on XLA devices and needs torch_xla, which this Python cannot import: "
                          f"{EXTRA}")
    missing.__name__ = missing.__qualname__ = name
    missing.__doc__ = f"``xla_tp.{name}``: needs torch_xla ({EXTRA})."
    return missing
