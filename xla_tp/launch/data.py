"""Training batches: byte-level text, pre-tokenized ids, or synthetic ids; deterministic per step.

- ``text``: the file's bytes are the tokens (ids 0-255: a byte-level tokenizer that needs no
  download and no vocabulary file), so the model's vocabulary must be at least 256.
- ``tokens``: a 1-D ``.npy`` array of token ids (any tokenizer, run beforehand).
- ``synthetic``: uniform random ids below the vocabulary size (throughput and fit runs).

``ByteTokenizer`` turns text into those ids and back (``xla-tp generate`` uses it for a text recipe).
Batch ``step`` depends only on the seed and the step, so a resumed run sees the data it would have
seen. On a multi-host slice each host reads only the rows its devices hold (``host_rows``:
``get(step, rows)``), and the global batch is assembled on the devices from every host's rows.
``causal-lm`` targets are the next token; ``masked-lm`` hides 15% of the tokens behind the id
``vocab - 1`` and scores only those. Example::

    batches = Batches(DataSpec("text", "data/tiny_corpus.txt"), vocab=256, batch=8, seq_len=64,
                      seed=0, task="causal-lm")
    inputs, targets = batches.get(step=0)     # two int64 [8, 64] tensors, targets shifted by one
    mine = host_rows(8, {"data": 4, "model": 2}, devices=[4, 5, 6, 7])   # the second of 2 hosts
    inputs, targets = batches.get(step=0, rows=mine.rows)                # rows 4-7 only
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from ..axes import axis_names, batch_axes, batch_ways
from .recipe import DataSpec, resolve_path
from .schema import LaunchError

IGNORE = -100        # target id F.cross_entropy skips
MASK_FRACTION = 0.15


def check_data(spec: DataSpec, vocab: int, seq_len: int, task: str) -> None:
    """The recipe's data, checked without reading it all (a dry run checks it too): the file exists and
    is of its kind, a byte corpus fits the vocabulary, and it is longer than one window. ``LaunchError``
    naming ``data.path`` and what to change otherwise."""
    if spec.kind == "synthetic":
        return
    if spec.kind == "text" and _limit(vocab, task) < 256:
        raise LaunchError(f"data.kind text reads bytes (ids 0-255) but the model's vocabulary is {vocab}"
                          f"{' with the last id as the mask' if task == 'masked-lm' else ''}; set "
                          f"model.overrides.vocab_size >= {256 + (task == 'masked-lm')}")
    path = _path(spec)
    if spec.kind == "text":
        length = path.stat().st_size
    else:
        try:
            tokens = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as error:
            raise LaunchError(f"data.path {spec.path}: not a .npy array of token ids ({error})") from None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise LaunchError(f"data.path {spec.path}: a tokens file is a 1-D integer .npy array, got "
                              f"{tokens.dtype} {tokens.shape}")
        length = len(tokens)
    if length <= seq_len + 1:
        raise LaunchError(f"data.path {spec.path}: {length} tokens, fewer than seq_len + 2 = {seq_len + 2}; "
                          f"use a longer file or a shorter seq_len")


class Batches:
    """``get(step)`` -> ``(inputs, targets)``, both ``[batch, seq_len]`` int64 on the CPU."""

    def __init__(self, spec: DataSpec, vocab: int, batch: int, seq_len: int, seed: int, task: str):
        check_data(spec, vocab, seq_len, task)
        self.kind, self.vocab, self.batch, self.seq_len, self.seed, self.task = (
            spec.kind, vocab, batch, seq_len, seed, task)
        self.limit = _limit(vocab, task)
        self.corpus = None
        if spec.kind == "text":
            self.corpus = np.frombuffer(_path(spec).read_bytes(), dtype=np.uint8)
        elif spec.kind == "tokens":
            self.corpus = np.load(_path(spec), mmap_mode="r")

    def get(self, step: int, rows: Optional[Sequence[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``step``, or only its ``rows`` (a host's share: the same values as those rows of the
        whole batch; only their windows are read)."""
        rng = np.random.default_rng([self.seed, step])
        picked = slice(None) if rows is None else np.asarray(rows, dtype=np.int64)
        if self.corpus is None:
            windows = rng.integers(0, self.limit, (self.batch, self.seq_len + 1))[picked]
        else:
            starts = rng.integers(0, len(self.corpus) - self.seq_len - 1, self.batch)[picked]
            windows = np.stack([np.asarray(self.corpus[s:s + self.seq_len + 1]) for s in starts]).astype(np.int64)
            if windows.max() >= self.limit or windows.min() < 0:
                raise LaunchError(f"data: token id {int(windows.max())} at step {step} is outside the model's "
                                  f"vocabulary ({self.limit} ids)")
        windows = torch.from_numpy(windows.astype(np.int64))
        if self.task == "causal-lm":
            return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        inputs = windows[:, :-1].clone()
        hidden = torch.from_numpy(rng.random((self.batch, self.seq_len))[picked] < MASK_FRACTION)
        hidden[:, 0] |= ~hidden.any(dim=1)   # every row scores at least one token
        targets = torch.where(hidden, inputs, torch.full_like(inputs, IGNORE))
        inputs[hidden] = self.vocab - 1
        return inputs, targets


@dataclass(frozen=True)
class HostRows:
    """The rows of every ``batch``-row global batch one host reads (``rows``, ascending), and, for each of its
    devices in the order given, which of those rows the device holds (``shards``: slices into ``rows``)."""
    batch: int
    rows: list[int]
    shards: list[slice]


def device_rows(batch: int, axes: Mapping[str, int], device_ids: Optional[Sequence[int]] = None) -> list[range]:
    """The rows of a ``batch``-row global batch each device holds, by device id: the batch split over the
    batch axes, whole on the others. ``device_ids``: the mesh's devices in mesh order (``make_mesh``'s,
    the default, lays device ``i`` at position ``i``; torch_xla's ``HybridMesh`` permutes them).

    >>> device_rows(4, {"data": 2, "model": 2})
    [range(0, 2), range(0, 2), range(2, 4), range(2, 4)]
    """
    names = axis_names(axes)
    shape = [axes.get(a, 1) for a in names]
    per = batch // batch_ways(axes)
    n = int(np.prod(shape))
    out = [range(0)] * n
    for position, device in enumerate(range(n) if device_ids is None else device_ids):
        coords = dict(zip(names, np.unravel_index(position, shape)))
        block = 0
        for a in batch_axes(axes):
            block = block * axes[a] + int(coords[a])
        out[device] = range(block * per, (block + 1) * per)
    return out


def host_rows(batch: int, axes: Mapping[str, int], devices: Sequence[int],
              device_ids: Optional[Sequence[int]] = None) -> HostRows:
    """What the host driving ``devices`` (device ids, in the runtime's order) reads of each global batch
    (``device_ids``: as for ``device_rows``).

    >>> host_rows(8, {"data": 4, "model": 2}, devices=[4, 5, 6, 7])
    HostRows(batch=8, rows=[4, 5, 6, 7], shards=[slice(0, 2, None), slice(0, 2, None), slice(2, 4, None), slice(2, 4, None)])
    """
    held = device_rows(batch, axes, device_ids)
    rows = sorted({r for d in devices for r in held[d]})
    at = {r: i for i, r in enumerate(rows)}
    return HostRows(batch, rows, [slice(at[held[d][0]], at[held[d][-1]] + 1) for d in devices])


def _limit(vocab: int, task: str) -> int:
    """Ids a batch may hold: masked-lm reserves the last one as the mask."""
    return vocab - 1 if task == "masked-lm" else vocab


def _path(spec: DataSpec):
    path = resolve_path(spec.path)
    if not path.is_file():
        raise LaunchError(f"data.path {spec.path!r}: no such file (relative paths are read from the current "
                          f"directory, then from the repository root)")
    return path


class ByteTokenizer:
    """The ``text`` data's tokenizer: a string's UTF-8 bytes are its ids, and back (a byte sequence that
    is not UTF-8 decodes with replacement characters). Its ``decode`` takes transformers' keyword
    arguments, so ``TextStreamer`` streams with it. Example:

    >>> ByteTokenizer().encode("hé"), ByteTokenizer().decode([104, 195, 169])
    ([104, 195, 169], 'hé')
    """

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Any, **unused: Any) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
