"""Routed experts, found in a traced forward: weights whose slices a router's top-k indices select.

A mixture-of-experts layer scores each token with a router projection, keeps the ``top-k`` experts,
and multiplies the token by those experts' slices of 3-D weights (``[E, 2I, H]`` and ``[E, H, I]``).
In the traced program that is a ``topk`` whose indices (through any ops) index a parameter of three
or more dimensions (``w[ids]``), and contractions of the selected slices with the tokens. Each such
parameter is an ``ExpertWeight``: which dimension counts experts, which one the tokens are
contracted with, which one the contraction keeps. Those contractions multiply two computed tensors,
which is not attention (``ExpertsFound.nodes``).

Transformers picks an experts implementation per config (``grouped_mm``, ``eager``, ...); the trace
runs the ``batched_mm`` one (``batched_experts``), whose per-token ``w[ids]`` is what is read here.
Example:

>>> from transformers import MixtralConfig, MixtralForCausalLM
>>> from xla_tp.dataflow.trace import trace
>>> moe = MixtralForCausalLM(MixtralConfig(hidden_size=16, intermediate_size=8, num_hidden_layers=1,
...                          num_attention_heads=2, num_key_value_heads=2, vocab_size=32, num_local_experts=4))
>>> layer = find_experts(trace(moe)).layers[0]
>>> layer.router.name, layer.top_k, [(w.param.name.rpartition(".")[2], w.contracted, w.kept) for w in layer.weights]
('model.layers.0.mlp.gate.weight', 2, [('gate_up_proj', 2, 1), ('down_proj', 2, 1)])
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

from torch import nn

from .contract import contraction
from .graph import Graph, Node, Value
from .ops import trace_param

TRACED_IMPLEMENTATION = "batched_mm"


@dataclass
class ExpertWeight:
    """A routed weight: ``expert_dim`` indexed by the router's choice, ``contracted`` with the tokens,
    ``kept`` in the output."""

    param: Value
    expert_dim: int
    contracted: int
    kept: int
    interleaved: bool = False  # its output split by stride 2 (gpt-oss's ``[g0, u0, g1, u1, ...]``)


@dataclass
class RoutedLayer:
    """One MoE layer: the module reading the routed weights, in call order, and its router."""

    module: str
    weights: list[ExpertWeight] = field(default_factory=list)
    router: Optional[Value] = None  # the router projection's weight (its scores feed the top-k)
    top_k: int = 0


@dataclass
class ExpertsFound:
    layers: list[RoutedLayer] = field(default_factory=list)
    nodes: set[int] = field(default_factory=set)  # contractions with routed weight slices (not attention)

    def weight(self, name: str) -> Optional[tuple[RoutedLayer, ExpertWeight]]:
        return next(((layer, w) for layer in self.layers for w in layer.weights if w.param.name == name), None)


def find_experts(graph: Graph) -> ExpertsFound:
    """See the module docstring."""
    found = ExpertsFound()
    by_module: dict[str, RoutedLayer] = {}
    for weight, sel, index in _selections(graph):
        choices = _choices(index)
        use = _contracted(sel, weight, found.nodes) if choices else None
        if use is None:
            continue
        module = sel.producer.module
        if module not in by_module:
            top_k = sum(int(c.arg(1, "k")) if c.op == "topk" else 1 for c in choices)
            by_module[module] = RoutedLayer(module, router=_router(choices[0]), top_k=top_k)
            found.layers.append(by_module[module])
        if all(w.param is not weight for w in by_module[module].weights):
            by_module[module].weights.append(use)
    return found


def _selections(graph: Graph) -> Iterator[tuple[Value, Value, Value]]:
    """``(weight, selected slices, index)`` for each ``weight[index]`` of a parameter of 3+ dims
    indexed on its first dimension by a computed tensor."""
    for node in graph.nodes:
        if node.op not in ("getitem", "index_select") or not node.outputs or not node.tensors:
            continue
        weight = node.tensors[0]
        index = node.arg(1, "index") if node.op == "getitem" else node.arg(2, "index")
        if node.op == "index_select" and node.arg(1, "dim") != 0:
            continue
        if weight.kind == "param" and len(weight.shape) >= 3 and isinstance(index, Value) and index.dynamic:
            yield weight, node.outputs[0], index


# ops whose output (at this position) is the index of a best score: a top-k, or a top-1 (PhiMoE's
# sparsemixer takes two ``max(dim=-1)`` indices, one after masking the first, and concatenates them)
_CHOICE_OUTPUT = {"topk": 1, "max": 1, "argmax": 0}


def _choices(index: Value) -> list[Node]:
    """The choices (``_CHOICE_OUTPUT``) whose indices ``index`` is computed from, through integer values
    only (the nearest on each path; several when their indices are concatenated)."""
    seen, work, found = {index.index}, [index], []
    while work:
        v = work.pop(0)
        node = v.producer
        if node is None:
            continue
        out = _CHOICE_OUTPUT.get(node.op)
        if out is not None and len(node.outputs) > out and node.outputs[out] is v:
            found.append(node)
            continue
        for t in node.tensors:
            if t.index not in seen and not t.dtype.is_floating_point:
                seen.add(t.index)
                work.append(t)
    return found


def _contracted(sel: Value, weight: Value, nodes: set[int]) -> Optional[ExpertWeight]:
    """How the slices ``sel`` (``[*ids, ...weight dims 1..]``) meet the tokens: the first contraction
    that reads them, through views that keep the slice dims."""
    lead = len(sel.shape) - (len(weight.shape) - 1)
    for node, _ in sel.consumers:
        spec = contraction(node) if node.op in ("bmm", "matmul", "einsum", "mm") else None
        if spec is None:
            continue
        labels = next((l for v, l in spec.operands if v is sel), None)
        if labels is None:
            continue
        dims = {d: labels[d] for d in range(lead, len(sel.shape))}
        contracted = [d for d, c in dims.items() if c not in spec.output]
        kept = [d for d, c in dims.items() if c in spec.output]
        if len(contracted) != 1 or len(kept) != 1:
            continue
        nodes.add(node.index)
        return ExpertWeight(weight, 0, contracted[0] - lead + 1, kept[0] - lead + 1, _strided(node.outputs[0]))
    return None


def _strided(out: Value, depth: int = 4) -> bool:
    """Whether ``out``'s features are taken apart by stride-2 slices (``[..., ::2]``, ``[..., 1::2]``)
    within ``depth`` ops that keep its last dimension (a squeeze, a bias added)."""
    for node, _ in out.consumers:
        index = node.arg(1, "index") if node.op == "getitem" else None
        steps = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, slice) and i.step == 2 for i in steps):
            return True
        if depth and any(v.shape[-1:] == out.shape[-1:] and _strided(v, depth - 1) for v in node.outputs):
            return True
    return False


def _router(choice: Node) -> Optional[Value]:
    """The parameter of the projection whose scores the choice reads (through element-wise ops)."""
    v = choice.tensors[0] if choice.tensors else None
    for _ in range(16):
        if v is None or v.producer is None:
            return None
        node = v.producer
        spec = contraction(node)
        if spec is not None:
            params = [trace_param(w) for w, _ in spec.operands if not w.dynamic]
            return next((p[0] for p in params if p is not None), None)
        v = next((t for t in node.tensors if t.dynamic), None)
    return None


@contextlib.contextmanager
def batched_experts(model: nn.Module) -> Iterator[None]:
    """Transformers' experts layers traced through their ``batched_mm`` implementation (its
    ``w[ids]`` shows the routing; ``grouped_mm`` hides it in a kernel that fake tensors cannot run in
    float32; ``eager``'s ``nonzero`` has no static shape under ``jax.jit``: the JAX backend runs it
    too); each config's choice is put back after."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and hasattr(c, "_experts_implementation_internal")}
    saved = {key: c._experts_implementation_internal for key, c in configs.items()}
    try:
        for c in configs.values():
            c._experts_implementation_internal = TRACED_IMPLEMENTATION
        yield
    finally:
        for key, c in configs.items():
            c._experts_implementation_internal = saved[key]
