"""``xla-tp``: audit a model's compiled program, print the plan "auto" would use, launch a recipe, or
generate text with a recipe's model.

    xla-tp audit llama --mesh data=2,model=4 [--backward] [--json]
    xla-tp plan llama --mesh model=4
    xla-tp launch [RECIPE] [--topology NAME] [--dry-run] [--print-commands] [key=value ...]
    xla-tp generate [RECIPE] --prompt TEXT [--checkpoint DIR] [--max-new-tokens N] [key=value ...]

A model is a name from ``xla_tp.zoo.registry`` (built with ``registry.build``, run on
``registry.example_input``) or a path to an HF ``config.json``; the plan is ``plan_for``'s. The CLI is
its own process, so it sets ``XLA_DUMP_POST_OPTIMIZATIONS=1`` (and, on CPU, as many devices as the
mesh needs) before torch_xla starts: the audit reads the device compiler's own program. Bad input
(an unknown axis, ``--batch 0``, a file that is not a config) is one line on stderr saying what to
do, with exit status 2; xla_tp's warnings are one line each.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Optional

from .console import OneLineParser, UsageError, fail, one_line_warnings, quiet_xla_warnings
from .errors import MeshError, PlanError

def parse_mesh(text: str) -> dict[str, int]:
    """``parse_mesh("data=2,model=4") == {"data": 2, "model": 4}``."""
    axes = {}
    for item in filter(None, text.split(",")):
        name, _, size = item.partition("=")
        if not size.isdigit() or int(size) < 1:
            raise MeshError(f"--mesh: {item!r} is not name=size with a positive size (e.g. --mesh data=2,model=4)")
        axes[name.strip()] = int(size)
    return axes


def _prepare_env(axes: dict[str, int]) -> None:
    os.environ.setdefault("XLA_DUMP_POST_OPTIMIZATIONS", "1")
    quiet_xla_warnings()
    if os.environ.setdefault("PJRT_DEVICE", "CPU") == "CPU" and axes:
        os.environ.setdefault("CPU_NUM_DEVICES", str(math.prod(axes.values())))


def load_model(name: str, batch: int, seq: int) -> tuple[Any, Any]:
    """(CPU model, example batch) for a registry name or a path to an HF ``config.json``.

    ``load_model("llama", 4, 16)[1].shape == (4, 16)``; an unknown name or a file that is not a
    config raises ``UsageError`` saying what to pass.
    """
    from .zoo import registry
    if os.path.exists(name):
        try:
            model = registry.from_config_path(name)
        except (OSError, ValueError, KeyError) as error:
            raise UsageError(f"{name}: not a Hugging Face config.json ({str(error).strip().splitlines()[0]}); "
                             f"pass a zoo model name (e.g. llama) or the path of a config.json") from None
    else:
        try:
            model = registry.build(name)
        except KeyError as error:  # unknown name: the message lists the known ones
            raise UsageError(error.args[0]) from None
    return model, registry.example_input(name, batch=batch, seq=seq)


def _mesh_and_model(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(mesh, CPU model, example batch) from the command line's ``--mesh``, model, ``--batch``, ``--seq``."""
    import xla_tp
    model, batch = load_model(args.model, args.batch, args.seq)   # a bad model name fails before the runtime starts
    axes = parse_mesh(args.mesh)
    return xla_tp.make_mesh(**axes) if axes else xla_tp.make_mesh(), model, batch


def cmd_audit(args: argparse.Namespace) -> int:
    import torch_xla
    import xla_tp
    from .auditing.run import audit
    from .apply import plan_for
    from .zoo.registry import positional_args
    mesh, model, batch = _mesh_and_model(args)
    model = xla_tp.parallelize_xla(model, plan_for(model, mesh=mesh), mesh=mesh)
    args_ = positional_args(model, batch.to(torch_xla.device()))
    report = audit(model, *args_, mesh=mesh, backward=args.backward)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from .apply import plan_for
    mesh, model, _ = _mesh_and_model(args)
    print(plan_for(model, mesh=mesh).explain(model, mesh))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="xla-tp", description=__doc__.split("\n")[0])
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
    from .generation.command import add_parser as add_generate
    from .launch.main import add_parser
    add_parser(sub)
    add_generate(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``xla-tp``. Example: ``main(["audit", "llama", "--mesh", "model=8"])``."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command in ("launch", "generate"):   # key=value overrides may sit anywhere; they prepare their own environment
        args.overrides = extra
        return args.func(args)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        for flag, value in (("--batch", args.batch), ("--seq", args.seq)):
            if value < 1:
                raise UsageError(f"{flag} {value}: pass a positive number (e.g. {flag} 4)")
        _prepare_env(parse_mesh(args.mesh))
        with one_line_warnings(args.command):
            return args.func(args)
    except (UsageError, PlanError, MeshError) as error:
        return fail(args.command, error)


if __name__ == "__main__":
    sys.exit(main())
