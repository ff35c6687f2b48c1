"""``torch_plan(model, mesh)``: the plan "auto" writes, as torch's own ``ParallelStyle`` objects.

torch's ``parallelize_module(model, device_mesh, plan)`` runs the result on any DTensor backend (CPU with
gloo, CUDA, TorchTPU): the planner's dataflow roles, in the styles torch users write by hand.

====================================  ===========================================================
"auto" role                            torch style
====================================  ===========================================================
column-parallel ``nn.Linear``          ``ColwiseParallel()``
row-parallel ``nn.Linear``             ``RowwiseParallel()``
vocab-parallel ``nn.Embedding``        ``RowwiseParallel(input_layouts=Replicate())``
output head ``nn.Linear``              ``ColwiseParallel(output_layouts=Replicate())``: whole logits;
                                       ``loss_parallel=True``: ``Shard(-1)``, ``use_local_output=False``,
                                       for torch's ``loss_parallel()`` cross-entropy
====================================  ===========================================================

torch runs each device's part of a split module as a local tensor, so a block the planner decided
together (projections meeting in one tensor, and the row projections contracting them) is split whole or
not at all. What torch's styles cannot say stays whole, its block with it, and ``explain()`` says why:
packed projections xla_tp re-lays device-major (GPT-2's ``c_attn``), zero heads added so the axis divides
them, key/value heads copied to every device, a split over part of the axis, routed experts (3-D weights),
and modules other than ``nn.Linear`` and ``nn.Embedding`` (torch's styles shard those two). The model's
attention must shape its heads from the tensors (``view(b, s, -1, d)``, as transformers' models do), since
each device sees its own heads. Example::

    plan = xla_tp.torch_plan(model, mesh={"model": 4})
    parallelize_module(model, init_device_mesh("cpu", (4,)), plan)      # torch's own
    print(plan.explain())
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import Replicate, Shard

from ..axes import MODEL, canonical_axis, sizes_of
from ..plan.layout import spec_axes
from ..plan.subaxis import split_sub_axis
from . import plan_for
from .plan import Plan
from .roles import Role

STYLED = (nn.Linear, nn.Embedding)


class TorchPlan(dict):
    """Module FQN -> torch ``ParallelStyle``; ``whole``: module FQN -> why torch's styles leave it whole;
    ``plan``: the ``Plan`` of "auto" it expresses."""

    def __init__(self, styles: Mapping[str, ParallelStyle], whole: Mapping[str, str], plan: Plan, tp: int):
        super().__init__(styles)
        self.whole, self.plan, self.tp = dict(whole), plan, tp

    def explain(self) -> str:
        """Each module's torch style, then what stays whole and why, against "auto"."""
        lines = [f"torch plan over a model axis of {self.tp} ({len(self)} modules split)"]
        lines += [f"  {fqn}: {_text(style)}" for fqn, style in self.items()]
        if self.whole:
            lines.append("whole on every device (split by \"auto\" on XLA, not by torch's styles):")
            lines += [f"  {fqn}: {why}" for fqn, why in self.whole.items()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"TorchPlan({ {k: _text(v) for k, v in self.items()} })"


def _text(style: ParallelStyle) -> str:
    if isinstance(style, RowwiseParallel) and style.input_layouts == (Replicate(),):
        return "RowwiseParallel(input_layouts=Replicate())"
    if isinstance(style, ColwiseParallel) and style.output_layouts == (Replicate(),):
        return "ColwiseParallel(output_layouts=Replicate())"
    if isinstance(style, ColwiseParallel) and not style.use_local_output:
        return "ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)"
    return f"{type(style).__name__}()"


def torch_plan(model: nn.Module, mesh: Any, tp_axis: str = MODEL, *, loss_parallel: bool = False,
               example_inputs: Optional[Sequence[Any]] = None,
               example_kwargs: Optional[Mapping[str, Any]] = None) -> TorchPlan:
    """The plan of ``plan_for(model, mesh)`` in torch's styles (see the module docstring). ``mesh``: axis sizes
    (``{"model": 4}``), a ``DeviceMesh`` (its tensor-parallel axis: the only one, or ``tp_axis``) or any mesh
    ``plan_for`` takes. Needs torch only. Example: ``parallelize_module(model, tp_mesh, torch_plan(model, tp_mesh))``."""
    sizes = _sizes(mesh, tp_axis)
    plan = plan_for(model, sizes, tp_axis, example_inputs=example_inputs, example_kwargs=example_kwargs)
    tp = sizes[canonical_axis(tp_axis)]
    modules = dict(model.named_modules())
    owners: dict[str, list[str]] = {}
    for name in plan.roles:
        owners.setdefault(name.rpartition(".")[0], []).append(name)
    styles: dict[str, ParallelStyle] = {}
    whole: dict[str, str] = {}
    for fqn, names in owners.items():
        style, why = _style(modules.get(fqn), [plan.roles[n] for n in names], [n in plan.packings for n in names],
                            loss_parallel)
        if style is None:
            whole[fqn] = why
        else:
            styles[fqn] = style
    _whole_blocks(plan, styles, whole)
    _tied(model, styles, whole)
    return TorchPlan(styles, whole, plan, tp)


def _sizes(mesh: Any, tp_axis: str) -> dict[str, int]:
    """Axis sizes of ``mesh``; a 1-D ``DeviceMesh`` named otherwise is the tensor-parallel axis."""
    names = getattr(mesh, "mesh_dim_names", None)
    if names is not None and len(names) == 1 and hasattr(mesh, "size"):
        return {canonical_axis(tp_axis): int(mesh.size())}
    return sizes_of(mesh)


def _style(module: Optional[nn.Module], roles: list, packed: list[bool],
           loss_parallel: bool) -> tuple[Optional[ParallelStyle], str]:
    """The torch style of one module whose parameters "auto" splits as ``roles``, or None and why not."""
    kinds = {r.kind for r in roles}
    if Role.EXPERTS in kinds:
        return None, "routed experts ([experts, ...] weights): no torch style splits them (torchtitan's ExpertParallel " \
                     "needs its own MoE module)"
    if any(packed):
        return None, "its weight is re-laid device-major (packed blocks, zero heads or copied heads): torch's styles " \
                     "split rows in their order"
    if any(split_sub_axis(a)[1] for r in roles for e in r.axes for a in spec_axes(e)):
        return None, "split over part of the model axis (a sub-axis): torch's styles split over the whole mesh dim"
    if not isinstance(module, STYLED):
        return None, f"a {type(module).__name__}: torch's ColwiseParallel and RowwiseParallel shard nn.Linear and " \
                     f"nn.Embedding only"
    if isinstance(module, nn.Embedding):
        return RowwiseParallel(input_layouts=Replicate()), ""
    if Role.HEAD in kinds:
        if loss_parallel:
            return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False), ""
        return ColwiseParallel(output_layouts=Replicate()), ""
    if Role.ROW in kinds:
        return RowwiseParallel(), ""
    return ColwiseParallel(), ""


def _whole_blocks(plan: Plan, styles: dict[str, ParallelStyle], whole: dict[str, str]) -> None:
    """A block with a member left whole (or replicated by "auto") is left whole entirely."""
    for block in plan.blocks:
        owners = {name.rpartition(".")[0] for name in block}
        held = [o for o in owners if o in whole] + [n.rpartition(".")[0] for n in block if n in plan.replicated]
        if not held:
            continue
        for owner in sorted(owners):
            if owner in styles:
                del styles[owner]
                whole[owner] = f"in one block with {held[0]}, which stays whole: torch runs each device's part as a " \
                               f"local tensor, so the block is split whole or not at all"


def _tied(model: nn.Module, styles: dict[str, ParallelStyle], whole: dict[str, str]) -> None:
    """A weight two styled modules share (a tied embedding and head): only the first keeps its style."""
    seen: dict[int, str] = {}
    for fqn, module in model.named_modules():
        if fqn not in styles:
            continue
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                del styles[fqn]
                whole[fqn] = f"its weight is {seen[id(p)]}'s too (tied): torch shards a parameter once"
                break
            seen[id(p)] = fqn
