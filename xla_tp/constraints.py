"""Activation layouts as sharding constraints, installed as module hooks.

Each placement in a ``ModuleLayout`` chain becomes one ``ShardingConstraint``: a copy of the
activation annotated with the placement's spec, whose gradient is annotated the same way in
backward (a plain ``mark_sharding`` would constrain the forward value only: see
docs/torch_xla.md).
Hooks run on every traced step (a Python autograd Function and a copy each), so on torch_xla only
what the compiler does not already know is installed (``runtime_chain``): of a redistribution, the
layout it goes to; of a single layout, nothing when the module's weights imply it (a column-parallel
Linear's replicated input, a row-parallel one's split input and reduced output). A split output
stays (it may leave the program: logits under loss parallelism, where nothing else keeps them split)
unless the module joins a column group (``drop_implied_output``): q/k/v or gate/up outputs stay inside. What the plan spells out beyond that (sequence-parallel layouts, a gathered output) stays. The
batch enters split over the data axes: the outermost parallelized module constrains every input that
carries it, passed by position or by keyword (``entry_hook``). The audit still reads the full chains, and each chain's dimensions are
checked against its tensor at the first forward. The constraints reach the backend through a ``Sharder`` (torch_xla's
``backends.annotate.XlaSharder``, the JAX backend's ``JaxSharder``). Example::

    install_constraints(model, state, XlaSharder(mesh))   # forward pre-hooks and hooks on planned modules
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping, Optional, Protocol

import torch
from torch import nn
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .axes import sequence_axes, spec_entry
from .batch import batch_inputs, uneven_note
from .errors import PlanError
from .lowering import scope
from .plan.layout import Chain, Layout, ModuleLayout, activation_spec
from .state import ModelState, all_states


class Sharder(Protocol):
    """What a backend gives the constraints: which tensors it lays out, and how."""

    def applies(self, x: Any) -> bool:
        """Whether ``x`` is a tensor of this backend."""

    def constrain(self, x: torch.Tensor, spec: tuple) -> torch.Tensor:
        """``x`` laid out as ``spec`` (a partition spec over mesh axes), its gradient too."""

    sizes: Mapping[str, int]  # the mesh's axis sizes


class Constrainer:
    """Applies chains of placements to tensors for one layout, through ``sharder``."""

    def __init__(self, sharder: Sharder, layout: Layout, checks: bool = True):
        self.sharder, self.tp_axis, self.batch_axes = sharder, layout.tp_axis, layout.batch_axes
        self.checks = checks  # check each placement against the tensor's rank (else once, at the first forward)

    def applies(self, x: Any) -> bool:
        return self.sharder.applies(x)

    def spec(self, placement: Any, x: torch.Tensor) -> tuple:
        return activation_spec(placement, tuple(x.shape), self.tp_axis, self.batch_axes, self.sharder.sizes)

    def entry_spec(self, x: torch.Tensor) -> tuple:
        """How an input that carries the batch enters: split over the batch axes, and a sequence of tokens
        (``[batch, sequence]`` ids, ``[batch, sequence, features]`` embeddings) over the context axis."""
        spec = self.spec(Replicate(), x)
        if x.dim() == 2 and not x.is_floating_point():
            spec = (spec[0], spec_entry(sequence_axes(self.sharder.sizes, x.shape[1])))
        return spec

    def __call__(self, x: Any, placements: Chain, ml: ModuleLayout, role: str, index: Any) -> Any:
        if not placements or not self.applies(x) or x.dim() == 0:
            return x
        if self.checks:
            self.check(x, placements, ml, role, index)
        for p in placements:
            x = self.sharder.constrain(x, self.spec(p, x))
        return x

    def check(self, x: Any, placements: Chain, ml: ModuleLayout, role: str, index: Any) -> None:
        """``PlanError`` if a placement of the full chain names a dimension ``x`` lacks."""
        if self.applies(x):
            for p in placements:
                _check_rank(p, x, ml, role, index)

    def pre_hook(self, ml: ModuleLayout):
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            args = tuple(self(a, ml.inputs[i], ml, "input", i) if i < len(ml.inputs) else a
                         for i, a in enumerate(args))
            kwargs = {k: self(v, ml.kwarg_inputs.get(k, ()), ml, "keyword input", k) for k, v in kwargs.items()}
            return args, kwargs
        return hook

    def post_hook(self, ml: ModuleLayout):
        def hook(module: nn.Module, args: tuple, output: Any):
            if isinstance(output, torch.Tensor):
                return self(output, ml.outputs[0], ml, "output", 0)
            if isinstance(output, (tuple, list)):
                done = [self(o, ml.outputs[i], ml, "output", i) if i < len(ml.outputs) else o
                        for i, o in enumerate(output)]
                return type(output)(done)
            return None
        return hook


def _check_rank(placement: Any, x: torch.Tensor, ml: ModuleLayout, role: str, index: Any) -> None:
    """``PlanError`` when ``placement`` names a dimension ``x`` lacks (a spec of the wrong length)."""
    ndim = x.dim()
    if isinstance(placement, Shard):
        if -ndim <= placement.dim < ndim:
            return
        problem = f"shards dim {placement.dim}"
    elif isinstance(placement, tuple):
        if len(placement) == ndim:
            return
        problem = f"has {len(placement)} entries"
    else:
        return
    raise PlanError(f"plan key {ml.source!r} ({ml.style} on module {ml.fqn or '<root>'!r}): the layout "
                    f"{placement!r} of {role} {index!r} {problem}, but that tensor has shape {tuple(x.shape)} "
                    f"({ndim} dims); fix the layout in the plan (negative dims count from the end)")


def runtime_chain(ml: ModuleLayout, chain: Chain, is_input: bool) -> Chain:
    """What of ``chain`` to apply at run time (see the module docstring).

    >>> col = ModuleLayout("fc1", "fc1", "ColwiseParallel()", natural_output=Shard(-1))
    >>> runtime_chain(col, (Replicate(),), True), runtime_chain(col, (Shard(1), Replicate()), True)
    ((), (Replicate(),))
    >>> row = ModuleLayout("fc2", "fc2", "RowwiseParallel()", natural_output=Partial())
    >>> runtime_chain(row, (Replicate(),), False), runtime_chain(row, (Shard(1),), False)
    ((), (Shard(dim=1),))
    >>> runtime_chain(col, (Shard(-1),), False)
    (Shard(dim=-1),)
    """
    if len(chain) > 1:  # a redistribution: the layout it goes to
        return chain[-1:]
    natural = ml.natural_output
    if natural is None or not chain:
        return chain
    if is_input:
        return () if chain[0] in (Replicate(), Shard(-1)) else chain
    implied = isinstance(natural, Partial) and chain[0] == Replicate()
    return () if implied else chain


class _FirstForward:
    """Pre/post hooks that check a module's full chains against its tensors, once."""

    def __init__(self, ml: ModuleLayout, constrain: Constrainer):
        self.ml, self.constrain, self.handles = ml, constrain, []

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        for i, a in enumerate(args[:len(self.ml.inputs)]):
            self.constrain.check(a, self.ml.inputs[i], self.ml, "input", i)
        for k, v in kwargs.items():
            self.constrain.check(v, self.ml.kwarg_inputs.get(k, ()), self.ml, "keyword input", k)

    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        outs = output if isinstance(output, (tuple, list)) else (output,)
        for i, o in enumerate(outs[:len(self.ml.outputs)]):
            self.constrain.check(o, self.ml.outputs[i], self.ml, "output", i)
        if torch.compiler.is_compiling():  # dynamo cannot represent a handle made outside its frame (and a
            return  # graph break here would leave the model's frames uncompiled); compiled, the check costs nothing
        for handle in self.handles:  # checked: nothing left to do on later forwards
            handle.remove()


def _pruned(ml: ModuleLayout) -> ModuleLayout:
    return dataclasses.replace(ml, inputs=tuple(runtime_chain(ml, c, True) for c in ml.inputs),
                               kwarg_inputs={k: runtime_chain(ml, c, True) for k, c in ml.kwarg_inputs.items()},
                               outputs=tuple(runtime_chain(ml, c, False) for c in ml.outputs))


def entry_hook(constrain: Constrainer, main_input: Optional[str]):
    """Pre-hook of the outermost parallelized forward: every input that carries the batch (by position or
    by keyword, ``batch.batch_inputs``; ``main_input``: the model's ``main_input_name``) split over the
    batch axes; a batch that does not divide them is split as far as it does, with a warning once."""
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if scope.depth() != 1:
            return None
        found = {key: x for key, x in batch_inputs(args, kwargs, main_input) if constrain.applies(x)}
        if not found:
            return None
        _warn_uneven(module, next(iter(found.values())).shape[0], constrain)
        split = {key: constrain.sharder.constrain(x, constrain.entry_spec(x)) for key, x in found.items()}
        return (tuple(split.get(i, a) for i, a in enumerate(args)),
                {k: split.get(k, v) for k, v in kwargs.items()})
    return hook


_warned_uneven: set[tuple[str, int]] = set()


def _warn_uneven(module: nn.Module, size: int, constrain: Constrainer) -> None:
    if torch.compiler.is_compiling():
        return
    note = uneven_note(size, constrain.batch_axes, constrain.sharder.sizes)
    if note is not None and (type(module).__name__, size) not in _warned_uneven:
        _warned_uneven.add((type(module).__name__, size))
        warnings.warn(f"xla_tp: {type(module).__name__}: {note}", stacklevel=4)


def install_constraints(root: nn.Module, state: ModelState, sharder: Sharder) -> None:
    """Add the hooks for every module layout of ``state`` that constrains activations (their runtime
    chains, and a one-off check of the full chains), and the entry constraint on ``root`` when the
    mesh has a data or fsdp axis. The handles are kept in ``state``.

    A module this layout plans drops the constraint hooks earlier calls (on it, its parents or its
    children) put on it; the hooks of the call this one replaces on ``root`` are already gone.
    """
    layout = state.layout
    planned = {id(root.get_submodule(fqn) if fqn else root) for fqn in layout.modules}
    for _, other in all_states():
        for key in [k for k in other.constraints if k in planned]:
            other.remove_constraint_hooks(key)
    constrain = Constrainer(sharder, layout, checks=False)
    state.sharder = sharder
    if layout.batch_axes or sequence_axes(sharder.sizes):  # the batch's (and the sequence's) split first, then
        # the root's own layouts (a sequence-parallel root refines it)
        hook = entry_hook(constrain, getattr(root, "main_input_name", None))
        state.add_constraint_hooks(root, [root.register_forward_pre_hook(hook, with_kwargs=True)])
    for fqn, ml in layout.modules.items():
        mod = root.get_submodule(fqn) if fqn else root
        pruned = _pruned(ml)
        handles = module_hooks(mod, pruned, constrain)
        if isinstance(pruned.natural_output, Shard) and pruned.outputs == ((pruned.natural_output,),):
            state.implied[id(mod)] = handles[-1]  # module_hooks adds the output hook last
        if any(ml.inputs) or any(ml.kwarg_inputs.values()) or any(ml.outputs):
            first = _FirstForward(ml, constrain)
            first.handles = [mod.register_forward_pre_hook(first.pre, with_kwargs=True),
                             mod.register_forward_hook(first.post)]
            handles += first.handles
        if handles:
            state.add_constraint_hooks(mod, handles)


def module_hooks(mod: nn.Module, ml: ModuleLayout, constrain: Constrainer) -> list[Any]:
    """Forward (pre-)hooks on ``mod`` applying ``constrain`` to ``ml``'s chains; their handles."""
    handles = []
    if any(ml.inputs) or any(ml.kwarg_inputs.values()):
        handles.append(mod.register_forward_pre_hook(constrain.pre_hook(ml), with_kwargs=True))
    if any(ml.outputs):
        handles.append(mod.register_forward_hook(constrain.post_hook(ml)))
    return handles


def register_hooks(root: nn.Module, layout: Layout, constrain: Constrainer) -> list[Any]:
    """``module_hooks`` on every module ``layout`` plans, untagged (the caller removes them)."""
    return [h for fqn, ml in layout.modules.items()
            for h in module_hooks(root.get_submodule(fqn) if fqn else root, ml, constrain)]
