"""Activation layouts as sharding constraints, installed as module hooks.

Each placement in a ``ModuleLayout`` chain becomes one ``ShardingConstraint``: a copy of the
activation annotated with the placement's spec, whose gradient is annotated the same way in
backward (a plain ``mark_sharding`` would constrain the forward value only: see the
README, "torch_xla behaviours xla_tp works around").
Hooks run on every traced step (a Python autograd Function and a copy each), so on torch_xla only
what the compiler does not already know is installed (``runtime_chain``): of a redistribution, the
layout it goes to; of a single layout, nothing when the module's weights imply it (a column-parallel
Linear's replicated input, a row-parallel one's split input and reduced output). A split output
stays (it may leave the program: logits under loss parallelism, where nothing else keeps them split)
unless the module joins a column group (``drop_implied_output``): q/k/v or gate/up outputs stay inside. What the plan spells out beyond that (sequence-parallel layouts, a gathered output) stays. The
batch enters split over the data axes: the outermost parallelized module constrains its first
input (``entry_hook``). The audit still reads the full chains, and each chain's dimensions are
checked against its tensor at the first forward. Example::

    install_constraints(model, layout, mesh)   # forward pre-hooks and hooks on planned modules
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
import torch_xla.distributed.spmd as xs
from torch import nn
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from . import dynamo
from .errors import PlanError
from .lowering import scope
from .plan.layout import Chain, Layout, ModuleLayout, activation_spec

_HANDLES = "_xla_tp_hooks"  # on each hooked module: (layout that installed them, handles)
_IMPLIED_OUTPUT = "_xla_tp_implied_output"  # on a column-parallel module: its output hook's handle


class ShardingConstraint(torch.autograd.Function):
    """``y = x`` laid out as ``spec``; ``dy`` laid out as ``spec`` too."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: xs.Mesh, spec: tuple) -> torch.Tensor:
        ctx.mesh, ctx.spec = mesh, spec
        return annotated_copy(x, mesh, spec)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return annotated_copy(grad, ctx.mesh, ctx.spec), None, None


def annotated_copy(x: torch.Tensor, mesh: xs.Mesh, spec: tuple) -> torch.Tensor:
    """A copy of ``x`` behind a Sharding custom call. ``xs.mark_sharding`` cannot be used: on a
    copy of device data (a fresh input) it refuses to replace the existing annotation. Under
    ``torch.compile`` it is a custom op dynamo records (``dynamo.constrain``)."""
    if torch.compiler.is_compiling():
        return dynamo.constrain(x, mesh, spec)
    return dynamo.annotated(x, mesh.get_op_sharding(spec))


class _Constrainer:
    """Applies chains of placements to tensors for one mesh and layout."""

    def __init__(self, mesh: xs.Mesh, layout: Layout):
        self.mesh, self.tp_axis, self.batch_axes = mesh, layout.tp_axis, layout.batch_axes
        sizes = dict(zip(mesh.axis_names, mesh.mesh_shape))
        self.batch_size = math.prod(sizes[a] for a in self.batch_axes)
        dynamo.name(mesh)  # for torch.compile

    def applies(self, x: Any) -> bool:
        """Whether ``x`` is a tensor this backend constrains (here: an XLA tensor)."""
        return isinstance(x, torch.Tensor) and x.device.type == "xla"

    def constrain(self, x: torch.Tensor, spec: tuple) -> torch.Tensor:
        """``x`` laid out as ``spec``, its gradient too."""
        return ShardingConstraint.apply(x, self.mesh, spec)

    checks = True  # check each placement against the tensor's rank (torch_xla does it once, at the first forward)

    def __call__(self, x: Any, placements: Chain, ml: ModuleLayout, role: str, index: Any) -> Any:
        if not placements or not self.applies(x) or x.dim() == 0:
            return x
        if self.checks:
            self.check(x, placements, ml, role, index)
        for p in placements:
            x = self.constrain(x, activation_spec(p, tuple(x.shape), self.tp_axis, self.batch_axes, self.batch_size))
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

    def __init__(self, ml: ModuleLayout, constrain: _Constrainer):
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


def entry_hook(constrain: _Constrainer):
    """Pre-hook: the first input of the outermost parallelized forward, batch split over the data axes."""
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if not args or scope.depth() != 1 or not constrain.applies(args[0]) or args[0].dim() == 0:
            return None
        x = args[0]
        spec = activation_spec(Replicate(), tuple(x.shape), constrain.tp_axis, constrain.batch_axes, constrain.batch_size)
        return (constrain.constrain(x, spec), *args[1:]), kwargs
    return hook


def install_constraints(root: nn.Module, layout: Layout, mesh: xs.Mesh, replacing: Optional[Layout] = None) -> None:
    """Add the hooks for every module layout that constrains activations (their runtime chains, and a
    one-off check of the full chains), and the entry constraint on ``root`` when the mesh has a data
    or fsdp axis.

    Hooks are kept on the module they run on, tagged with the layout that installed them. A
    module this layout plans drops the hooks of earlier calls; ``replacing`` (the layout of the
    previous call on ``root``) drops the hooks that call installed on modules this one leaves out.
    Hooks that other calls (on parents or children of ``root``) installed elsewhere stay.
    """
    for fqn, mod in root.named_modules():
        tag, handles = getattr(mod, _HANDLES, (None, ()))
        if handles and (fqn in layout.modules or (replacing is not None and tag is replacing)):
            for handle in handles:
                handle.remove()
            delattr(mod, _HANDLES)
    constrain = _Constrainer(mesh, layout)
    constrain.checks = False
    # the batch's split first, then the root's own layouts (a sequence-parallel root refines it)
    entry = [root.register_forward_pre_hook(entry_hook(constrain), with_kwargs=True)] if layout.batch_axes else []
    if entry:
        tag, handles = getattr(root, _HANDLES, (layout, []))
        setattr(root, _HANDLES, (tag, [*handles, *entry]))
    for fqn, ml in layout.modules.items():
        mod = root.get_submodule(fqn) if fqn else root
        pruned = _pruned(ml)
        handles = [*getattr(mod, _HANDLES, (None, []))[1], *module_hooks(mod, pruned, constrain)]
        vars(mod).pop(_IMPLIED_OUTPUT, None)
        if isinstance(pruned.natural_output, Shard) and pruned.outputs == ((pruned.natural_output,),):
            setattr(mod, _IMPLIED_OUTPUT, handles[-1])  # module_hooks adds the output hook last
        if any(ml.inputs) or any(ml.kwarg_inputs.values()) or any(ml.outputs):
            first = _FirstForward(ml, constrain)
            first.handles = [mod.register_forward_pre_hook(first.pre, with_kwargs=True),
                             mod.register_forward_hook(first.post)]
            handles += first.handles
        if handles:
            setattr(mod, _HANDLES, (layout, handles))


def drop_implied_output(mod: nn.Module) -> None:
    """Take off ``mod``'s output constraint if it only restates its weights' split (a column-parallel
    output); for modules whose output never leaves the program (column-group members)."""
    handle = vars(mod).pop(_IMPLIED_OUTPUT, None)
    if handle is not None:
        handle.remove()


def module_hooks(mod: nn.Module, ml: ModuleLayout, constrain: _Constrainer) -> list[Any]:
    """Forward (pre-)hooks on ``mod`` applying ``constrain`` to ``ml``'s chains; their handles."""
    handles = []
    if any(ml.inputs) or any(ml.kwarg_inputs.values()):
        handles.append(mod.register_forward_pre_hook(constrain.pre_hook(ml), with_kwargs=True))
    if any(ml.outputs):
        handles.append(mod.register_forward_hook(constrain.post_hook(ml)))
    return handles


def register_hooks(root: nn.Module, layout: Layout, constrain: _Constrainer) -> list[Any]:
    """``module_hooks`` on every module ``layout`` plans, untagged (the caller removes them)."""
    return [h for fqn, ml in layout.modules.items()
            for h in module_hooks(root.get_submodule(fqn) if fqn else root, ml, constrain)]


def constraint_hooks(root: nn.Module) -> list[Any]:
    """The handles of every xla_tp constraint hook on ``root`` and its submodules (for suspending them)."""
    return [handle for mod in root.modules() for handle in getattr(mod, _HANDLES, (None, ()))[1]]
