"""What every ``xla-tp`` command shares: bad input as one line on stderr with exit status 2, one-line
warnings, XLA's C++ warnings off. The commands (``cli``, ``launch.main``, ``generation.command``) import it;
it imports none of them. Example::

    try:
        ...
    except PlanError as error:
        return fail("plan", error)     # "xla-tp plan: <the message>" on stderr; 2
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from typing import Any, Iterator, NoReturn, Optional

BAD_INPUT = 2


class UsageError(ValueError):
    """A command-line value xla-tp cannot use; printed as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors as one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(BAD_INPUT)


def fail(command: str, error: BaseException) -> int:
    """Print ``error`` on stderr as one line, ``xla-tp COMMAND: ...``; the bad-input status (2)."""
    print(f"xla-tp {command}: {' '.join(str(error).split())}", file=sys.stderr)
    return BAD_INPUT


@contextlib.contextmanager
def one_line_warnings(command: str) -> Iterator[None]:
    """Within the block, warnings print as one line (xla_tp's as ``xla-tp COMMAND: warning: ...``)."""
    def formatted(message: Any, category: type, filename: str, lineno: int, line: Optional[str] = None) -> str:
        text = " ".join(str(message).split())
        if text.startswith("xla_tp: "):
            return f"xla-tp {command}: warning: {text[len('xla_tp: '):]}\n"
        return f"{category.__name__}: {text}\n"
    saved = warnings.formatwarning
    warnings.formatwarning = formatted
    try:
        yield
    finally:
        warnings.formatwarning = saved


def quiet_xla_warnings() -> None:
    """XLA's C++ warnings (``GSPMD ... deprecated``) off in the CLI's process before the runtime starts,
    unless asked for (``TF_CPP_MIN_LOG_LEVEL=0``): importing torch_xla sets the level to 1 when unset."""
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1") == "1":
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
