"""The training loop of a launched run: optimizer, schedule, sharded batches, metrics, clean stops.

Each step: the global batch is sharded over the ``data``/``fsdp`` axes, forward, fp32
cross-entropy, backward, optional gradient clipping, optimizer and schedule step, one
``torch_xla.sync()``. Every ``log_interval`` steps (and at the first and last) the loss is read
and a metrics record is logged: loss, learning rate, tokens/s over the interval, MFU against
the slice's peak bf16 FLOP/s (FLOPs per token ``6 * N + 12 * layers * heads * head_dim *
seq_len``, N the parameters that multiply: the input embedding is a lookup, unless tied), and the
number of XLA compilations so far (flat after the first two steps: a growing count means
recompilation); for an MoE model also the share of routed assignments its layers dropped
(``moe_dropped``: past a full expert's slots). Ctrl-C or SIGTERM stops after the current step: the stop is recorded and the
run exits with status 130. Example::

    loop = Loop(model, optimizer, schedule, batches, mesh, recipe, reporter, flops_per_token, peak)
    status = loop.run(start_step=0)
"""
from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.distributed.spmd as xs
from torch import nn

from .. import processes
from ..axes import batch_axes, spec_entry
from ..compiles import compiled
from ..lowering.routed import moe_report
from .checkpoints import Checkpoints
from .data import IGNORE, Batches, HostRows
from .model import ModelShape, active_parameters
from .progress import Reporter
from .recipe import OptimizerSpec, Recipe

INTERRUPTED = 130


def make_optimizer(model: nn.Module, spec: OptimizerSpec, steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """The recipe's optimizer and its learning-rate schedule (linear warm-up, then constant or cosine)."""
    params = model.parameters()
    if spec.name == "sgd":
        opt = torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    else:
        cls = torch.optim.AdamW if spec.name == "adamw" else torch.optim.Adam
        opt = cls(params, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps, weight_decay=spec.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(spec, steps, step))


def lr_factor(spec: OptimizerSpec, steps: int, step: int) -> float:
    """Multiplier of ``spec.lr`` at ``step`` (0-based). Cosine ends at 10% of the peak."""
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    if spec.schedule == "constant":
        return 1.0
    done = (step - spec.warmup_steps) / max(1, steps - spec.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))


def causal_or_masked_loss(task: str):
    """``loss_fn(model, inputs, targets) -> (logits, loss)``: fp32 cross-entropy on the model's logits, plus an
    MoE model's router load-balancing loss (``aux_loss`` x ``config.router_aux_loss_coef``) where it has one."""
    kwargs = {"use_cache": False} if task == "causal-lm" else {}

    def loss_fn(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor):
        config = getattr(model, "config", None)
        routed = {"output_router_logits": True} if getattr(config, "output_router_logits", None) is not None else {}
        out = model(input_ids=inputs, **kwargs, **routed)
        loss = F.cross_entropy(out.logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
        if getattr(out, "aux_loss", None) is not None:
            loss = loss + config.router_aux_loss_coef * out.aux_loss
        return out.logits, loss
    return loss_fn


def flops_per_token(model: nn.Module, shape: ModelShape, seq_len: int) -> int:
    """Training FLOPs per token: ``6 * N + 12 * layers * heads * head_dim * seq_len`` (``N``: the parameters a
    token computes with; an MoE model's routed experts count ``top_k / E``)."""
    n = active_parameters(model, shape)
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    if out is None or out.weight is not emb:
        n -= emb.numel()
    return 6 * n + 12 * shape.layers * shape.heads * shape.head_dim * seq_len


def moe_dropped(model: nn.Module) -> dict[str, float]:
    """``{"moe_dropped": fraction}``: the routed assignments the last step's MoE layers dropped (past a full
    expert's slots); ``{}`` for a model without MoE layers."""
    layers = moe_report(model).values()
    routed = sum(layer["routed"] for layer in layers)
    return {"moe_dropped": sum(layer["dropped"] for layer in layers) / routed} if routed else {}


def batch_spec(mesh: xs.Mesh) -> tuple:
    """Partition spec of a ``[batch, seq]`` input: the batch over the data/fsdp axes that are > 1."""
    return (spec_entry(batch_axes(dict(zip(mesh.axis_names, mesh.mesh_shape)))), None)


def to_device(t: torch.Tensor, mesh: xs.Mesh, host: Optional[HostRows] = None) -> torch.Tensor:
    """A CPU ``[batch, seq]`` tensor on the XLA device, batch-sharded. With ``host`` (several hosts), ``t``
    holds only this host's rows of the global batch (``host.rows``), and the global batch is assembled from
    every host's rows: each of this host's devices receives the block it holds (torch_xla's sharded-input
    path, ``_global_tensor_from_cpu_shards``), so no host reads all of it."""
    if host is None:
        t = t.to(torch_xla.device())
        xs.mark_sharding(t, mesh, batch_spec(mesh))
        return t
    shards = [t[block].contiguous() for block in host.shards]
    return torch_xla._XLAC._global_tensor_from_cpu_shards(shards, mesh.get_op_sharding(batch_spec(mesh)),
                                                          [host.batch, *t.shape[1:]])


class StopFlag:
    """Ctrl-C / SIGTERM set a flag the loop reads between steps; a second Ctrl-C stops at once."""

    def __init__(self):
        self.stop = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "StopFlag":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.stop and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.stop = True

    def agreed(self) -> bool:
        """Whether any process was asked to stop: on several hosts, one stopped host stops them all after
        the same step (each step's collectives need every host). Read once per step, by every process."""
        self.stop = any(processes.gathered(self.stop))
        return self.stop

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


@dataclass
class Loop:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Any
    batches: Batches
    mesh: xs.Mesh
    recipe: Recipe
    reporter: Reporter
    flops_per_token: int
    peak_flops: Optional[float]          # the whole slice's peak bf16 FLOP/s; None on CPU
    checkpoints: Optional[Checkpoints] = None
    host: Optional[HostRows] = None      # several hosts: the rows of each batch this one reads

    def run(self, start_step: int = 0) -> int:
        """Train from ``start_step`` to ``recipe.steps``; 0 when done, 130 when stopped early."""
        r = self.recipe
        loss_fn = causal_or_masked_loss(r.model.task)
        self.model.train()
        self.reporter.start(r.steps, start_step)
        last_time, last_step, t0 = time.perf_counter(), start_step, time.perf_counter()
        step, compiled_before = start_step, compiled()  # the steps' own programs, not the check's or the audit's
        try:
            with StopFlag() as flag:
                while step < r.steps and not flag.stop:
                    lr = self.optimizer.param_groups[0]["lr"]   # this step's learning rate
                    loss = self._step(loss_fn, step)
                    step += 1
                    flag.agreed()
                    if step % r.log_interval == 0 or step in (start_step + 1, r.steps) or flag.stop:
                        value = loss.item()   # waits for the step: the interval's time is device time
                        now = time.perf_counter()
                        metrics = self._metrics(step, value, lr, now - last_time, step - last_step, now - t0,
                                               compiled() - compiled_before)
                        self.reporter.step(step, {**metrics, "first": step == start_step + 1})
                        last_time, last_step = now, step
                    else:
                        self.reporter.step(step)
                    if self.checkpoints is not None and self.checkpoints.after_step(
                            self.model, self.optimizer, step, stopping=flag.stop and step < r.steps):
                        self.reporter.record({"event": "checkpoint", "step": step})
            if step < r.steps:
                self.reporter.record({"event": "stopped", "step": step})
                self.reporter.say(f"stopped after step {step} of {r.steps} (Ctrl-C or SIGTERM)")
                return INTERRUPTED
            self.reporter.record({"event": "done", "step": step})
            return 0
        finally:
            self.reporter.close()

    def _step(self, loss_fn, step: int) -> torch.Tensor:
        inputs, targets = self.batches.get(step, None if self.host is None else self.host.rows)
        _, loss = loss_fn(self.model, to_device(inputs, self.mesh, self.host), to_device(targets, self.mesh, self.host))
        loss.backward()
        if self.recipe.optimizer.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe.optimizer.grad_clip)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        torch_xla.sync()
        return loss

    def _metrics(self, step: int, loss: float, lr: float, seconds: float, steps: int,
                 elapsed: float, compiles: int) -> dict[str, Any]:
        tokens_per_s = steps * self.recipe.batch * self.recipe.seq_len / max(seconds, 1e-9)
        mfu = None if self.peak_flops is None else tokens_per_s * self.flops_per_token / self.peak_flops
        return {"step": step, "steps": self.recipe.steps, "loss": loss, "lr": lr,
                "tokens_per_s": tokens_per_s, "mfu": mfu, "elapsed_s": round(elapsed, 3),
                "compiles": compiles, **moe_dropped(self.model)}
