"""``load_checkpoint``: a sharded checkpoint into a model on any mesh, all or nothing.

The checkpoint is verified whole first (every file present, with the size and SHA-256 recorded
when it was saved: ``integrity.verify``), then its names and shapes are compared with the model's
``state_dict`` (and the optimizer's parameters): a damaged checkpoint, or one of another model or
shape, is refused naming the file or every mismatching name and shape. Everything is read into
fresh tensors and swapped in only once all of it was read, so a failure at any point leaves the
model and optimizer exactly as they were (the swap costs one more copy of the parameters on the
devices while it runs). Each device reads only the pieces of its own shards (torch_xla's
``SPMDLoadPlanner``, without its read-back of the values being replaced:
``planner.ShardLoadPlanner``), whatever mesh and plan wrote them: a checkpoint saved on
``fsdp=2, model=4`` loads on ``model=8`` or ``data=4, model=2``. Parameters (re-laid ones included)
and optimizer states go through the model's ``load_state_dict`` and keep their shardings.

Safetensors weights (a file or a Hugging Face checkpoint directory) are checked the same way
(names and shapes), then written tensor by tensor into the model's own blocks, each device's block
read straight from the file (``safetensors.SafetensorsSource``): no second copy, so a file that
fails half-way leaves the tensors before it loaded. Example::

    step = xla_tp.load_checkpoint("ckpt", model, opt)      # the newest complete step under ckpt/
"""
from __future__ import annotations

import io
import logging
import os
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch_xla
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

from .. import processes
from ..errors import CheckpointError
from ..backends.host import release_host_memory, write_from_host
from ..guard import restore_sharding
from .layout import GROUPS, MODEL, STATE, param_names, shard_like, swapped
from .safetensors import SafetensorsSource, safetensors_files
from .integrity import UNCHANGED, reason, verify
from .planner import ShardLoadPlanner
from .store import CheckpointRoot, resolve

log = logging.getLogger(__name__)


def load_checkpoint(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[int]:
    """Load the checkpoint at ``path`` (a root: its newest complete step; a step directory; or
    safetensors weights: a file, or a Hugging Face checkpoint directory) into ``model`` (and
    ``optimizer``), on the model's current mesh and plan. Returns the saved step (None for safetensors).
    An xla_tp checkpoint loads all or nothing: it is verified whole first (``integrity.verify``), read
    into fresh tensors, and swapped in only once everything was read; any failure raises
    ``CheckpointError`` naming the file and what is wrong, with the model and optimizer as they were
    (safetensors weights are written in place: see the module docstring). Example::

        model = xla_tp.parallelize_xla(build(), "auto", mesh=xla_tp.make_mesh(model=8))
        xla_tp.load_checkpoint("ckpt", model)
    """
    start = time.perf_counter()
    files = safetensors_files(path)
    if files is not None:
        if optimizer is not None:
            raise CheckpointError(f"{path!r} holds safetensors weights only; load the optimizer from an "
                                  f"xla_tp checkpoint, or call load_checkpoint without it")
        step, directory, prefix, reader = None, os.fspath(path), "", SafetensorsSource(files)
        meta = reader.read_metadata().state_dict_metadata
    else:
        step, directory = resolve(path)
        meta = _verified(path, step, directory).state_dict_metadata
        prefix, reader = MODEL, dcp.FileSystemReader(directory)
    live = _saved_entries(model.state_dict(keep_vars=True), meta, prefix)
    _check_model(directory, meta, live, prefix)
    groups = _read_groups(directory, meta) if optimizer is not None else None
    owners = _check_optimizer(directory, meta, model, optimizer, groups) if optimizer is not None else {}
    params = dict(model.named_parameters(remove_duplicate=False))
    in_place = isinstance(reader, SafetensorsSource)   # weights into the model's own blocks: host memory stays low
    targets = {prefix + key: _target(meta[prefix + key], value, params.get(key, value), in_place)
               for key, value in live.items()}
    for key, (param, _) in owners.items():
        md = meta[key]
        laid_out = isinstance(md, TensorStorageMetadata) and tuple(md.size) == tuple(live[param_names(model)[id(param)]].shape)
        targets[key] = _empty_like_entry(md, param) if laid_out else _placeholder(md)
    torch_xla.sync(wait=True)  # targets become device data, whose shards are then replaced
    _read(directory, reader, targets)
    optimizer_state = _optimizer_state(model, optimizer, groups, owners, targets) if optimizer is not None else None
    swap = {k: targets[prefix + k] for k, v in live.items() if targets[prefix + k] is not v}
    model.load_state_dict(swap, strict=False)   # everything was read: swap in
    for p in params.values():
        restore_sharding(p)
    if optimizer is not None:
        optimizer.load_state_dict(optimizer_state)
    torch_xla.sync()
    log.info("xla_tp: loaded step %s from %s in %.1f s", step, directory, time.perf_counter() - start)
    return step


def _verified(path: str, step: Optional[int], directory: str) -> Metadata:
    """``verify(directory)``; when ``path`` is a root whose newest checkpoint is damaged, the error
    also names the older ones."""
    try:
        return verify(directory)
    except CheckpointError as error:
        older = [s for s in CheckpointRoot(path).steps() if s != step] if directory != os.fspath(path) else []
        if not older:
            raise
        raise CheckpointError(f"{error}. Older checkpoints in {os.fspath(path)!r}: steps "
                              f"{', '.join(map(str, older))}; load one by its directory, e.g. "
                              f"{CheckpointRoot(path).step_dir(older[-1])!r}") from error


def _target(md: Any, value: Any, like: torch.Tensor, in_place: bool) -> Any:
    """What a state_dict entry is read into: a new tensor sharded like ``like`` (the entry itself when
    ``in_place`` and the layouts agree); non-tensors as they are."""
    if not isinstance(value, torch.Tensor) or not isinstance(md, TensorStorageMetadata):
        return value
    return value if in_place and value is like else _empty_like_entry(md, like)


def _read(directory: str, reader: Any, state: dict[str, Any], planner: Any = None) -> None:
    """Read ``state``'s entries from the checkpoint; ``CheckpointError`` if anything fails."""
    try:
        if isinstance(reader, SafetensorsSource):
            _write_each(reader, state)
        else:
            dcp.load(state, storage_reader=reader, planner=planner or ShardLoadPlanner(),
                     process_group=processes.checkpoint_group(), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as error:
        raise CheckpointError(f"reading checkpoint {directory!r} failed ({reason(error)}); {UNCHANGED}") from error


def _write_each(source: SafetensorsSource, targets: dict[str, torch.Tensor]) -> None:
    """Write every tensor of ``source`` into its target, one at a time, reporting progress."""
    last = time.perf_counter()
    for n, (name, target) in enumerate(targets.items(), 1):
        write_from_host(target, lambda blocks, name=name: source.read(name, blocks))
        release_host_memory()
        if time.perf_counter() - last > 10:
            last = time.perf_counter()
            log.info("xla_tp: loaded %d of %d tensors", n, len(targets))


def _saved_entries(state: dict, meta: dict, prefix: str) -> dict:
    """The ``state_dict`` entries a checkpoint must hold: a tied tensor whose other name is saved may
    be left out (Hugging Face checkpoints write ``lm_head.weight`` only once, as the embedding)."""
    saved_ids = {id(v) for k, v in state.items() if prefix + k in meta}
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        if prefix + key in meta or (id(value) not in saved_ids and id(value) not in seen):
            out[key] = value
        seen.add(id(value))
    return out


def _check_model(directory: str, meta: dict, live: dict, prefix: str) -> None:
    saved = {k[len(prefix):]: tuple(m.size) for k, m in meta.items()
             if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    want = {k: tuple(v.shape) for k, v in live.items()}
    missing = sorted(set(want) - set(saved))
    unexpected = sorted(set(saved) - set(want))
    shapes = [f"{k}: checkpoint {saved[k]} vs model {want[k]}" for k in sorted(set(saved) & set(want))
              if saved[k] != want[k]]
    problems = [f"{title} ({len(items)}): {', '.join(items[:8])}{', ...' if len(items) > 8 else ''}"
                for title, items in (("missing from the checkpoint", missing), ("not in the model", unexpected),
                                     ("shapes differ", shapes)) if items]
    if problems:
        raise CheckpointError(f"checkpoint {directory!r} does not fit this model; nothing was loaded. "
                              + "; ".join(problems)
                              + ". Load it into the model (and configuration) that saved it")


def _read_groups(directory: str, meta: dict) -> list[dict]:
    if GROUPS not in meta:
        raise CheckpointError(f"checkpoint {directory!r} holds no optimizer state; nothing was loaded. "
                              f"Call load_checkpoint without the optimizer, or load a checkpoint saved with one")
    holder: dict[str, Any] = {GROUPS: None}
    _read(directory, dcp.FileSystemReader(directory), holder, SPMDLoadPlanner())
    return _unpickled(holder[GROUPS])


def _check_optimizer(directory: str, meta: dict, model: nn.Module, optimizer: torch.optim.Optimizer,
                     groups: list[dict]) -> dict[str, tuple[torch.Tensor, str]]:
    """Checkpoint key -> (parameter, state key) for every saved optimizer state."""
    names = param_names(model)
    current = [[names.get(id(p), "<not a model parameter>") for p in g["params"]] for g in optimizer.param_groups]
    saved = [g["params"] for g in groups]
    if current != saved:
        diff = [f"group {i}: checkpoint {len(s)} parameters vs optimizer {len(c)}"
                + (f" (first difference: {next(a for a, b in zip(s, c) if a != b)!r})" if len(s) == len(c) else "")
                for i, (s, c) in enumerate(zip(saved, current)) if s != c]
        if len(saved) != len(current):
            diff.insert(0, f"checkpoint has {len(saved)} parameter groups, the optimizer {len(current)}")
        raise CheckpointError(f"checkpoint {directory!r}: the optimizer's parameters differ from the saved ones; "
                              f"nothing was loaded. {'; '.join(diff)}. Build the optimizer over the same "
                              f"parameters, in the same groups, as the one that saved")
    by_name = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
    owners = {}
    for key in meta:
        if key.startswith(STATE):
            name, _, state_key = key[len(STATE):].rpartition(".")
            owners[key] = (by_name[name], state_key)
    return owners


def _empty_like_entry(md: TensorStorageMetadata, param: torch.Tensor) -> torch.Tensor:
    """A device tensor of the checkpoint entry's shape and dtype, sharded like ``param``."""
    t = torch.empty(tuple(md.size), dtype=md.properties.dtype, device=param.device)
    return shard_like(t, param)


def _placeholder(md: Any) -> Any:
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(tuple(md.size), dtype=md.properties.dtype)
    return None


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, groups: list[dict],
                     owners: dict[str, tuple[torch.Tensor, str]], targets: dict[str, Any]) -> dict:
    """The optimizer's ``state_dict`` from the loaded states, each back in its parameter's layout
    (through the model's own ``load_state_dict``, on tensors swapped in for the parameters: the model
    itself is not touched)."""
    names = param_names(model)
    state: dict[int, dict[str, Any]] = {}
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    for state_key in sorted({k for _, k in owners.values()}):
        laid = {key: p for key, (p, k) in owners.items() if k == state_key and _is_laid_out(targets[key], p)}
        fresh = {id(p): torch.empty(p.shape, dtype=targets[key].dtype, device=p.device) for key, p in laid.items()}
        with swapped(model, fresh):
            model.load_state_dict({names[id(p)]: targets[key] for key, p in laid.items()}, strict=False)
        for key, (p, k) in owners.items():
            if k == state_key:
                value = targets[key]
                if key in laid:
                    value = fresh[id(p)]
                    restore_sharding(value, like=p)
                state.setdefault(index[id(p)], {})[k] = _unpickled(value) if isinstance(value, bytes) else value
    saved_groups = [{**g, "params": [index[id(p)] for p in cur["params"]]}
                    for g, cur in zip(groups, optimizer.param_groups)]
    return {"state": state, "param_groups": saved_groups}


def _is_laid_out(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.device == param.device


def _unpickled(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True)
