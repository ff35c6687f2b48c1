"""``xla-tp generate [RECIPE] --prompt TEXT [--checkpoint DIR] [--max-new-tokens N] [--topology NAME] [key=value ...]``.

The recipe's model, built on ``meta`` and parallelized with the recipe's plan on its mesh, takes its
weights from ``--checkpoint``: a checkpoint the launcher saved (its directory, or one step of it) or a
Hugging Face directory of safetensors (without it the weights are the model's random init, and the
command says so). The tokenizer is the directory's own when it has one, else the bytes of the text
(what the launcher trains a ``data.kind: text`` recipe on). The prompt and the new text stream to
stdout as the tokens come; stderr gets what was loaded, then the tokens per second and the programs
compiled, then what the persistent compilation cache supplied (``xla_tp.compile_cache``: on by default in
``~/.cache/xla_tp/xla_cache``; ``--compile-cache DIR``, ``--no-compile-cache``). Bad input (an unknown
recipe, a missing checkpoint, a prompt too long for the model) is one line on stderr with exit status 2. Example::

    xla-tp generate --prompt "The tiny corpus" --checkpoint ckpt --max-new-tokens 64
    xla-tp generate qwen3 --checkpoint ~/Qwen3-1.7B --prompt "Hello" --do-sample --temperature 0.7
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional

from ..compile_cache import add_cache_flags, cache_from_args, check_cache_flags
from ..compiles import compile_counts
from ..console import UsageError, fail, one_line_warnings
from ..errors import CheckpointError, GenerationError, MeshError, PlanError

INTERRUPTED = 130
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def add_parser(sub: Any) -> None:
    """Register ``generate`` on the ``xla-tp`` subcommand parser."""
    from ..launch.recipe import DEFAULT_RECIPE
    p = sub.add_parser("generate", help="continue a prompt with a recipe's model, tensor-parallel",
                       description="Continue a prompt with a recipe's model, parallelized on its mesh; the "
                                   "tokens stream as they come.",
                       epilog="Recipe overrides: key=value anywhere on the line (mesh=\"{model: 8}\").")
    p.add_argument("recipe", nargs="?", default=DEFAULT_RECIPE,
                   help=f"recipe name from recipes/ or a YAML path (default {DEFAULT_RECIPE})")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--checkpoint", type=Path, help="a checkpoint the launcher saved, or a Hugging Face directory")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--topology", help="tpu_configs/ name or YAML path (default: the recipe's)")
    p.add_argument("--do-sample", action="store_true", help="sample instead of taking the likeliest token")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=0, help="the sampling seed")
    add_cache_flags(p, "$XDG_CACHE_HOME/xla_tp/xla_cache, else ~/.cache/xla_tp/xla_cache")
    p.set_defaults(func=generate_command)


def generate_command(args: argparse.Namespace) -> int:
    """The ``generate`` subcommand; returns the exit status."""
    try:
        return _generate(args)
    except (PlanError, MeshError, GenerationError, CheckpointError, UsageError) as error:   # LaunchError: a PlanError
        return fail("generate", error)
    except KeyboardInterrupt:
        print("xla-tp generate: interrupted", file=sys.stderr)
        return INTERRUPTED


def default_cache() -> Path:
    """Where generate keeps compiled programs: the user's cache directory (``$XDG_CACHE_HOME``, else
    ``~/.cache``), ``xla_tp/xla_cache``. A generation has no run directory, and a checkpoint's directory may be
    read-only or absent (random init); the programs depend on the model's shapes and the mesh, not on the
    weights, so every checkpoint of one model shares them."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "xla_tp" / "xla_cache"


def tokenizer_for(data_kind: str, checkpoint: Optional[Path], where: str) -> Any:
    """The checkpoint directory's Hugging Face tokenizer, else the bytes of the text for a text recipe."""
    from ..launch.data import ByteTokenizer
    from ..launch.schema import LaunchError
    if checkpoint is not None and checkpoint.is_dir() and any((checkpoint / f).is_file() for f in TOKENIZER_FILES):
        import transformers
        return transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    if data_kind == "text":
        return ByteTokenizer()
    raise LaunchError(f"{where}: data.kind {data_kind} gives no tokenizer; pass --checkpoint DIR holding a Hugging "
                      f"Face tokenizer ({TOKENIZER_FILES[0]})")


def _generate(args: argparse.Namespace) -> int:
    from ..launch.main import prepare_env, split_recipe
    from ..launch.recipe import check_for_topology, load_recipe
    from ..launch.schema import LaunchError
    from ..launch.topology import load_topology
    recipe_arg, overrides = split_recipe(args.recipe, args.overrides)
    recipe = load_recipe(recipe_arg, overrides)
    if recipe.model.task != "causal-lm":
        raise LaunchError(f"{recipe.path}: model.task is {recipe.model.task}; generate needs a causal-lm recipe")
    if not args.prompt:
        raise LaunchError("--prompt is empty: pass the text to continue")
    if args.checkpoint is not None and not args.checkpoint.exists():
        raise LaunchError(f"--checkpoint {args.checkpoint}: no such file or directory")
    tokenizer = tokenizer_for(recipe.data.kind, args.checkpoint, recipe.path)
    topology = load_topology(args.topology or recipe.topology)
    axes = check_for_topology(recipe, topology)
    check_cache_flags(args)
    prepare_env(topology, dry_run=False)
    from .. import processes
    with one_line_warnings("generate"):
        cache = cache_from_args(args, default_cache(), processes.index())
    status = _decode(args, recipe, topology, axes, tokenizer)
    print(cache.summary(compile_counts()), file=sys.stderr)
    return status


def _decode(args: argparse.Namespace, recipe: Any, topology: Any, axes: dict[str, int], tokenizer: Any) -> int:
    import torch
    import torch_xla.core.xla_model as xm
    from transformers import TextStreamer

    import xla_tp
    from ..launch.model import build_model, hf_config
    from ..launch.plans import plan_input
    from ..launch.recipe import PRECISIONS
    from ..launch.session import check_devices
    from .run import run
    check_devices(topology)
    mesh = xla_tp.make_mesh(**axes)
    config = hf_config(recipe.model, recipe.path)
    model = build_model(config, "causal-lm", device="meta", dtype=getattr(torch, PRECISIONS[recipe.precision]),
                        seed=recipe.seed)
    xla_tp.parallelize_xla(model, plan_input(recipe), mesh=mesh)
    if args.checkpoint is not None:
        xla_tp.load_checkpoint(str(args.checkpoint), model)
    weights = args.checkpoint or "the model's random init (no --checkpoint)"
    print(f"xla-tp generate {recipe.name}: {type(model).__name__} on mesh "
          f"{','.join(f'{k}={v}' for k, v in axes.items())}, weights from {weights}", file=sys.stderr)
    xm.set_rng_state(args.seed)
    ids = torch.tensor([tokenizer.encode(args.prompt)])
    result = run(model, ids, args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                 top_k=args.top_k, top_p=args.top_p, streamer=TextStreamer(tokenizer))
    print(f"{result.new_tokens} tokens in {result.seconds:.2f} s: the first after {result.first_token_seconds:.2f} s, "
          f"then {result.tokens_per_second:.1f} tokens/s; {result.compiles} programs compiled (prompt bucket "
          f"{result.prompt_bucket}, cache {result.cache_length} tokens, KV cache "
          f"{result.kv_bytes_per_device:,} bytes per device of {result.kv_bytes:,})", file=sys.stderr)
    return 0
