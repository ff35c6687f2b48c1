"""Checkpoints in a launched run: every ``checkpoint.interval`` steps, on a stop, and ``--resume``.

Saves go through ``xla_tp.save_checkpoint`` (sharded, atomic: a save killed half-way never looks
like a checkpoint, the newest ``checkpoint.keep`` are kept). ``--resume`` loads the newest complete
checkpoint under ``checkpoint.dir`` onto this run's mesh (any mesh: checkpoints reshard) and returns
its step; batches depend only on the seed and the step, and the learning-rate schedule is advanced to
it, so a resumed run continues where the saved one was. Example::

    saver = Checkpoints(recipe)
    start = saver.resume(model, optimizer, schedule) if resume else 0
    saver.after_step(model, optimizer, step, stopping=False)
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import xla_tp

from .recipe import Recipe
from .schema import LaunchError


class Checkpoints:
    """Where and when a run saves, and how it resumes (see the module docstring)."""

    def __init__(self, recipe: Recipe, resume: bool):
        spec = recipe.checkpoint
        if resume and not spec.dir:
            raise LaunchError("--resume needs checkpoint.dir: the directory the earlier run saved into")
        self.dir, self.interval, self.keep = spec.dir, spec.interval, spec.keep

    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer, schedule: Any) -> int:
        """Load the newest complete checkpoint; the step it was saved at."""
        if not os.path.isdir(self.dir):
            raise LaunchError(f"--resume: {self.dir!r} holds no checkpoint (start without --resume)")
        try:
            step = xla_tp.load_checkpoint(self.dir, model, optimizer)
        except xla_tp.CheckpointError as error:
            raise LaunchError(f"--resume from {self.dir!r}: {error}") from None
        for _ in range(step or 0):
            schedule.step()
        return step or 0

    def after_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, stopping: bool) -> bool:
        """Save at every ``interval``-th step, and when the run stops early; True if it saved."""
        if not self.interval or not (step % self.interval == 0 or stopping):
            return False
        xla_tp.save_checkpoint(self.dir, model, optimizer, step=step, keep=self.keep)
        return True
