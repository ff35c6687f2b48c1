"""A parallelized weight read transposed: ``x @ w.T`` is ``F.linear(x, w)``.

Some models write their projections as a matmul with the transposed weight (Falcon's ``FalconLinear``:
``hidden_states @ self.weight.T``). The planner traces that as the projection it is; inside a
parallelized forward the lowering must see it so too (its column groups, a packed weight's device-major
output, multi-query copies), or a re-laid packed output reaches the model in the wrong order. The
transpose of a parallelized 2-D parameter (``w.T``, ``w.t()``, ``w.transpose(0, 1)``) is marked with
its parameter; ``entry``'s matmul handler hands ``x @ marked`` to its ``F.linear`` handler. Example::

    y = x @ lin.weight.T          # inside a parallelized forward: F.linear(x, lin.weight), lowered
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..state import param_state
from .tags import Tag

_OF = Tag("transposed_parameter")


def parameter_of(t: Any) -> Optional[torch.Tensor]:
    """The parallelized parameter ``t`` is the transpose of, else None."""
    return _OF.of(t)


def _marked(func: Callable, swaps: Callable[..., bool]) -> Callable:
    def handler(w: Any, *args: Any, **kwargs: Any) -> Any:
        if not (isinstance(w, torch.Tensor) and w.dim() == 2 and param_state(w) is not None and swaps(*args, **kwargs)):
            return NotImplemented
        return _OF.put(func(w, *args, **kwargs), w)
    return handler


def _swaps_the_two(d0: int = 0, d1: int = 1) -> bool:
    return {d0 % 2, d1 % 2} == {0, 1}


HANDLERS: dict[Callable, Callable] = {
    torch.Tensor.T.__get__: _marked(torch.Tensor.T.__get__, lambda: True),
    torch.Tensor.t: _marked(torch.Tensor.t, lambda: True),
    torch.t: _marked(torch.t, lambda: True),
    torch.Tensor.transpose: _marked(torch.Tensor.transpose, _swaps_the_two),
    torch.transpose: _marked(torch.transpose, _swaps_the_two),
}
