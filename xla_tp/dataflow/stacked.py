"""Stacked experts computed for every token, found in a traced forward: no router's choice selects them.

Llama 4's ``Llama4TextExperts`` holds its experts as ``gate_up [E, H, 2I]`` and ``down [E, I, H]`` and
runs every one of them on every token: the tokens are repeated ``E`` times (each copy scaled by its
expert's router score), viewed as ``[E, T, H]``, contracted batched over ``E`` with the first weight
(``bmm``), gated, contracted with the second, and the ``E`` outputs are summed. In the traced program that
is two contractions, in one module, of a 3-D parameter whose dimension 0 is a batch dimension shared with
the leading dimension of the other operand (the expert dimension), and a ``sum`` over a leading
dimension of ``E`` after the second one (through views only). Each such layer is a ``StackedLayer``;
``repeats`` names the module whose forward repeats the tokens (``x.repeat(E, 1)``; None: none does).
Weights selected by a router's top-k (``w[ids]``) are ``routing``'s. Example:

>>> from transformers import Llama4ForCausalLM, Llama4TextConfig
>>> from xla_tp.dataflow.trace import trace
>>> cfg = Llama4TextConfig(hidden_size=16, intermediate_size=8, intermediate_size_mlp=16, num_hidden_layers=1,
...                        num_attention_heads=2, num_key_value_heads=2, head_dim=8, vocab_size=32, num_local_experts=4)
>>> (layer,) = find_stacked(trace(Llama4ForCausalLM(cfg)))
>>> layer.module, layer.repeats, layer.sums
('model.layers.0.feed_forward.experts', 'model.layers.0.feed_forward', 'model.layers.0.feed_forward')
>>> [(w.param.name.rpartition(".")[2], w.contracted, w.kept) for w in layer.weights]
[('gate_up_proj', 1, 2), ('down_proj', 1, 2)]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .contract import Contraction, contraction
from .graph import Graph, Value
from .ops import POINTWISE, VIEWS
from .routing import ExpertWeight

_BATCHED = ("bmm", "matmul", "einsum")
_DEPTH = 8  # ops walked between the tokens' repeat and the contraction, or the contraction and the sum


@dataclass
class StackedLayer:
    """One layer of stacked experts: the module contracting the weights, its two weights in call order
    (``[E, ...]``: ``expert_dim`` 0), the module repeating the tokens (None: none found) and the one summing
    their outputs over the experts."""

    module: str
    weights: list[ExpertWeight]
    repeats: Optional[str] = None
    sums: str = ""  # the module whose forward sums the experts' outputs

    @property
    def experts(self) -> int:
        return self.weights[0].param.shape[0]


def find_stacked(graph: Graph) -> list[StackedLayer]:
    """See the module docstring."""
    by_module: dict[str, list[tuple[ExpertWeight, Value, Value]]] = {}
    for node in graph.nodes:
        spec = contraction(node) if node.op in _BATCHED else None
        use = _batched_use(spec) if spec is not None and node.outputs else None
        if use is not None:
            by_module.setdefault(node.module, []).append((*use, node.outputs[0]))
    layers = []
    for module, uses in by_module.items():
        if len(uses) != 2 or uses[0][0].param.shape[0] != uses[1][0].param.shape[0]:
            continue
        (up, tokens, _), (down, _, out) = uses
        sums = _summed(out, up.param.shape[0])
        if sums is not None:
            layers.append(StackedLayer(module, [up, down], _repeater(tokens), sums))
    return layers


def _batched_use(spec: Contraction) -> Optional[tuple[ExpertWeight, Value]]:
    """A 3-D parameter contracted batched over its dimension 0 with a computed tensor whose leading
    dimension that is: how (``ExpertWeight``), and the tensor."""
    if len(spec.operands) != 2:
        return None
    for (w, lw), (x, lx) in (spec.operands, spec.operands[::-1]):
        if w.kind != "param" or len(w.shape) != 3 or not x.dynamic or not lx or lx[0] != lw[0] \
                or lw[0] not in spec.output:
            continue
        contracted = [d for d in (1, 2) if lw[d] not in spec.output]
        kept = [d for d in (1, 2) if lw[d] in spec.output and lw[d] not in lx]
        if len(contracted) == 1 and len(kept) == 1:
            return ExpertWeight(w, 0, contracted[0], kept[0]), x
    return None


def _summed(out: Value, experts: int) -> Optional[str]:
    """The module summing ``out`` (through views) over a leading dimension of ``experts``; None if none does."""
    work = [(out, 0)]
    while work:
        v, depth = work.pop()
        for node, _ in v.consumers:
            if node.op == "sum" and v.shape[:1] == (experts,) and node.arg(1, "dim") in (0, (0,), [0]):
                return node.module
            if node.op in VIEWS and depth < _DEPTH:
                work += [(o, depth + 1) for o in node.outputs]
    return None


def _repeater(tokens: Value) -> Optional[str]:
    """The module whose ``repeat`` made ``tokens`` (through views and element-wise ops keeping its size)."""
    v: Optional[Value] = tokens
    for _ in range(_DEPTH):
        node = v.producer if v is not None else None
        if node is None:
            return None
        if node.op == "repeat":
            return node.module
        if node.op not in VIEWS and node.op not in POINTWISE:
            return None
        size = _numel(v)
        v = next((t for t in node.tensors if t.dynamic and _numel(t) == size), None)
    return None


def _numel(v: Value) -> int:
    n = 1
    for s in v.shape:
        n *= s
    return n
