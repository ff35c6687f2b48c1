"""Where the lowering acts: inside a parallelized model's forward, and in the backward of one.

``install_root(root, state, first)`` puts two hooks on a parallelized module: the pre-hook before any
other hook xla_tp adds to it, the post-hook after (``install_exit``), always called, so an exception
never leaves anything entered. (Not ``prepend=True``: dynamo's guards on a prepended hook's closure
name it by the dict's insertion order, and fail to build.) They track the
outermost parallelized forward of this thread: it runs outside ``torch.inference_mode`` (``inference``);
when it ends, the per-forward state (tagged packed outputs, cached group outputs) is dropped, and its
outputs' autograd nodes mark the backward that reaches them, so the lowering acts in that backward too (activation checkpointing recomputes a
block's forward there, outside any root's hooks, and must record what the original forward
recorded). ``first(root, args, kwargs)`` runs at a forward of ``root`` while its lowering is pending.
The lowering mode itself is entered around the modules that own a rewrite (``owners``), counted here.

``depth()`` says whether this thread is inside a parallelized forward; ``lowering()`` whether the
rewrites of ``entry`` act now. Example::

    install_root(model, state, first=None)
    depth()          # 0 outside any parallelized forward
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch import nn

from ..errors import PlanError
from ..inference import leave_inference, return_to_inference
from ..state import ModelState


class _ThreadState(threading.local):
    """Every attribute exists from the start in each thread (``torch.compile`` guards on their presence:
    one created lazily would recompile the compiled model at the next call)."""

    def __init__(self) -> None:
        self.depth, self.sites, self.entered, self.current, self.inference = 0, 0, 0, None, None
        self.exits: list[Callable[[], None]] = []


_state = _ThreadState()
_backward_tasks: dict[int, ModelState] = {}  # autograd graph task -> the parallelized model whose backward it runs
_suspended = [0]  # > 0: the lowering is off everywhere (``suspended``)


def depth() -> int:
    """How many parallelized roots this thread is inside (1 in the outermost one's own hooks)."""
    return _state.depth


def inside() -> bool:
    """Whether the code running now belongs to a parallelized model: its forward, or a backward that
    goes through it (its checkpointed blocks are recomputed there)."""
    if depth() > 0:
        return True
    if torch.compiler.is_compiling():  # a compiled backward is traced with its forward, never re-run here
        return False
    task = torch._C._current_graph_task_id()
    return task != -1 and task in _backward_tasks


def lowering() -> bool:
    """Whether the code running now is lowered: ``inside()``, unless ``suspended``."""
    return not _suspended[0] and inside()


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """The lowering off, in every thread, for the block (a reference run of the plain computation: its
    backward, a checkpointed block's recomputation included, runs on autograd's own threads)."""
    _suspended[0] += 1
    try:
        yield
    finally:
        _suspended[0] -= 1


def current() -> Optional[ModelState]:
    """The state of the outermost parallelized model running now (forward or backward), if any."""
    if depth() > 0:
        return _state.current
    if torch.compiler.is_compiling():
        return None
    return _backward_tasks.get(torch._C._current_graph_task_id())


def in_site() -> bool:
    """Whether this thread is inside a module that slices a packed projection (a site of ``owners``)."""
    return _state.sites > 0


def enter_mode(site: bool) -> bool:
    """Count one more module around which the lowering mode is entered (``site``: a packed-output site);
    True for the first, which enters it (``owners``)."""
    _state.entered, _state.sites = _state.entered + 1, _state.sites + site
    return _state.entered == 1


def mode_entered() -> bool:
    """Whether the lowering mode is entered in this thread (around some owner's forward)."""
    return _state.entered > 0


def leave_mode(site: bool) -> bool:
    """Count one module less; True for the last, which leaves the mode."""
    _state.entered, _state.sites = _state.entered - 1, _state.sites - site
    return _state.entered == 0


def on_exit(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the outermost parallelized forward ends (per-forward caches)."""
    _state.exits.append(callback)


def _enter_backward(state: ModelState) -> Callable[[Any], None]:
    def prehook(grad_outputs: Any) -> None:
        task = torch._C._current_graph_task_id()
        if task != -1 and task not in _backward_tasks:
            _backward_tasks[task] = state
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _backward_tasks.pop(task, None))
    return prehook


def _mark_backward(output: Any, prehook: Callable[[Any], None]) -> None:
    """Hook the autograd nodes of ``output``'s tensors: the backward that reaches them is lowered."""
    if isinstance(output, torch.Tensor):
        if output.grad_fn is not None:
            output.grad_fn.register_prehook(prehook)
    elif isinstance(output, Mapping):
        for value in output.values():
            _mark_backward(value, prehook)
    elif isinstance(output, (tuple, list)):
        for value in output:
            _mark_backward(value, prehook)


def _check_on_device(root: nn.Module, home: str) -> None:
    """A parallelized model moved off the XLA device (``model.to("cpu")``) keeps weights laid out for the
    devices (re-laid packed projections, zero heads) that nothing reads right there: refused, with the fix."""
    p = next(root.parameters(), None)
    if p is not None and p.device.type not in (home, "meta"):
        raise PlanError(f"{type(root).__name__} is parallelized by xla_tp but its parameters are on {p.device}: "
                        f"call xla_tp.unparallelize(model) before moving it off the XLA device (its weights go back "
                        f"to the model's own layout), or move it back with model.to(torch_xla.device())")


def install_root(root: nn.Module, state: ModelState,
                 first: Optional[Callable[[nn.Module, ModelState, tuple, dict], None]]) -> None:
    """The pre-hook of ``root`` (see the module docstring): call it before xla_tp adds any other hook
    to ``root``, and ``install_exit`` after. The handles go to ``state``."""
    def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        _state.depth = depth() + 1  # the exit hook, called even when the forward raises, takes it back
        if _state.depth == 1 and state.home and not torch.compiler.is_compiling():
            _check_on_device(module, state.home)
        if _state.depth == 1:
            _state.current, _state.inference = state, leave_inference()
            if state.pending and first is not None:
                _first(first, module, state, args, kwargs)

    def leave(module: nn.Module, args: Any, output: Any) -> Any:
        _state.depth = depth() - 1
        if _state.depth != 0:
            return None
        callbacks, _state.exits, _state.current = _state.exits, [], None
        for callback in callbacks:
            callback()
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            _mark_backward(output, _enter_backward(state))
        context, _state.inference = _state.inference, None
        return return_to_inference(context, output)

    model = type(root).__name__
    state.handles.append(root.register_forward_pre_hook(_RootHook(enter, model), with_kwargs=True))
    state.exit_hook = _RootHook(leave, model)


class _RootHook:
    """A hook of the root, which a copy of the model cannot take along: ``copy.deepcopy`` and ``pickle``
    (``torch.save(model)``) of a parallelized model reach it and stop with the fix. A deep copy would hold
    the weights laid out for the devices (packed projections re-laid, zero heads) with this model's state
    running its forward, and compute something else."""

    def __init__(self, hook: Callable[..., Any], model: str) -> None:
        self.hook, self.model = hook, model

    def __call__(self, *args: Any) -> Any:
        return self.hook(*args)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise PlanError(f"{self.model} is parallelized by xla_tp and cannot be copied or pickled as it is: copy it "
                        f"before parallelize_xla (then parallelize the copy too), save its state_dict() or an "
                        f"xla_tp.save_checkpoint (both in the model's own layout), or xla_tp.unparallelize it first")


def install_exit(root: nn.Module, state: ModelState) -> None:
    """The post-hook of ``root``, after every other hook xla_tp added to it (it runs last: it hands the
    outputs back to inference mode)."""
    state.handles.append(root.register_forward_hook(state.exit_hook, always_call=True))


@torch.compiler.disable  # under torch.compile: run as is, between two compiled graphs (the first step only)
def _first(first: Callable, module: nn.Module, state: ModelState, args: tuple, kwargs: dict) -> None:
    first(module, state, args, kwargs)
