"""Plain ``nn.Linear`` stacks and MLPs: consecutive Linears paired column-then-row.

Linears are taken in registration order; a Linear whose input is the previous unpaired Linear's
output starts no new pair but closes one: the first is column-parallel, the second row-parallel,
so each pair costs one all-reduce and the activation between them never moves. A Linear left
without a partner (or whose width does not divide the axis) stays replicated, with the reason.
Example::

    plan = plan(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)), tp=4)
    plan == {"0": ColwiseParallel(), "2": RowwiseParallel()}
"""
from __future__ import annotations

from torch import nn

from .plan import Plan
from .table import build_plan

FAMILY = "mlp"
UNPAIRED = "Linear without a column/row partner: replicated so every pair costs one all-reduce"


def detect(model: nn.Module) -> bool:
    """Any ``nn.Linear`` at all: the fallback family."""
    return any(isinstance(m, nn.Linear) for m in model.modules())


def pairs(model: nn.Module, tp: int) -> list[tuple[str, str]]:
    """(FQN, role) for each Linear of a pair: ``[("0", "col"), ("2", "row")]``."""
    out: list[tuple[str, str]] = []
    prev = None
    for fqn, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        if prev is not None and prev[1].out_features == mod.in_features and mod.in_features % tp == 0:
            out += [(prev[0], "col"), (fqn, "row")]
            prev = None
        else:
            prev = (fqn, mod)
    return out


def plan(model: nn.Module, tp: int) -> Plan:
    """Column/row pairs over the Linears of ``model``; the rest replicated."""
    table = pairs(model, tp)
    paired = {f for f, _ in table}
    rest = [(f, UNPAIRED) for f, m in model.named_modules() if isinstance(m, nn.Linear) and f not in paired]
    return build_plan(model, table, tp, FAMILY, replicate=rest)
