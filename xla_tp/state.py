"""One state per parallelized model: what xla_tp knows about it and what it changed, in one place.

``parallelize_xla`` builds a ``ModelState`` for the module it is given and registers it here (a weak
registry: the state goes with the model). It holds the call's layout and mesh, the sharding each
parameter got, every hook the call added, the lowering found for the model (column groups,
vocabulary tables, tied heads, re-laid packed projections) and its lease on the compatibility
effects. A parameter xla_tp sharded carries one attribute, ``_xla_tp``, its ``ParamState``: what the
lowering reads during a forward, where a lookup must be cheap and visible to ``torch.compile``.
Nothing else is left on user objects. ``unparallelize`` takes it all off. Example::

    model = xla_tp.parallelize_xla(model, "auto", mesh=mesh)
    layout_of(model).params["lm_head.weight"]     # ('model', None): every call on the model, merged
    state_of(model).groups                        # [('model.layers.0.self_attn.q_proj', ...), ...]
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .errors import PlanError
from .plan.layout import Layout

PARAM_ATTR = "_xla_tp"
_calls = itertools.count(1)
_states: WeakIdKeyDictionary = WeakIdKeyDictionary()  # module -> ModelState of the call made on it


@dataclass(eq=False)
class ParamState:
    """What xla_tp knows of one parameter: its sharding record (backend's), and the lowering's roles."""

    sharding: Any = None  # the backend's record of the sharding it applied (``ParamSharding``)
    packing: Any = None  # ``Packing`` of a re-laid packed projection
    vocab: Any = None  # ``embedding.VocabSplit`` of a vocabulary-split table
    tie: Any = None  # ``tied.Tie`` when an LM head reads the table too
    group: Any = None  # ``groups.ColumnGroup`` it belongs to
    experts: Any = None  # ``experts.ExpertSet`` of the MoE layer whose routed weight it is


@dataclass(frozen=True)
class ParamSharding:
    """The sharding torch_xla's backend gave a parameter (``guard`` restores it after optimizer steps)."""

    fqn: str
    mesh: Any  # an ``xs.Mesh``
    spec: Any  # a ``plan.layout.Spec``
    expected: str  # the HLO sharding string right after annotation


def record_of(p: torch.Tensor) -> Optional[ParamSharding]:
    """The sharding recorded for ``p`` (None if xla_tp did not shard it)."""
    return getattr(param_state(p), "sharding", None)


def param_state(t: Any) -> Optional[ParamState]:
    """``t``'s ``ParamState`` (any object: cheap enough to call on every op argument)."""
    return getattr(t, PARAM_ATTR, None)


def ensure_param_state(p: torch.Tensor) -> ParamState:
    """``p``'s ``ParamState``, made if it has none."""
    ps = param_state(p)
    if ps is None:
        ps = ParamState()
        setattr(p, PARAM_ATTR, ps)
    return ps


def clear_param_state(p: torch.Tensor) -> None:
    p.__dict__.pop(PARAM_ATTR, None)


@dataclass(eq=False)
class ModelState:
    """One ``parallelize_xla`` call, as kept for the module it was given (see the module docstring)."""

    layout: Layout
    mesh: Any
    tp: int
    call: int = field(default_factory=lambda: next(_calls))  # order of the calls: later ones win
    records: dict[str, Any] = field(default_factory=dict)  # parameter FQN -> the sharding record it left
    constraints: dict[int, tuple[Any, list[Any]]] = field(default_factory=dict)  # id(module) -> (weakref, handles)
    implied: dict[int, Any] = field(default_factory=dict)  # id(module) -> its implied output constraint's handle
    handles: list[Any] = field(default_factory=list)  # other hooks: scope, inference, packed state dicts
    relaid: dict[str, Any] = field(default_factory=dict)  # parameter FQN -> Packing applied to it
    sites: set[str] = field(default_factory=set)  # modules that slice a re-laid packed projection
    concats: dict[tuple[int, ...], int] = field(default_factory=dict)  # concatenations laid device-major: their
    # pieces' sizes -> over how many devices (``lowering.concat``)
    tagged_concats: set[tuple[int, ...]] = field(default_factory=set)  # those read channel by channel: tagged
    owners: dict[str, str] = field(default_factory=dict)  # module FQN -> the rewrite it owns (``lowering.owners``)
    owner_handles: list[Any] = field(default_factory=list)  # (weakref to module, its hooks) (found again: replaced)
    groups: list[tuple[str, ...]] = field(default_factory=list)  # column groups found (member FQNs)
    tables: list[str] = field(default_factory=list)  # vocabulary-split tables found (module FQNs)
    experts: list[str] = field(default_factory=list)  # MoE layers found (module FQNs)
    moe_options: Any = None  # ``experts.MoeOptions`` shared by its MoE layers (capacity, dropless)
    pending: bool = False  # the lowering is found at the next forward (it could not be traced before)
    home: str = ""  # the device type its parameters were placed on ("xla"; the JAX backend keeps torch's CPU tensors)
    exit_hook: Any = None  # the root's last post-hook (``lowering.scope``), registered after the others
    lease: Any = None  # on the compatibility effects (``compat``)
    sharder: Any = None  # the backend's ``constraints.Sharder`` on the mesh (lays out activations inside the lowering)
    finalizer: Any = None
    modules: Any = field(default_factory=weakref.WeakSet)  # the modules of the model when it was parallelized

    def explain(self) -> str:
        """What this call did, as text: the mesh, each planned module's style, the lowering it found.

        Example: ``print(xla_tp.state_of(model).explain())``."""
        sizes = dict(zip(getattr(self.mesh, "axis_names", ()), getattr(self.mesh, "mesh_shape", ())))
        mesh = " x ".join(f"{a}={int(s)}" for a, s in sizes.items()) or str(self.mesh)
        lines = [f"parallelize call #{self.call} on mesh {mesh} (tensor-parallel axis {self.layout.tp_axis!r}, "
                 f"batch over {list(self.layout.batch_axes) or 'nothing'})",
                 f"modules planned ({len(self.layout.modules)}):"]
        lines += [f"  {fqn or '<root>'}: {ml.style} (key {ml.source!r})" for fqn, ml in self.layout.modules.items()]
        lines.append(f"parameters sharded: {sum(1 for r in self.records.values() if r is not None)}")
        if int(sizes.get("context", 1)) > 1:
            lines.append(f"context parallelism: the sequence split {int(sizes['context'])} ways over 'context' for "
                         f"the whole model; attention gathers keys and values over it (queries stay split)")
        if self.pending:
            lines.append("lowering: found at the next forward (the model could not be traced before it)")
        else:
            lines.append(f"column groups (one input gradient each): {[list(g) for g in self.groups] or 'none'}")
            lines.append(f"vocabulary tables (per-device gradients): {self.tables or 'none'}")
            if self.experts:
                lines.append(f"MoE layers (static slots, {self.moe_options}): {self.experts}")
            owned = {}
            for fqn, what in self.owners.items():
                owned.setdefault(what, []).append(fqn or "<root>")
            lines += [f"rewrites owned by ({what}): {fqns}" for what, fqns in sorted(owned.items())]
        if self.relaid:
            lines.append(f"packed projections re-laid device-major: {sorted(self.relaid)}")
        return "\n".join(lines)

    def add_constraint_hooks(self, module: nn.Module, handles: list[Any]) -> None:
        ref, old = self.constraints.get(id(module), (weakref.ref(module), []))
        self.constraints[id(module)] = (ref, [*old, *handles])

    def remove_constraint_hooks(self, key: int) -> None:
        """Remove the constraint hooks this call put on the module ``id(module) == key``."""
        _, handles = self.constraints.pop(key, (None, []))
        for handle in handles:
            handle.remove()
        self.implied.pop(key, None)

    def constraint_handles(self) -> list[Any]:
        return [h for _, handles in self.constraints.values() for h in handles]

    def remove_hooks(self) -> None:
        for _, handles in self.constraints.values():
            for handle in handles:
                handle.remove()
        for handle in [*self.handles, *(h for _, handles in self.owner_handles for h in handles)]:
            handle.remove()
        self.constraints, self.implied, self.handles, self.owner_handles = {}, {}, [], []


def register(module: nn.Module, state: ModelState, release: Callable[[], None]) -> None:
    """Make ``state`` the state of ``module``; ``release`` runs when it is dropped or the module dies."""
    _states[module] = state
    state.finalizer = weakref.finalize(module, release)


def drop(module: nn.Module) -> Optional[ModelState]:
    """Forget ``module``'s state (its hooks and lease are the caller's to undo); the state, if any."""
    state = _states.pop(module, None)
    if state is not None and state.finalizer is not None:
        state.finalizer()
    return state


def state_of(module: nn.Module) -> Optional[ModelState]:
    """The state of the last call made on ``module`` itself (not on its parents or children)."""
    return _states.get(module)


def states_under(model: nn.Module) -> Iterator[tuple[str, nn.Module, ModelState]]:
    """``(prefix, module, state)`` for every parallelized module of ``model`` (itself included)."""
    for prefix, mod in model.named_modules(remove_duplicate=False):
        state = _states.get(mod)
        if state is not None:
            yield prefix, mod, state


def all_states() -> Iterator[tuple[nn.Module, ModelState]]:
    return iter(list(_states.items()))


def outermost(module: nn.Module) -> nn.Module:
    """The outermost parallelized module that contains ``module`` (``module`` itself if none does)."""
    best, size = module, -1
    for root, _ in all_states():
        if any(m is module for m in root.modules()):
            n = sum(1 for _ in root.modules())
            if n > size:
                best, size = root, n
    return best


def constraint_handles(model: nn.Module) -> list[Any]:
    """The handles of every constraint hook xla_tp put on ``model`` or a module in it (for suspending them)."""
    inside = {id(m) for m in model.modules()}
    return [h for _, state in all_states() for key, (_, handles) in state.constraints.items() if key in inside
            for h in handles]


def drop_implied_output(module: nn.Module) -> None:
    """Take off ``module``'s output constraint where it only restates its weights' split (a
    column-parallel output), for modules whose output never leaves the program (column-group members)."""
    for _, state in all_states():
        handle = state.implied.pop(id(module), None)
        if handle is not None:
            handle.remove()


def stale_params(module: nn.Module, layout: Layout) -> set[str]:
    """Parameters the previous call on ``module`` sharded that ``layout`` leaves out.

    A parameter that a later call (on a parent or a child) sharded again belongs to that call
    and is not stale. Example: MLP parallelized with fc1 and fc2, then again with fc2 only ->
    ``{"fc1.weight", "fc1.bias"}``.
    """
    previous = state_of(module)
    if previous is None:
        return set()
    params = dict(module.named_parameters())
    return {name for name, record in previous.records.items()
            if record is not None and name not in layout.params and name in params
            and getattr(param_state(params[name]), "sharding", None) is record}


def added_modules(model: nn.Module) -> dict[str, nn.Module]:
    """FQN -> module, for each module of ``model`` that holds parameters of its own and was not there when
    ``model`` (or the model around it) was parallelized: an adapter such as LoRA's ``lora_A``/``lora_B``,
    added by ``peft.get_peft_model`` after ``parallelize_xla``. Empty when nothing under ``model`` is parallelized."""
    known: set[int] = set()
    found = [state for _, _, state in states_under(model)]
    for root, state in all_states():
        if any(m is model for m in root.modules()):
            found.append(state)
    for state in found:
        known |= {id(m) for m in state.modules}
    if not known:
        return {}
    return {fqn: m for fqn, m in model.named_modules()
            if id(m) not in known and next(m.parameters(recurse=False), None) is not None}


def layout_of(model: nn.Module) -> Optional[Layout]:
    """Every layout applied to ``model`` and its submodules, merged (FQNs relative to ``model``).

    torch's idiom parallelizes a model in several calls (the root, then each block): where two calls
    plan the same module or parameter, the later call wins. None when nothing under ``model`` was
    parallelized; calls on different axes cannot be merged (``PlanError``). Example::

        parallelize_module(model, tp_mesh, {"tok_embeddings": RowwiseParallel()})
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, {"attention.wq": ColwiseParallel()})
        layout_of(model).params   # {'tok_embeddings.weight': ..., 'layers.0.attention.wq.weight': ...}
    """
    found = sorted(((state.call, prefix, state.layout) for prefix, _, state in states_under(model)),
                   key=lambda item: item[0])
    if not found:
        return None
    axes = {(layout.tp_axis, layout.batch_axes) for _, _, layout in found}
    if len(axes) > 1:
        where = ", ".join(f"{prefix or '<root>'}: tp {layout.tp_axis!r}, batch {layout.batch_axes}"
                          for _, prefix, layout in found)
        raise PlanError(f"the model was parallelized by calls on different axes ({where}); parallelize every "
                        f"part on the same mesh and tensor-parallel axis, or pass plan_layout= to the audit")
    (tp_axis, batch_axes), = axes
    merged = Layout(tp_axis=tp_axis, batch_axes=batch_axes)
    for _, prefix, layout in found:
        for fqn, module_layout in layout.modules.items():
            merged.modules[_join(prefix, fqn)] = replace(module_layout, fqn=_join(prefix, fqn))
        merged.params.update({_join(prefix, name): spec for name, spec in layout.params.items()})
    return merged


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name
