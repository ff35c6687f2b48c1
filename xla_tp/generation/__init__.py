"""Tensor-parallel generation that compiles once: ``xla_tp.generate``.

``run`` (``run.py``) drives a call; ``buckets`` rounds prompt and cache lengths, ``prompts`` left-pads
a batch, ``cache`` lays the KV cache out like the key/value heads, ``decoders`` (``hf``, ``zoo``) call
each kind of model with its cache, ``captured`` replays the decode step's forward without re-tracing it, ``choose`` picks
tokens on the device and ``stream`` reads them on the host; ``audit`` reads one decode step's program and ``command`` is ``xla-tp generate``. Example::

    ids = xla_tp.generate(model, input_ids, max_new_tokens=64)
"""
from .audit import audit_decode
from .captured import uncaptured
from .choose import Sampling
from .run import Generated, generate, run

__all__ = ["Generated", "Sampling", "audit_decode", "generate", "run", "uncaptured"]
