"""The audit of one decode step: what the program ``generate`` runs per new token communicates.

The prefill runs for real (it fills the cache the step reads); the step is traced lazily and compiled,
not run, and dropped with its cache: one program with the forward ``generate`` replays
(``captured``) and the choice it runs after, so the collectives of both. A tensor-parallel decoder's minimum is two all-reduces of
``[batch, 1, hidden]`` per layer (attention and MLP outputs), one more for a vocabulary-split
embedding, one of ``[batch]`` for the greedy choice over vocabulary-split logits (``choose``), and on a
data axis one all-gather of the chosen ``[batch]`` tokens, which the host reads (``run.Chosen``). Top-k and top-p sort the whole vocabulary, which gathers the logits. Example::

    report = audit_decode(model, input_ids)
    report.collectives          # {'all-reduce': {'count': 6, 'bytes': ..., 'axes': ['model']}}
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from torch import nn

from ..auditing import AuditReport
from ..auditing.capture import capture_partitioned_hlo
from ..auditing.figures import report_from_hlo
from .choose import Sampling
from .decoders import decoder_for
from .run import Decoding, prepare


def audit_decode(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int = 16, *,
                 attention_mask: Optional[torch.Tensor] = None, sampling: Optional[Sampling] = None) -> AuditReport:
    """The partitioned program of one decode step of ``generate(model, input_ids, max_new_tokens)``."""
    decoder = decoder_for(model)
    batch, cache_length, _, _ = prepare(decoder, input_ids, attention_mask, max_new_tokens, None, None)
    with torch.no_grad():
        decoding = Decoding(decoder, batch, cache_length, sampling, captured=False)
        first = decoding.prefill()
        torch_xla.sync()
        # the prefill runs asynchronously, its cache donated next: reading the step's HLO while it runs can
        # crash the process (a segmentation fault, now and then), so wait for it
        xm.wait_device_ops()
        following = decoding.step(first.tokens)
        text = capture_partitioned_hlo([*following, decoding.positions, decoding.slots, *decoding.cache_tensors()])
    mesh: Any = decoder.placement.mesh
    ids = np.asarray(mesh.device_ids).reshape(tuple(mesh.mesh_shape))
    report, _ = report_from_hlo(text, ids, tuple(str(n) for n in mesh.axis_names), False, None)
    report.notes.append(f"one decode step: batch {batch.ids.shape[0]}, cache {cache_length} tokens, "
                        f"{'sampled' if sampling else 'greedy'}")
    return report
