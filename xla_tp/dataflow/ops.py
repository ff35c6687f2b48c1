"""How a sharded feature dimension flows through one torch op: ``step(node, pos, features)``.

Given that tensor ``node.tensors[pos]`` holds a projection's features as ``features``, ``step``
says where they are in the op's outputs, whether the op contracts them against a parameter
(``row``: the end of a column -> row region), or why they cannot stay sharded (``stop``). Other
operands of an element-wise op or a contraction (attention's k and v, a rotary table, a mask) need
no say: the compiler slices a replicated partner locally, and a sharded one meets the same
features at the op's output, which is how regions are grouped.
Ops are grouped by what they do to dimensions: element-wise, views, permutations, slices,
concatenation, reductions, normalisations along a dim, contractions. Anything else stops.
Example (a projection's 64 features, viewed as 8 heads of 8):

>>> import torch
>>> from xla_tp.dataflow.trace import trace
>>> view = trace(torch.nn.Unflatten(-1, (8, 8)), (torch.zeros(2, 5, 64),)).nodes[0]
>>> out = step(view, 0, Features.whole(2, 64)).outputs[0][1]
>>> out.lead.dim, out.lead.size
(2, 8)
>>> norm = trace(torch.nn.LayerNorm(64), (torch.zeros(2, 5, 64),)).nodes[0]
>>> step(norm, 0, Features.whole(2, 64)).stop
'layer_norm normalises over the sharded dimension'
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Union

from .contract import CONTRACTIONS, contraction
from .graph import Node, Value
from .shapes import Features, Stop

POINTWISE = frozenset("""
add sub mul div true_divide floor_divide pow neg negative exp exp2 log log2 log10 log1p expm1 sin cos tan tanh
sigmoid silu gelu relu relu6 leaky_relu elu selu celu softplus mish hardswish hardsigmoid hardtanh logsigmoid
softsign tanhshrink erf erfc rsqrt sqrt abs reciprocal square sign clamp clip clamp_min clamp_max minimum maximum
where masked_fill lerp addcmul addcdiv float half bfloat16 double int long bool contiguous clone detach dropout
alpha_dropout feature_alpha_dropout eq ne lt le gt ge logical_and logical_or logical_not logical_xor and or xor
invert bitwise_and bitwise_or bitwise_not bitwise_xor isnan isinf isfinite nan_to_num round floor ceil trunc frac
fmod remainder atan atan2 sinh cosh asin acos logit xlogy copysign heaviside polar complex real imag conj
radd rsub rmul rdiv rtruediv rpow requires_grad_ fill_ zero_ add_ sub_ mul_ div_ masked_fill_ clamp_ tanh_
sigmoid_ exp_ neg_ pow_ iadd isub imul itruediv subtract multiply divide
""".split())
FIRST_ONLY = frozenset({"to", "type", "type_as", "view_as", "reshape_as", "expand_as"})  # later args: not data
VIEWS = frozenset({"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as", "reshape_as",
                   "_unsafe_view"})
EXPANDS = frozenset({"expand", "expand_as", "broadcast_to"})
PERMUTES = frozenset({"transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "t", "T", "mT",
                      "adjoint"})
REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm", "logsumexp", "prod",
                        "any", "all", "argmax", "argmin", "nansum", "nanmean", "count_nonzero", "var_mean",
                        "std_mean", "linalg_vector_norm"})
# reductions the partitioner completes exactly from per-device partial results (one all-reduce of the
# reduced values, or two for var/std): over a split dimension they need no gather (an RMSNorm over all heads)
PARTIAL = frozenset({"sum", "mean", "amax", "amin", "var", "std", "norm", "linalg_vector_norm", "logsumexp",
                     "nansum", "nanmean"})
ALONG_DIM = frozenset({"softmax", "log_softmax", "_softmax", "cumsum", "cumprod", "logcumsumexp", "normalize",
                       "flip", "roll", "sort", "argsort", "topk", "cummax", "cummin"})
SHAPE_ONLY = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
                        "randint_like"})


@dataclass
class Step:
    """What one op does with sharded features (see the module docstring)."""

    outputs: list[tuple[int, Features]] = field(default_factory=list)
    stop: Stop = ""
    row: Optional[tuple[Value, int]] = None  # (the parameter contracted against, its sharded dim)
    ends: str = ""  # the features are reduced away here, split (a vocabulary-parallel loss: ``vocab``)
    reduces: str = ""  # a per-token statistic over the split features (a norm's mean square): all-reduced
    concat: Optional[tuple[int, int]] = None  # (offset, size): the features are this piece of a concatenation
    # along their split dimension (``indexing._cat``), which only a row projection may read


def stop(why: str) -> Step:
    return Step(stop=why)


def step(node: Node, pos: int, feats: Features) -> Step:
    """See the module docstring. ``pos`` indexes ``node.tensors``."""
    op = node.op
    if op.startswith("new_") or op in SHAPE_ONLY:
        return Step()  # the output depends on the shape only
    handler = _HANDLERS.get(op)
    if handler is None:
        for group, fn in _GROUPS:
            if op in group:
                handler = fn
                break
    if handler is None:
        return stop(f"'{op}' is not an op xla_tp can follow a sharded dimension through")
    result = handler(node, pos, feats)
    return result if isinstance(result, Step) else stop(result)


def _rank(v: Value) -> int:
    return len(v.shape)


def _norm_dim(dim: Any, rank: int) -> int:
    return int(dim) % rank if rank else 0


def _one(node: Node, f: Union[Features, Stop]) -> Union[Step, Stop]:
    if isinstance(f, str):
        return f
    return Step([(i, f) for i in range(len(node.outputs))])


def _aligned(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    """Input ``pos``'s features carried to the outputs with their dims aligned from the right (dims the output
    adds in front: broadcasting, ``expand``, ``repeat``, a batch of triangular solves)."""
    shift = _rank(node.outputs[0]) - _rank(node.tensors[pos])
    return _one(node, feats.moved({f.dim: f.dim + shift for f in feats.factors}))


def _pointwise(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    if node.op in FIRST_ONLY and pos != 0:
        return Step()  # a dtype/shape reference, not data
    if not node.outputs:
        return "writes in place with no result"
    return _aligned(node, pos, feats)


def _view(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    if pos != 0:
        return Step()
    return _one(node, feats.reshaped(node.tensors[0].shape, node.outputs[0].shape))


def _expand(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    if pos != 0:
        return Step()
    return _aligned(node, 0, feats)


def _view_complex(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    before, after = node.tensors[0].shape, node.outputs[0].shape
    if node.op == "view_as_complex":
        return _one(node, feats.sliced(len(before) - 1, 0, 1, keep_dim=False))
    return _one(node, feats.reshaped(before, after[:-1]))  # view_as_real: a new last dim of 2


def _permute(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    rank = _rank(node.tensors[0])
    order = list(range(rank))
    op = node.op
    if op in ("transpose", "swapaxes", "swapdims"):
        a, b = _norm_dim(node.arg(1, "dim0"), rank), _norm_dim(node.arg(2, "dim1"), rank)
        order[a], order[b] = order[b], order[a]
    elif op == "permute":
        dims = node.args[1:] if len(node.args) > 2 or not isinstance(node.arg(1, "dims"), (list, tuple)) \
            else node.arg(1, "dims")
        order = [_norm_dim(d, rank) for d in dims]
    elif op in ("movedim", "moveaxis"):
        src, dst = node.arg(1, "source"), node.arg(2, "destination")
        src, dst = ([src], [dst]) if isinstance(src, int) else (list(src), list(dst))
        src, dst = [_norm_dim(s, rank) for s in src], [_norm_dim(d, rank) for d in dst]
        rest = [d for d in range(rank) if d not in src]
        order = [None] * rank
        for s, d in zip(src, dst):
            order[d] = s
        it = iter(rest)
        order = [o if o is not None else next(it) for o in order]
    elif op in ("t", "T", "mT", "adjoint"):
        if rank >= 2:
            order[-1], order[-2] = order[-2], order[-1]
        if op == "T":
            order = list(reversed(range(rank)))
    new = {old: new for new, old in enumerate(order)}
    return _one(node, feats.moved(new))


def _drop_unit_factors(feats: Features, keep: set[int]) -> Features:
    return replace(feats, factors=tuple(f for f in feats.factors if f.dim in keep or f.size > 1))


def _reduce_dims(node: Node, rank: int) -> Optional[list[int]]:
    dim = node.arg(1, "dim")
    if node.op in ("normalize",):
        dim = node.arg(2, "dim", 1)
    if dim is None:
        return None
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return [_norm_dim(d, rank) for d in dims]


def _reduce(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    if node.op in ("max", "min") and isinstance(node.arg(1, "other"), Value):  # torch.max(a, b): element-wise
        return _pointwise(node, pos, feats)
    if pos != 0:
        return Step()
    rank = _rank(node.tensors[0])
    dims = _reduce_dims(node, rank)
    if dims is None or feats.lead.dim in dims:
        if node.op in PARTIAL and dims is not None and all(f.dim in dims for f in feats.factors):
            return Step(reduces=f"{node.op} over the split features: the per-device partial results all-reduced")
        return f"reduces ({node.op}) over the sharded dimension"
    keep = bool(node.arg(2, "keepdim", node.kwargs.get("keepdim", False)))
    mapping: dict[int, Optional[int]] = {}
    for d in range(rank):
        if d in dims:
            mapping[d] = d if keep else None
        else:
            mapping[d] = d - (0 if keep else sum(1 for r in dims if r < d))
    trimmed = _drop_unit_factors(feats, {d for d in range(rank) if d not in dims})
    trimmed = replace(trimmed, factors=tuple(f for f in trimmed.factors if f.dim not in dims))
    return _one(node, trimmed.moved(mapping))


def _along_dim(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    if pos != 0:
        return Step()
    rank = _rank(node.tensors[0])
    dims = _reduce_dims(node, rank) if node.op not in ("flip", "roll") else None
    if node.op == "flip":
        dims = [_norm_dim(d, rank) for d in node.arg(1, "dims")]
    if node.op == "roll":
        d = node.arg(2, "dims")
        dims = None if d is None else [_norm_dim(x, rank) for x in (d if isinstance(d, (list, tuple)) else [d])]
    if dims is None or feats.lead.dim in dims:
        return f"{node.op} runs along the sharded dimension"
    return _one(node, feats)


def _norm(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    if pos != 0:
        return Step()  # the norm's weight/bias: parameters, element-wise
    rank = _rank(node.tensors[0])
    shape = node.arg(1, "normalized_shape")
    n = len(shape) if isinstance(shape, (list, tuple)) else 1
    if feats.lead.dim >= rank - n:
        return f"{node.op} normalises over the sharded dimension"
    return _one(node, feats)


def trace_param(v: Value) -> Optional[tuple[Value, dict[int, int]]]:
    """The parameter ``v`` is a cast/transposed view of, with ``v``'s dims mapped to the parameter's."""
    dims = {d: d for d in range(len(v.shape))}
    while v.kind != "param":
        node = v.producer
        if node is None or not node.tensors:
            return None
        src = node.tensors[0]
        if node.op in ("to", "float", "half", "bfloat16", "type", "type_as", "contiguous", "detach", "clone"):
            v = src
            continue
        if node.op in ("t", "T", "mT", "transpose", "swapaxes") and len(src.shape) == 2:
            dims = {d: 1 - m for d, m in dims.items()}
            v = src
            continue
        return None
    return v, dims


def _contract(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    spec = contraction(node)
    if spec is None:
        return f"'{node.op}' with arguments xla_tp cannot read"
    me = node.tensors[pos]
    labels = next((l for v, l in spec.operands if v is me), None)
    if labels is None:  # an element-wise extra (bias, mask): like pointwise on the output
        extra = next(l for v, l in spec.extras if v is me)
        lead = extra[feats.lead.dim]
        if lead not in spec.output:
            return "an attention mask/bias sharded along a contracted dimension"
        return Step([(0, feats.moved({f.dim: spec.output.index(extra[f.dim]) for f in feats.factors
                                      if extra[f.dim] in spec.output}))])
    lead = labels[feats.lead.dim]
    others = [(v, l) for v, l in [*spec.operands, *spec.extras] if v is not me and lead in l]
    if lead not in spec.output:
        params = [trace_param(v) for v, _ in others]
        if len(others) == 1 and params[0] is not None:
            param, dims = params[0]
            return Step(row=(param, dims[others[0][1].index(lead)]))
        return "contracts the sharded dimension with another activation"
    mapping = {f.dim: spec.output.index(labels[f.dim]) if labels[f.dim] in spec.output else None
               for f in feats.factors}
    kept = replace(feats, factors=tuple(f for f in feats.factors if mapping[f.dim] is not None))
    moved = kept.moved(mapping)
    if node.op == "scaled_dot_product_attention" and not isinstance(moved, str):
        moved = _grouped_heads(node, me.shape[feats.lead.dim], moved)
    return _one(node, moved)


def _grouped_heads(node: Node, heads: int, feats: Features) -> Union[Features, Stop]:
    """SDPA with ``enable_gqa``: each of the ``heads`` key/value heads serves ``n`` query heads, as
    ``repeat_interleave(n)`` along the heads would (``_repeat_interleave``)."""
    lead, out = feats.lead, node.outputs[0].shape[feats.lead.dim]
    if out == heads:
        return feats
    if out % heads or lead.size != heads or lead.outer != 1:
        return "attention with grouped key/value heads that do not divide the query heads"
    n = out // heads
    return replace(feats, factors=(replace(lead, size=lead.size * n, stride=lead.stride / n), *feats.factors[1:]))


def _repeat_interleave(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    if pos != 0:
        return Step()
    rank = _rank(node.tensors[0])
    dim = node.arg(2, "dim")
    repeats = node.arg(1, "repeats")
    if dim is None or not isinstance(repeats, int):
        return "repeat_interleave without a dim or with per-element repeats"
    dim = _norm_dim(dim, rank)
    if dim != feats.lead.dim:
        return _one(node, feats)
    lead = feats.lead
    grown = replace(lead, size=lead.size * repeats, stride=lead.stride / repeats)
    return _one(node, replace(feats, factors=(grown, *feats.factors[1:])))


def _repeat(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    if pos != 0:
        return Step()
    sizes = node.args[1:] if not isinstance(node.arg(1, "repeats"), (list, tuple)) else node.arg(1, "repeats")
    sizes = [int(s) for s in sizes]
    shift = len(sizes) - _rank(node.tensors[0])
    if any(sizes[f.dim + shift] != 1 for f in feats.factors[:1]):
        return "repeats the sharded dimension"
    return _aligned(node, 0, feats)


def _solve(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    """``linalg.solve_triangular(A, B)``: a batch of systems, each solved alone (the gated delta rule's
    chunks, one per head): split features on the batch dims stay where they are (their minor part may lie on
    a matrix's dims: a key head's features); split on a matrix's dims, they stop."""
    if feats.lead.dim >= _rank(node.tensors[pos]) - 2:
        return f"'{node.op}' solves along the sharded dimension"
    return _aligned(node, pos, feats)


_HANDLERS: dict[str, Callable[[Node, int, Features], Union[Step, Stop]]] = {
    "view_as_complex": _view_complex, "view_as_real": _view_complex, "layer_norm": _norm,
    "rms_norm": _norm, "repeat_interleave": _repeat_interleave, "repeat": _repeat,
    "solve_triangular": _solve, "linalg_solve_triangular": _solve,
}  # more are registered by ``indexing`` (slices, getitem, cat, gather) and ``vocab`` (a loss over split logits)
_GROUPS = ((POINTWISE | FIRST_ONLY - VIEWS - EXPANDS, _pointwise), (VIEWS, _view), (EXPANDS, _expand),
           (PERMUTES, _permute), (REDUCTIONS, _reduce), (ALONG_DIM, _along_dim),
           (frozenset(CONTRACTIONS), _contract))



def register(handlers: dict[str, Callable[[Node, int, Features], Union[Step, Stop]]]) -> None:
    """Add handlers for ops by name (``vocab`` registers the vocabulary-parallel loss this way)."""
    _HANDLERS.update(handlers)


__all__ = ["Step", "register", "step", "trace_param"]
