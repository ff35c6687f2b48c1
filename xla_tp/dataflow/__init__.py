"""One forward traced on fake tensors (``trace``), and how split features flow through it (``ops``, ``regions``)."""
from . import vocab  # noqa: F401  (registers the vocabulary-parallel softmax and loss with ops.step)
