"""``AuditReport``: what one compiled program communicates, computes and stores, per device.

Example::

    report = xla_tp.audit(model, tokens, mesh=mesh)
    print(report)                      # a table
    report.comm_ratio                  # 1.0 = no communication beyond what the plan implies
    json.dumps(report.to_dict())
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    """``num / den``; 1.0 for 0/0, inf for x/0, None when either is unknown.

    >>> ratio(3, 2), ratio(0, 0), ratio(None, 2)
    (1.5, 1.0, None)
    """
    if num is None or den is None:
        return None
    if den == 0:
        return 1.0 if num == 0 else math.inf
    return num / den


@dataclass
class AuditReport:
    """Per-device facts of one partitioned program (docs/audit.md).

    ``collectives``: kind -> ``{"count", "bytes", "axes"}`` (bytes per device, result size; axes:
    the mesh axes each group spans, e.g. ``["model"]``). ``expected``: the same for what the plan's
    layouts imply. Ratios are None when their denominator is unknown (no plan layout, a function
    instead of a module).
    """

    mesh: dict[str, int]
    backward: bool
    collectives: dict[str, dict[str, Any]]
    comm_bytes: int
    expected: dict[str, dict[str, Any]] = field(default_factory=dict)
    comm_minimum_bytes: Optional[int] = None
    flops_per_device: int = 0
    unsharded_flops: Optional[int] = None
    param_bytes_per_device: Optional[int] = None
    param_bytes_total: Optional[int] = None
    temp_bytes_per_device: Optional[int] = None  # peak temporary memory (XLA's buffer assignment; jaxlib's route)
    notes: list[str] = field(default_factory=list)

    @property
    def comm_ratio(self) -> Optional[float]:
        return ratio(self.comm_bytes, self.comm_minimum_bytes)

    @property
    def compute_balance(self) -> Optional[float]:
        devices = math.prod(self.mesh.values())
        return ratio(self.flops_per_device * devices, self.unsharded_flops)

    @property
    def param_memory_ratio(self) -> Optional[float]:
        if self.param_bytes_total is None:
            return None
        ideal = self.param_bytes_total / self.mesh.get("model", 1)
        return ratio(self.param_bytes_per_device, ideal)

    def count(self, kind: str) -> int:
        """Number of ``kind`` collectives: ``report.count("all-gather")``."""
        return self.collectives.get(kind, {}).get("count", 0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: fields plus the three ratios (inf written as None)."""
        out = asdict(self)
        for name in ("comm_ratio", "compute_balance", "param_memory_ratio"):
            value = getattr(self, name)
            out[name] = None if value is None or math.isinf(value) else round(value, 6)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AuditReport":
        """Inverse of :meth:`to_dict` (ratios are recomputed)."""
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})

    def __str__(self) -> str:
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
        lines = [f"xla_tp audit ({'forward+backward' if self.backward else 'forward'}, mesh {mesh})",
                 _collective_table(self.collectives, self.expected)]
        rows = [("communication bytes/device", _num(self.comm_bytes), _num(self.comm_minimum_bytes),
                 _fmt(self.comm_ratio)),
                ("dot FLOPs x devices", _num(self.flops_per_device * math.prod(self.mesh.values())),
                 _num(self.unsharded_flops), _fmt(self.compute_balance)),
                ("parameter bytes/device", _num(self.param_bytes_per_device),
                 _num(None if self.param_bytes_total is None
                      else self.param_bytes_total // self.mesh.get("model", 1)),
                 _fmt(self.param_memory_ratio))]
        if self.temp_bytes_per_device is not None:
            rows.append(("peak temporary bytes/device", _num(self.temp_bytes_per_device), "-", "-"))
        lines.append(_table(("metric", "measured", "ideal", "ratio"), rows))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _collective_table(found: dict[str, dict], expected: dict[str, dict]) -> str:
    kinds = list(dict.fromkeys([*found, *expected]))
    rows = [(k, str(found.get(k, {}).get("count", 0)), _num(found.get(k, {}).get("bytes", 0)),
             ",".join(found.get(k, {}).get("axes", [])) or "-",
             str(expected.get(k, {}).get("count", 0)), _num(expected.get(k, {}).get("bytes", 0)))
            for k in kinds]
    return _table(("collective", "count", "bytes/device", "mesh axes", "plan count", "plan bytes"),
                  rows or [("(none)", "0", "0", "-", "0", "0")])


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows])


def _num(value: Optional[int]) -> str:
    return "?" if value is None else f"{value:,}"


def _fmt(value: Optional[float]) -> str:
    return "?" if value is None else f"{value:.3f}"
