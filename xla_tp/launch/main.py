"""``xla-tp launch RECIPE [--topology NAME] [--dry-run] [--print-commands] [--check] [--resume | --overwrite]
[--backend jax [--hosts N]] [key=value ...]``.

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

``--backend jax`` (``jax_run``): the same checks and fit table, then the run on the JAX backend, in this process
or (``--hosts N``, ``hosts``) in N local processes joined into one mesh; what it does not support yet is refused
before anything runs.

Exit status: 0 done, 1 ``--check`` failed, 2 bad input, 3 will not fit, 130 stopped by Ctrl-C/SIGTERM.
Example::

    xla-tp launch                                   # tiny-llama-cpu on 8 emulated CPU devices
    xla-tp launch llama3-70b --dry-run              # plan + fit on v5p-64, model on meta
    xla-tp launch llama3-8b --topology v5e-8 batch=4 --print-commands
    xla-tp launch --backend jax --hosts 2           # tiny-llama-cpu on JAX: 2 processes x 4 CPU devices
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from ..compile_cache import add_cache_flags, cache_flags, cache_from_args, check_cache_flags
from ..console import UsageError, fail, one_line_warnings, quiet_xla_warnings
from ..errors import MeshError, PlanError
from .recipe import DEFAULT_RECIPE, Recipe, check_for_topology, load_recipe
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
    p.add_argument("--backend", choices=("torch_xla", "jax"), default="torch_xla",
                   help="torch_xla (default) or jax (parallelize_jax through torchax)")
    p.add_argument("--hosts", type=int, default=1, metavar="N",
                   help="with --backend jax on a CPU topology: run as N local processes joined into one mesh")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="with --backend jax: process 0's address; with --print-commands, what the hosts are told "
                        "(default \"$COORDINATOR\":8476)")
    p.add_argument("--num-processes", type=int, help="with --coordinator: how many processes join")
    p.add_argument("--process-index", type=int, help="with --coordinator: this process's index")
    p.add_argument("--checked", action="store_true", help=argparse.SUPPRESS)   # a --hosts child: parent checked
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
    check_backend_flags(args, recipe, topology)
    check_cache_flags(args)
    if args.print_commands:
        from .commands import worker_commands
        jax = args.backend == "jax"
        print("\n".join(worker_commands(recipe_arg, topology, [*cache_flags(args), *overrides], args.tpu_name,
                                        args.zone, args.workdir,
                                        jax_coordinator=(args.coordinator or '"$COORDINATOR":8476') if jax else None)))
        return 0
    if args.backend == "jax":
        return _launch_jax(args, recipe_arg, overrides, recipe, topology, axes)
    session, cache, status = _fit_check(args, recipe, topology, axes, args.run_dir)
    if session is None:
        return status
    return session.train(run_dir=args.run_dir, check=args.check, audit=not args.no_audit, resume=args.resume,
                         cache=cache)


def _fit_check(args: argparse.Namespace, recipe: Recipe, topology: Topology, axes: dict[str, int],
               run_dir: Optional[Path], jax: bool = False, process_index: Optional[int] = None,
               process_count: Optional[int] = None) -> tuple[Any, Any, int]:
    """Steps 3-6: an earlier run's files, the environment, (torch_xla's compilation cache,) the plan and the fit
    check; ``(session, cache, 0)`` for a run to go on, ``(None, None, status)`` when it stops here. With ``jax``,
    torch_xla only plans, on the slice's chips emulated on the CPU, and keeps no cache."""
    earlier = EarlierRun(Path(recipe.checkpoint.dir) if recipe.checkpoint.dir else None, run_dir)
    if not args.dry_run:
        earlier.check(args.resume, args.overwrite)
    prepare_env(topology, args.dry_run or jax)
    from .session import RUNS, Session
    cache = None
    if not args.dry_run and not jax:   # before the first XLA computation (Session's mesh is one)
        from .. import processes
        with one_line_warnings("launch"):
            cache = cache_from_args(args, (run_dir or RUNS) / "xla_cache", processes.index())
    session = Session(recipe, topology, axes, process_index, process_count)
    if not args.dry_run and args.overwrite and session.process_index == 0:
        for line in earlier.move_aside():
            session.say(line)
    if not session.plan_and_fit():
        return None, None, DOES_NOT_FIT
    if args.dry_run:
        session.say("dry run: the model stayed on meta; nothing was allocated or compiled")
        return None, None, 0
    return session, cache, 0


def check_backend_flags(args: argparse.Namespace, recipe: Recipe, topology: Topology) -> None:
    """``LaunchError`` (one line naming the flag) for flags the chosen backend does not take."""
    joined = [f for f, v in (("--hosts", args.hosts != 1), ("--coordinator", args.coordinator),
                             ("--num-processes", args.num_processes is not None),
                             ("--process-index", args.process_index is not None)) if v]
    if args.backend != "jax":
        if joined:
            raise LaunchError(f"{joined[0]} needs --backend jax (torch_xla's CPU client cannot span processes; on a "
                              f"TPU slice --print-commands gives each worker its command)")
        return
    if args.hosts < 1 or topology.chips % args.hosts:
        raise LaunchError(f"--hosts {args.hosts}: the {topology.chips} devices of {topology.name} must divide over "
                          f"the hosts (1, 2, 4, ...)")
    if args.hosts > 1 and (topology.is_tpu or args.coordinator):
        raise LaunchError("--hosts emulates hosts on this machine's CPU (a cpu-N topology); on a pod start every "
                          "host with the commands --print-commands gives")
    if not args.print_commands and args.coordinator and (args.num_processes is None or args.process_index is None):
        raise LaunchError("--coordinator needs --num-processes and --process-index (--print-commands gives them)")
    from .jax_run import unsupported
    why = unsupported(recipe, topology, {"--check": args.check, "--resume": args.resume,
                                         "--compile-cache": args.compile_cache is not None})
    if why:
        raise LaunchError(why)


def _launch_jax(args: argparse.Namespace, recipe_arg: str, overrides: list[str], recipe: Recipe,
                topology: Topology, axes: dict[str, int]) -> int:
    """``--backend jax``: the checks and the fit table (torch_xla's plan on meta, emulated on the CPU), then
    the run in this process, or in ``--hosts`` local processes; a ``--hosts`` child goes straight to training."""
    from .jax_run import train_jax
    from .session import RUNS
    run_dir = args.run_dir if args.run_dir is not None else RUNS / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    index = args.process_index or 0
    if args.coordinator:
        from .hosts import join
        join(args.coordinator, args.num_processes, index)
    if args.checked:
        return train_jax(recipe, topology, axes, run_dir, index, audit=not args.no_audit)
    session, _, status = _fit_check(args, recipe, topology, axes, run_dir, jax=True, process_index=index,
                                    process_count=args.num_processes or args.hosts)
    if session is None:
        return status
    if args.hosts == 1:
        return train_jax(recipe, topology, axes, run_dir, index, audit=not args.no_audit)
    from .hosts import run_local_hosts
    session.say(f"\nstarting {args.hosts} processes x {topology.chips // args.hosts} CPU devices, joined into one "
                f"JAX mesh on 127.0.0.1")
    child = [recipe_arg, *overrides, "--backend", "jax", "--run-dir", str(run_dir), "--checked",
             *(["--topology", args.topology] if args.topology else []), *(["--no-audit"] if args.no_audit else [])]
    return run_local_hosts(child, args.hosts, topology.chips)


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
