"""``torch.compile(model, backend="openxla")`` on a parallelized model: annotations dynamo can record.

Eager and ``torch_xla.compile`` re-trace the Python forward every step, so sharding annotations
(activation constraints, the vocabulary-parallel embedding's gradient) call torch_xla directly.
Dynamo cannot trace those calls (a pybind function, and ``Mesh.get_op_sharding``'s numpy): each one
would split the graph into pieces torch_xla's dynamo bridge fails on (``Failed to get computation
by hash ... kicked out of the LRU cache``, before this module existed). While dynamo traces, an annotation is instead the custom op
``xla_tp::constrain``: one node in the FX graph, with the same effect on the value, which the
openxla backend runs on XLA tensors when it builds the program.

The rest of xla_tp keeps its one-off work out of the compiled graph: the first forward's group
discovery runs eagerly (``torch.compiler.disable``: one graph break, on the first call only), and
hooks that remove themselves wait for an eager call. ``inputs_by_data`` fixes the bridge's input
matching (a ``compat`` effect), without which a compiled training step silently replays its first
step's values. Example::

    y = constrain(x, str(mesh), ("data", None, "model"))   # inside a forward that torch.compile traces
"""
from __future__ import annotations

import ast
import functools
from typing import Any, Callable

import torch
import torch_xla
import torch_xla.distributed.spmd as xs
from torch_xla._dynamo import dynamo_bridge as bridge


@functools.lru_cache(maxsize=None)
def _sharding(mesh: str, spec: str) -> Any:
    return xs.Mesh.from_str(mesh).get_op_sharding(ast.literal_eval(spec))


def annotated(x: torch.Tensor, sharding: Any) -> torch.Tensor:
    """A copy of ``x`` behind a Sharding custom call with the op sharding ``sharding`` (eager)."""
    y = x.clone()
    torch_xla._XLAC._xla_annotate_custom_sharding(y, sharding)
    return y


@torch.library.custom_op("xla_tp::constrain", mutates_args=())
def _constrain(x: torch.Tensor, mesh: str, spec: str) -> torch.Tensor:
    return annotated(x, _sharding(mesh, spec))


@_constrain.register_fake
def _(x: torch.Tensor, mesh: str, spec: str) -> torch.Tensor:
    return torch.empty_like(x)


def constrain(x: torch.Tensor, mesh_name: str, spec: tuple) -> torch.Tensor:
    """A copy of ``x`` laid out as ``spec`` on the mesh named ``mesh_name`` (``str(mesh)``, read outside
    compilation): one op dynamo records (no gradient rule: callers inside an autograd Function annotate
    the gradient themselves)."""
    return _constrain(x, mesh_name, repr(tuple(spec)))


def inputs_by_data(extract: Callable) -> Callable:
    """torch_xla's ``extract_graph_helper`` that finds a compiled graph's inputs by their data (a
    ``compat`` effect, installed while a model is parallelized).

    The bridge tells a graph's inputs from its constants by the tensor id recorded in each input's
    device data. Under SPMD that record is rewritten whenever torch_xla wraps the data in a new
    tensor (``XLATensor(handle)`` re-annotates sharded data, which re-stamps the id), which the
    bridge itself does while extracting a graph. The next graph that reads the same tensor (the
    backward reads the forward's inputs: token ids, norm weights) then takes it for a constant and
    replays the first step's values on every later step: gradients are silently wrong from the
    second step on, with or without xla_tp. After each extraction, a constant whose data is one of
    the call's arguments (same device buffer) becomes that argument again.
    """
    @functools.wraps(extract)
    def extract_graph_helper(xla_model: Any, *args: Any) -> tuple:
        torch_xla.sync(reset_scope=False)  # what ``extract`` starts with: every argument is device data now
        tensors, _ = bridge._split_xla_args_tensor_sym_constant(xla_model.xla_args)
        buffers: dict[int, int] = {}
        for index, handle in enumerate(torch_xla._XLAC._get_tensors_handle(list(tensors))):
            buffers.setdefault(handle, index)
        out = extract(xla_model, *args)
        _rematch(out[5], buffers)
        return out

    return extract_graph_helper


def _rematch(matcher: Any, buffers: dict[int, int]) -> None:
    """Point ``matcher``'s constants that hold an argument's buffer back at that argument."""
    for i, (arg, value) in enumerate(zip(matcher.arg_idxs, matcher.graph_input_xla_values)):
        if arg is None and value is not None and matcher.graph_input_tensor_ids[i] != matcher.seed_info_id:
            index = buffers.get(torch_xla._XLAC._get_tensors_handle([value])[0])
            if index is not None:
                matcher.arg_idxs[i], matcher.graph_input_xla_values[i] = index, None
