"""The communication a plan's own layouts imply, measured on real activation shapes.

Rules (tensor-parallel axis only; nothing else is "needed"): at every point where a layout
changes, Partial -> Replicate is one all-reduce of that activation, Partial -> Shard one
reduce-scatter, Shard -> Replicate one all-gather, Shard(a) -> Shard(b) one all-to-all. A Linear
or Embedding sharded on its contraction dimension emits Partial, one sharded on its output
features emits Shard(-1). With ``backward=True`` each forward step gets its conjugate
(all-gather <-> reduce-scatter, all-reduce -> none), each distinct input of a colwise layer that
needs a gradient gets one all-reduce (Megatron's one per group: q, k and v reading one input share it;
a module whose split output comes from a bias alone, a norm's scale or a depthwise convolution contracts
nothing; an MoE experts layer's input likewise), and each parameter gradient one all-reduce over the data axis.

Example::

    with ActivationRecorder(model, layout) as rec:
        out = model(x)
    expected = minimum_collectives(rec, layout, mesh_sizes, backward=False)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ..axes import sequence_axes
from ..batch import ways
from ..lowering.context import recording_gathers
from ..plan.layout import Chain, Layout
from ..state import added_modules


@dataclass(frozen=True)
class Expected:
    """One collective the plan needs: ``elements`` per device of an activation of ``dtype``."""

    kind: str
    elements: int
    dtype: torch.dtype
    where: str
    ways: int = 0  # devices a reduce-scatter splits over (0: the tensor-parallel axis's)


@dataclass
class _Call:
    fqn: str
    args: tuple  # original inputs (before the layout's constraints)
    outputs: tuple
    constrained: tuple = ()  # the inputs after the layout's constraints
    added: bool = False  # a module added after the model was parallelized (``state.added_modules``)


@dataclass(frozen=True)
class ContextGather:
    """A key or value attention gathers over the context axis (``lowering.attention.context_split``):
    ``elements`` per device once gathered, split ``ways`` ways before."""

    elements: int
    ways: int
    dtype: torch.dtype
    requires_grad: bool


class ActivationRecorder:
    """Temporary hooks on the planned modules, and on the modules added since the model was parallelized
    (adapters), recording each call's inputs and outputs; and the keys and values attention gathers over
    a context axis (``gathers``)."""

    def __init__(self, root: nn.Module, layout: Layout):
        self.root, self.layout = root, layout
        self.calls: list[_Call] = []
        self.gathers: list[ContextGather] = []
        self.added = added_modules(root)
        self._handles: list[Any] = []
        self._recording = recording_gathers(lambda *fields: self.gathers.append(ContextGather(*fields)))

    def __enter__(self) -> "ActivationRecorder":
        self._recording.__enter__()
        for fqn in self.layout.modules:
            mod = self.root.get_submodule(fqn) if fqn else self.root
            self._handles.append(mod.register_forward_pre_hook(self._pre(fqn), prepend=True))
            self._handles.append(mod.register_forward_pre_hook(self._constrained()))
            self._handles.append(mod.register_forward_hook(self._post()))
        for fqn, mod in self.added.items():
            self._handles.append(mod.register_forward_hook(self._added(fqn)))
        return self

    def _added(self, fqn: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            outs = tuple(output) if isinstance(output, (tuple, list)) else (output,)
            self.calls.append(_Call(fqn, tuple(args), outs, added=True))
        return hook

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._recording.__exit__(*exc)

    def _pre(self, fqn: str):
        def hook(module: nn.Module, args: tuple) -> None:
            self.calls.append(_Call(fqn, tuple(args), ()))
        return hook

    def _constrained(self):
        def hook(module: nn.Module, args: tuple) -> None:
            self.calls[_last_open(self.calls)].constrained = tuple(args)
        return hook

    def _post(self):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            outs = tuple(output) if isinstance(output, (tuple, list)) else (output,)
            self.calls[_last_open(self.calls)].outputs = outs
        return hook


def _last_open(calls: list[_Call]) -> int:
    return max(i for i, c in enumerate(calls) if not c.outputs)


def _step_kind(src: Placement, dst: Placement, ndim: int) -> Optional[str]:
    if isinstance(src, Partial):
        return "all-reduce" if isinstance(dst, Replicate) else "reduce-scatter"
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return "all-gather"
    if isinstance(src, Shard) and isinstance(dst, Shard) and src.dim % ndim != dst.dim % ndim:
        return "all-to-all"
    return None


CONJUGATE = {"all-gather": "reduce-scatter", "reduce-scatter": "all-gather", "all-to-all": "all-to-all"}


def _steps(chain: Chain, start: Optional[Placement]) -> list[tuple[Placement, Placement]]:
    placements = [p for p in chain if not isinstance(p, tuple)]
    if start is not None:
        placements.insert(0, start)
    return list(zip(placements, placements[1:]))


class _Counter:
    """Turns placement steps on concrete tensors into ``Expected`` entries."""

    def __init__(self, layout: Layout, sizes: Mapping[str, int], backward: bool):
        self.tp = sizes.get(layout.tp_axis, 1)
        self.batch = math.prod(sizes.get(a, 1) for a in layout.batch_axes)
        self.sizes, self.backward = sizes, backward
        self.found: list[Expected] = []
        self.gathered: set[int] = set()

    def elements(self, t: torch.Tensor, kind: str) -> int:
        n = t.numel() // (self.batch if t.dim() and t.shape[0] % self.batch == 0 else 1)
        if t.dim() >= 3:  # a [batch, sequence, ...] activation: its sequence split over a context axis
            n //= ways(sequence_axes(self.sizes, t.shape[1]), self.sizes)
        return n // self.tp if kind in ("reduce-scatter", "all-to-all") else n

    def add(self, kind: str, t: torch.Tensor, where: str) -> None:
        self.found.append(Expected(kind, self.elements(t, kind), t.dtype, where))

    def chain(self, t: Any, chain: Chain, start: Optional[Placement], where: str) -> bool:
        """Count one tensor's steps; True when one of them is a forward all-gather."""
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or self.tp == 1:
            return False
        gathered = False
        for src, dst in _steps(chain, start):
            kind = _step_kind(src, dst, t.dim())
            if kind is None:
                continue
            gathered |= kind == "all-gather"
            self.add(kind, t, where)
            if self.backward and kind in CONJUGATE and t.requires_grad:
                self.add(CONJUGATE[kind], t, where + " (grad)")
        return gathered


def minimum_collectives(calls: list[_Call], root: nn.Module, layout: Layout,
                        sizes: Mapping[str, int], backward: bool = False,
                        gathers: Sequence[ContextGather] = ()) -> list[Expected]:
    """Every collective the layouts imply for the recorded calls, in call order; then each key and value
    gathered over a context axis (one all-gather; its gradient one reduce-scatter)."""
    count = _Counter(layout, sizes, backward)
    for g in gathers:
        count.found.append(Expected("all-gather", g.elements, g.dtype, "attention key/value over the context axis"))
        if backward and g.requires_grad:
            count.found.append(Expected("reduce-scatter", g.elements // g.ways, g.dtype,
                                        "attention key/value over the context axis (grad)", g.ways))
    grad_reduced: set[int] = set()
    for call, role in adapters(calls, layout).values():
        _adapter(call, role, count)
    for call in calls:
        if call.added:
            continue
        ml = layout.modules[call.fqn]
        mod = root.get_submodule(call.fqn) if call.fqn else root
        for i, arg in enumerate(call.args):
            chain = ml.inputs[i] if i < len(ml.inputs) else ()
            if count.chain(arg, chain, None, f"{call.fqn} input {i}") and i < len(call.constrained):
                count.gathered.add(id(call.constrained[i]))
        natural = ml.natural_output
        for i, out in enumerate(call.outputs):
            chain = ml.outputs[i] if i < len(ml.outputs) else ()
            count.chain(out, chain or ((Replicate(),) if isinstance(natural, Partial) else ()),
                        natural if i == 0 else None, f"{call.fqn} output {i}")
        if backward and (ml.input_grad or isinstance(natural, Shard) and _contracts_its_input(mod)):
            x = call.args[0] if call.args else None
            seen = grad_reduced | count.gathered
            if isinstance(x, torch.Tensor) and x.requires_grad and id(x) not in seen:
                grad_reduced.add(id(x))
                count.add("all-reduce", x, f"{call.fqn} input grad")
    return count.found


def _contracts_its_input(module: nn.Module) -> bool:
    """Whether a column-parallel ``module`` makes its split outputs from its whole input's features (a Linear, a
    convolution of one group): each device's input gradient is then a partial sum. A scale per feature (a
    norm's 1-D weight) or a convolution of groups (depthwise) reads its input split like its output, so its
    input's gradient is each device's own. ``_contracts_its_input(nn.Linear(4, 8))`` is True."""
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() >= 2 and getattr(module, "groups", 1) == 1


def adapters(calls: list[_Call], layout: Layout) -> dict[str, tuple[_Call, str]]:
    """Each recorded call of a module added after the model was parallelized, by FQN, that adapts a planned
    layer it sits in (LoRA's ``lora_A``/``lora_B``): ``(call, role)``, where ``role`` is the layout
    Megatron gives it beside its layer: ``"row"`` for one contracting a row-parallel layer's split input
    (its output a partial sum: one all-reduce; its weight split on its input), ``"column"`` for one
    writing a column-parallel layer's split output (its input's gradient a partial sum; its weight split
    on its output). Adapters in neither place are replicated and cost nothing."""
    found = {}
    for call in calls:
        if not call.added or not call.args or not call.outputs:
            continue
        owner = max((c for c in calls if not c.added and c.args and c.outputs and call.fqn.startswith(c.fqn + ".")),
                    key=lambda c: len(c.fqn), default=None)
        if owner is None:
            continue
        natural = layout.modules[owner.fqn].natural_output
        x, y = call.args[0], call.outputs[0]
        if isinstance(natural, Partial) and _width(x) is not None and _width(x) == _width(owner.args[0]):
            found[call.fqn] = (call, "row")
        elif isinstance(natural, Shard) and _width(y) is not None and _width(y) == _width(owner.outputs[0]):
            found[call.fqn] = (call, "column")
    return found


def _width(t: Any) -> Optional[int]:
    return int(t.shape[-1]) if isinstance(t, torch.Tensor) and t.dim() else None


def _adapter(call: _Call, role: str, count: _Counter) -> None:
    if role == "row":
        count.add("all-reduce", call.outputs[0], f"{call.fqn} output (adapter of a row-parallel layer)")
    elif count.backward and call.args[0].requires_grad:
        count.add("all-reduce", call.args[0], f"{call.fqn} input grad (adapter of a column-parallel layer)")
