"""What a run tells people: lines, a progress bar, and JSONL metrics. Only process 0 speaks.

On a multi-host slice every worker runs the same command; ``Reporter(process_index=...)`` makes
every process but the first silent (no lines, no bar, no metrics file), so the logs are written
once. The bar (tqdm) is drawn only on a terminal; in logs and CI each logged step is one line.
Example::

    reporter = Reporter(run_dir, process_index=0)
    reporter.start(total_steps=100)
    reporter.step(10, {"step": 10, "steps": 100, "loss": 2.9, "lr": 3e-3, "tokens_per_s": 5321.0,
                       "mfu": None, "compiles": 4})
    reporter.close()      # run_dir/metrics.jsonl holds one JSON object per logged step
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional, TextIO


class Reporter:
    """Lines, bar and ``metrics.jsonl`` for process 0; nothing at all for the others."""

    def __init__(self, run_dir: Optional[Path], process_index: int = 0, stream: Optional[TextIO] = None,
                 tty: Optional[bool] = None):
        self.speaks = process_index == 0
        self.stream = sys.stdout if stream is None else stream
        self.tty = self.stream.isatty() if tty is None else tty
        self.metrics_path = Path(run_dir) / "metrics.jsonl" if run_dir is not None else None
        self._file: Optional[TextIO] = None
        self._bar: Any = None

    def say(self, text: str = "") -> None:
        """Print a line (above the bar when one is drawn)."""
        if not self.speaks:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def start(self, total_steps: int, first_step: int = 0) -> None:
        """Open the metrics file and, on a terminal, the progress bar."""
        if not self.speaks:
            return
        if self.metrics_path is not None:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.metrics_path.open("a")
        if self.tty:
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, initial=first_step, unit="step", file=self.stream,
                             dynamic_ncols=True)

    def step(self, step: int, metrics: Optional[dict[str, Any]] = None) -> None:
        """Advance the bar by one step; with ``metrics``, also log them (line + JSONL)."""
        if not self.speaks:
            return
        if self._bar is not None:
            self._bar.update(1)
        if metrics is None:
            return
        self.record(metrics)
        if self._bar is not None:
            self._bar.set_postfix_str(format_metrics(metrics, short=True))
        self.say(format_metrics(metrics))

    def record(self, fields: dict[str, Any]) -> None:
        """One JSON object on its own line of ``metrics.jsonl``, flushed."""
        if self.speaks and self._file is not None:
            self._file.write(json.dumps(fields) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None


def format_metrics(m: dict[str, Any], short: bool = False) -> str:
    """``step 20/80  loss 2.8361  lr 3.0e-03  5,321 tok/s  MFU 41.2%  compiles 4``."""
    mfu = "-" if m.get("mfu") is None else f"{m['mfu']:.1%}"
    parts = [f"loss {m['loss']:.4f}", f"{m['tokens_per_s']:,.0f} tok/s", f"MFU {mfu}"]
    if short:
        return "  ".join(parts)
    head = f"step {m['step']:>{len(str(m['steps']))}}/{m['steps']}" if "steps" in m else f"step {m['step']}"
    moe = [f"MoE dropped {m['moe_dropped']:.1%}"] if "moe_dropped" in m else []
    line = "  ".join([head, parts[0], f"lr {m['lr']:.1e}", *parts[1:], *moe, f"compiles {m['compiles']}"])
    return line + ("  (includes compiling the step)" if m.get("first") else "")
