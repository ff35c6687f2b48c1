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
    """A checkpoint that does not fit the model (names, shapes), is damaged (a file missing, truncated
    or altered: the message names it), or cannot be read or written (a full disk says so). A load
    raises it with the model and optimizer exactly as they were; a save, with nothing left behind.

    Example::

        try:
            xla_tp.load_checkpoint("ckpt/step_00000100", model, opt)
        except CheckpointError as e:
            print(e)   # ... __0_0.distcp is 1,024 bytes, 2,048 when saved (truncated); nothing was loaded ...
    """


class GenerationError(ValueError):
    """A ``generate`` call that cannot run: a model that is not a causal LM (or not parallelized), a
    prompt longer than the model's positions, ``max_new_tokens < 1``, a sampling setting out of range.
    Raised before anything is allocated or compiled; the message names the input and what to pass."""
