"""Checkpoint directories: one per step, committed atomically, the last ``keep`` kept.

A checkpoint root holds ``step_00000010/`` directories. A save writes into a hidden temporary
directory (``.tmp.step_00000010.<host>.<pid>``) and renames it into place only once every file,
and the ``xla_tp.json`` marker, is written and synced: a save killed half-way leaves only a
hidden directory, which is never taken for a checkpoint and is removed by the next save once its
process is gone. Example::

    root = CheckpointRoot("ckpt")
    tmp = root.begin(10)                      # write files into tmp
    root.commit(tmp, 10, {"step": 10})        # ckpt/step_00000010 now exists, complete
    root.latest()                             # (10, "ckpt/step_00000010")
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import uuid
from typing import Optional

from ..errors import CheckpointError

MARKER = "xla_tp.json"
_STEP = re.compile(r"^step_(\d+)$")
_TMP = re.compile(r"^\.tmp\.step_\d+\.(?P<host>[^.]+)\.(?P<pid>\d+)\.")


def is_checkpoint(path: str) -> bool:
    """True for a complete, committed step directory."""
    return os.path.isfile(os.path.join(path, MARKER)) and not os.path.basename(os.path.normpath(path)).startswith(".")


def read_marker(path: str) -> dict:
    with open(os.path.join(path, MARKER)) as f:
        return json.load(f)


class CheckpointRoot:
    """The directory that holds a run's step checkpoints."""

    def __init__(self, path: str):
        self.path = os.fspath(path)

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        if not os.path.isdir(self.path):
            return []
        found = [(int(m.group(1)), name) for name in os.listdir(self.path) if (m := _STEP.match(name))]
        return sorted(step for step, name in found if is_checkpoint(os.path.join(self.path, name)))

    def step_dir(self, step: int) -> str:
        return os.path.join(self.path, f"step_{step:08d}")

    def latest(self) -> Optional[tuple[int, str]]:
        steps = self.steps()
        return (steps[-1], self.step_dir(steps[-1])) if steps else None

    def begin(self, step: int) -> str:
        """A fresh hidden directory to write step ``step`` into (stale ones of dead saves removed)."""
        os.makedirs(self.path, exist_ok=True)
        self._remove_stale()
        tmp = os.path.join(self.path, f".tmp.step_{step:08d}.{_host()}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
        return tmp

    def commit(self, tmp: str, step: int, info: dict, keep: Optional[int] = None) -> str:
        """Write the marker, sync, and rename ``tmp`` to the step directory (replacing an older save
        of the same step); then drop all but the newest ``keep`` checkpoints. Returns the directory."""
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(info, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        final = self.step_dir(step)
        if os.path.exists(final):
            self._discard(final)
        os.rename(tmp, final)
        _fsync_dir(self.path)
        if keep is not None:
            for old in self.steps()[:-keep]:
                self._discard(self.step_dir(old))
        return final

    def abort(self, tmp: str) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def _discard(self, path: str) -> None:
        """Hide ``path`` with one rename (so it is never seen half-deleted), then delete it."""
        trash = os.path.join(self.path, f".trash.{os.path.basename(path)}.{uuid.uuid4().hex[:8]}")
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _remove_stale(self) -> None:
        for name in os.listdir(self.path):
            m = _TMP.match(name)
            if name.startswith(".trash.") or (m and m["host"] == _host() and not _alive(int(m["pid"]))):
                shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)


def resolve(path: str) -> tuple[Optional[int], str]:
    """``(step, directory)`` of the checkpoint ``path`` names: a step directory, or a root (its newest
    complete step). ``CheckpointError`` if there is none."""
    path = os.fspath(path)
    if is_checkpoint(path):
        return read_marker(path).get("step"), path
    if os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"{path!r} is an incomplete checkpoint (a save that did not finish: no {MARKER}); "
                              f"load its root directory to get the newest complete one")
    latest = CheckpointRoot(path).latest()
    if latest is None:
        raise CheckpointError(f"no complete checkpoint in {path!r}; pass a directory written by "
                              f"xla_tp.save_checkpoint (a root of step_* directories, or one of them)")
    return latest


def _host() -> str:
    return socket.gethostname().replace(".", "-")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
