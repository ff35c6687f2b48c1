"""``xla-tp launch RECIPE [--topology NAME] [--dry-run] [--print-commands] [--check] [--resume | --overwrite] [key=value ...]``.

Steps, in order; nothing heavy happens before the fit check:

1. read the recipe (``key=value`` overrides applied) and the topology; check the mesh and batch;
2. ``--print-commands``: print the per-worker commands of the slice and stop;
3. a real run whose ``checkpoint.dir`` or ``--run-dir`` holds an earlier run's checkpoints or
   metrics continues it (``--resume``), moves its files aside (``--overwrite``), or is refused
   (exit 2) saying which flag to pass (``rerun``); a real run then turns torch_xla's persistent
   compilation cache on (``compile_cache``: ``RUN_DIR/xla_cache`` by default, ``runs/xla_cache`` without
   ``--run-dir``; ``--compile-cache DIR`` shared by the hosts; ``--no-compile-cache``), before the first
   XLA computation, and the run ends with the programs compiled and how many came from the cache;
4. build the model on ``meta``, plan it on the mesh, estimate memory per chip and print the table;
   a run that will not fit is refused (exit 3) with the numbers and what would make it fit;
5. print the plan's summary (what the audit reports about parameters, from the plan);
6. ``--dry-run`` stops here: nothing allocated, nothing compiled. A dry run emulates the slice's
   chips on the CPU, so it runs anywhere (a laptop, one worker of a multi-host slice);
7. otherwise: build the model on the CPU, optionally ``--check`` one step against it unsharded,
   parallelize, audit the compiled forward, and train with progress, JSONL metrics and clean stops;
   ``--resume`` loads the newest checkpoint that verifies, skipping damaged ones and saying why.

Exit status: 0 done, 1 ``--check`` failed, 2 bad input, 3 will not fit, 130 stopped by Ctrl-C/SIGTERM.
Example::

    xla-tp launch                                   # tiny-llama-cpu on 8 emulated CPU devices
    xla-tp launch llama3-70b --dry-run              # plan + fit on v5p-64, model on meta
    xla-tp launch llama3-8b --topology v5e-8 batch=4 --print-commands
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from ..compile_cache import add_cache_flags, cache_flags, cache_from_args, check_cache_flags
from ..console import UsageError, fail, one_line_warnings, quiet_xla_warnings
from ..errors import MeshError, PlanError
from .recipe import DEFAULT_RECIPE, check_for_topology, load_recipe
from .rerun import EarlierRun
from .schema import LaunchError
from .topology import Topology, load_topology

DOES_NOT_FIT, INTERRUPTED = 3, 130


def add_parser(sub: Any) -> None:
    """Register ``launch`` on the ``xla-tp`` subcommand parser."""
    p = sub.add_parser("launch", help="train (or dry-run) a recipe on a TPU slice or emulated devices",
                       description="Train (or dry-run) a recipe on a TPU slice or emulated devices: fit check "
                                   "first, then progress, JSONL metrics and clean stops.",
                       epilog="Recipe overrides: key=value anywhere on the line, dotted for nested keys "
                              "(steps=20 optimizer.lr=1e-3 mesh.model=8).")
    p.add_argument("recipe", nargs="?", default=DEFAULT_RECIPE,
                   help=f"recipe name from recipes/ or a YAML path (default {DEFAULT_RECIPE})")
    p.add_argument("--topology", help="tpu_configs/ name or YAML path (default: the recipe's)")
    p.add_argument("--dry-run", action="store_true", help="stop after the plan, the fit table and the summary")
    p.add_argument("--print-commands", action="store_true", help="print the command of every TPU VM worker")
    p.add_argument("--check", action="store_true", help="compare one step with the unsharded CPU model first")
    p.add_argument("--no-audit", action="store_true", help="skip the compiled-program audit before training")
    p.add_argument("--resume", action="store_true",
                   help="continue the run whose checkpoints are in checkpoint.dir, from the newest that verifies")
    p.add_argument("--overwrite", action="store_true",
                   help="start over where an earlier run left checkpoints or metrics (they are moved aside)")
    p.add_argument("--run-dir", type=Path, help="where metrics.jsonl goes (default runs/RECIPE-TIME)")
    add_cache_flags(p, "RUN_DIR/xla_cache; runs/xla_cache without --run-dir")
    p.add_argument("--tpu-name", default='"$TPU_NAME"', help="TPU name for --print-commands")
    p.add_argument("--zone", default='"$ZONE"', help="zone for --print-commands")
    p.add_argument("--workdir", default="~/xla_tp", help="repository checkout on the workers, for --print-commands")
    p.set_defaults(func=launch)


def split_recipe(recipe: str, extra: list[str]) -> tuple[str, list[str]]:
    """The recipe and the ``key=value`` overrides; ``xla-tp launch steps=5`` is the default recipe.

    ``extra`` holds the arguments argparse did not recognise: anything but ``key=value`` is an error.
    """
    wrong = [a for a in extra if "=" not in a or a.startswith("-")]
    if wrong:
        raise LaunchError(f"unrecognised argument(s) {' '.join(wrong)}; overrides are key=value "
                          f"(see xla-tp launch --help)")
    if "=" in recipe:
        return DEFAULT_RECIPE, [recipe, *extra]
    return recipe, list(extra)


def launch(args: argparse.Namespace) -> int:
    """The ``launch`` subcommand; returns the exit status. Bad input is one line on stderr, exit 2."""
    try:
        return _launch(args)
    except (PlanError, MeshError, UsageError) as error:   # LaunchError is a PlanError
        return fail("launch", error)
    except KeyboardInterrupt:                 # a second Ctrl-C during a step, or one before training
        print("xla-tp launch: interrupted", file=sys.stderr)
        return INTERRUPTED


def _launch(args: argparse.Namespace) -> int:
    recipe_arg, overrides = split_recipe(args.recipe, args.overrides)
    recipe = load_recipe(recipe_arg, overrides)
    topology = load_topology(args.topology or recipe.topology)
    axes = check_for_topology(recipe, topology)
    check_cache_flags(args)
    if args.print_commands:
        from .commands import worker_commands
        print("\n".join(worker_commands(recipe_arg, topology, [*cache_flags(args), *overrides], args.tpu_name,
                                        args.zone, args.workdir)))
        return 0
    earlier = EarlierRun(Path(recipe.checkpoint.dir) if recipe.checkpoint.dir else None, args.run_dir)
    if not args.dry_run:
        earlier.check(args.resume, args.overwrite)
    prepare_env(topology, args.dry_run)
    from .session import RUNS, Session
    cache = None
    if not args.dry_run:             # before the first XLA computation (Session's mesh is one)
        import torch_xla.runtime as xr
        with one_line_warnings("launch"):
            cache = cache_from_args(args, (args.run_dir or RUNS) / "xla_cache", xr.process_index())
    session = Session(recipe, topology, axes)
    if not args.dry_run and args.overwrite and session.process_index == 0:
        for line in earlier.move_aside():
            session.say(line)
    if not session.plan_and_fit():
        return DOES_NOT_FIT
    if args.dry_run:
        session.say("dry run: the model stayed on meta; nothing was allocated or compiled")
        return 0
    return session.train(run_dir=args.run_dir, check=args.check, audit=not args.no_audit, resume=args.resume,
                         cache=cache)


def prepare_env(topology: Topology, dry_run: bool) -> None:
    """Process environment before the XLA runtime starts (importing torch_xla has set PJRT_DEVICE:
    TPU on a TPU VM, CPU elsewhere).

    A real run of a TPU topology on a TPU VM uses the TPU. Everything else runs on the CPU with one
    emulated device per chip of the slice: dry runs (so they work anywhere, even on one worker of a
    multi-host slice), ``cpu-N`` topologies, and the fit check of a TPU topology on a machine
    without one (the run is then refused after the fit check).
    """
    os.environ.setdefault("XLA_DUMP_POST_OPTIMIZATIONS", "1")   # the audit reads the partitioned program
    quiet_xla_warnings()
    if topology.is_tpu and not dry_run and os.environ.get("PJRT_DEVICE") == "TPU":
        return
    os.environ.update(topology.env)
    os.environ["PJRT_DEVICE"] = "CPU"
    os.environ["CPU_NUM_DEVICES"] = str(topology.chips)
