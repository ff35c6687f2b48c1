"""A launch into the places an earlier run used: resumed, refused, or started over on purpose.

An earlier run's checkpoints (``checkpoint.dir``) and its ``metrics.jsonl`` (``--run-dir``) belong to
it. A new launch that finds them continues that run (``--resume``), starts over deliberately
(``--overwrite``: the earlier files are moved aside, never deleted), or is refused with the flag to
pass. A resumed run's ``metrics.jsonl`` keeps the records up to the restored checkpoint's step,
then a resume record, so every step is in it once. Example::

    earlier = EarlierRun(Path("ckpt"), Path("runs/a"))
    earlier.check(resume=False, overwrite=False)    # LaunchError: ... pass --resume ... or --overwrite ...
    earlier.move_aside()                            # with --overwrite, on process 0
    rewind_metrics(Path("runs/a/metrics.jsonl"), step=6, source="ckpt/step_00000006")
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

from ..checkpoint.store import CheckpointRoot
from .schema import LaunchError


class EarlierRun:
    """What an earlier run left where this launch will write: checkpoints in ``checkpoint_dir``
    (committed steps) and a non-empty ``metrics.jsonl`` in ``run_dir``."""

    def __init__(self, checkpoint_dir: Optional[Path], run_dir: Optional[Path]):
        self.checkpoint_dir = checkpoint_dir
        self.steps = CheckpointRoot(str(checkpoint_dir)).steps() if checkpoint_dir is not None else []
        self.metrics = run_dir / "metrics.jsonl" if run_dir is not None else None
        self.has_metrics = self.metrics is not None and self.metrics.is_file() and self.metrics.stat().st_size > 0

    def check(self, resume: bool, overwrite: bool) -> None:
        """``LaunchError`` (one line, the flag to pass) unless this launch may go ahead."""
        if resume and overwrite:
            raise LaunchError("--resume continues the earlier run and --overwrite starts over: pass one of them")
        if resume or overwrite or not (self.steps or self.has_metrics):
            return
        held = (f"checkpoint.dir {str(self.checkpoint_dir)!r} already holds the checkpoints of an earlier run "
                f"(steps {_listed(self.steps)})" if self.steps else
                f"--run-dir {str(self.metrics.parent)!r} already holds the metrics.jsonl of an earlier run")
        raise LaunchError(f"{held}: pass --resume to continue that run, or --overwrite to start over (its files "
                          f"are moved aside), or use another {'checkpoint.dir' if self.steps else '--run-dir'}")

    def move_aside(self) -> list[str]:
        """Rename the earlier run's checkpoint directory and metrics beside themselves (nothing is
        deleted); one line per move."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        moved = []
        if self.steps:
            aside = _aside(self.checkpoint_dir, stamp)
            os.rename(self.checkpoint_dir, aside)
            moved.append(f"--overwrite: moved the earlier run's checkpoints (steps {_listed(self.steps)}) to "
                         f"{str(aside)!r}")
        if self.has_metrics:
            aside = _aside(self.metrics, stamp)
            os.rename(self.metrics, aside)
            moved.append(f"--overwrite: moved the earlier run's metrics to {str(aside)!r}")
        return moved


def rewind_metrics(path: Path, step: int, source: str) -> int:
    """Keep the records of ``path`` up to ``step`` (drop the later ones and a line cut short by a kill),
    append a resume record, and replace the file in one rename. Returns how many records were dropped."""
    kept, dropped = [], 0
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1
                continue
            if isinstance(record, dict) and record.get("step", 0) <= step:
                kept.append(line)
            else:
                dropped += 1
    kept.append(json.dumps({"event": "resume", "step": step, "from": source, "dropped": dropped}))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write("\n".join(kept) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return dropped


def _aside(path: Path, stamp: str) -> Path:
    """A free name beside ``path``: ``ckpt.replaced-20261124-041200`` (``-2``, ... if taken)."""
    candidate, n = path.with_name(f"{path.name}.replaced-{stamp}"), 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.replaced-{stamp}-{n}")
    return candidate


def _listed(steps: list[int]) -> str:
    return ("..., " if len(steps) > 5 else "") + ", ".join(map(str, steps[-5:]))
