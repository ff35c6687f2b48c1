"""Host trace time and steady-state training steps of one model, measured the same way for every route.

- ``trace_stats``: the process's CPU time to trace one forward (or forward+backward), nothing
  executed: the median, min and max of ``TRACES`` traces after ``WARMUP``. Process CPU time: autograd
  traces an XLA backward on its own device thread, which a thread clock misses; other processes on the
  machine do not count.
- ``step_stats``: a training step (forward, backward, SGD) run for real on each execution route:
  ``eager`` (lazy tracing, ``torch_xla.sync()``), ``torch_xla.compile`` and ``dynamo``
  (``torch.compile(model, backend="openxla")``). Per route: the median wall time of ``STEPS`` steps
  after ``WARMUP`` (trace + execute, waiting for the devices), and the XLA compilations in the
  warm-up and in the measured steps (``xla_tp.compiles``: every compilation; the measured steps must compile nothing).

Example::

    trace_stats(model, batch, backward=True)     # {"median": 0.021, "min": 0.020, "max": 0.024}
    step_stats(model, batch)["dynamo"]            # {"median": ..., "warmup_compiles": 3, "compiles": 0}
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch_xla
import torch_xla.core.xla_model as xm

from xla_tp.compiles import compiled
from xla_tp.zoo import registry

WARMUP, TRACES, STEPS = 3, 9, 5
EXECUTIONS = ("dynamo", "eager", "torch_xla.compile")


def stats(samples: list[float]) -> dict[str, float]:
    """``{"median", "min", "max"}`` of ``samples`` (seconds): ``stats([3, 1, 2])["median"] == 2``."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def trace_once(model: torch.nn.Module, batch: torch.Tensor, backward: bool) -> float:
    """Process CPU seconds to trace one forward (+ backward) of ``model``; the graph is dropped, not run."""
    params = [p for p in model.parameters() if p.requires_grad]
    start = time.process_time()
    out = registry.run(model, batch).float().mean()
    if backward:
        torch.autograd.grad(out, params, allow_unused=True)
    return time.process_time() - start


def trace_stats(model: torch.nn.Module, batch: torch.Tensor, backward: bool,
                n: int = TRACES, warmup: int = WARMUP) -> dict[str, float]:
    """``stats`` of ``n`` traces after ``warmup`` (see the module docstring)."""
    for _ in range(warmup):
        trace_once(model, batch, backward)
    return stats([trace_once(model, batch, backward) for _ in range(n)])


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = registry.run(model, batch).float().square().mean()
    loss.backward()
    opt.step()
    return loss


def _steps(step: Callable[[], Any], warmup: int, n: int) -> dict[str, Any]:
    def timed() -> tuple[float, int]:
        before = compiled()
        start = time.perf_counter()
        step()
        torch_xla.sync()
        xm.wait_device_ops()
        return time.perf_counter() - start, compiled() - before

    warm = [timed() for _ in range(warmup)]
    runs = [timed() for _ in range(n)]
    return {**stats([t for t, _ in runs]), "warmup_compiles": sum(c for _, c in warm),
            "compiles": sum(c for _, c in runs)}


def step_stats(model: torch.nn.Module, batch: torch.Tensor, warmup: int = WARMUP,
               n: int = STEPS) -> dict[str, dict[str, Any]]:
    """Per execution route, ``_steps`` of SGD training steps on ``model`` (its parameters change), or
    ``{"status": "fails: ..."}``."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    torch._dynamo.reset()  # dynamo would reuse another model's program (same class, other shardings): it fails
    steps: dict[str, Callable[[], Any]] = {
        "eager": lambda: _train_step(model, opt, batch),
        "torch_xla.compile": (lambda fn: lambda: fn(model, opt, batch))(torch_xla.compile(_train_step)),
        "dynamo": (lambda compiled: lambda: _train_step(compiled, opt, batch))(torch.compile(model, backend="openxla")),
    }
    out: dict[str, dict[str, Any]] = {}
    for name in EXECUTIONS:
        try:
            out[name] = _steps(steps[name], warmup, n)
        except Exception as error:  # a route failing is a result
            out[name] = {"status": f"fails: {type(error).__name__}: {str(error).splitlines()[0][:160]}"}
            torch_xla.sync()
    return out
