"""One launched run: plan and fit check on ``meta``, then (unless a dry run) build, shard and train.

``Session`` holds what the steps share (recipe, topology, mesh, config, the meta model and the
plan) so the fit check and the run use the same plan on the same mesh. It runs in the launcher's
own process after ``prepare_env``. Example::

    session = Session(recipe, topology, {"data": 2, "model": 4})
    if session.plan_and_fit():                 # prints the fit table and the plan summary
        status = session.train(run_dir=Path("runs/demo"), check=True, audit=True)
"""
from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
import yaml

import xla_tp

from .. import processes
from ..axes import axis_names
from ..compile_cache import CompileCache
from ..compiles import compile_counts
from ..dataflow.graph import Graph
from .check import compare_one_step, parallelizer
from .checkpoints import Checkpoints
from .data import Batches, check_data, host_rows
from .fit import BYTES, FitReport, FitSettings, estimate, human, suggest
from .model import ModelShape, active_parameters, build_model, hf_config, model_shape
from .plans import PlanInput, PlannedSpecs, plan_input, plan_specs
from .progress import Reporter
from .recipe import PRECISIONS, Recipe
from .rerun import rewind_metrics
from .schema import LaunchError
from .slices import hybrid_mesh
from .topology import Topology
from .train import Loop, causal_or_masked_loss, flops_per_token, make_optimizer, to_device

CHECK_FAILED = 1
RUNS = Path("runs")                    # default run directories: runs/RECIPE-TIME


class Session:
    def __init__(self, recipe: Recipe, topology: Topology, axes: dict[str, int], process_index: Optional[int] = None,
                 process_count: Optional[int] = None):
        self.recipe, self.topology, self.axes = recipe, topology, axes
        self.config = hf_config(recipe.model, recipe.path)
        self.config.use_cache = False          # training: no KV cache in the program
        self.shape = model_shape(self.config)
        if self.shape.max_positions is not None and recipe.seq_len > self.shape.max_positions:
            raise LaunchError(f"{recipe.path}: seq_len={recipe.seq_len} is longer than the model's "
                              f"{self.shape.max_positions} positions; raise model.overrides."
                              f"max_position_embeddings or lower seq_len")
        self.dtype = getattr(torch, PRECISIONS[recipe.precision])
        self.plan = plan_input(recipe)
        check_data(recipe.data, self.shape.vocab, recipe.seq_len, recipe.model.task)   # before the runtime starts
        self.mesh = xla_tp.make_mesh(**axes)
        if topology.slices > 1 and xr.device_type() == "TPU":    # the slices' devices, data over DCN
            self.mesh = hybrid_mesh(axes, topology.slices)
        self.process_index = processes.index() if process_index is None else process_index
        self.process_count = processes.count() if process_count is None else process_count
        self.reporter = Reporter(None, self.process_index)

    def say(self, text: str = "") -> None:
        self.reporter.say(text)

    # -- plan and fit: the model on meta ------------------------------------------------------------
    def plan_and_fit(self) -> bool:
        """Print the header, the fit table and the plan summary; False when the run will not fit."""
        r, t = self.recipe, self.topology
        meta = build_model(self.config, r.model.task, device="meta", dtype=self.dtype)
        planned = plan_specs(meta, self.plan, self.mesh)
        n_params = sum(p.numel() for p in meta.parameters())
        active = active_parameters(meta, self.shape)
        slices = f", {t.slices} slices: data={self.axes.get('data', 1)} over DCN" if t.slices > 1 else ""
        self.say(f"xla-tp launch {r.name}: {t.name} ({t.chips} chips, {t.hosts} host(s){slices}), mesh "
                 f"{_axes(self.axes)}, process {self.process_index} of {self.process_count}")
        self.say(f"model: {type(meta).__name__} from {type(self.config).__name__}, {n_params / 1e6:,.1f} M "
                 f"parameters{f' ({active / 1e6:,.1f} M active per token)' if active != n_params else ''} on meta, {r.precision}; plan {r.plan if isinstance(r.plan, str) else 'inline'} "
                 f"({planned.source}); global batch {r.batch} x {r.seq_len} tokens\n")
        settings = FitSettings(r.precision, r.optimizer.name, r.optimizer.momentum, r.batch, r.seq_len,
                               r.activation_checkpointing, "grouped" if t.is_tpu else "slots")
        fit = estimate(meta, planned.specs, self.mesh, self.shape, settings, t)
        self.say(fit.table())
        if not fit.fits:
            tips = suggest(fit, self.shape, t.chips, estimator(meta, self.plan, self.shape, settings, t,
                                                               planned.graph), t.slices)
            self.say(f"\nrefused: {r.name} needs about {human(fit.total)} per chip on {t.name}, which has "
                     f"{human(fit.usable)} usable. What would change that (as overrides):")
            for tip in tips:
                self.say(f"  {tip}")
            return False
        self.say("\n" + plan_summary(meta, planned, fit))
        if t.hosts > 1:
            self.say(f"\n{t.name} has {t.hosts} hosts: run the same command on every worker "
                     f"(--print-commands lists them); only process 0 logs.")
        return True

    # -- the run ------------------------------------------------------------------------------------
    def train(self, run_dir: Optional[Path], check: bool, audit: bool, resume: bool = False,
              cache: Optional[CompileCache] = None) -> int:
        """Build, (check,) parallelize, audit and train; the exit status. At the end, the programs compiled
        and what the persistent compilation ``cache`` (``xla_tp.compile_cache``) supplied."""
        r, t = self.recipe, self.topology
        checkpoints = Checkpoints(r, resume)
        check_devices(t)
        processes.init_group()   # several hosts: the gloo group checkpoints coordinate through
        run_dir = run_dir if run_dir is not None else RUNS / f"{r.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.reporter = Reporter(run_dir, self.process_index)
        model = build_model(self.config, r.model.task, device="cpu", dtype=self.dtype, seed=r.seed)
        if r.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        batches = Batches(r.data, self.shape.vocab, r.batch, r.seq_len, r.seed, r.model.task)
        loss_fn = causal_or_masked_loss(r.model.task)
        if check and not self._check(model, batches, loss_fn):
            return CHECK_FAILED
        start = time.perf_counter()
        xla_tp.parallelize_xla(model, self.plan, mesh=self.mesh)
        self.say(f"\nparallelized in {time.perf_counter() - start:.2f}s")
        if audit:
            inputs, _ = batches.get(0)
            self.say(str(xla_tp.audit(model, to_device(inputs, self.mesh), mesh=self.mesh)))
        optimizer, schedule = make_optimizer(model, r.optimizer, r.steps)
        start_step = 0
        if resume:
            start_step, source = checkpoints.resume(model, optimizer, schedule, self.say)
            self.say(f"resumed from step {start_step} ({source})")
        if self.reporter.speaks:
            run_dir.mkdir(parents=True, exist_ok=True)
            if resume:
                dropped = rewind_metrics(run_dir / "metrics.jsonl", start_step, source)
                if dropped:
                    self.say(f"metrics.jsonl: dropped {dropped} record(s) after step {start_step}; they are trained again")
            (run_dir / "recipe.yaml").write_text(yaml.safe_dump(
                {"recipe": r.path, "topology": t.name, "mesh": self.axes, "steps": r.steps, "batch": r.batch,
                 "seq_len": r.seq_len, "precision": r.precision, "optimizer": vars(r.optimizer)}))
        peak = None if t.peak_bf16_tflops_per_chip is None else t.peak_bf16_tflops_per_chip * 1e12 * t.chips
        self.say(f"training {r.steps} steps; metrics: {run_dir / 'metrics.jsonl'}")
        host = None if processes.count() == 1 else host_rows(r.batch, self.axes, processes.local_devices(t.chips),
                                                             np.asarray(self.mesh.device_ids).ravel().tolist())
        loop = Loop(model, optimizer, schedule, batches, self.mesh, r, self.reporter,
                    flops_per_token(model, self.shape, r.seq_len), peak, checkpoints, host)
        status = loop.run(start_step=start_step)
        self.say((cache or CompileCache(None, off="not turned on")).summary(compile_counts()))
        return status

    def _check(self, model, batches: Batches, loss_fn) -> bool:
        inputs, targets = batches.get(0)
        errors = compare_one_step(model, parallelizer(self.plan, self.mesh), inputs,
                                  targets, lambda x: to_device(x, self.mesh), loss_fn)
        for what, err in errors.items():
            self.say(f"check: max |{what} - CPU| = {err:.2e}")
        worst = max(errors.values())
        ok = worst <= self.recipe.check_tolerance
        self.say("check: OK" if ok else f"check: FAILED, error {worst:.2e} > {self.recipe.check_tolerance:.0e}")
        return ok


def estimator(meta: torch.nn.Module, plan: PlanInput, shape: ModelShape, settings: FitSettings,
              topology: Topology, graph: Optional[Graph] = None) -> Callable[[dict[str, int]], FitReport]:
    """``estimate`` for another mesh of the same chips: the plan is made again for that mesh (from the
    model's ``graph`` when "auto" traced it already)."""
    def on(axes: dict[str, int]) -> FitReport:
        names = axis_names(axes)
        mesh = xs.Mesh(np.arange(topology.chips), tuple(axes.get(a, 1) for a in names), names)
        return estimate(meta, plan_specs(meta, plan, mesh, graph).specs, mesh, shape, settings, topology)
    return on


def check_devices(topology: Topology) -> None:
    """A real run needs the slice's devices: the right kind and the right count."""
    kind, count = xr.device_type(), xr.global_runtime_device_count()
    if topology.is_tpu and kind != "TPU":
        raise LaunchError(f"topology {topology.name} is a TPU slice but XLA runs on {kind} here: run on the "
                          f"slice's TPU VMs (--print-commands), use --dry-run here, or pick --topology cpu-8")
    if count != topology.chips:
        raise LaunchError(f"topology {topology.name} has {topology.chips} chips but the runtime sees {count} "
                          f"devices" + ("; start the command on every worker (--print-commands)"
                                        if topology.hosts > 1 else ""))


def plan_summary(model: torch.nn.Module, planned: PlannedSpecs, fit: FitReport) -> str:
    """The audit's parameter figures, read from the plan (a dry run compiles nothing): how many
    parameters are sharded, bytes per chip against the ideal ``total / (fsdp x model)``, and why
    the rest stay replicated."""
    names = [n for n, _ in model.named_parameters()]
    sharded = {n for n in names if any(a is not None for a in planned.specs.get(n, ()))}
    itemsize = BYTES[fit.settings.precision]
    total = sum(p.numel() for p in model.parameters()) * itemsize
    ways = fit.mesh.get("fsdp", 1) * fit.mesh.get("model", 1)
    reasons = collections.Counter(planned.replicated.get(n, "no plan key shards it").split(":")[0]
                                  for n in names if n not in sharded)
    lines = [f"plan summary ({planned.source}, from the plan; the run audits the compiled program): "
             f"{len(names)} parameters, {len(sharded)} sharded, {len(names) - len(sharded)} replicated",
             f"  parameter bytes per chip {human(fit.params)}; ideal: total {human(total)} / {ways} = "
             f"{human(total // ways)}; ratio {fit.params / (total / ways):.3f}"]
    lines += [f"  replicated: {count} x {reason}" for reason, count in reasons.most_common()]
    return "\n".join(lines)


def _axes(axes: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in axes.items())
