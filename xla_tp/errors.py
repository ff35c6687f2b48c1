"""The errors xla_tp raises for bad input: all are ``ValueError`` subclasses."""


class PlanError(ValueError):
    """A plan that cannot be applied. Raised before any parameter is touched.

    Example::

        try:
            parallelize_xla(model, {"layers.*.qproj": ColwiseParallel()})
        except PlanError as e:
            print(e)   # names the key and suggests 'layers.*.q_proj'
    """


class MeshError(ValueError):
    """A mesh that cannot be built or used (wrong device count, unknown axis)."""


class OptimizerError(ValueError):
    """An optimizer that cannot keep its state on a parallelized model; raised before its first step
    changes anything, naming the reason and an optimizer that works."""


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model (names, shapes) or cannot be read or written.
    Raised before the model or optimizer is touched."""
