"""Backends: where a validated layout is carried out.

torch_xla's (``spmd``: ``mark_sharding`` or ``distribute_tensor`` per parameter, ``annotate``: the
activations' constraints, ``place``, ``init``, ``host``, ``submesh``) and JAX's (``jax``: ``parallelize_jax``);
``torchax``: importing torchax for both. Nothing here is imported with the package: each adapter loads
its own runtime when used.
"""
