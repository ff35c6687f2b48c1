"""Benchmarks (``python -m bench``, ``python -m bench.optimizers``, ``python -m bench.meta_init``,
``python -m bench.generation``, ``python -m bench.long_context``; ``python -m bench.overhead`` and
``python -m bench.planning``, which ``python -m bench`` runs too)."""
import json
from pathlib import Path


def write_result(out: str, name: str, result: dict) -> None:
    """Write ``result`` to ``out/name`` as JSON and print it."""
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / name).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
