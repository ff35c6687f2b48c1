"""One forward traced on fake tensors (``trace``), and how split features flow through it (``ops``, ``regions``)."""
from . import indexing, partners, vocab  # noqa: F401  (register slicing, depthwise convolutions and the
# vocabulary-parallel loss with ops.step)
