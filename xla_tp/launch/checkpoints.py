"""Checkpoints in a launched run: every ``checkpoint.interval`` steps, on a stop, and ``--resume``.

Saves go through ``xla_tp.save_checkpoint`` (sharded, atomic: a save killed half-way never looks
like a checkpoint, the newest ``checkpoint.keep`` are kept). ``--resume`` loads the newest checkpoint
under ``checkpoint.dir`` that verifies (a damaged one is skipped, saying why) onto this run's mesh
(any mesh: checkpoints reshard) and returns its step; batches depend only on the seed and the step, and the learning-rate schedule is advanced to
it, so a resumed run continues where the saved one was. Example::

    saver = Checkpoints(recipe)
    start, source = saver.resume(model, optimizer, schedule) if resume else (0, None)
    saver.after_step(model, optimizer, step, stopping=False)
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

import xla_tp
from xla_tp.checkpoint.store import CheckpointRoot

from .recipe import Recipe
from .schema import LaunchError


class Checkpoints:
    """Where and when a run saves, and how it resumes (see the module docstring)."""

    def __init__(self, recipe: Recipe, resume: bool):
        spec = recipe.checkpoint
        if resume and not spec.dir:
            raise LaunchError("--resume needs checkpoint.dir: the directory the earlier run saved into")
        self.dir, self.interval, self.keep = spec.dir, spec.interval, spec.keep

    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer, schedule: Any,
               say: Callable[[str], None] = print) -> tuple[int, str]:
        """Load the newest checkpoint that verifies, saying which newer ones were skipped and why;
        ``(step, directory)``. A checkpoint that fails leaves the model and optimizer as they were."""
        root = CheckpointRoot(self.dir)
        steps = root.steps()
        if not steps:
            raise LaunchError(f"--resume: {self.dir!r} holds no checkpoint (start without --resume)")
        for step in reversed(steps):
            directory = root.step_dir(step)
            try:
                xla_tp.load_checkpoint(directory, model, optimizer)
            except xla_tp.CheckpointError as error:
                say(f"--resume: skipped {directory}: {error}")
                continue
            for _ in range(step):
                schedule.step()
            return step, directory
        raise LaunchError(f"--resume: none of the {len(steps)} checkpoint(s) in {self.dir!r} could be loaded "
                          f"(each skipped above, with why); start over with --overwrite")

    def after_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, stopping: bool) -> bool:
        """Save at every ``interval``-th step, and when the run stops early; True if it saved."""
        if not self.interval or not (step % self.interval == 0 or stopping):
            return False
        xla_tp.save_checkpoint(self.dir, model, optimizer, step=step, keep=self.keep)
        return True
