"""Checkpoints in a launched run, and ``--resume``: not available in this version, and said so.

Saving every ``checkpoint.interval`` steps and resuming from the latest complete checkpoint use
``xla_tp.save_checkpoint(path, model, optimizer, step=...)`` and ``xla_tp.load_checkpoint(path,
model, optimizer)`` (sharded checkpoints). This version of xla_tp does not have them yet, so a recipe
with ``checkpoint.interval > 0`` or a ``--resume`` is refused before anything is built, with a message
that says why and what to do. The run is already shaped for them: batches depend only on the seed and
the step, the learning-rate schedule on the step, and the training loop starts from ``start_step``.
Example::

    refuse_unavailable(recipe, resume=args.resume)   # LaunchError while the API is missing
"""
from __future__ import annotations

import xla_tp

from .recipe import Recipe
from .schema import LaunchError

API = ("save_checkpoint", "load_checkpoint")


def missing_api() -> list[str]:
    """The checkpoint functions ``xla_tp`` lacks (all of them in this version)."""
    return [name for name in API if not hasattr(xla_tp, name)]


def refuse_unavailable(recipe: Recipe, resume: bool) -> None:
    """LaunchError when the run asks for checkpoints or a resume that this xla_tp cannot do."""
    missing = missing_api()
    if not missing:
        return
    wants = []
    if recipe.checkpoint.interval:
        wants.append(f"checkpoint.interval={recipe.checkpoint.interval} (set checkpoint.interval=0 to run "
                     f"without checkpoints)")
    if resume:
        wants.append("--resume (start without it)")
    if wants:
        raise LaunchError(f"{' and '.join(wants)}: checkpoints are not available in this version of xla_tp "
                          f"(it has no {' / '.join('xla_tp.' + m for m in missing)} yet)")
