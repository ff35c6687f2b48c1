"""The two errors xla_tp raises for bad input: both are ``ValueError`` subclasses."""


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
