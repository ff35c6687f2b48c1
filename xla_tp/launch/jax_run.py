"""``xla-tp launch --backend jax``: a recipe trained on the JAX backend (``parallelize_jax``), in this process.

The recipe's model is built as the torch_xla run builds it (same config, seed and dtype), parallelized with
``parallelize_jax(model, plan, mesh=<the recipe's mesh>)`` and trained with the JAX backend's own jitted step
on the same batches (``Batches``: every process gives the whole global batch; each device takes its shard).
The optimizer is the recipe's (``adamw``, or ``adam``): torch's arithmetic (``xla_tp.backends.jax.AdamW``),
the recipe's warm-up and schedule per step, and torch's gradient-norm clipping. Progress lines and
``metrics.jsonl`` are the torch_xla run's (``Reporter``: process 0 only); ``compiles`` counts the programs JAX
compiled in the process. Across processes (``jax.distributed.initialize`` before) every process runs the same
loop, and a Ctrl-C seen by process 0 stops all of them after the same step. Example::

    status = train_jax(load_recipe("tiny-llama-cpu", ["steps=5"]), load_topology("cpu-8"),
                       {"data": 2, "model": 4}, run_dir=Path("runs/jax"), process_index=0, audit=False)
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import yaml

from .data import Batches
from .model import build_model, hf_config, model_shape
from .plans import plan_input
from .progress import Reporter
from .recipe import PRECISIONS, OptimizerSpec, Recipe
from .schema import LaunchError
from .topology import Topology
from .train import INTERRUPTED, StopFlag, causal_or_masked_loss, flops_per_token, lr_factor


def unsupported(recipe: Recipe, topology: Topology, flags: dict[str, bool]) -> Optional[str]:
    """Why ``--backend jax`` cannot run this (one line naming the flag or key), or None."""
    for flag, given in flags.items():
        if given:
            return f"{flag} is not supported with --backend jax yet; run it with the torch_xla backend (the default)"
    if recipe.checkpoint.dir and recipe.checkpoint.interval:
        return ("checkpoint.interval: --backend jax does not save checkpoints yet; pass checkpoint.interval=0 "
                "or use the torch_xla backend")
    if recipe.optimizer.name not in ("adamw", "adam"):
        return f"optimizer.name={recipe.optimizer.name}: --backend jax trains with adamw or adam"
    if recipe.activation_checkpointing:
        return "activation_checkpointing=true is not supported with --backend jax yet; pass activation_checkpointing=false"
    if "context" in recipe.mesh_for(topology):
        return "a context mesh axis is not supported with --backend jax yet"
    return None


@dataclass(frozen=True)
class RecipeOptimizer:
    """The recipe's optimizer in optax's protocol (what ``JaxModel.train_step`` takes): torch's Adam/AdamW
    arithmetic at learning rate ``lrs[step]``, after torch's ``clip_grad_norm_(grad_clip)``."""

    spec: OptimizerSpec
    lrs: tuple[float, ...]

    @staticmethod
    def of(spec: OptimizerSpec, steps: int) -> "RecipeOptimizer":
        return RecipeOptimizer(spec, tuple(spec.lr * lr_factor(spec, steps, s) for s in range(max(steps, 1))))

    def _adam(self) -> Any:
        from ..backends.jax import AdamW
        decoupled = self.spec.weight_decay if self.spec.name == "adamw" else 0.0
        # lr 1: an AdamW update is linear in lr, so the step's rate multiplies it afterwards
        return AdamW(lr=1.0, betas=tuple(self.spec.betas), eps=self.spec.eps, weight_decay=decoupled)

    def init(self, params: Any) -> Any:
        return self._adam().init(params)

    def update(self, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        import jax
        import jax.numpy as jnp
        clip, spec = self.spec.grad_clip, self.spec
        if clip:
            norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))
            coef = jnp.minimum(1.0, clip / (norm + 1e-6))
            grads = jax.tree.map(lambda g: (g * coef).astype(g.dtype), grads)
        if spec.name == "adam" and spec.weight_decay:   # torch's Adam: L2 added to the gradient
            grads = jax.tree.map(lambda g, p: g + spec.weight_decay * p, grads, params)
        lr = jnp.asarray(self.lrs, jnp.float32)[jnp.minimum(state.count, len(self.lrs) - 1)]
        updates, state = self._adam().update(grads, state, params)
        return jax.tree.map(lambda u: (u * lr).astype(u.dtype), updates), state


class CompileCounter:
    """Programs JAX compiled in this process since it was made (jax.monitoring's backend-compile events)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        import jax
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._seen)

    def _seen(self, event: str, seconds: float, **unused: Any) -> None:
        if event == self.EVENT:
            self.count += 1


def train_jax(recipe: Recipe, topology: Topology, axes: dict[str, int], run_dir: Path, process_index: int,
              audit: bool) -> int:
    """Build, parallelize on JAX, (audit,) train; 0 when done, 130 when stopped early."""
    import jax

    import xla_tp
    r = recipe
    reporter = Reporter(run_dir, process_index)
    cpu_devices(topology)
    if jax.device_count() != topology.chips:
        raise LaunchError(f"topology {topology.name} has {topology.chips} chips but jax sees {jax.device_count()} "
                          f"{jax.devices()[0].platform} devices over {jax.process_count()} process(es)")
    counter = CompileCounter()
    config = hf_config(r.model, r.path)
    config.use_cache = False
    shape = model_shape(config)
    model = build_model(config, r.model.task, device="cpu", dtype=getattr(torch, PRECISIONS[r.precision]), seed=r.seed)
    batches = Batches(r.data, shape.vocab, r.batch, r.seq_len, r.seed, r.model.task)
    start = time.perf_counter()
    jm = xla_tp.parallelize_jax(model, plan_input(r), mesh=axes)
    reporter.say(f"\nparallelized on JAX in {time.perf_counter() - start:.2f}s: {jax.device_count()} "
                 f"{jax.devices()[0].platform} devices, {jax.process_count()} process(es)")
    if audit:
        reporter.say(str(jm.audit(batches.get(0)[0])))
    loss_fn = causal_or_masked_loss(r.model.task)
    step_fn = jm.train_step(lambda m, x, y: loss_fn(m, x, y)[1], RecipeOptimizer.of(r.optimizer, r.steps))
    if reporter.speaks:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.yaml").write_text(yaml.safe_dump(
            {"recipe": r.path, "topology": topology.name, "backend": "jax", "processes": jax.process_count(),
             "mesh": axes, "steps": r.steps, "batch": r.batch, "seq_len": r.seq_len, "precision": r.precision,
             "optimizer": vars(r.optimizer)}))
    reporter.say(f"training {r.steps} steps on JAX; metrics: {run_dir / 'metrics.jsonl'}")
    peak = None if topology.peak_bf16_tflops_per_chip is None else topology.peak_bf16_tflops_per_chip * 1e12 * topology.chips
    flops = flops_per_token(model, shape, r.seq_len)
    reporter.start(r.steps)
    step, last_time, last_step, t0 = 0, time.perf_counter(), 0, time.perf_counter()
    try:
        with StopFlag() as flag:
            while step < r.steps and not _stop(flag.stop):
                lr = r.optimizer.lr * lr_factor(r.optimizer, r.steps, step)
                loss = step_fn(*batches.get(step))
                step += 1
                if step % r.log_interval == 0 or step in (1, r.steps) or flag.stop:
                    value = float(loss)     # waits for the step
                    now = time.perf_counter()
                    tokens_per_s = (step - last_step) * r.batch * r.seq_len / max(now - last_time, 1e-9)
                    reporter.step(step, {"step": step, "steps": r.steps, "loss": value, "lr": lr,
                                         "tokens_per_s": tokens_per_s,
                                         "mfu": None if peak is None else tokens_per_s * flops / peak,
                                         "elapsed_s": round(now - t0, 3), "compiles": counter.count,
                                         "first": step == 1})
                    last_time, last_step = now, step
                else:
                    reporter.step(step)
        if step < r.steps:
            reporter.record({"event": "stopped", "step": step})
            reporter.say(f"stopped after step {step} of {r.steps} (Ctrl-C or SIGTERM)")
            return INTERRUPTED
        reporter.record({"event": "done", "step": step})
        return 0
    finally:
        reporter.close()


def cpu_devices(topology: Topology) -> None:
    """A CPU topology's chips shared out over the joined processes, before jax starts (unless
    ``--xla_force_host_platform_device_count`` chose already, as ``--hosts`` does)."""
    import jax

    from ..backends.jax.runtime import processes
    if topology.is_tpu or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        jax.config.update("jax_num_cpu_devices", topology.chips // processes())
    except RuntimeError:
        pass  # jax has started: its device count is fixed, and the check after this says so if it is wrong


def _stop(mine: bool) -> bool:
    """Whether to stop: process 0's flag, the same in every process (they must stop after the same step)."""
    import jax
    if jax.process_count() == 1:
        return mine
    from jax.experimental import multihost_utils
    return bool(multihost_utils.broadcast_one_to_all(np.int32(mine)))
