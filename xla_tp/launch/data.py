"""Training batches: byte-level text, pre-tokenized ids, or synthetic ids; deterministic per step.

- ``text``: the file's bytes are the tokens (ids 0-255: a byte-level tokenizer that needs no
  download and no vocabulary file), so the model's vocabulary must be at least 256.
- ``tokens``: a 1-D ``.npy`` array of token ids (any tokenizer, run beforehand).
- ``synthetic``: uniform random ids below the vocabulary size (throughput and fit runs).

``ByteTokenizer`` turns text into those ids and back (``xla-tp generate`` uses it for a text recipe).
Batch ``step`` depends only on the seed and the step, so a resumed run sees the data it would have
seen, and every host of a multi-host slice builds the same global batch (each device then takes
its shard). ``causal-lm`` targets are the next token; ``masked-lm`` hides 15% of the tokens behind
the id ``vocab - 1`` and scores only those. Example::

    batches = Batches(DataSpec("text", "data/tiny_corpus.txt"), vocab=256, batch=8, seq_len=64,
                      seed=0, task="causal-lm")
    inputs, targets = batches.get(step=0)     # two int64 [8, 64] tensors, targets shifted by one
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

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

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, step])
        if self.corpus is None:
            windows = rng.integers(0, self.limit, (self.batch, self.seq_len + 1))
        else:
            starts = rng.integers(0, len(self.corpus) - self.seq_len - 1, self.batch)
            windows = np.stack([np.asarray(self.corpus[s:s + self.seq_len + 1]) for s in starts]).astype(np.int64)
            if windows.max() >= self.limit or windows.min() < 0:
                raise LaunchError(f"data: token id {int(windows.max())} at step {step} is outside the model's "
                                  f"vocabulary ({self.limit} ids)")
        windows = torch.from_numpy(windows.astype(np.int64))
        if self.task == "causal-lm":
            return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        inputs = windows[:, :-1].clone()
        hidden = torch.from_numpy(rng.random(inputs.shape) < MASK_FRACTION)
        hidden[:, 0] |= ~hidden.any(dim=1)   # every row scores at least one token
        targets = torch.where(hidden, inputs, torch.full_like(inputs, IGNORE))
        inputs[hidden] = self.vocab - 1
        return inputs, targets


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
