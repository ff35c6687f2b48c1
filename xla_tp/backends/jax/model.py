"""``JaxModel``: a torch module's parameters as sharded jax arrays, and jitted calls over them.

What ``parallelize_jax`` returns. The torch module stays the program (traced by torchax); its
parameters live in ``params`` as jax arrays laid out as the plan's layout says. Example::

    jm = xla_tp.parallelize_jax(model, plan="auto", mesh={"data": 2, "model": 4})
    logits = jm(tokens).logits                         # torch tensors in, torch tensors out
    jm.params["model.layers.0.self_attn.q_proj.weight"].sharding.spec   # PartitionSpec('model', None)
    loss, grads = jm.value_and_grad(loss_fn)(jm.params, tokens, labels)
    step = jm.train_step(loss_fn, AdamW(lr=1e-3))
    loss = step(tokens, labels)                        # jm.params updated, shardings kept

Across processes (``jax.distributed.initialize`` first, a mesh over every process's devices), every
process makes the same calls: inputs are whole in each, or each process's own rows through
``jm.process_rows(rows)``; outputs hold the whole value in every process, or (``outputs="process"``)
each process's own rows.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from torch import nn
from torch.distributed.tensor.placement_types import Replicate

from ... import lowering
from ...batch import batch_inputs
from ...plan.layout import Layout, activation_spec
from ...state import state_of
from .audit import audit_jax, compiled_hlo
from .program import Inputs, Outputs, Program, call_module, jax_view, signature
from .runtime import from_process_rows, shardy, to_jax, to_torch
from .train import TrainStep

LossFn = Callable[..., Any]  # loss_fn(module, *batch, **kwargs) -> scalar torch tensor


class JaxModel:
    """``module`` sharded on ``mesh`` by ``layout``, run through JAX.

    - ``jm(*args, **kwargs)``: jitted forward; torch tensors (or jax / numpy arrays) in, the module's
      output structure with CPU torch tensors out. Inputs are sharded on the batch (dim 0) over the
      data axes. Hugging Face models run with ``use_cache=False`` unless told otherwise.
    - ``params`` / ``buffers``: FQN -> jax array (tied parameters appear once, under their first name).
    - ``value_and_grad(loss_fn)``, ``train_step(loss_fn, optimizer)``, ``audit(*args)``, ``to_module()``.
    - ``outputs``: ``"global"`` (every process gets the whole output) or ``"process"`` (its own rows).
    """

    def __init__(self, module: nn.Module, layout: Layout, mesh: Mesh, plan: Any, outputs: str = "global"):
        self.module, self.layout, self.mesh, self.plan, self.outputs = module, layout, mesh, plan, outputs
        self._rows = tuple(layout.batch_axes) if outputs == "process" else None  # to_torch's batch_axes
        self.program = Program(module, layout, mesh)
        self.trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        self.params = {n: to_jax(p, self.sharding(n)) for n, p in module.named_parameters()}
        self.buffers = {n: to_jax(b, NamedSharding(mesh, PartitionSpec())) for n, b in module.named_buffers()}
        self._outputs: dict[tuple, Outputs] = {}
        self._takes_use_cache = "use_cache" in inspect.signature(type(module).forward).parameters
        self._forward = jax.jit(self._forward_fn, static_argnames=("static",))

    def sharding(self, name: str) -> NamedSharding:
        """The ``NamedSharding`` of parameter ``name`` under the layout (replicated if unplanned)."""
        return NamedSharding(self.mesh, PartitionSpec(*self.layout.params.get(name, ())))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arrays, static = self.inputs(args, self._defaults(kwargs))
        with shardy():
            flat = self._forward(self.params, self.buffers, arrays, static=static)
        return self._outputs[signature(arrays, static)].merge([to_torch(a, self._rows) for a in flat])

    def _forward_fn(self, params: dict, buffers: dict, arrays: tuple, static: Inputs) -> list:
        args, kwargs = static.merge(arrays)
        flat, self._outputs[signature(arrays, static)] = Outputs.split(
            self.program.run(call_module, {**params, **buffers}, args, kwargs))
        return flat

    def _defaults(self, kwargs: dict) -> dict:
        return {"use_cache": False, **kwargs} if self._takes_use_cache else kwargs

    def inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, Inputs]:
        """``(arrays, static)`` for a call: torch tensors become jax arrays sharded on the batch.

        A module whose column groups (q/k/v, gate/up) could not be found when it was parallelized
        (its forward needs real arguments) finds them on these: their forward then runs as one
        contraction, so the gradient has one reduction per group.
        """
        state = state_of(self.module)
        if state is not None and state.pending:
            host = jax.tree_util.tree_map(lambda a: to_torch(a) if isinstance(a, jax.Array) else
                                          torch.from_numpy(a) if isinstance(a, np.ndarray) else a, (args, kwargs))
            lowering.find_at_call(self.module, state, *host, embeddings=False)
        batched = {id(x) for _, x in batch_inputs(args, kwargs, getattr(self.module, "main_input_name", None))}
        return Inputs.split(args, kwargs, lambda x: self._to_array(x, id(x) in batched))

    def process_slice(self, batch: int) -> slice:
        """The rows of a batch of ``batch`` this process's devices hold, split over the data axes: what it gives
        ``process_rows`` (processes whose devices share a data shard give the same rows).
        Example: ``jm.process_rows(ids[jm.process_slice(len(ids))])``."""
        index = self._batch_sharding((batch,)).addressable_devices_indices_map((batch,)).values()
        starts = sorted({i[0].start or 0 for i in index})
        stops = sorted({batch if i[0].stop is None else i[0].stop for i in index})
        return slice(starts[0], stops[-1])

    def process_rows(self, rows: Any) -> jax.Array:
        """This process's ``rows`` of a batch input (``process_slice``), assembled with every other process's
        into one global array split over the data axes; pass it to ``jm(...)`` or a train step. Every process
        calls it. Example: ``jm(jm.process_rows(my_ids))``."""
        rows = torch.from_numpy(rows) if isinstance(rows, np.ndarray) else rows
        shards = math.prod(self.mesh.shape[a] for a in self.layout.batch_axes)
        held = len({i[0].start for i in self._batch_sharding((shards,)).addressable_devices_indices_map((shards,)).values()})
        shape = (rows.shape[0] * shards // held, *rows.shape[1:])
        return from_process_rows(rows, self._batch_sharding(shape), shape)

    def _batch_sharding(self, shape: tuple[int, ...]) -> NamedSharding:
        spec = activation_spec(Replicate(), shape, self.layout.tp_axis, self.layout.batch_axes, dict(self.mesh.shape))
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    @property
    def processes(self) -> int:
        """How many processes hold devices of the mesh."""
        return len({d.process_index for d in self.mesh.devices.flat})

    def _to_array(self, x: Any, batched: bool) -> jax.Array:
        """``x`` as a jax array: split on the batch if it carries it (``xla_tp.batch``), else replicated."""
        if isinstance(x, jax.Array):
            return x
        if isinstance(x, np.ndarray):
            x = torch.from_numpy(x)
        spec = activation_spec(Replicate(), tuple(x.shape), self.layout.tp_axis,
                               self.layout.batch_axes if batched else (), dict(self.mesh.shape))
        return to_jax(x, NamedSharding(self.mesh, PartitionSpec(*spec)))

    def loss(self, loss_fn: LossFn, constrained: bool = True) -> Callable:
        """The pure loss ``f(trainable, frozen, buffers, arrays, static) -> scalar jax array``."""
        def f(trainable: dict, frozen: dict, buffers: dict, arrays: tuple, static: Inputs) -> jax.Array:
            args, kwargs = static.merge(arrays)
            return jax_view(self.program.run(loss_fn, {**trainable, **frozen, **buffers}, args, kwargs,
                                             constrained))
        return f

    def split_params(self, params: dict) -> tuple[dict, dict]:
        """``(trainable, frozen)``: parameters with and without ``requires_grad`` in the module."""
        return ({n: a for n, a in params.items() if n in self.trainable},
                {n: a for n, a in params.items() if n not in self.trainable})

    def value_and_grad(self, loss_fn: LossFn) -> Callable[..., tuple[jax.Array, dict]]:
        """A jitted ``f(params, *batch, **kwargs) -> (loss, grads)``.

        ``loss_fn(module, *batch, **kwargs)`` is torch code returning a scalar, e.g.
        ``lambda m, x, y: F.cross_entropy(m(x).logits.flatten(0, 1), y.flatten())``. ``grads`` maps
        each trainable parameter's FQN to its gradient, sharded like the parameter.
        """
        trainable, _ = self.split_params(self.params)
        out_shardings = (NamedSharding(self.mesh, PartitionSpec()), {n: self.sharding(n) for n in trainable})
        grad_fn = jax.jit(jax.value_and_grad(self.loss(loss_fn)), static_argnames=("static",),
                          out_shardings=out_shardings)

        def value_and_grad(params: dict, *batch: Any, **kwargs: Any) -> tuple[jax.Array, dict]:
            arrays, static = self.inputs(batch, kwargs)
            with shardy():
                return grad_fn(*self.split_params(params), self.buffers, arrays, static=static)
        return value_and_grad

    def train_step(self, loss_fn: LossFn, optimizer: Any) -> "TrainStep":
        """A jitted training step over ``params``; see ``TrainStep``."""
        return TrainStep(self, loss_fn, optimizer)

    def audit(self, *args: Any, backward: bool = False, **kwargs: Any):
        """The ``AuditReport`` of the jax-compiled program of ``jm(*args, **kwargs)``."""
        return audit_jax(self, args, self._defaults(kwargs), backward)

    def hlo(self, *args: Any, backward: bool = False, **kwargs: Any) -> str:
        """The per-device HLO JAX compiles for ``jm(*args, **kwargs)`` (what ``audit`` reads)."""
        return compiled_hlo(self, args, self._defaults(kwargs), backward)

    def to_module(self) -> nn.Module:
        """Copy ``params`` and ``buffers`` into the torch module's own tensors; return the module.

        Example: ``torch.save(jm.to_module().state_dict(), "model.pt")`` after training on JAX.
        """
        state = {**self.params, **self.buffers}
        for name, t in [*self.module.named_parameters(), *self.module.named_buffers()]:
            t.data.copy_(to_torch(state[name]).to(t.dtype))
        return self.module

    def __repr__(self) -> str:
        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
        return f"JaxModel({type(self.module).__name__}, mesh({mesh}), {len(self.params)} parameters)"
