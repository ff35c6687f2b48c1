"""``audit``: compile a module (or function) as it is sharded now, read the partitioned program.

Nothing is executed and nothing in the process changes: the module runs through
``torch.func.functional_call`` with cloned buffers (in-place buffer updates land on the clones),
gradients come from ``torch.autograd.grad`` (no ``.grad`` is written), the XLA RNG seed is put
back, every parameter's and input's sharding annotation is left as it was, temporary hooks are
removed, and the captured tensors are dropped uncomputed. The trace runs in this process, so a
forward that fails raises the model's own error.

The layout that defines the communication minimum is every layout applied to the module, merged
(``layout_of``: a model parallelized in several calls is audited against all of them). The
partitioned program comes from ``capture_partitioned_hlo``: torch_xla's own compiler, unless the
process read torch_xla's HLO before with ``XLA_DUMP_POST_OPTIMIZATIONS`` unset (then jaxlib's XLA). Example::

    report = audit(model, tokens, mesh=mesh, backward=True)
    assert report.count("all-gather") == 0
"""
from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_leaves, tree_map

from ..axes import batch_axes
from ..batch import main_input, uneven_note
from ..errors import PlanError
from ..lowering import scope
from ..lowering.routed import route_notes
from ..lowering.packed import original_shape
from ..mesh import MeshLike, to_xs_mesh
from ..plan.layout import Layout
from ..state import constraint_handles, layout_of
from .capture import capture_partitioned_hlo, capture_program, route
from .hlo import dot_flops
from .figures import report_from_hlo, set_minimum
from .live import unread
from .minimum import ActivationRecorder
from .params import param_bytes, sharding_string
from .report import AuditReport

Target = Union[nn.Module, Callable[..., Any]]


RESERVED = ("mesh", "backward", "plan_layout")  # audit's own keywords: never a model input


def audit(module_or_fn: Target, *example_args: Any, mesh: MeshLike = None, backward: bool = False,
          plan_layout: Optional[Layout] = None, **example_kwargs: Any) -> AuditReport:
    """Audit the compiled, partitioned program of ``module_or_fn(*example_args, **example_kwargs)``: the
    inputs as the model takes them, by position or by keyword as Hugging Face users pass them
    (``audit(model, mesh=mesh, **tokenizer(text, return_tensors="pt"))``), traced as given, so the
    program is the one the same call compiles. ``mesh``, ``backward`` and ``plan_layout`` are the audit's
    own: a model with an input of one of those names is refused (wrap it in a module that passes it).

    ``plan_layout`` (default: every layout ``parallelize_xla`` applied to the module and its
    submodules, merged) defines the communication minimum. Example::

        model = xla_tp.parallelize_xla(model, plan, mesh=mesh)
        print(xla_tp.audit(model, x, mesh=mesh))
        print(xla_tp.audit(model, mesh=mesh, input_ids=ids, attention_mask=mask))
    """
    _refuse_reserved(module_or_fn)
    xmesh = to_xs_mesh(mesh)
    with warnings.catch_warnings():  # the model's own warning of an uneven batch: the audit's below says it once
        warnings.filterwarnings("ignore", message=r"xla_tp: .*batch \d+ does not divide")
        report = audit_here(module_or_fn, example_args, xmesh, backward, plan_layout, kwargs=example_kwargs)
    note = _uneven_batch(module_or_fn, example_args, example_kwargs, xmesh)
    if note is not None:
        warnings.warn(f"xla_tp: {note}; the audit measures that program", stacklevel=2)
        report.notes.append(note)
    return report


def _refuse_reserved(target: Target) -> None:
    """``PlanError`` when ``target`` takes an input named like one of the audit's own keywords."""
    forward = target.forward if isinstance(target, nn.Module) else target
    try:
        names = set(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return
    clash = sorted(names & set(RESERVED))
    if clash:
        raise PlanError(f"audit: {type(target).__name__} takes an input named {clash[0]!r}, which is one of the "
                        f"audit's own keywords ({', '.join(RESERVED)}); audit a small module whose forward passes "
                        f"it on under another name")


def _uneven_batch(target: Target, args: tuple, kwargs: dict, xmesh: Any) -> Optional[str]:
    """What the program does with a batch that does not divide over the mesh's batch axes (None: it does)."""
    sizes = dict(zip(xmesh.axis_names, (int(s) for s in xmesh.mesh_shape)))
    main = main_input(args, kwargs, getattr(target, "main_input_name", None))
    return None if main is None else uneven_note(main.shape[0], batch_axes(sizes), sizes)


def audit_here(target: Target, args: tuple, xmesh: Any, backward: bool,
               plan_layout: Optional[Layout], unsharded_flops: Optional[int] = None,
               kwargs: Optional[dict] = None) -> AuditReport:
    """``audit`` on an ``xs.Mesh``.

    ``unsharded_flops``, when the caller knows it, saves compiling the unsharded program.
    """
    kwargs = kwargs or {}
    module = target if isinstance(target, nn.Module) else None
    layout = plan_layout or (layout_of(module) if module is not None else None)
    seed = xm.get_rng_state()
    kept = _Annotations([*(module.parameters() if module is not None else ()), *tree_leaves((args, kwargs))])
    try:
        program, calls, gathers, unused, unreached = _trace(target, args, kwargs, backward, layout)
        text = program.text
        unsharded = unsharded_flops
        if unsharded is None and module is not None:
            unsharded = unsharded_dot_flops(module, args, backward, kwargs)
    finally:
        xm.set_rng_state(seed)
        kept.restore()
    ids = np.asarray(xmesh.device_ids).reshape(tuple(xmesh.mesh_shape))
    report, found = report_from_hlo(text, ids, tuple(str(n) for n in xmesh.axis_names), backward, unsharded)
    report.temp_bytes_per_device = program.temp_bytes
    if module is not None:
        report.param_bytes_per_device, report.param_bytes_total = param_bytes(module)
        report.notes += route_notes(module)
    else:
        report.notes.append("a function, not a module: no parameter bytes or compute balance")
    if layout is not None and module is not None:
        set_minimum(report, calls, module, layout, found, gathers=gathers, zero_grads=unreached)
        if unused:
            report.notes.append(f"{len(unused)} calls of planned modules compute what the call's outputs never read "
                                f"(e.g. {unused[0]}): the program drops that work, the minimum counts none of it")
    else:
        report.notes.append("no plan layout: the communication minimum is unknown")
    if route() == "jaxlib":
        report.notes.append("partitioned by jaxlib's XLA for CPU, which may partition some programs differently "
                            "(this process read torch_xla's HLO before with XLA_DUMP_POST_OPTIMIZATIONS unset; set "
                            "it at start-up to read the device compiler's own program)")
    return report


class _Annotations:
    """Tensors without a sharding annotation, given none back after tracing.

    Lowering a traced program annotates the IR node of every unannotated input ``{replicated}``,
    and torch_xla adopts a node's annotation into its tensor on a later read (the read after
    that returns it): the audit must not change what the user's tensors carry, so the tensors
    that had none are cleared unconditionally (a no-op for a tensor that still has none).
    """

    def __init__(self, tensors: list[Any]):
        self.bare = [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "xla"
                     and not sharding_string(t)]

    def restore(self) -> None:
        for t in self.bare:
            torch_xla._XLAC._xla_clear_sharding(t)


def _trace(target: Target, args: tuple, kwargs: dict, backward: bool, layout: Optional[Layout]):
    """Trace forward (and backward) lazily; return the partitioned program, the recorded calls the program reads
    (``live.unread``: a call none of whose tensor outputs it reads is left out), the context gathers, the
    FQNs of the calls left out, and the parameters whose gradient the outputs do not reach."""
    module = target if isinstance(target, nn.Module) else None
    if module is None or layout is None:
        return capture_program(_outputs(target, args, kwargs, backward, None)[0]), [], [], [], set()
    with ActivationRecorder(module, layout) as recorder:
        tensors, unreached = _outputs(module, args, kwargs, backward, dict(module.named_parameters()))
    produced = [(c, t) for c in recorder.calls for t in c.outputs if isinstance(t, torch.Tensor)]
    missed = unread(tensors, [t for _, t in produced])
    read = {id(c) for k, (c, _) in enumerate(produced) if k not in missed}
    unused = {id(c) for c, _ in produced} - read
    kept = [c for c in recorder.calls if id(c) not in unused]
    return (capture_program(tensors), kept, recorder.gathers, [c.fqn for c in recorder.calls if id(c) in unused],
            unreached)


def _outputs(target: Target, args: tuple, kwargs: dict, backward: bool,
             params: Optional[dict[str, torch.Tensor]]) -> tuple[list[torch.Tensor], set[str]]:
    """Forward outputs, plus with ``backward`` the gradients of their sum w.r.t. ``params`` (zeros for a parameter
    the sum does not reach); and the names of those parameters."""
    if isinstance(target, nn.Module):
        buffers = {n: b.clone() for n, b in target.named_buffers()}
        out = functional_call(target, {**(params or {}), **buffers}, args, kwargs)
    else:
        out = target(*args, **kwargs)
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not backward:
        return leaves, set()
    named = [(n, p) for n, p in (params or {}).items() if p.requires_grad]
    named += [("", a) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.requires_grad]
    loss = sum(t.float().sum() for t in leaves if t.requires_grad)
    if not named or not isinstance(loss, torch.Tensor):
        raise ValueError("audit(backward=True): nothing requires a gradient")
    grads = torch.autograd.grad(loss, [w for _, w in named], allow_unused=True)
    unreached = {n for (n, _), g in zip(named, grads) if g is None and n}
    return leaves + [torch.zeros_like(w) if g is None else g for (_, w), g in zip(named, grads)], unreached


def unsharded_dot_flops(module: nn.Module, args: tuple, backward: bool, kwargs: Optional[dict] = None) -> int:
    """Dot FLOPs of the same computation with no sharding anywhere (fresh unannotated inputs), on the
    model's original shapes (zero heads the plan added count as work).

    xla_tp's constraint hooks are suspended while it traces; values do not matter for FLOPs.
    """
    device = next((p.device for p in module.parameters()), torch.device("xla"))
    # the model as written: a weight padded with zero heads (or grown by copies) takes its original shape
    params = {n: _distinct(original_shape(p), p.dtype, device, i).requires_grad_(p.requires_grad)
              if p.is_floating_point() else p.detach().cpu().to(device)
              for i, (n, p) in enumerate(module.named_parameters())}
    plain = tree_map(lambda a: a.detach().cpu().to(device).requires_grad_(a.requires_grad)
                     if isinstance(a, torch.Tensor) else a, (args, kwargs or {}))
    with _suspended_hooks(module), scope.suspended():
        return dot_flops(capture_partitioned_hlo(_outputs(module, *plain, backward, params)[0]))


def _distinct(shape: torch.Size, dtype: torch.dtype, device: torch.device, index: int) -> torch.Tensor:
    """Values no two parameters share, made in the program from one small vector per dimension
    (``w[i, j] = i + j + index``; nothing the size of the weight exists on the host or a device).
    Equal values would let XLA merge equal dots (two same-shape projections as one), random ones
    make the program's RNG most of its compile time (2-4x on small models), and torch_xla's
    ``arange`` is a constant the size of the weight."""
    out = torch.full((1,) * len(shape), float(index)).to(device)
    for d, n in enumerate(shape):
        out = out + torch.arange(n, dtype=torch.float32).to(device).view([-1 if i == d else 1 for i in range(len(shape))])
    return out.expand(shape).to(dtype) if shape else out.reshape(()).to(dtype)


class _suspended_hooks:
    """Context manager: take xla_tp's activation hooks off ``module`` (and its submodules) and put them back."""

    def __init__(self, module: nn.Module):
        self.handles = constraint_handles(module)
        self.orders: dict[int, tuple[dict, list]] = {}  # dict order is call order: each touched dict's, as it was

    def __enter__(self) -> None:
        for handle in self.handles:
            hooks = handle.hooks_dict_ref()
            if hooks is not None and handle.id in hooks:
                self.orders.setdefault(id(hooks), (hooks, list(hooks.items())))
                hooks.pop(handle.id)

    def __exit__(self, *exc: Any) -> None:
        for hooks, items in self.orders.values():
            hooks.clear()
            hooks.update(items)


