"""The engine behind every family planner: a table of (FQN suffix, role) -> a checked ``Plan``.

A family planner is a small ordered table, e.g. ``("self_attn.q_proj", "col_heads")``. Each module
whose FQN ends with a suffix (longest suffix wins) gets the role's style, after checking that the
sharded dimension divides the model axis and, for attention roles, that the heads divide it. A
check that fails replicates the module and records why: never an error deep inside XLA. Keys are
FQNs with layer indices replaced by ``*``. Example::

    plan = build_plan(model, [("fc1", "col"), ("fc2", "row")], tp=4, family="mlp")
    plan == {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ..plan.styles import ShardParams
from .plan import Plan
from .structure import config_heads, has

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")  # a leading index stays: "0" must not become "*"


@dataclass(frozen=True)
class Role:
    """How to shard one module: its style and the (parameter, dim) that must divide the axis."""

    style: Any
    checks: tuple[tuple[str, int], ...]
    heads: str = ""  # "q": needs query heads % tp == 0; "kv": key/value heads too


CONV_COL = ShardParams({"weight": (None, "tp"), "bias": ("tp",)}, inputs=((Replicate(),),),
                       outputs=((Shard(-1),),), natural_output=Shard(-1))
CONV_ROW = ShardParams({"weight": ("tp", None), "bias": (None,)}, inputs=((Shard(-1),),),
                       outputs=((Replicate(),),), natural_output=Partial())

ROLES: dict[str, Role] = {
    "col": Role(ColwiseParallel(), (("weight", 0),)),
    "row": Role(RowwiseParallel(), (("weight", 1),)),
    "col_heads": Role(ColwiseParallel(), (("weight", 0),), heads="q"),
    "col_kv": Role(ColwiseParallel(), (("weight", 0),), heads="kv"),
    "row_heads": Role(RowwiseParallel(), (("weight", 1),), heads="q"),
    "vocab": Role(RowwiseParallel(input_layouts=Replicate()), (("weight", 0),)),
    "head": Role(ColwiseParallel(output_layouts=Shard(-1), use_local_output=False), (("weight", 0),)),
    "conv_col": Role(CONV_COL, (("weight", 1),)),
    "conv_row": Role(CONV_ROW, (("weight", 0),)),
}


def pattern(fqn: str) -> str:
    """``pattern("model.layers.3.mlp.up_proj") == "model.layers.*.mlp.up_proj"``."""
    return _INDEX.sub("*", fqn)


RoleRef = Union[str, Role]  # a name in ROLES, or a family's own Role


def role_of(fqn: str, table: Sequence[tuple[str, RoleRef]]) -> Optional[RoleRef]:
    """The role of the longest table suffix that ends ``fqn`` at a segment boundary."""
    hits = [(len(s), r) for s, r in table if fqn == s or fqn.endswith("." + s)]
    return max(hits, key=lambda hit: hit[0])[1] if hits else None


def _failure(mod: nn.Module, role: Role, tp: int, heads: tuple[int, int]) -> Optional[str]:
    if role.heads and heads[0] % tp:
        return f"{heads[0]} attention heads do not divide the model axis ({tp}): attention replicated"
    if role.heads == "kv" and heads[1] % tp:
        return (f"{heads[1]} key/value heads < or not divisible by the model axis ({tp}): k/v projections "
                f"replicated (computed on every device, no communication)")
    for name, dim in role.checks:
        p = mod.get_parameter(name)
        if p.shape[dim] % tp:
            return f"{name} dim {dim} ({p.shape[dim]}) is not divisible by the model axis ({tp})"
    return None


def build_plan(model: nn.Module, table: Sequence[tuple[str, RoleRef]], tp: int, family: str,
               heads: tuple[int, int] = (0, 0), replicate: Sequence[tuple[str, str]] = (),
               prepare: Optional[Callable[[nn.Module], None]] = None) -> Plan:
    """Apply ``table`` to every module of ``model``; ``replicate`` lists (suffix, reason) kept whole."""
    plan = Plan(family=family, prepare=prepare)
    failed: dict[str, str] = {}
    for fqn, mod in model.named_modules():
        name = role_of(fqn, table)
        if name is None or not any(True for _ in mod.parameters()):
            continue
        key, role = pattern(fqn), name if isinstance(name, Role) else ROLES[name]
        why = failed.get(key) or _failure(mod, role, tp, heads)
        if why:
            failed[key] = why
            plan.pop(key, None)
        else:
            plan[key] = role.style
    reasons = {**failed, **{pattern(f): r for f, _ in model.named_modules()
                            for s, r in replicate if f == s or f.endswith("." + s)}}
    _record_replicated(model, plan, reasons)
    return plan


def _record_replicated(model: nn.Module, plan: Plan, reasons: dict[str, str]) -> None:
    """Every parameter no planned module holds goes into ``plan.replicated`` with a reason."""
    mods = dict(model.named_modules())
    covered = {id(p) for f, m in mods.items() if pattern(f) in plan for p in m.parameters()}
    for full, p in model.named_parameters():
        if id(p) in covered:
            continue
        owner = full.rpartition(".")[0]
        plan.replicated[full] = reasons.get(pattern(owner)) or default_reason(mods[owner])


def default_reason(mod: nn.Module) -> str:
    """Why a module no rule names stays replicated. Example: ``default_reason(nn.LayerNorm(4))``."""
    kind = type(mod).__name__
    if "norm" in kind.lower():
        return "norm: replicated (Megatron layout; tiny, applied to replicated activations)"
    if isinstance(mod, nn.Embedding):
        return "position/type embedding: small, replicated"
    return f"{kind}: no rule of this family shards it"


@dataclass(frozen=True)
class LinearFamily:
    """A family recognised by ``nn.Linear`` modules at ``probes`` and planned by ``table``.

    Example::

        BERT = LinearFamily("bert", TABLE, probes=("attention.self.query", "attention.output.dense"))
        BERT.detect(model), BERT.plan(model, tp=4)
    """

    name: str
    table: tuple
    probes: tuple[str, ...]
    heads: Callable[[nn.Module], tuple[int, int]] = config_heads
    prepare: Optional[Callable[[nn.Module], None]] = None

    def detect(self, model: nn.Module) -> bool:
        """Every probe suffix names an ``nn.Linear`` of ``model``."""
        return all(has(model, s, nn.Linear) for s in self.probes)

    def plan(self, model: nn.Module, tp: int) -> Plan:
        """The family's plan for ``model`` on a model axis of size ``tp``."""
        return build_plan(model, self.table, tp, self.name, heads=self.heads(model), prepare=self.prepare)

