"""The normalised form every plan is lowered to, before validation and before any backend.

A ``Layout`` holds, per module that the plan names, a ``ModuleLayout``:

- ``params``: local parameter name -> ``Spec``, one mesh axis (or None, or a tuple of axes)
  per tensor dimension, exactly the partition spec ``xs.mark_sharding`` takes;
- ``inputs`` / ``kwarg_inputs`` / ``outputs``: per activation, a chain of placements
  (``Shard(d)`` / ``Replicate()`` over the tensor-parallel axis) applied in order as sharding
  constraints. ``(Shard(1), Replicate())`` on an input means "arrives sequence-sharded, is
  all-gathered here". Placements keep torch's types so negative dims resolve against the
  activation's rank at run time.

Example (what ``ColwiseParallel()`` on ``layers.0.wq`` lowers to):

>>> ModuleLayout(fqn="layers.0.wq", source="layers.*.wq", style="ColwiseParallel()",
...              params={"weight": ("model", None)}, inputs=((Replicate(),),), outputs=((Shard(-1),),))
ModuleLayout(fqn='layers.0.wq', source='layers.*.wq', style='ColwiseParallel()', params={'weight': ('model', None)}, inputs=((Replicate(),),), kwarg_inputs={}, outputs=((Shard(dim=-1),),), natural_output=None, input_grad=False)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from ..axes import sequence_axes, spec_entry
from ..batch import batch_split
from .subaxis import split_sub_axis

Axis = Union[str, tuple[str, ...], None]
Spec = tuple[Axis, ...]
Chain = tuple[Union[Placement, Spec], ...]  # a Spec entry is an explicit per-dimension constraint


@dataclass
class ModuleLayout:
    """What one plan entry asks of one module."""

    fqn: str
    source: str
    style: str
    params: dict[str, Spec] = field(default_factory=dict)
    inputs: tuple[Chain, ...] = ()
    kwarg_inputs: dict[str, Chain] = field(default_factory=dict)
    outputs: tuple[Chain, ...] = ()
    natural_output: Optional[Placement] = None  # what the module's own math emits over the TP axis:
    # Partial() when it contracts a sharded dimension (row-parallel), Shard(-1) when column-parallel
    input_grad: bool = False  # its own math splits a whole input and contracts it back (an MoE experts
    # layer): the input's gradient is one all-reduce


@dataclass
class Layout:
    """A whole plan, normalised: ``modules`` by FQN, ``params`` by parameter FQN."""

    tp_axis: str
    batch_axes: tuple[str, ...]
    modules: dict[str, ModuleLayout] = field(default_factory=dict)
    params: dict[str, Spec] = field(default_factory=dict)


def spec_axes(axes: Axis) -> tuple[str, ...]:
    """The mesh axes one spec entry names.

    >>> spec_axes(None), spec_axes("model"), spec_axes(("data", "fsdp"))
    ((), ('model',), ('data', 'fsdp'))
    """
    if axes is None:
        return ()
    return axes if isinstance(axes, tuple) else (axes,)


def uses_axis(spec: Spec, axis: str) -> bool:
    """Whether any dimension of ``spec`` is split over ``axis`` (or a sub-axis of it, ``plan.subaxis``).

    >>> uses_axis((None, ("data", "model")), "model"), uses_axis(("data", None), "model"), uses_axis(("model@4",), "model")
    (True, False, True)
    """
    return any(axis == split_sub_axis(a)[0] for entry in spec for a in spec_axes(entry))


def chain(*placements: Optional[Placement]) -> Chain:
    """The placements to constrain to, in order, with Nones and repeats dropped.

    ``chain(Shard(1), Replicate()) == (Shard(1), Replicate())``;
    ``chain(Replicate(), Replicate()) == (Replicate(),)``. Partial placements are dropped:
    under SPMD every activation is a global value, so a pending reduction is not a layout.
    """
    out: list[Placement | Spec] = []
    for p in placements:
        if p is None or not isinstance(p, (Shard, Replicate, tuple)):
            continue
        if not out or out[-1] != p:
            out.append(p)
    return tuple(out)


def activation_spec(placement: Placement | Spec, shape: tuple[int, ...], tp_axis: str,
                    batch_axes: tuple[str, ...], sizes: Mapping[str, int]) -> Spec:
    """The partition spec of an activation of ``shape`` under ``placement`` over ``tp_axis``.

    Dimension 0 is the batch: it is sharded over ``batch_axes`` (data/fsdp; ``sizes``: the mesh's axis
    sizes), or over the largest group of them it divides (``batch.batch_split``), so a TP constraint
    never gathers the data-parallel axis and every constraint splits the batch as the model's entry does.
    On a mesh with a context axis, dimension 1 of a ``[batch, sequence, features]`` activation is
    the sequence, split over it (before the tensor-parallel axis of a ``Shard(1)``).
    ``activation_spec(Shard(1), (8, 16, 64), "model", ("data",), {"data": 2}) == ("data", "model", None)``
    An explicit spec (a tuple of axes, from rule lists) is used as it is.
    """
    if isinstance(placement, tuple):
        return placement
    ndim = len(shape)
    spec: list[Axis] = [None] * ndim
    if ndim == 0:
        return ()
    spec[0] = spec_entry(batch_split(shape[0], batch_axes, sizes))
    if ndim == 3:
        spec[1] = spec_entry(sequence_axes(sizes, shape[1]))
    if isinstance(placement, Shard):
        dim = placement.dim % ndim
        spec[dim] = (*spec_axes(spec[dim]), tp_axis) if spec[dim] is not None else tp_axis
    return tuple(spec)
