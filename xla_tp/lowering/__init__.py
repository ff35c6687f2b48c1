"""Lowering at run time: ops rewritten during a parallelized forward so the compiler keeps shardings.

``install(module)`` covers a module's forward with the lowering mode (``mode``): attention with
visible heads (``attention``), spelled-out LayerNorm, re-laid packed projections (``packed``).
"""
from .attention import use_flash_attention
from .mode import install, uninstall

__all__ = ["install", "uninstall", "use_flash_attention"]
