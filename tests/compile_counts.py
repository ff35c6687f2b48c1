"""Reading what a child process compiled: the summary line xla_tp printed (``xla_tp.compile_cache``), parsed, and
torch_xla's own counters, printed by the child itself as its last line (``COUNTERS``), to check one against the
other. Example::

    out = run_fresh(script + COUNTERS)
    line, counters = parse_summary(out), last_counters(out)
    assert line["loaded"] == counters["PersistentCacheHit"]
"""
from __future__ import annotations

import json
import re

# appended to a child's script (or run after a command in it): torch_xla's counters as one JSON line
COUNTERS = """
import json as _json
import torch_xla.debug.metrics as _met
_names = ("PersistentCacheHit", "PersistentCacheMiss", "PersistentCacheDeserializeFailure")
_data = _met.metric_data("CompileTime")
print("COUNTERS " + _json.dumps({**{n: _met.counter_value(n) or 0 for n in _names}, "CompileTime": _data[0] if _data else 0}))
"""

LINE = re.compile(r"(?P<programs>\d+) programs compiled \((?P<seconds>[\d.]+) s\); persistent cache (?:off \((?P<off>.*)\)|"
                  r"(?P<path>\S+): (?P<loaded>\d+) loaded, (?P<written>\d+) written"
                  r"(?:, (?P<unloadable>\d+) could not be loaded by this backend)?)$")


def parse_summary(text: str) -> dict:
    """The one summary line in ``text`` as numbers (absent counts are 0; ``off``: why the cache was off)."""
    found = [m for m in map(LINE.match, text.splitlines()) if m]
    assert len(found) == 1, text[-3000:]
    fields = found[0].groupdict()
    numbers = {k: int(fields[k] or 0) for k in ("programs", "loaded", "written", "unloadable")}
    return {**numbers, "seconds": float(fields["seconds"]), "path": fields["path"], "off": fields["off"]}


def last_counters(text: str) -> dict:
    """The counters ``COUNTERS`` printed."""
    lines = [line for line in text.splitlines() if line.startswith("COUNTERS ")]
    assert lines, text[-3000:]
    return json.loads(lines[-1][len("COUNTERS "):])
