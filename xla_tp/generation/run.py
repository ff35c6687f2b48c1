"""``generate``: tensor-parallel decoding that compiles one prefill per prompt bucket and one decode step.

A call validates everything first (the model, the prompts, the settings: ``GenerationError``, nothing
allocated), then pads the prompts on the left to a bucket (``buckets``, ``prompts``) and runs three
programs: the prefill, which allocates the KV cache laid out like the key/value heads (``cache``),
fills it and picks the first token; then, once per new token, the decode step's forward, which feeds
the last token and writes its keys and values in place (the cache's buffers are donated to it),
captured by dynamo on the first step and replayed after (``captured``), and the choice of the next
token (``choose``: greedy or sampled, on the device). Positions, cache slots and the cache's write
position are device tensors carried from step to step, never constants in a program, so the same
decode programs serve every step, every prompt and every ``max_new_tokens`` whose cache length falls
in the same bucket (or, with ``cache_length=``, every call of a batch size). The host reads each
step's tokens while the next one runs (``stream``).
Example::

    ids = xla_tp.generate(model, input_ids, max_new_tokens=64)          # [B, prompt + new]
    result = run(model, input_ids, max_new_tokens=64)                   # with what it cost
    result.compiles, result.tokens_per_second, result.kv_bytes_per_device
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
import torch_xla
from torch import nn

from ..compiles import compiled
from ..errors import GenerationError
from .buckets import lengths
from .cache import cache_bytes
from .captured import captured_logits, step_logits
from .choose import Sampling, choose
from .decoders import Decoder, decoder_for
from .prompts import Batch, left_padded, token_counts
from .stream import Tokens


@dataclass(frozen=True)
class Generated:
    """One ``run``: the sequences (prompt and new tokens, on the prompt's device) and what it cost."""

    sequences: torch.Tensor
    new_tokens: int  # steps run (rows finished earlier are padded)
    prompt_bucket: int  # the prompt's padded length
    cache_length: int
    batch: int  # rows compiled (the caller's, padded to a multiple of the mesh's batch ways)
    compiles: int  # programs compiled during the call (every one: ``xla_tp.compiles``)
    first_token_seconds: float
    seconds: float
    kv_bytes_per_device: int
    kv_bytes: int

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second after the first (decode steps only), all rows together."""
        after = self.seconds - self.first_token_seconds
        return (self.new_tokens - 1) * self.sequences.shape[0] / after if after > 0 else 0.0


class Chosen(NamedTuple):
    """One step's next tokens ``[B]``: as the next step takes them (split like the batch), and as the host
    reads them (whole on every device, gathered inside the step: fetching a split tensor would compile a
    program at every step)."""

    tokens: torch.Tensor
    readable: torch.Tensor


class Decoding:
    """One generation's device state: the cache, the valid slots, the next tokens' positions and slots.
    ``captured=False`` traces the decode step's forward lazily at every step (the audit reads its program)."""

    def __init__(self, decoder: Decoder, batch: Batch, cache_length: int, sampling: Optional[Sampling],
                 captured: bool = True) -> None:
        device = torch_xla.device()
        self.decoder, self.sampling = decoder, sampling
        self.step_logits = functools.partial(captured_logits if captured else step_logits, decoder)
        self.cache = decoder.new_cache(batch.ids.shape[0], cache_length)
        self.prompt, self.valid = batch.ids.to(device), batch.valid.to(device)
        self.positions = batch.positions.to(device)
        self.slots = torch.arange(batch.ids.shape[1]).to(device)

    def prefill(self) -> Chosen:
        """The first new tokens (pending: the program runs at the next ``torch_xla.sync()``)."""
        return self._feed(self.prompt, self.decoder.logits)

    def step(self, tokens: torch.Tensor) -> Chosen:
        """Feed ``tokens`` ``[B]`` (a ``Chosen.tokens``); the next ones (pending)."""
        return self._feed(tokens, self.step_logits)

    def _feed(self, ids: torch.Tensor, logits_of: Callable[..., torch.Tensor]) -> Chosen:
        logits = logits_of(ids, self.positions, self.slots, self.valid, self.cache)
        # advanced with the choice, so every decode step takes the same shapes
        self.positions, self.slots = self.positions[:, -1:] + 1, self.slots[-1:] + 1
        tokens = choose(logits, self.sampling)
        return Chosen(tokens, self.decoder.placement.sharder.annotate(tokens, (None,)))

    def cache_tensors(self) -> list[torch.Tensor]:
        return self.decoder.cache_tensors(self.cache)


def _token_ids(value: Union[int, list[int], None], name: str) -> Optional[list[int]]:
    if value is None:
        return None
    ids = [value] if isinstance(value, int) else list(value)
    if not all(isinstance(i, int) and i >= 0 for i in ids):
        raise GenerationError(f"{name}={value!r}: pass a token id (or a list of them for eos_token_id)")
    return ids


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GenerationError(f"{name}={value!r}: pass at least 1")
    return value


def prepare(decoder: Decoder, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], max_new_tokens: int,
            eos_token_id: Any, pad_token_id: Any, cache_length: Optional[int] = None) -> tuple[Batch, int, list[int], int]:
    """``(batch, cache length, eos ids, pad id)``, after checking every input."""
    _count(max_new_tokens, "max_new_tokens")
    longest = int(token_counts(input_ids, attention_mask).max())
    if decoder.limit is not None and longest + max_new_tokens > decoder.limit:
        raise GenerationError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} is longer than "
                              f"the model's {decoder.limit} positions: shorten the prompt or lower max_new_tokens")
    if cache_length is not None and longest + max_new_tokens > _count(cache_length, "cache_length"):
        raise GenerationError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} does not fit in "
                              f"cache_length={cache_length}: raise it (or pass None for a bucket)")
    if cache_length is not None and decoder.limit is not None and cache_length > decoder.limit:
        raise GenerationError(f"cache_length={cache_length} is longer than the model's {decoder.limit} positions")
    eos = _token_ids(eos_token_id, "eos_token_id")
    eos = decoder.eos if eos is None else eos
    pad = _token_ids(pad_token_id, "pad_token_id")
    # transformers' order: the caller's, the model's, its end-of-sequence id, else 0
    pad_id = next(p for p in (*(pad or ()), decoder.pad, *eos, 0) if p is not None)
    length, cache_length = lengths(longest, max_new_tokens, decoder.limit, cache_length)
    batch = left_padded(input_ids, attention_mask, pad_id, length, cache_length, decoder.placement.batch_multiple)
    return batch, cache_length, eos, pad_id


def run(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int = 64, *,
        attention_mask: Optional[torch.Tensor] = None, do_sample: bool = False, temperature: float = 1.0,
        top_k: Optional[int] = None, top_p: Optional[float] = None, eos_token_id: Union[int, list[int], None] = None,
        pad_token_id: Optional[int] = None, streamer: Optional[Any] = None,
        cache_length: Optional[int] = None) -> Generated:
    """``generate``, returning what the call cost with the sequences (``Generated``)."""
    sampling = Sampling(temperature, top_k, top_p) if do_sample else None
    decoder = decoder_for(model)
    batch, cache_length, eos, pad = prepare(decoder, input_ids, attention_mask, max_new_tokens, eos_token_id,
                                            pad_token_id, cache_length)
    before, start = compiled(), time.perf_counter()
    tokens = Tokens(batch.rows, eos, pad, streamer)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    first = None
    with torch.no_grad():
        decoding = Decoding(decoder, batch, cache_length, sampling)
        pending = decoding.prefill()
        torch_xla.sync()
        for _ in range(max_new_tokens - 1):
            following = decoding.step(pending.tokens)
            torch_xla.sync()  # dispatched: the device runs it while the host reads the tokens before it
            finished = tokens.add(pending.readable)
            first = first or time.perf_counter()
            if finished:
                break
            pending = following
        else:
            tokens.add(pending.readable)
    end = time.perf_counter()
    tokens.end()
    per_device, total = cache_bytes(decoding.cache_tensors())
    new = tokens.new()
    sequences = torch.cat([input_ids.cpu(), new.to(input_ids.dtype)], dim=1).to(input_ids.device)
    return Generated(sequences, new.shape[1], batch.ids.shape[1], cache_length, batch.ids.shape[0],
                     compiled() - before, (first or end) - start, end - start,
                     per_device, total)


def generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int = 64, *,
             attention_mask: Optional[torch.Tensor] = None, do_sample: bool = False, temperature: float = 1.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, eos_token_id: Union[int, list[int], None] = None,
             pad_token_id: Optional[int] = None, streamer: Optional[Any] = None,
             cache_length: Optional[int] = None) -> torch.Tensor:
    """Decode ``max_new_tokens`` after each prompt of ``input_ids`` ``[B, S]`` on a parallelized causal LM
    (a transformers ``AutoModelForCausalLM`` or ``xla_tp.zoo.llama.Llama``): ``[B, S + new]``, the
    prompts followed by the new tokens, on ``input_ids``' device, as transformers' ``generate`` returns
    them (a row that ended with ``eos_token_id`` continues with ``pad_token_id``; the call stops when
    every row has ended). ``attention_mask`` (1 a token, 0 padding) lets rows have different lengths;
    ``do_sample`` with ``temperature``, ``top_k``, ``top_p`` samples; ``streamer`` (transformers'
    ``TextStreamer``) gets the tokens as they come. End-of-sequence and padding ids default to the
    model's generation config. ``cache_length`` fixes the KV cache's length (default: the prompt's
    bucket plus ``max_new_tokens``, rounded to a bucket): with it, one decode program serves every call
    of a batch size. Example::

        ids = xla_tp.generate(model, tokenizer("Hello", return_tensors="pt").input_ids, max_new_tokens=32)
    """
    return run(model, input_ids, max_new_tokens, attention_mask=attention_mask, do_sample=do_sample,
               temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
               pad_token_id=pad_token_id, streamer=streamer, cache_length=cache_length).sequences
