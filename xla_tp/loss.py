"""Loss parallelism: vocabulary-sharded logits into cross-entropy, never gathered.

With DTensor, torch needs ``loss_parallel()`` to route ``cross_entropy`` to a vocab-parallel
kernel. Under SPMD the ordinary ``F.cross_entropy`` on logits sharded over the vocabulary
(``ColwiseParallel(output_layouts=Shard(-1))`` on the output projection) already compiles to
the vocab-parallel program: the max, the sum of exponentials and the target logit are each
reduced across the model axis with an all-reduce of ``B*S`` elements, and the ``B*S*V`` logits
are not all-gathered (``tests/program/test_compiled.py`` reads the compiled program to prove it).
So ``loss_parallel`` here is a context manager kept for drop-in compatibility. Example::

    with xla_tp.loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
"""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """torch's ``loss_parallel()`` for XLA: plain ``cross_entropy`` is already vocab-parallel."""
    yield
