"""Prompt and cache lengths rounded up to buckets, so a few compiled programs serve every length.

A prefill is compiled once per (batch, prompt bucket), a decode step once per (batch, cache length).
Buckets are 16, then four per doubling (16, 20, 24, 28, 32, 40, 48, 56, 64, 80, ...): padding adds
less than a quarter to a prompt (powers of two, as JetStream buckets, can nearly double it), and a
doubling of the prompt length costs at most four programs. Example:

>>> [bucket(n) for n in (1, 16, 17, 33, 65, 100)]
[16, 16, 20, 40, 80, 112]
>>> lengths(prompt=7, new_tokens=16, limit=2048), lengths(prompt=7, new_tokens=16, limit=2048, cache=64)
((16, 32), (16, 64))
"""
from __future__ import annotations

from typing import Optional

SMALLEST = 16
PER_DOUBLING = 4


def bucket(length: int) -> int:
    """The smallest bucket that holds ``length`` tokens."""
    if length <= SMALLEST:
        return SMALLEST
    below = 1 << ((length - 1).bit_length() - 1)  # the largest power of two under length
    step = below // PER_DOUBLING
    return -(-length // step) * step


def lengths(prompt: int, new_tokens: int, limit: Optional[int], cache: Optional[int] = None) -> tuple[int, int]:
    """``(prompt bucket, cache length)`` for a prompt of ``prompt`` tokens and ``new_tokens`` more, within
    the model's ``limit`` positions (None: no limit) and the given ``cache`` length (None: a bucket). The
    cache holds the padded prompt and every token fed back; both are buckets unless the limit or the
    given length cuts them (the caller checks ``prompt + new_tokens`` against both)."""
    room = min(n for n in (limit, cache, 1 << 62) if n is not None)
    padded = max(prompt, min(bucket(prompt), room - new_tokens))
    return padded, cache if cache is not None else min(bucket(padded + new_tokens), room)
