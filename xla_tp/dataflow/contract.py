"""Contractions as einsum specs: which operand dims are batch, kept, or summed away.

``linear``, ``addmm``, ``mm``, ``bmm``, ``baddbmm``, ``matmul``, ``einsum``,
``scaled_dot_product_attention`` and convolution calls are described the same way: a label per dimension of each
operand, the labels of the output, and extra operands added element-wise (a bias, an attention
mask) with their labels. Example:

>>> from torch import nn
>>> from xla_tp.dataflow.trace import trace
>>> spec = contraction(trace(nn.Linear(64, 128)).nodes[0])          # F.linear(x [2, 8, 64], w [128, 64])
>>> [labels for _, labels in spec.operands], spec.output, spec.extras[0][1]
(['abi', 'oi'], 'abo', 'o')
"""
from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Optional

from .graph import Node, Value

CONTRACTIONS = ("linear", "addmm", "mm", "bmm", "baddbmm", "matmul", "rmatmul", "einsum",
                "scaled_dot_product_attention", "conv1d", "conv2d", "conv3d")


@dataclass
class Contraction:
    """``operands``: (value, labels) contracted together; ``extras``: (value, labels) added element-wise."""

    operands: list[tuple[Value, str]]
    output: str
    extras: list[tuple[Value, str]] = field(default_factory=list)


def _letters(n: int, skip: str = "") -> str:
    pool = [c for c in string.ascii_letters if c not in skip]
    return "".join(pool[:n])


def _right(labels: str, rank: int) -> str:
    """The last ``rank`` labels (an operand broadcast against a longer shape)."""
    return labels[len(labels) - rank:] if rank else ""


def contraction(node: Node) -> Optional[Contraction]:
    """The einsum view of a contraction node, or None if ``node`` is not one (or not understood)."""
    op = node.op
    if op == "linear":
        x, w, b = node.arg(0, "input"), node.arg(1, "weight"), node.arg(2, "bias")
        batch = _letters(len(x.shape) - 1, "io")
        extras = [(b, "o")] if isinstance(b, Value) else []
        return Contraction([(x, batch + "i"), (w, "oi")], batch + "o", extras)
    if op == "addmm":
        bias, a, b = node.arg(0, "input"), node.arg(1, "mat1"), node.arg(2, "mat2")
        return Contraction([(a, "ni"), (b, "io")], "no", [(bias, _right("no", len(bias.shape)))])
    if op == "mm":
        return Contraction([(node.arg(0, "input"), "nk"), (node.arg(1, "mat2"), "km")], "nm")
    if op in ("bmm", "baddbmm"):
        first = 1 if op == "baddbmm" else 0
        spec = Contraction([(node.arg(first, "batch1"), "bnk"), (node.arg(first + 1, "batch2"), "bkm")], "bnm")
        if op == "baddbmm":
            extra = node.arg(0, "input")
            spec.extras.append((extra, _right("bnm", len(extra.shape))))
        return spec
    if op in ("matmul", "rmatmul"):
        a, b = node.arg(0, "input"), node.arg(1, "other")
        if op == "rmatmul":
            a, b = b, a
        return _matmul(a, b) if isinstance(a, Value) and isinstance(b, Value) else None
    if op == "einsum":
        return _einsum(node)
    if op in ("conv1d", "conv2d", "conv3d"):
        return _conv(node)
    if op == "scaled_dot_product_attention":
        q, k, v, mask = (node.arg(i, n) for i, n in enumerate(("query", "key", "value", "attn_mask")))
        batch = _letters(len(q.shape) - 2, "lesf")
        spec = Contraction([(q, batch + "le"), (k, _right(batch, len(k.shape) - 2) + "se"),
                            (v, _right(batch, len(v.shape) - 2) + "sf")], batch + "lf")
        if isinstance(mask, Value):
            spec.extras.append((mask, _right(batch + "ls", len(mask.shape))))
        return spec
    return None


def _conv(node: Node) -> Optional[Contraction]:
    """A batched convolution over its channels: input channels ``c`` contracted with the weight's, output
    channels ``o`` kept; the windows (``xyz`` in, ``ijk`` in the kernel, ``XYZ`` out) are no einsum
    labels, so a split that reaches them stops. Grouped convolutions are not read."""
    x, w, b = node.arg(0, "input"), node.arg(1, "weight"), node.arg(2, "bias")
    if not isinstance(x, Value) or not isinstance(w, Value) or node.arg(6, "groups", 1) != 1:
        return None
    n = len(w.shape) - 2
    if len(x.shape) != n + 2:
        return None
    extras = [(b, "o")] if isinstance(b, Value) else []
    return Contraction([(x, "bc" + "xyz"[:n]), (w, "oc" + "ijk"[:n])], "bo" + "XYZ"[:n], extras)


def _matmul(a: Value, b: Value) -> Contraction:
    ra, rb = len(a.shape), len(b.shape)
    if ra == 1 and rb == 1:
        return Contraction([(a, "k"), (b, "k")], "")
    if ra == 1:
        batch = _letters(rb - 2, "km")
        return Contraction([(a, "k"), (b, batch + "km")], batch + "m")
    if rb == 1:
        batch = _letters(ra - 2, "nk")
        return Contraction([(a, batch + "nk"), (b, "k")], batch + "n")
    batch = _letters(max(ra, rb) - 2, "nkm")
    return Contraction([(a, _right(batch, ra - 2) + "nk"), (b, _right(batch, rb - 2) + "km")], batch + "nm")


def _einsum(node: Node) -> Optional[Contraction]:
    equation = node.arg(0, "equation")
    ops = node.args[1:]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = tuple(ops[0])
    if not isinstance(equation, str) or not all(isinstance(o, Value) for o in ops):
        return None
    equation = equation.replace(" ", "")
    lhs, _, out = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ops):
        return None
    used = set(equation)
    ell_rank = max((len(o.shape) - len(t.replace("...", "")) for o, t in zip(ops, terms) if "..." in t), default=0)
    ell = _letters(ell_rank, "".join(used))
    labels = [t.replace("...", _right(ell, len(o.shape) - len(t.replace("...", "")))) for o, t in zip(ops, terms)]
    if "->" not in equation:  # implicit output: labels seen once, in alphabetical order
        once = sorted(c for c in set("".join(labels)) if "".join(labels).count(c) == 1 and c not in ell)
        out = ell + "".join(once)
    else:
        out = out.replace("...", ell)
    return Contraction(list(zip(ops, labels)), out)
