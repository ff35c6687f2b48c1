"""Safetensors files (one, or a Hugging Face checkpoint directory) read lazily, one tensor at a time.

A ``torch.distributed.checkpoint`` storage reader, so ``load_checkpoint`` loads a Hugging Face
checkpoint exactly as it loads its own: checked first, then each device's shards written straight
into the sharded model. Files are read with plain reads, never memory-mapped, and only the tensor
being loaded is held on the host: peak host memory stays near the largest single tensor, however
big the model. A model built on ``meta`` and parallelized is initialised on the device, then
overwritten shard by shard. Example::

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    xla_tp.parallelize_xla(model, "auto", mesh=mesh)
    xla_tp.load_checkpoint("Llama-3-8B/", model)      # model.safetensors(.index.json) or *.safetensors
"""
from __future__ import annotations

import json
import os
import struct
from typing import Optional

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def safetensors_files(path: str) -> Optional[list[str]]:
    """The safetensors files ``path`` names (a file, or a directory of them), or None."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return [path]
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, ".metadata")):
        return None
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    return files or None


def read_header(path: str) -> tuple[int, dict]:
    """``(offset of the data, {name: {"dtype", "shape", "data_offsets"}})`` of one safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


class SafetensorsReader(StorageReader):
    """Reads tensors from safetensors ``files`` for ``dcp.load``, one whole tensor at a time."""

    def __init__(self, files: list[str]):
        super().__init__()
        self.files = files
        self.where: dict[str, tuple[str, int, dict]] = {}
        self._cached: tuple[Optional[str], Optional[torch.Tensor]] = (None, None)

    def reset(self, checkpoint_id=None) -> None:
        self._cached = (None, None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return safetensors_files(os.fspath(checkpoint_id)) is not None

    def read_metadata(self) -> Metadata:
        meta = {}
        for path in self.files:
            start, header = read_header(path)
            for name, info in header.items():
                self.where[name] = (path, start, info)
                size = torch.Size(info["shape"])
                meta[name] = TensorStorageMetadata(TensorProperties(dtype=DTYPES[info["dtype"]]), size,
                                                   [ChunkStorageMetadata(torch.Size([0] * len(size)), size)])
        return Metadata(state_dict_metadata=meta)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        if not self.where:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        for req in plan.items:
            piece = self._tensor(req.storage_index.fqn)
            for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                piece = piece.narrow(dim, offset, length)
            target = planner.resolve_tensor(req).detach()
            target.copy_(piece)
            planner.commit_tensor(req, target)
        self._cached = (None, None)
        done: Future = Future()
        done.set_result(None)
        return done

    def _tensor(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` on the host (the previous one is released first)."""
        if self._cached[0] != name:
            self._cached = (None, None)
            path, start, info = self.where[name]
            begin, end = info["data_offsets"]
            buf = bytearray(end - begin)
            with open(path, "rb", buffering=0) as f:
                f.seek(start + begin)
                view, done = memoryview(buf), 0
                while done < len(buf):
                    done += f.readinto(view[done:])
            dtype = DTYPES[info["dtype"]]
            flat = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
            self._cached = (name, flat.reshape(info["shape"]))
        return self._cached[1]
