"""Route (f): the same "auto" plan on JAX through torchax (``xla_tp.parallelize_jax``).

Measured like the XLA routes: the forward's audit (read from the program JAX compiled), the time
to trace and compile that forward, and the time to trace one forward+backward. JAX traces a step
once per input shape and then reuses the executable, where torch_xla re-traces every step; the
trace time is reported for comparison all the same. Example::

    row = jax_row("llama", "tiny", {"data": 2, "model": 4})
"""
from __future__ import annotations

import time
from typing import Any

import jax

import xla_tp
from xla_tp.zoo import registry

from .models import build
from .timing import stats

ROUTE = "f_jax_torchax"
NOTE = ("the same 'auto' plan compiled by JAX (torchax, Shardy); its trace time is one trace, a one-off there: JAX traces "
        "once per input shape and reuses the executable, where torch_xla re-traces every step")


def jax_row(family: str, width: str, sizes: dict[str, int]) -> dict[str, Any]:
    """The row fields of route (f) for ``family``/``width`` on a mesh of ``sizes``."""
    model, batch, _ = build(family, width)
    jm = xla_tp.parallelize_jax(model, "auto", mesh=sizes)
    args = registry.positional_args(model, batch)
    start = time.perf_counter()
    jm.hlo(*args)
    compile_s = time.perf_counter() - start
    report = jm.audit(*args)
    data = report.to_dict()
    return {"how": "parallelize_jax auto (torchax, Shardy)", "status": "ok", "compile_s": compile_s,
            "trace_fwdbwd": stats([trace_time(jm, batch)]), "all_gathers": report.count("all-gather"),
            **{k: data[k] for k in ("comm_ratio", "compute_balance", "param_memory_ratio", "collectives")}}


def trace_time(jm: Any, batch: Any) -> float:
    """Seconds to trace forward+backward through torchax into a jaxpr (nothing compiles or runs)."""
    arrays, static = jm.inputs(registry.positional_args(jm.module, batch), {})
    grad = jax.jit(jax.value_and_grad(jm.loss(lambda m, x: registry.run(m, x).float().mean())),
                   static_argnames=("static",))
    start = time.perf_counter()
    grad.trace(*jm.split_params(jm.params), jm.buffers, arrays, static=static)
    return time.perf_counter() - start
