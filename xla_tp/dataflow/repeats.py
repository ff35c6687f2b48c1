"""Repeated blocks: a stack's identical layers traced once, their calls copied for the others.

An 80-layer decoder calls 80 layers that compute the same thing on different weights. ``trace``
records the first call of each structure for real and copies it for the next ones called with the
same arguments (``Span.replay``), module names and weights renamed, nothing run. The last block of the
structure is recorded for real again and checked equal to the first (the same calls on the same
shapes, read off relative to the block: ``signature``); if it is not, the whole forward is recorded
call by call (``Diverged``). Two blocks have one structure (``structures``) when they sit in one
``ModuleList``, ``Sequential`` or ``ModuleDict`` and have the same classes, submodule names, parameter
and buffer shapes and dtypes and plain attributes (``sliding_window``, ``attention_type``,
``is_sliding``, ...), an attribute equal to the block's own index in the stack (``layer_idx``) aside.
So Gemma's sliding and full layers, a dense first layer before MoE layers, or a layer whose forward
the user replaced are traced on their own. Example:

>>> from torch import nn
>>> stack = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)] + [nn.Linear(8, 4)])
>>> sorted(structures(nn.Sequential(stack)).items())
[('0.0', 0), ('0.1', 0), ('0.2', 0)]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map, tree_unflatten

from .graph import Copy, Graph, Node, Value

_SIMPLE = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_OWN = ("_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set")


def structures(model: nn.Module) -> dict[str, int]:
    """FQN -> structure number, for the blocks of a stack that another block of the stack repeats
    (not the stacks inside such a block: they are traced or copied with it)."""
    found: dict[str, int] = {}
    stacks = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict))]
    for name, stack in stacks:
        if any(name == m or name.startswith(f"{m}.") for m in found):
            continue
        blocks = [(f"{name}.{child}" if name else child, block) for child, block in stack.named_children()
                  if any(True for _ in block.parameters())]
        attributes = [_attributes(block) for _, block in blocks]
        index = {k for k, v in attributes[0].items() if isinstance(v, int) and not isinstance(v, bool)} if blocks else set()
        index = {k for k in index if all(a.get(k) == i for i, a in enumerate(attributes))} if len(blocks) > 1 else set()
        groups: dict[tuple, list[str]] = {}
        for (fqn, block), attrs in zip(blocks, attributes):
            key = tuple(sorted((k, v) for k, v in attrs.items() if k not in index))
            groups.setdefault((key, _tensors(block)), []).append(fqn)
        for members in groups.values():
            if len(members) > 2:
                number = len(set(found.values()))
                found.update({m: number for m in members})
    return found


def _attributes(block: nn.Module) -> dict[tuple[str, str], Any]:
    """(submodule, attribute) -> the attribute as compared (see the module docstring); a forward set on
    the instance makes the block its own structure."""
    found: dict[tuple[str, str], Any] = {}
    for name, module in block.named_modules():
        found[(name, "<class>")] = type(module)
        for k, v in vars(module).items():
            if k == "forward":
                found[(name, k)] = id(block)
            elif k not in _OWN and not k.endswith("_hooks") and not k.startswith("_forward"):
                found[(name, k)] = _attribute(v)
    return found


def _tensors(block: nn.Module) -> tuple:
    return tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                 for n, t in (*block.named_parameters(), *block.named_buffers()))


def _attribute(value: Any) -> Any:
    if isinstance(value, _SIMPLE):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, _SIMPLE) for v in value):
        return tuple(value)
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    return type(value)


class Diverged(Exception):
    """A block recorded for real did something else than the block its structure's copies come from."""


@dataclass(eq=False)
class Span:
    """One block's recorded call: its nodes and values (``[node0, node1)``, ``[value0, value1)`` of the
    graph), the values of its tensor arguments at entry and at exit, and its output's structure."""

    fqn: str
    node0: int
    value0: int
    args: list[Value]
    call: tuple = ()  # the call's arguments as ``call_key`` reads them
    node1: int = 0
    value1: int = 0
    exits: list[Value] = field(default_factory=list)
    out_spec: Any = None
    out_leaves: list[Any] = field(default_factory=list)  # the output's leaves
    out_values: list[Optional[Value]] = field(default_factory=list)  # a tensor leaf's value, else None
    callers: dict[str, set[str]] = field(default_factory=dict)  # the block's submodules -> their callers

    def local(self, v: Value) -> tuple:
        """``v`` relative to the block: made in it, an argument, its own weight or buffer, or from outside."""
        if self.value0 <= v.index < self.value1:
            return ("made", v.index - self.value0)
        if any(v is a for a in self.args):
            return ("arg", next(i for i, a in enumerate(self.args) if a is v))
        if v.kind in ("param", "buffer") and v.name.startswith(f"{self.fqn}."):
            return ("own", v.name[len(self.fqn):])
        return ("outside", v.index)

    def signature(self, graph: Graph) -> tuple:
        """The record relative to the block: equal for two calls that compute the same thing."""
        rel = lambda a: self.local(a) if isinstance(a, Value) else _plain(a)  # noqa: E731
        made = tuple((v.kind, v.shape, v.dtype, v.dynamic, v.producer.index - self.node0 if v.producer else -1)
                     for v in graph.values[self.value0:self.value1])
        nodes = tuple((n.op, n.func, rename(n.module, self.fqn, ""), tree_map(rel, (n.args, n.kwargs)),
                       tuple(rel(v) for v in n.tensors), tuple(rel(v) for v in n.outputs))
                      for n in graph.nodes[self.node0:self.node1])
        callers = tuple(sorted((rename(k, self.fqn, ""), tuple(sorted(rename(c, self.fqn, "") for c in v)))
                               for k, v in self.callers.items()))
        return (made, nodes, self.call,
                tuple(rel(v) for v in self.exits), self.out_spec,
                tuple(_plain(a) if v is None else rel(v) for a, v in zip(self.out_leaves, self.out_values)), callers)

    def copyable(self) -> bool:
        """Whether the output is tensors and plain values only (an object holding tensors cannot be copied)."""
        return all(v is not None or isinstance(a, (*_SIMPLE, tuple, list)) for a, v in zip(self.out_leaves, self.out_values))

    def replay(self, graph: Graph, fqn: str, args: list[Value], leaves: dict[str, Value],
               make: Callable[[Value, torch.Tensor], torch.Tensor]) -> tuple[Any, list[Value], Copy]:
        """This block's calls again for the block ``fqn`` called with ``args`` (``leaves``: the model's parameter
        and buffer values by FQN): the output (new tensors from ``make(value, like)``), the values its arguments
        have after it and the ``Copy``."""
        copy = Copy(self.fqn, fqn, self.node0, self.node1, len(graph.nodes) - self.node0,
                    len(graph.values) - self.value0)
        made: list[Value] = []
        given = {a.index: args[i] for i, a in reversed(list(enumerate(self.args)))}  # the first position of each
        own = f"{self.fqn}."

        def mapped(v: Value) -> Value:
            if self.value0 <= v.index < self.value1:
                return made[v.index - self.value0]
            if v.index in given:
                return given[v.index]
            if v.kind in ("param", "buffer") and v.name.startswith(own):
                return leaves[fqn + v.name[len(self.fqn):]]
            return v

        for v in graph.values[self.value0:self.value1]:
            made.append(Value(len(graph.values), v.shape, v.dtype, v.kind, v.name, None, v.dynamic))
            graph.values.append(made[-1])
        for n in graph.nodes[self.node0:self.node1]:
            args_, kwargs = _mapped((n.args, n.kwargs), mapped)
            node = Node(len(graph.nodes), n.op, n.func, args_, kwargs, tuple(mapped(v) for v in n.tensors),
                        tuple(mapped(v) for v in n.outputs), rename(n.module, self.fqn, fqn))
            for pos, v in enumerate(node.tensors):
                v.consumers.append((node, pos))
            for v in node.outputs:
                v.producer = node
            graph.nodes.append(node)
        for sub, who in self.callers.items():
            graph.callers.setdefault(rename(sub, self.fqn, fqn), set()).update(rename(c, self.fqn, fqn) for c in who)
        out = tree_unflatten([a if v is None else make(mapped(v), a) for a, v in zip(self.out_leaves, self.out_values)],
                             self.out_spec)
        return out, [mapped(v) for v in self.exits], copy


def call_key(leaves: list[Any], values: list[Value]) -> tuple:
    """A call's flattened arguments (``leaves``; ``values``: its tensors' values, in order) as two calls that
    compute the same thing have them: each tensor's shape, dtype and whether it is an activation, the others
    as they are (an object without a value: itself)."""
    tensors = iter(values)
    described = lambda v: (v.shape, v.dtype, v.dynamic)  # noqa: E731
    return tuple(described(next(tensors)) if isinstance(a, torch.Tensor) else _plain(a) for a in leaves)


def _mapped(a: Any, mapped: Callable[[Value], Value]) -> Any:
    """``a`` (a call's arguments: tuples, lists and dicts of values and constants) with each value mapped."""
    if isinstance(a, Value):
        return mapped(a)
    if type(a) in (tuple, list):
        return type(a)(_mapped(x, mapped) for x in a)
    if isinstance(a, tuple) and hasattr(a, "_fields"):  # a named tuple
        return type(a)(*(_mapped(x, mapped) for x in a))
    if type(a) is dict:
        return {k: _mapped(x, mapped) for k, x in a.items()}
    return a


def rename(module: str, old: str, new: str) -> str:
    """``module`` under the block ``old`` as under the block ``new``.

    >>> rename("layers.0.mlp", "layers.0", "layers.7"), rename("layers.01", "layers.0", "layers.7")
    ('layers.7.mlp', 'layers.01')
    """
    if module == old:
        return new
    return new + module[len(old):] if module.startswith(f"{old}.") else module


def _plain(a: Any) -> Any:
    """A non-tensor argument as something ``==`` compares (an object without a value: itself)."""
    return a if isinstance(a, (*_SIMPLE, tuple, list, slice, torch.Size, type(Ellipsis))) else ("object", id(a))
