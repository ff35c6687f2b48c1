"""``xla-tp``: audit a model's compiled program, or print the plan "auto" would use.

    xla-tp audit llama --mesh data=2,model=4 [--backward] [--json]
    xla-tp plan llama --mesh model=4

A model is a name from ``xla_tp.zoo.registry`` (falls back to the built-in torchtitan-style
Llama, "llama", while the registry is not there) or a path to an HF ``config.json``. The CLI is
its own process, so it sets ``XLA_DUMP_POST_OPTIMIZATIONS=1`` (and, on CPU, as many devices as the
mesh needs) before torch_xla starts: the audit runs in-process, no subprocess needed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Optional


def parse_mesh(text: str) -> dict[str, int]:
    """``parse_mesh("data=2,model=4") == {"data": 2, "model": 4}``."""
    axes = {}
    for item in filter(None, text.split(",")):
        name, _, size = item.partition("=")
        if not size.isdigit():
            raise SystemExit(f"--mesh: {item!r} is not name=size (e.g. data=2,model=4)")
        axes[name.strip()] = int(size)
    return axes


def _prepare_env(axes: dict[str, int]) -> None:
    os.environ.setdefault("XLA_DUMP_POST_OPTIMIZATIONS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if os.environ.setdefault("PJRT_DEVICE", "CPU") == "CPU" and axes:
        os.environ.setdefault("CPU_NUM_DEVICES", str(math.prod(axes.values())))


def load_model(name: str, batch: int, seq: int) -> tuple[Any, Any, Optional[dict]]:
    """(CPU model, example tokens, known plan or None) for a registry name or an HF config path."""
    import torch
    if os.path.exists(name):
        import transformers
        config = transformers.AutoConfig.from_pretrained(name)
        model = transformers.AutoModelForCausalLM.from_config(config)
        return model, torch.randint(0, config.vocab_size, (batch, seq)), None
    try:
        from .zoo import registry  # being written: build(name) -> model or (model, inputs)
    except ImportError:
        registry = None
    if registry is not None and hasattr(registry, "build"):
        built = registry.build(name)
        return (*built, None) if isinstance(built, tuple) else (built, None, None)
    if name not in ("llama", "titan_llama"):
        raise SystemExit(f"unknown model {name!r}: the zoo registry is not available yet; use 'llama' "
                         f"or a path to an HF config.json")
    from .zoo.llama import Llama, LlamaArgs, torchtitan_tp_plan
    model = Llama(LlamaArgs())
    return model, torch.randint(0, 128, (batch, seq)), torchtitan_tp_plan(model, sequence_parallel=False)


def _plan(model: Any, known: Optional[dict], mesh: Any) -> Any:
    try:
        from .planners import plan_for
    except ImportError:
        if known is None:
            raise SystemExit("no plan: xla_tp.planners (the 'auto' planner) is not available yet and "
                             "this model has no built-in plan")
        return known
    return plan_for(model, mesh=mesh)


def cmd_audit(args: argparse.Namespace) -> int:
    import torch_xla
    import xla_tp
    from .audit import audit
    axes = parse_mesh(args.mesh)
    mesh = xla_tp.make_mesh(**axes) if axes else xla_tp.make_mesh()
    model, tokens, known = load_model(args.model, args.batch, args.seq)
    model = xla_tp.parallelize_xla(model, _plan(model, known, mesh), mesh=mesh)
    x = (tokens if tokens is not None else __import__("torch").randint(0, 100, (args.batch, args.seq)))
    report = audit(model, x.to(torch_xla.device()), mesh=mesh, backward=args.backward)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import xla_tp
    try:
        from .planners import plan_for
    except ImportError:
        print("xla-tp plan: the 'auto' planner (xla_tp.planners) is not available yet", file=sys.stderr)
        return 2
    axes = parse_mesh(args.mesh)
    mesh = xla_tp.make_mesh(**axes) if axes else xla_tp.make_mesh()
    model = load_model(args.model, args.batch, args.seq)[0]
    print(plan_for(model, mesh=mesh).explain(model, mesh))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xla-tp", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, text in (("audit", cmd_audit, "audit the partitioned program"),
                             ("plan", cmd_plan, "print the plan 'auto' would use")):
        p = sub.add_parser(name, help=text)
        p.add_argument("model", help="zoo model name (e.g. llama) or path to an HF config.json")
        p.add_argument("--mesh", default="", help="axes, e.g. data=2,model=4 (default: model over all devices)")
        p.add_argument("--batch", type=int, default=4)
        p.add_argument("--seq", type=int, default=16)
        p.set_defaults(func=func)
    audit_p = sub.choices["audit"]
    audit_p.add_argument("--backward", action="store_true", help="audit forward + backward")
    audit_p.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``xla-tp``. Example: ``main(["audit", "llama", "--mesh", "model=8"])``."""
    args = build_parser().parse_args(argv)
    _prepare_env(parse_mesh(args.mesh))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
