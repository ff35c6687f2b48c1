"""The traced program: every torch function call of one forward, with its tensors as ``Value``s.

A ``Graph`` is what ``trace`` records: ``Node``s in call order (the torch function, its
arguments with tensors replaced by ``Value``s, its tensor outputs, the innermost module that
called it) and ``Value``s (shape, dtype, where they come from, who reads them). Values know
whether they depend on the model's inputs (``dynamic``): a tensor computed only from parameters,
buffers and constants (a rotary table, an ALiBi slope, a causal mask) is not an activation.
Example:

>>> from torch import nn
>>> from xla_tp.dataflow.trace import trace
>>> graph = trace(nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 32)))
>>> graph.nodes
[Node#0(embedding in '0'), Node#1(linear in '1')]
>>> graph.params["1.weight"].consumers, graph.outputs[0].dynamic
([(Node#1(linear in '1'), 1)], True)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch


@dataclass(eq=False)
class Value:
    """One tensor of the traced forward (a new ``Value`` per in-place update)."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # "param" | "buffer" | "input" | "const" | "act"
    name: str = ""  # parameter/buffer FQN, or the input's position
    producer: Optional["Node"] = None
    dynamic: bool = False  # depends on a model input
    consumers: list[tuple["Node", int]] = field(default_factory=list)  # (node, position in node.tensors)

    def __repr__(self) -> str:
        where = self.name or (self.producer.op if self.producer else "?")
        return f"Value#{self.index}({self.kind} {where} {list(self.shape)})"


@dataclass(eq=False)
class Node:
    """One torch function call: ``op`` is its short name (``linear``, ``view``, ``getitem``, ...)."""

    index: int
    op: str
    func: Any
    args: tuple  # the call's arguments, tensors replaced by Values
    kwargs: dict
    tensors: tuple[Value, ...]  # every Value among args/kwargs, in order (consumers index into this)
    outputs: tuple[Value, ...]  # tensor outputs in order (a tuple result flattened)
    module: str  # FQN of the innermost module whose forward made the call ("" for the root)

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        """Positional argument ``i`` or keyword ``name`` (the way torch functions take either)."""
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(name, default)

    def __repr__(self) -> str:
        return f"Node#{self.index}({self.op} in {self.module or '<root>'!r})"


@dataclass(frozen=True)
class Copy:
    """Nodes ``[node0, node1)`` of the block ``source`` copied for the block ``target`` (``repeats``): the copy of
    node ``i`` is node ``i + node_shift``, of a value made in the block ``v`` is ``v + value_shift``."""

    source: str
    target: str
    node0: int
    node1: int
    node_shift: int
    value_shift: int

    def holds(self, node: int) -> bool:
        """Whether node index ``node`` is one of this copy's nodes."""
        return self.node0 + self.node_shift <= node < self.node1 + self.node_shift


@dataclass
class Graph:
    """The whole trace: nodes in call order, values, and the named leaves."""

    nodes: list[Node] = field(default_factory=list)
    values: list[Value] = field(default_factory=list)
    params: dict[str, Value] = field(default_factory=dict)  # every name of a (tied) parameter
    inputs: list[Value] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    callers: dict[str, set[str]] = field(default_factory=dict)  # module FQN -> the modules whose forward called it
    copies: list[Copy] = field(default_factory=list)  # blocks recorded as copies of an identical one (``repeats``)
    # what analyses derive from the trace alone, kept for the next question (``regions.explored``)
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def new_value(self, t: torch.Tensor, kind: str, name: str = "", producer: Optional[Node] = None,
                  dynamic: bool = False) -> Value:
        v = Value(len(self.values), tuple(int(s) for s in t.shape), t.dtype, kind, name, producer, dynamic)
        self.values.append(v)
        return v

    def param_names(self, v: Value) -> list[str]:
        """Every FQN of parameter ``v`` (tied parameters have several)."""
        return [n for n, p in self.params.items() if p is v]

    def walk(self) -> Iterator[Node]:
        return iter(self.nodes)
