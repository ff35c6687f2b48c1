"""Read what the compiled program communicates, computes and stores: ``audit`` -> ``AuditReport``.

Example::

    report = xla_tp.audit(model, tokens, mesh=mesh)
    print(report)
"""
from .report import AuditReport
from .run import audit

__all__ = ["AuditReport", "audit"]
