"""How many programs torch_xla has compiled in this process: every compilation, the graph cache's misses and
the programs compiled outside it (fetching a sharded tensor to the host compiles one each time).

torch_xla's ``UncachedCompile`` counter counts only misses of its graph cache; each compilation is one
``CompileTime`` sample, whatever asked for it, so that is what xla_tp counts and prints. Example::

    before = compiled()
    ids = xla_tp.generate(model, prompt, max_new_tokens=64)
    print(compiled() - before)        # the programs this call compiled
"""
from __future__ import annotations

import torch_xla.debug.metrics as met


def compiled() -> int:
    """Programs compiled in this process so far (``CompileTime`` samples)."""
    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0
