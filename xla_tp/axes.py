"""Mesh axes, and the one table that says which mesh axes each logical axis is split over.

A mesh has up to five axes, in this order: ``data`` (batch replicas), ``fsdp`` (batch and parameter
shards), ``context`` (sequence shards: context parallelism, attention gathers keys and values over
it; only in meshes that ask for it), ``expert`` (batch shards that also split the experts of
mixture-of-experts layers: tokens reach their experts by all-to-all; only in meshes that ask for it)
and ``model`` (tensor parallel); aliases ``tp``/``tensor`` -> ``model``, ``dp`` -> ``data``,
``cp`` -> ``context``, ``ep`` -> ``expert``.
Everything that places a tensor says what each of its dimensions *is* (a logical axis) and reads
``LOGICAL_AXES`` for where that goes, in the spirit of MaxText's logical axis rules: the planners'
parameter roles, the activations' batch and sequence dimensions, FSDP's parameter shards, the batch
the launcher and the audit divide, the head split flash attention is told about. ``TP`` stands for
the tensor-parallel axis of the call (``model`` unless ``tp_axis=`` says otherwise). Example:

>>> mesh_axes("heads", {"data": 2, "model": 4}), mesh_axes("batch", {"data": 2, "fsdp": 2, "model": 2})
(('model',), ('data', 'fsdp'))
>>> batch_axes({"data": 1, "model": 8}), mesh_axes("embed", {"model": 8})
((), ())
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

DATA, FSDP, CONTEXT, EXPERT, MODEL = "data", "fsdp", "context", "expert", "model"
AXIS_ORDER = (DATA, FSDP, CONTEXT, EXPERT, MODEL)
OPTIONAL_AXES = (CONTEXT, EXPERT)  # in a mesh only when asked for (a mesh always has the others, of size 1 or more)
AXIS_ALIASES = {"tp": MODEL, "tensor": MODEL, "dp": DATA, "cp": CONTEXT, "ep": EXPERT}
TP = "tp"  # in the table and in styles: the tensor-parallel axis of the call

LOGICAL_AXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", (DATA, FSDP, EXPERT)),  # an activation's batch dimension, over every batch axis the mesh has
    ("sequence", (CONTEXT,)),  # an activation's sequence dimension: over the context axis (whole without one;
    # a plan's sequence-parallel Shard(1) layouts split it over the tensor-parallel axis too)
    ("vocab", (TP,)),  # embedding rows, output-head rows (logits stay split)
    ("heads", (TP,)),  # attention heads: q/k/v outputs, the output projection's input
    ("kv_heads", (TP,)),  # key/value heads of grouped-query attention
    ("mlp", (TP,)),  # the MLP's intermediate features (a routed expert's too, expert-tensor-parallel)
    ("experts", (TP,)),  # the experts of a mixture-of-experts layer, expert-parallel: over the model axis
    ("dispatched_experts", (EXPERT,)),  # ... over the expert axis: tokens reach them by all-to-all
    ("kernel", (TP,)),  # a patch embedding's kernel rows (a convolution over non-overlapping patches)
    ("embed", ()),  # the hidden (residual) dimension: whole on the model axis
    ("param_shard", (FSDP,)),  # FSDP: each parameter's first free dimension that the axis divides
)
_TABLE = dict(LOGICAL_AXES)


def axis_names(sizes: Mapping[str, Any]) -> tuple[str, ...]:
    """The axes of a mesh with these ``sizes``, in order: every axis but the optional ones not given.

    >>> axis_names({"model": 8}), axis_names({"expert": 2, "model": 4})
    (('data', 'fsdp', 'model'), ('data', 'fsdp', 'expert', 'model'))
    """
    return tuple(a for a in AXIS_ORDER if a not in OPTIONAL_AXES or a in sizes)


def canonical_axis(name: str) -> str:
    """``canonical_axis("tp") == "model"``; unknown names are returned unchanged."""
    return AXIS_ALIASES.get(name, name)


def mesh_axes(logical: Optional[str], sizes: Optional[Mapping[str, int]] = None, tp_axis: str = MODEL) -> tuple[str, ...]:
    """The mesh axes ``logical`` is split over (``TP`` as ``tp_axis``), those of size 1 in ``sizes``
    (when given) or missing from it left out. ``KeyError`` for a name the table lacks."""
    if logical is None:
        return ()
    if logical not in _TABLE:
        raise KeyError(f"logical axis {logical!r} is not in LOGICAL_AXES ({', '.join(_TABLE)})")
    axes = tuple(tp_axis if a == TP else a for a in _TABLE[logical])
    return axes if sizes is None else tuple(a for a in axes if sizes.get(a, 1) > 1)


def spec_entry(axes: tuple[str, ...]) -> Optional[object]:
    """A partition-spec entry for ``axes``: None, one axis name, or a tuple of names."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def batch_axes(sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes the batch is split over: ``batch_axes({"data": 2, "model": 4}) == ("data",)``."""
    return mesh_axes("batch", sizes)


def batch_ways(sizes: Mapping[str, int]) -> int:
    """How many ways the batch is split: ``batch_ways({"data": 2, "fsdp": 2, "model": 2}) == 4``."""
    n = 1
    for a in batch_axes(sizes):
        n *= sizes[a]
    return n


def sequence_axes(sizes: Mapping[str, int], length: Optional[int] = None) -> tuple[str, ...]:
    """The mesh axes a sequence of ``length`` tokens is split over (context parallelism): the context axis
    where the mesh has one and it divides ``length`` (any length when None).

    >>> sequence_axes({"context": 4, "model": 2}, 2048), sequence_axes({"context": 4}, 6), sequence_axes({"model": 8})
    (('context',), (), ())
    """
    axes = mesh_axes("sequence", sizes)
    ways = 1
    for a in axes:
        ways *= sizes[a]
    return axes if length is None or length % ways == 0 else ()


def param_shard_axis(sizes: Mapping[str, int]) -> Optional[str]:
    """The axis FSDP shards parameters over, if the mesh has it: ``param_shard_axis({"fsdp": 2}) == "fsdp"``."""
    axes = mesh_axes("param_shard", sizes)
    return axes[0] if axes else None


def sizes_of(mesh: Any) -> dict[str, int]:
    """Axis name -> size of any mesh xla_tp takes, read without a runtime: axis sizes (a mapping), an
    ``xs.Mesh`` or ``jax.sharding.Mesh``-like object (``axis_names`` and ``mesh_shape``/``shape``), or a
    ``DeviceMesh`` (``mesh_dim_names``; an unnamed 1-D one is the ``model`` axis; a slice of
    ``init_device_mesh`` stands for its whole mesh). Names go through the aliases.

    >>> sizes_of({"tp": 4, "dp": 2})
    {'model': 4, 'data': 2}
    """
    if isinstance(mesh, Mapping):
        pairs = [(str(k), int(v)) for k, v in mesh.items()]
    elif hasattr(mesh, "axis_names") and hasattr(mesh, "mesh_shape"):
        pairs = list(zip(mesh.axis_names or (MODEL,), (int(s) for s in mesh.mesh_shape)))
    elif hasattr(mesh, "mesh_dim_names"):
        mesh = getattr(mesh, "whole", mesh)
        shape = tuple(mesh.mesh.shape)
        names = mesh.mesh_dim_names or ((MODEL,) if len(shape) == 1 else None)
        if names is None:
            raise ValueError(f"a {len(shape)}-D DeviceMesh needs mesh_dim_names to say which axis is which")
        pairs = list(zip(names, shape))
    else:
        raise TypeError(f"not a mesh: {type(mesh).__name__}; pass axis sizes such as {{'model': 4}}, an xs.Mesh "
                        f"or a DeviceMesh")
    return {canonical_axis(name): size for name, size in pairs}
