"""``TrainStep``: one jitted optimizer step over a ``JaxModel``'s parameters, shardings kept.

Parameters and optimizer state go in and come out with the same shardings (``out_shardings`` say
so, and their buffers are donated: the previous arrays are freed). Frozen parameters
(``requires_grad=False``) are inputs only. Example::

    step = jm.train_step(lambda m, x, y: F.cross_entropy(m(x).logits.flatten(0, 1), y.flatten()),
                         AdamW(lr=1e-3))
    for x, y in batches:
        loss = step(x, y)            # a jax scalar; jm.params now holds the updated parameters
"""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .runtime import shardy


class TrainStep:
    """``step(*batch, **kwargs) -> loss``; ``step.state`` is the optimizer state."""

    def __init__(self, jm: Any, loss_fn: Any, optimizer: Any):
        self.jm, self.optimizer = jm, optimizer
        trainable, _ = jm.split_params(jm.params)
        shardings = {n: jm.sharding(n) for n in trainable}
        replicated = NamedSharding(jm.mesh, PartitionSpec())
        # eager init: zeros_like keeps each parameter's sharding; anything else (a step count) is replicated
        state = optimizer.init(trainable)
        state_shardings = jax.tree.map(lambda a: a.sharding if _on_mesh(a, jm.mesh) else replicated, state)
        self.state = jax.device_put(state, state_shardings)
        grad_fn = jax.value_and_grad(jm.loss(loss_fn))

        def step(trainable: dict, frozen: dict, buffers: dict, opt_state: Any, arrays: tuple, static: Any):
            loss, grads = grad_fn(trainable, frozen, buffers, arrays, static)
            updates, opt_state = optimizer.update(grads, opt_state, trainable)
            trainable = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), trainable, updates)
            return loss, trainable, opt_state

        self._step = jax.jit(step, static_argnames=("static",), donate_argnums=(0, 3),
                             out_shardings=(replicated, shardings, state_shardings))

    def __call__(self, *batch: Any, **kwargs: Any) -> jax.Array:
        arrays, static = self.jm.inputs(batch, kwargs)
        trainable, frozen = self.jm.split_params(self.jm.params)
        with shardy():
            loss, trainable, self.state = self._step(trainable, frozen, self.jm.buffers, self.state,
                                                     arrays, static=static)
        self.jm.params.update(trainable)
        return loss


def _on_mesh(a: jax.Array, mesh: Any) -> bool:
    return isinstance(a.sharding, NamedSharding) and a.sharding.mesh == mesh
