"""The generated tokens on the host: finished rows padded, the streamer fed, the stop decided.

The host reads each step's tokens while the device runs the next step (the loop dispatches step
``t + 1`` before reading step ``t``), so the device never waits for the host. A row is finished after
its first end-of-sequence token; later tokens of it are ``pad`` (transformers' rule), and the
generation stops once every row is finished. Example:

>>> tokens = Tokens(rows=2, eos=[2], pad=0)
>>> tokens.add(torch.tensor([5, 2])), tokens.add(torch.tensor([2, 7])), tokens.new().tolist()
(False, True, [[5, 2], [2, 0]])
"""
from __future__ import annotations

from typing import Any, Optional

import torch


class Tokens:
    """Each step's tokens for the caller's ``rows`` (see the module docstring); ``streamer`` gets them as
    transformers' streamers do (``put`` per step, ``end`` at the end)."""

    def __init__(self, rows: int, eos: list[int], pad: int, streamer: Optional[Any] = None) -> None:
        self.rows, self.pad, self.streamer = rows, pad, streamer
        self.eos = torch.tensor(eos, dtype=torch.long)
        self.done = torch.zeros(rows, dtype=torch.bool)
        self.steps: list[torch.Tensor] = []

    def add(self, step: torch.Tensor) -> bool:
        """Read one step's tokens (a device tensor of at least ``rows``); True once every row is finished."""
        tokens = torch.where(self.done, self.pad, step.cpu()[: self.rows])
        self.steps.append(tokens)
        if len(self.eos):
            self.done |= torch.isin(tokens, self.eos)
        if self.streamer is not None:
            self.streamer.put(tokens)
        return bool(self.done.all()) and len(self.eos) > 0

    def new(self) -> torch.Tensor:
        """The tokens read so far, ``[rows, steps]``."""
        return torch.stack(self.steps, dim=1) if self.steps else torch.empty(self.rows, 0, dtype=torch.long)

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()
