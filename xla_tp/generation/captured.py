"""The decode step's forward, captured once: ``torch.compile`` with torch_xla's ``openxla`` backend.

Lazy tracing runs the model's Python at every step to rebuild a graph XLA has already compiled; for
a small model that costs more than the device's run of the step (the bench's tiny Llama: about 8 ms
of tracing against 3 ms of running, per token). Captured by dynamo, the first decode step traces
the model once and later steps replay the compiled program: a new token costs the program's run and
a guard check. One capture per model, batch and cache length (``dynamic=False``: shapes are
constants of the program, as they are for the prefill).

The cache's tensors are inputs of the captured program, never constants, donated to it (updated in
place, as the lazy step does) and laid out on the way out as they came in (``Placement.pin``; the
next step and the next generation take the same program). A new generation's cache reuses the
capture: ``hf.PlacedLayer`` drops the static-address marks transformers sets for CUDA graphs, which
make dynamo guard a tensor's identity and capture again for every new cache. The prefill runs once
per bucket and stays lazy; so does the choice of the next token (``choose``: a few ops, one small
program). A step dynamo cannot capture whole (a graph break: pieces would donate the cache to each
other) is traced lazily at every step, as before, and ``uncaptured(model)`` says why.
Example::

    logits = captured_logits(decoder, tokens, positions, slots, valid, cache)   # [B, vocab], computed
"""
from __future__ import annotations

import types
import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch._dynamo.utils import counters


def step_logits(decoder: Any, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                valid: torch.Tensor, cache: Any) -> torch.Tensor:
    """``decoder.logits`` on one new token per row (``tokens`` ``[B]``), the cache laid out as it came:
    the decode step's forward, traced lazily (``captured_logits`` replays it)."""
    logits = decoder.logits(tokens[:, None], positions, slots, valid, cache)
    for t in decoder.cache_tensors(cache):
        decoder.placement.pin(t)
    return logits


_CAPTURES: "weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, ...], Callable[..., torch.Tensor]]]" = (
    weakref.WeakKeyDictionary())


def _captured(model: nn.Module, shape: tuple[int, ...]) -> Callable[..., torch.Tensor]:
    """The capture for ``model``'s cache ``shape``: a function with a code object of its own (dynamo keeps
    one cache per code object, with room for 8 captures; one shared function would stop capturing at the
    ninth model, batch or cache length of a process)."""
    per_model = _CAPTURES.setdefault(model, {})
    if shape not in per_model:
        own = types.FunctionType(step_logits.__code__.replace(), step_logits.__globals__, "step_logits")
        per_model[shape] = torch.compile(own, backend="openxla", dynamic=False, fullgraph=True)
    return per_model[shape]


_UNCAPTURED: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()  # model: why not


def captured_logits(decoder: Any, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    valid: torch.Tensor, cache: Any) -> torch.Tensor:
    """``step_logits`` through the captured program (see the module docstring); traced lazily for a model
    whose step dynamo cannot capture whole (``uncaptured``)."""
    import torch_xla.core.xla_model as xm
    if decoder.model in _UNCAPTURED:
        return step_logits(decoder, tokens, positions, slots, valid, cache)
    graphs, seed = counters["stats"]["unique_graphs"], xm.get_rng_state()
    _donate(decoder.cache_tensors(cache), True)  # each step's cache is the last step's output: donate it again
    try:
        logits = _captured(decoder.model, tuple(tokens.shape) + tuple(valid.shape))(
            decoder, tokens, positions, slots, valid, cache)
    except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as e:  # while tracing
        _UNCAPTURED[decoder.model] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        _donate(decoder.cache_tensors(cache), False)
        return step_logits(decoder, tokens, positions, slots, valid, cache)
    if counters["stats"]["unique_graphs"] != graphs:
        xm.set_rng_state(seed)  # capturing advances torch_xla's RNG once; a replay does not: sampling repeats
    return logits


def _donate(tensors: list[torch.Tensor], donate: bool) -> None:
    import torch_xla
    for t in tensors:
        torch_xla._XLAC._set_buffer_donation(t, donate)


def uncaptured(model: nn.Module) -> Optional[str]:
    """Why ``model``'s decode step is traced lazily at every step (dynamo could not capture it as one
    program: a graph break), or None when it is captured (or not yet tried)."""
    return _UNCAPTURED.get(model)
