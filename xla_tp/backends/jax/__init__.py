"""The JAX backend: the same plans, lowered to ``NamedSharding`` and run through torchax.

``parallelize_jax`` resolves the plan exactly as ``parallelize_xla`` does (``"auto"`` ->
``plan_for``, ``"hf"``, dicts of styles), normalises and validates it into the same ``Layout``, lets
the plan prepare the model (einsum attention, head-aligned packed weights), and then, instead of
annotating XLA tensors, puts each parameter on the JAX mesh as a jax array with the layout's
``PartitionSpec``. Activation chains become ``with_sharding_constraint`` inside the jitted
function. Needs the ``[jax]`` extra (jax, jaxlib, torchax). Example::

    jm = xla_tp.parallelize_jax(model, plan="auto", mesh={"data": 2, "model": 4})
    logits = jm(tokens).logits
    print(jm.audit(tokens))
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Union

from torch import nn

from ...apply import PlanLike, begin, install_lowering, layout_for, resolve_plan
from ...dataflow.trace import selections
from ...errors import PlanError
from ...axes import canonical_axis
from ...planners.experts import EXPERT_PARALLEL
from ...planners.roles import Role

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from .model import JaxModel

EXTRA = "the JAX backend needs jax, jaxlib and torchax: pip install 'xla_tp[jax]'"


def parallelize_jax(model: nn.Module, plan: PlanLike = "auto", mesh: Union["Mesh", Mapping[str, int], None] = None,
                    *, tp_axis: str = "model", strict: bool = True, outputs: str = "global") -> "JaxModel":
    """Shard ``model``'s parameters on a JAX mesh following ``plan``; a ``JaxModel``.

    ``plan`` takes everything ``parallelize_xla`` takes. ``mesh`` is a ``jax.sharding.Mesh``, axis
    sizes such as ``{"data": 2, "model": 4}`` (laid out like ``make_mesh``), or None (a 1-D
    ``model`` mesh over all jax devices). On CPU jax gets ``CPU_NUM_DEVICES`` devices (or as many as
    the mesh needs) if it has not started yet. Like ``parallelize_xla``, the model's forward is
    prepared in place (einsum attention, ...); its own CPU tensors keep their values, the
    ``JaxModel`` holds the sharded copies. After a plan or mesh error the model is as it was. Across
    processes (``jax.distributed.initialize`` before, the mesh over every process's devices) each process
    makes the same calls; ``outputs``: ``"global"`` (each gets the whole output) or ``"process"`` (its own
    rows). Example::

        jm = parallelize_jax(model, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, mesh={"model": 8})
        y = jm(x)
    """
    if not isinstance(model, nn.Module):
        raise PlanError(f"parallelize_jax takes an nn.Module, got {type(model).__name__}")
    if outputs not in ("global", "process"):
        raise PlanError(f"parallelize_jax: outputs={outputs!r}; pass 'global' (every process gets the whole "
                        f"output) or 'process' (each process its own rows)")
    try:
        from .mesh import to_jax_mesh
        from .model import JaxModel
    except ImportError as e:
        raise ImportError(f"{EXTRA} ({e})") from e
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise PlanError(f"parallelize_jax: {meta[0]!r} ({len(meta)} tensors in all) is on the meta device; "
                        f"the JAX backend copies CPU tensors, so materialise the model first "
                        f"(model.to_empty(device='cpu') and initialise, or load a checkpoint)")
    jmesh = to_jax_mesh(mesh)
    axes = {str(k): int(v) for k, v in jmesh.shape.items()}
    tp_axis = canonical_axis(tp_axis)
    # transformers' batched_mm experts (what jit runs) read their weights as written: split whole experts
    # where the model axis divides them, and never re-lay gate and up (xla_tp's experts lowering is torch_xla's)
    plan = resolve_plan(model, plan, axes, tp_axis, experts=EXPERT_PARALLEL)
    plan.packings = {name: p for name, p in plan.packings.items()
                     if name not in plan.roles or plan.roles[name].kind != Role.EXPERTS}
    picking = selections(plan.graph) if plan.graph is not None else []
    if picking:
        raise PlanError(f"parallelize_jax: {picking[0].module or type(model).__name__} picks its experts' tokens with "
                        f"torch.where (a shape known only from the values, which jit cannot compile); parallelize "
                        f"it with parallelize_xla, whose lowering gives the positions a static size, or hold the "
                        f"experts in [experts, ...] weights indexed by the router's top-k ids")
    layout = layout_for(model, plan, axes, tp_axis, strict, lambda spec: None)
    state = begin(model, plan, layout, jmesh, axes[tp_axis], embeddings=False)
    # attention with visible heads, whoever wrote the plan, and column groups (as on torch_xla); no
    # vocabulary tables: JAX differentiates the forward itself
    install_lowering(model, state, plan, embeddings=False)
    return JaxModel(model, layout, jmesh, plan, outputs)


def __getattr__(name: str) -> Any:
    """``AdamW`` and ``JaxModel`` load jax on first use, so ``import xla_tp`` does not need it."""
    if name == "AdamW":
        from .optim import AdamW
        return AdamW
    if name == "JaxModel":
        from .model import JaxModel
        return JaxModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AdamW", "JaxModel", "parallelize_jax"]
