"""Which recorded activations the traced program reads: torch_xla's graph of the program's outputs, walked.

A module can run in the forward and its result go nowhere: Llava reads its vision tower's hidden states of the
layer before the last (``vision_feature_layer=-2``), so the last layer runs for nothing; Gemma 3 reads SigLIP's
last hidden state, not its pooling head. torch_xla traces such work and never lowers it (only what the outputs
depend on is in the program), so it communicates nothing and the minimum counts nothing for it. Example::

    unread_roots(ir_text, probes=2)      # the roots before index 2 that no output's graph (the roots after) reaches
    unread(outputs, [linear_out])        # {0} when nothing in ``outputs`` depends on ``linear_out``
"""
from __future__ import annotations

import re
from typing import Sequence

_NODE_RE = re.compile(r"^\s*%(\d+) = .*?\s[\w:.]+\(([^)]*)\)(.*)$", re.M)
_OPERAND_RE = re.compile(r"%(\d+)")
_ROOT_RE = re.compile(r"\bROOT=(\d+)")


def unread_roots(ir_text: str, probes: int) -> set[int]:
    """Indices ``< probes`` of the roots of ``ir_text`` (torch_xla's IR of a list of tensors: the probes, then the
    program's outputs) whose node no output's graph reaches. A node several tensors share is labelled with the
    last one's index: a probe that is an output, or another probe, stays unnamed and counts as read.

    >>> text = ("%0 = f32[2]{0} xla::device_data(), xla_shape=f32[2]{0}\\n"
    ...         "%1 = f32[2]{0} aten::neg(%0), xla_shape=f32[2]{0}, ROOT=0\\n"
    ...         "%2 = f32[2]{0} aten::exp(%0), xla_shape=f32[2]{0}, ROOT=1\\n")
    >>> unread_roots(text, probes=1)
    {0}
    """
    operands: dict[int, list[int]] = {}
    roots: dict[int, int] = {}
    for node, args, attributes in _NODE_RE.findall(ir_text):
        operands[int(node)] = [int(a) for a in _OPERAND_RE.findall(args)]
        root = _ROOT_RE.search(attributes)
        if root:
            roots[int(root.group(1))] = int(node)
    reached = {node for index, node in roots.items() if index >= probes}
    stack = list(reached)
    while stack:
        for operand in operands.get(stack.pop(), ()):
            if operand not in reached:
                reached.add(operand)
                stack.append(operand)
    return {index for index, node in roots.items() if index < probes and node not in reached}


def unread(outputs: Sequence, probes: Sequence) -> set[int]:
    """Indices of ``probes`` (lazy XLA tensors) that nothing the program computing ``outputs`` lowers depends
    on. A probe that is device data (no pending computation) counts as read: its node is made anew per query."""
    import torch_xla  # torch_xla's own IR; the caller traced on it
    pending = [i for i, t in enumerate(probes) if "XLAData: None" in torch_xla._XLAC._get_xla_tensor_debug_info(t)]
    if not pending or not outputs:
        return set()
    text = torch_xla._XLAC._get_xla_tensors_text([*(probes[i] for i in pending), *outputs])
    return {pending[i] for i in unread_roots(text, len(pending))}
