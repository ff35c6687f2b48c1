"""``ByModule``: what xla_tp keeps about a module, forgotten when the module is collected.

A dict keyed by ``id(module)`` (dynamo traces a lookup in it; a ``WeakKeyDictionary`` breaks a captured
graph), each entry dropped by a ``weakref.finalize`` on its module, so no entry outlives its module and a
new module that reuses the id finds nothing. Example::

    sites: ByModule[Site] = ByModule()
    sites[module] = site
    sites.get(module)          # site; None once the module is gone
"""
from __future__ import annotations

import weakref
from typing import Generic, Optional, TypeVar

from torch import nn

V = TypeVar("V")


class ByModule(Generic[V]):
    """See the module docstring."""

    def __init__(self) -> None:
        self.by_id: dict[int, V] = {}

    def __contains__(self, module: nn.Module) -> bool:
        return id(module) in self.by_id

    def __setitem__(self, module: nn.Module, value: V) -> None:
        if id(module) not in self.by_id:
            weakref.finalize(module, self.by_id.pop, id(module), None)
        self.by_id[id(module)] = value

    def get(self, module: nn.Module) -> Optional[V]:
        return self.by_id.get(id(module))

    def pop(self, module: nn.Module) -> Optional[V]:
        return self.by_id.pop(id(module), None)

    def __len__(self) -> int:
        return len(self.by_id)
