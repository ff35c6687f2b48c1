"""Safetensors files (one, or a Hugging Face checkpoint directory) read lazily, block by block.

``load_checkpoint`` checks a Hugging Face checkpoint exactly as it checks its own (names and
shapes from the headers, before anything is touched), then writes each tensor into the sharded
model: the blocks the devices hold are read straight from the file (``SafetensorsSource.read``)
and handed to the devices (``backends.host.write_from_host``). Files are read with plain reads, never
memory-mapped, and only the tensor being loaded is on the host: peak host memory stays near the
largest single tensor, however big the model. A model built on ``meta`` and parallelized is
initialised (``backends.init``), then overwritten tensor by tensor. Example::

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    xla_tp.parallelize_xla(model, "auto", mesh=mesh)
    xla_tp.load_checkpoint("Llama-3-8B/", model)      # model.safetensors(.index.json) or *.safetensors
"""
from __future__ import annotations

import json
import math
import os
import struct
from typing import Optional, Sequence

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                   TensorProperties, TensorStorageMetadata)

from ..errors import CheckpointError
from ..backends.host import Block

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
CHUNK_BYTES = 16 << 20  # rows read at once to cut out blocks split along later dimensions


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


class SafetensorsSource:
    """Tensors of safetensors ``files``, read block by block: ``read(name, blocks)`` reads only the
    rows the blocks cover, each byte once, with plain reads (never memory-mapped)."""

    def __init__(self, files: list[str]):
        self.files = files
        self.where: dict[str, tuple[str, int, dict]] = {}
        for path in files:
            start, header = read_header(path)
            for name, info in header.items():
                self.where[name] = (path, start, info)

    def read_metadata(self) -> Metadata:
        """Names, shapes and dtypes, as ``torch.distributed.checkpoint`` metadata."""
        meta = {}
        for name, (_, _, info) in self.where.items():
            size = torch.Size(info["shape"])
            meta[name] = TensorStorageMetadata(TensorProperties(dtype=DTYPES[info["dtype"]]), size,
                                               [ChunkStorageMetadata(torch.Size([0] * len(size)), size)])
        return Metadata(state_dict_metadata=meta)

    def read(self, name: str, blocks: Sequence[Block]) -> list[torch.Tensor]:
        """One host tensor per block of tensor ``name``. A block spanning whole rows (split along the
        first dimension only) is read straight into its buffer; the others are cut from the rows they
        cover, read in pieces of at most ``CHUNK_BYTES``."""
        path, start, info = self.where[name]
        dtype, shape = DTYPES[info["dtype"]], tuple(info["shape"])
        offset = start + info["data_offsets"][0]
        out: list[torch.Tensor] = []
        with open(path, "rb", buffering=0) as f:
            if not shape:
                return [_read_rows(f, offset, dtype, shape, 0, 1)] * len(blocks)
            for b in blocks:
                if all(b[d] == slice(0, shape[d]) for d in range(1, len(shape))):
                    out.append(_read_rows(f, offset, dtype, shape, b[0].start, b[0].stop))
                else:
                    out.append(torch.empty([s.stop - s.start for s in b], dtype=dtype))
            cut = [(b, o) for b, o in zip(blocks, out) if o.shape[1:] != shape[1:]]
            if cut:
                row_bytes = math.prod(shape[1:]) * dtype.itemsize
                step = max(1, CHUNK_BYTES // max(1, row_bytes))
                lo, hi = min(b[0].start for b, _ in cut), max(b[0].stop for b, _ in cut)
                for r in range(lo, hi, step):
                    rows = _read_rows(f, offset, dtype, shape, r, min(r + step, hi))
                    for b, o in cut:
                        a, z = max(r, b[0].start), min(r + rows.shape[0], b[0].stop)
                        if a < z:
                            o[a - b[0].start:z - b[0].start] = rows[(slice(a - r, z - r), *b[1:])]
                    del rows
        return out


def _read_rows(f, offset: int, dtype: torch.dtype, shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
    """Rows ``lo:hi`` (along the first dimension) of the row-major tensor stored at ``offset``."""
    row = math.prod(shape[1:]) * dtype.itemsize
    buf = torch.empty((hi - lo) * row, dtype=torch.uint8)
    view, done = memoryview(buf.numpy()), 0
    f.seek(offset + lo * row)
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise CheckpointError(f"{f.name!r} ends before the tensor at byte {offset} does: the file is truncated")
        done += n
    return buf.view(dtype).reshape((hi - lo, *shape[1:]) if shape else ())
