"""Read what the compiled program communicates, computes and stores: ``audit`` -> ``AuditReport``.

Reading partitioned HLO (``hlo``), the plan's minimum (``minimum``) and the report need torch only;
``run.audit`` compiles a torch model's program with torch_xla (the JAX backend has its own, ``jm.audit``).
Example::

    report = xla_tp.audit(model, tokens, mesh=mesh)
    print(report)
"""
from .report import AuditReport

__all__ = ["AuditReport"]
