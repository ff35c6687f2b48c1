"""The processes of a run: one per TPU VM host, and the one place that says which one this is.

On a multi-host slice every host runs the same program. Checkpoints, per-host data and reporting
ask this module (and nothing else) for this process's ``index()`` and the ``count()``: the gloo
process group's rank and size once one exists, else torch_xla's ``process_index()`` /
``process_count()`` (0 and 1 on one host, and without torch_xla). ``init_group()`` creates that
group the way torch_xla documents it for SPMD checkpointing (``gloo`` over ``init_method="xla://"``,
the TPU runtime's own rendezvous) and does nothing on one host; tests pass
``init_method="tcp://127.0.0.1:PORT"`` to stand N local processes in for N hosts. Example::

    from xla_tp import processes
    processes.init_group()                 # every host, before the first checkpoint
    if processes.is_reporter():            # process 0 prints and writes metrics
        print("step 10")
    processes.barrier()                    # wait for every host
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from .adapters import has_torch_xla

TIMEOUT = timedelta(minutes=30)     # a collective that waits longer than this fails instead of hanging
_checkpoints: Optional[Any] = None   # the group checkpoints talk in, apart from the run's own collectives


def index() -> int:
    """This process's index among the run's processes (0 on one host)."""
    if dist.is_initialized():
        return dist.get_rank()
    return _runtime().process_index() if _runtime() is not None else 0


def count() -> int:
    """How many processes the run has (1 on one host)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return _runtime().process_count() if _runtime() is not None else 1


def is_reporter() -> bool:
    """True for the one process that prints, draws progress and writes metrics: process 0."""
    return index() == 0


def init_group(init_method: Optional[str] = None, *, timeout: timedelta = TIMEOUT) -> bool:
    """Join every process into one gloo process group (what ``torch.distributed.checkpoint`` needs to
    coordinate a save across hosts); True if a group exists afterwards. Without ``init_method``: torch_xla's
    rendezvous (``xla://``) when the runtime has several processes, nothing on one host. Calling it again
    is harmless. Example::

        processes.init_group()                                  # a TPU pod: gloo over xla://
        processes.init_group("tcp://127.0.0.1:29500")           # with RANK and WORLD_SIZE set: local stand-ins
    """
    global _checkpoints
    if dist.is_initialized():
        return True
    if init_method is None:
        if _runtime() is None or _runtime().process_count() == 1:
            return False
        import torch_xla.distributed.xla_backend  # noqa: F401  registers the xla:// rendezvous
        init_method = "xla://"
    dist.init_process_group("gloo", init_method=init_method, timeout=timeout)
    _checkpoints = dist.new_group(backend="gloo", timeout=timeout)
    return True


def checkpoint_group() -> Optional[Any]:
    """The process group checkpoints use: a second gloo group made by ``init_group`` (an asynchronous save
    talks in its thread while the loop's own collectives go on), else None (the default group)."""
    return _checkpoints if dist.is_initialized() else None


def local_devices(devices: int) -> list[int]:
    """Ids of the XLA devices (of ``devices`` in the mesh) this process drives, in the runtime's order: its
    TPU VM's chips on a pod (the runtime names them ``TPU:<global ordinal>``, the ids a mesh holds, in the order
    ``_global_tensor_from_cpu_shards`` takes their blocks). Where the runtime holds every device (one host, or local processes standing in
    for hosts, each emulating the whole slice), the ``index()``-th of ``count()`` equal blocks."""
    import torch_xla
    names = torch_xla._XLAC._xla_get_runtime_devices()
    if len(names) < devices:
        return [int(name.rsplit(":", 1)[1]) for name in names]
    per = devices // count()
    return list(range(index() * per, (index() + 1) * per))


def barrier() -> None:
    """Wait until every process gets here (nothing to wait for on one process)."""
    if dist.is_initialized():
        dist.barrier()


def from_reporter(value: Any, group: Optional[Any] = None) -> Any:
    """Process 0's ``value``, on every process of ``group`` (``value`` itself on one process)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def gathered(value: Any, group: Optional[Any] = None) -> list:
    """Every process's ``value``, in process order (``[value]`` on one process)."""
    if not dist.is_initialized():
        return [value]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _runtime() -> Any:
    """``torch_xla.runtime``, or None where torch_xla does not import."""
    if not has_torch_xla():
        return None
    import torch_xla.runtime as xr
    return xr
