"""How many programs torch_xla has compiled in this process: every compilation, the graph cache's misses and
the programs compiled outside it (fetching a sharded tensor to the host compiles one each time), and what
torch_xla's persistent compilation cache (``xla_tp.compile_cache``) did: programs loaded instead of compiled,
entries written, entries the backend could not load.

torch_xla's ``UncachedCompile`` counter counts only misses of its graph cache; each compilation is one
``CompileTime`` sample, whatever asked for it, so that is what xla_tp counts and prints. A program the
persistent cache supplies is not compiled (``PersistentCacheHit``, no ``CompileTime`` sample); one it lacks
(``PersistentCacheMiss``) or cannot load (``PersistentCacheDeserializeFailure``) is compiled, then written.
Example::

    before = compiled()
    ids = xla_tp.generate(model, prompt, max_new_tokens=64)
    print(compiled() - before)        # the programs this call compiled
    counts = compile_counts()         # the whole process: counts.programs, counts.seconds, counts.loaded, ...
"""
from __future__ import annotations

from dataclasses import dataclass

import torch_xla.debug.metrics as met


@dataclass(frozen=True)
class Compiles:
    """What torch_xla compiled and what its persistent cache did, in this process so far."""

    programs: int      # compilations (``CompileTime`` samples)
    seconds: float     # their total time
    loaded: int        # programs the persistent cache supplied, not compiled (``PersistentCacheHit``)
    missed: int        # looked up, not in the cache: compiled (``PersistentCacheMiss``)
    unloadable: int    # in the cache, but the backend could not load them: compiled (``...DeserializeFailure``)


def compile_counts() -> Compiles:
    """torch_xla's compile metrics and persistent-cache counters, read now."""
    data = met.metric_data("CompileTime")
    programs, nanoseconds = (int(data[0]), float(data[1])) if data else (0, 0.0)
    return Compiles(programs, nanoseconds / 1e9, _counter("PersistentCacheHit"), _counter("PersistentCacheMiss"),
                    _counter("PersistentCacheDeserializeFailure"))


def compiled() -> int:
    """Programs compiled in this process so far (``CompileTime`` samples)."""
    return compile_counts().programs


def _counter(name: str) -> int:
    return int(met.counter_value(name) or 0)
