"""The next token, chosen on the device inside the compiled step: greedy or sampled.

Greedy is ``argmax``, written as one max-reduction: each score's bits, made to sort as the floats do,
packed with its index into one 64-bit key. Over a vocabulary split across the model axis (a
vocab-parallel LM head) XLA's own ``argmax`` all-gathers every device's (value, index) pair; the key
needs one all-reduce. Sampling follows transformers' order (temperature, top-k, top-p) and draws
with the Gumbel-max trick (``argmax(scores + Gumbel noise)`` samples ``softmax(scores)``), so it is
the same max-reduction; the knobs are values, not shapes, except ``top_k``. Example:

>>> scores = torch.tensor([[0.5, -2.0, 3.0, 3.0], [-1.0, -0.5, -7.0, -0.5]])
>>> argmax(scores).tolist(), scores.argmax(-1).tolist()
([2, 1], [2, 1])
>>> choose(torch.tensor([[0.5, 4.0, 3.0]]), Sampling(temperature=0.7, top_k=1)).tolist()
[1]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..bitcast import f32_as_i32
from ..errors import GenerationError

_LOW_BITS = 0xFFFFFFFF


@dataclass(frozen=True)
class Sampling:
    """Sampled decoding: ``temperature`` > 0, keep the ``top_k`` best tokens, keep the smallest set whose
    probability reaches ``top_p`` (transformers' meanings)."""

    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise GenerationError(f"temperature={self.temperature}: pass a positive temperature (1.0: the "
                                  f"model's distribution), or do_sample=False for greedy decoding")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise GenerationError(f"top_k={self.top_k!r}: pass a positive number of tokens, or None")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p={self.top_p!r}: pass a probability in (0, 1], or None")


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """``scores.argmax(-1)`` (the first index of the largest value) as one max-reduction."""
    bits = f32_as_i32(scores.float())
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # as signed ints, ordered as the floats
    size = scores.shape[-1]
    backwards = size - 1 - torch.arange(size, device=scores.device)  # the first index wins a tie
    return size - 1 - (((ordered << 32) | backwards).amax(-1) & _LOW_BITS)


def _keep_top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    kth = scores.topk(min(k, scores.shape[-1]), dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, float("-inf"))


def _keep_top_p(scores: torch.Tensor, p: float) -> torch.Tensor:
    ranked = scores.sort(dim=-1, descending=True).values
    probs = ranked.softmax(-1)
    above = probs.cumsum(-1) - probs  # probability of the tokens ranked before each
    cutoff = ranked.masked_fill(above >= p, float("inf")).amin(-1, keepdim=True)
    return scores.masked_fill(scores < cutoff, float("-inf"))


def choose(logits: torch.Tensor, sampling: Optional[Sampling] = None) -> torch.Tensor:
    """The next token of each row of ``logits`` ``[B, vocab]``: greedy without ``sampling``."""
    scores = logits.float()
    if sampling is None:
        return argmax(scores)
    scores = scores / sampling.temperature
    if sampling.top_k is not None:
        scores = _keep_top_k(scores, sampling.top_k)
    if sampling.top_p is not None and sampling.top_p < 1:
        scores = _keep_top_p(scores, sampling.top_p)
    uniform = torch.rand_like(scores).clamp(min=torch.finfo(torch.float32).tiny)
    return argmax(scores - torch.log(-torch.log(uniform)))
