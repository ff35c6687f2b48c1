"""``AdamW`` for JAX with torch's semantics, in optax's protocol (``init`` / ``update``).

``update`` returns additive updates, as optax transformations do, so ``JaxModel.train_step`` takes
this or any optax optimizer (``optax.adamw(1e-3)``). The arithmetic is ``torch.optim.AdamW``'s:
decoupled weight decay ``p * (1 - lr * wd)``, bias-corrected moments, ``eps`` added after the
square root of the corrected second moment. Example::

    opt = AdamW(lr=1e-3, weight_decay=0.01)
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class AdamWState(NamedTuple):
    """Step count and first/second moments (trees like the parameters, sharded like them)."""

    count: jax.Array
    mu: Any
    nu: Any


@dataclass(frozen=True)
class AdamW:
    """``torch.optim.AdamW(lr, betas, eps, weight_decay)`` as an optax-style transformation."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    def init(self, params: Any) -> AdamWState:
        """Zero moments shaped and sharded like ``params``."""
        return AdamWState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params),
                          jax.tree.map(jnp.zeros_like, params))

    def update(self, grads: Any, state: AdamWState, params: Any) -> tuple[Any, AdamWState]:
        """``(updates, new_state)``: ``params + updates`` is torch's AdamW step."""
        b1, b2 = self.betas
        count = state.count + 1
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
        step_size = self.lr / (1 - b1 ** count)
        root_bc2 = jnp.sqrt(1 - b2 ** count)

        def delta(p: jax.Array, m: jax.Array, v: jax.Array) -> jax.Array:
            decayed = p * (1 - self.lr * self.weight_decay)
            return (decayed - step_size * m / (jnp.sqrt(v) / root_bc2 + self.eps) - p).astype(p.dtype)

        return jax.tree.map(delta, params, mu, nu), AdamWState(count, mu, nu)
