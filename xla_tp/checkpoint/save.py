"""``save_checkpoint``: sharded state of a model (and optimizer) through ``torch.distributed.checkpoint``.

Each device's shard is written as it is (torch_xla's ``SPMDSavePlanner``): no tensor is gathered
whole on the host. The checkpoint directory appears only once complete (``store.CheckpointRoot``),
its marker recording every file's size and SHA-256 (``integrity``). A save that fails (a full disk
included) leaves nothing and raises ``CheckpointError``; older checkpoints stay as they were.
``async_save=True`` copies the shards to host memory before returning and writes them in a
background thread, so the next training step runs while the files are written.

On several hosts (a gloo process group, ``xla_tp.processes.init_group()``) every host writes its own
shards into one hidden directory that process 0 made; once all have written, process 0 alone
writes the marker (every host's files) and renames the directory to ``step_N``, and every host
returns only after that: one checkpoint, committed once. A host that dies half-way makes the
others fail and remove the directory; the previous checkpoint stays as it was. Example::

    xla_tp.save_checkpoint("ckpt", model, opt, step=100, keep=3)        # ckpt/step_00000100
    handle = xla_tp.save_checkpoint("ckpt", model, opt, step=200, async_save=True)
    ...                                                                 # train on
    handle.result()                                                     # the directory, once committed
"""
from __future__ import annotations

import dataclasses
import io
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch_xla
import torch_xla.distributed.spmd as xs
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlan
from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner
from torch_xla.experimental.distributed_checkpoint._helpers import _cpu_shards_from_tensors, _is_sharded_tensor

from .. import processes
from ..errors import CheckpointError
from .integrity import RecordingWriter, disk_full, reason
from .layout import model_state, optimizer_state
from .store import CheckpointRoot

log = logging.getLogger(__name__)
FORMAT = 2  # 2: the marker records each file's size and SHA-256
_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xla_tp-checkpoint")  # saves stay in order


class SaveHandle:
    """An asynchronous save in flight. ``result()`` waits and returns the committed directory (or
    raises what the save raised); ``done()`` says whether it has finished."""

    def __init__(self, future: Future, step: int):
        self._future, self.step = future, step

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> str:
        return self._future.result(timeout)


def save_checkpoint(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                    step: Optional[int] = None, *, keep: Optional[int] = None,
                    async_save: bool = False) -> Union[str, SaveHandle]:
    """Save ``model`` (and ``optimizer``) sharded under the checkpoint root ``path`` as step ``step``
    (default: one past the newest step there). ``keep=k`` leaves only the newest ``k`` checkpoints.
    Returns the step directory, or a ``SaveHandle`` with ``async_save=True``. Example::

        xla_tp.save_checkpoint("ckpt", model, opt, step=10)    # -> "ckpt/step_00000010"
    """
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise CheckpointError(f"keep={keep!r}: pass a positive number of checkpoints to keep, or None for all")
    root = CheckpointRoot(path)
    if step is None:
        latest = root.latest()
        step = 0 if latest is None else latest[0] + 1
    flat: dict[str, Any] = model_state(model)
    if optimizer is not None:
        flat.update(optimizer_state(model, optimizer))
    flat = {k: v if isinstance(v, torch.Tensor) else _pickled(v) for k, v in flat.items()}
    torch_xla.sync(wait=True)  # re-laid views and annotated states become sharded device data
    info = {"format": FORMAT, "step": step, "tensors": sum(isinstance(v, torch.Tensor) for v in flat.values()),
            "model": type(model).__name__, "optimizer": type(optimizer).__name__ if optimizer is not None else None}
    if not async_save:
        return _write(flat, root, step, info, keep)
    snapshot = _to_host(flat)
    return SaveHandle(_writer.submit(_write, snapshot, root, step, info, keep), step)


def _write(flat: dict, root: CheckpointRoot, step: int, info: dict, keep: Optional[int]) -> str:
    """Write ``flat`` into a hidden directory shared by every process and commit it once as step
    ``step``, recording every file's size and SHA-256 in the marker; on any failure remove the hidden
    directory (older checkpoints stay as they were) and raise ``CheckpointError`` (saying so when the
    disk is full)."""
    start = time.perf_counter()
    group = processes.checkpoint_group()
    tmp = _on_reporter(lambda: root.begin(step), group)
    writer = RecordingWriter(tmp)
    try:
        dcp.save(flat, storage_writer=writer, planner=_SavePlanner(), process_group=group,
                 no_dist=not dist.is_initialized())
        files = {name: record for records in processes.gathered(writer.records(), group)
                 for name, record in records.items()}
        final = _on_reporter(lambda: root.commit(tmp, step, {**info, "files": files}, keep), group)
    except BaseException as error:
        root.abort(tmp)
        if isinstance(error, (Exception, CheckpointException)):
            raise _save_failed(root, step, error, writer) from error
        raise
    log.info("xla_tp: saved step %d to %s in %.1f s", step, final, time.perf_counter() - start)
    return final


def _on_reporter(act: Callable[[], str], group: Any) -> str:
    """``act()`` run by process 0 alone, its result (or its ``OSError``, raised) on every process: the
    others wait for it, so no process goes on before the shared directory exists, or is committed."""
    outcome: Union[str, OSError, None] = None
    if processes.is_reporter():
        try:
            outcome = act()
        except OSError as error:
            outcome = error
    outcome = processes.from_reporter(outcome, group)
    if isinstance(outcome, OSError):
        raise outcome
    return outcome


def _save_failed(root: CheckpointRoot, step: int, error: BaseException, writer: RecordingWriter) -> CheckpointError:
    kept = f"nothing of step {step} was kept and the checkpoints already in {root.path!r} are intact"
    full = disk_full(error, writer)
    if full is not None:
        return CheckpointError(f"disk full (ENOSPC) while writing {full} of step {step} to {root.path!r}: {kept}. "
                               f"Free space there (or save to another disk, or keep fewer checkpoints) and save again")
    return CheckpointError(f"saving step {step} to {root.path!r} failed ({reason(error)}): {kept}")


class _SavePlanner(SPMDSavePlanner):
    """torch_xla's planner, writing each distinct shard once.

    It emits one write item per local shard, replicas included. Its de-duplication compares
    ``MetadataIndex`` values, which ignore the shard number, so within one process the replicas of a
    shard all count as duplicates and every copy is dropped: a tensor sharded over some mesh axes and
    replicated over others (a bias or norm on an fsdp x tp mesh) silently vanishes from the
    checkpoint. Keeping the first item per ``(name, offset)`` avoids that.
    """

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        seen, items = set(), []
        for item in plan.items:
            key = (item.index.fqn, tuple(item.index.offset) if item.index.offset is not None else None)
            if key not in seen:
                seen.add(key)
                items.append(item)
        return dataclasses.replace(plan, items=items)


def _pickled(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _to_host(flat: dict) -> dict:
    """A host copy of ``flat``: sharded XLA tensors as per-device shards, others whole."""
    wrapped = {k: xs.wrap_if_sharded(v) if isinstance(v, torch.Tensor) and v.device.type == "xla" else v
               for k, v in flat.items()}
    sharded = [k for k, v in wrapped.items() if _is_sharded_tensor(v)]
    out = dict(zip(sharded, _cpu_shards_from_tensors([wrapped[k].global_tensor for k in sharded])))
    for k, v in flat.items():
        if k not in out:
            out[k] = v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
    return out

