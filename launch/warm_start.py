"""The warm-start commands: `async-rl demos` (an environment's solved train episodes as a JSONL file,
rollout/demos.py) and `async-rl sft` (supervised fine-tuning on such a file into a model directory,
learner/sft.py). Each prints what it wrote on stdout (one JSON line), progress on stderr, a failure in one line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import msgspec

from async_rl.config import Config, configured_model_path
from async_rl.config_load import dump_config, load_config_explained
from async_rl.errors import AsyncRLError
from async_rl.hf_io import refuse_non_empty
from async_rl.model_defaults import said
from launch.rundir import fresh_run_name

DEMOS_HELP = ("Write solved episodes of the environment's train split (never its eval split) as OpenAI chat "
              "conversations, one JSON object a line, for `async-rl sft` (the env's demonstration member: "
              "docs/models.md, 'Warm start').")
SFT_HELP = ("Supervised fine-tuning (a warm start before RL) on OpenAI chat conversations with tool calls, on the "
            "learner's engine; the loss is on assistant tokens only. Writes OUT_DIR, a model directory for "
            "model.path and export (LoRA merged).")


def add_parsers(roles: argparse._SubParsersAction, config_help: str, overrides_help: str) -> None:
    demos = roles.add_parser("demos", help=DEMOS_HELP.split(" (")[0], description=DEMOS_HELP)
    demos.add_argument("--config", default=None, metavar="FILE", help=config_help)
    demos.add_argument("--out", required=True, metavar="FILE.jsonl", help="the file to write (replaced)")
    demos.add_argument("--n", type=int, required=True, metavar="N", help="how many conversations to write")
    demos.add_argument("overrides", nargs="*", metavar="section.key=value", help=overrides_help)
    sft = roles.add_parser("sft", help=SFT_HELP.split(" (")[0], description=SFT_HELP)
    sft.add_argument("--model", required=True, metavar="DIR", help="the model directory to start from")
    sft.add_argument("--data", required=True, metavar="FILE.jsonl",
                     help='conversations, one a line: {"messages": [...], "tools": [...]}')
    sft.add_argument("--out", required=True, metavar="OUT_DIR", help="the model directory to write (refused if it "
                     "exists and is not empty, unless --force)")
    sft.add_argument("--config", default=None, metavar="FILE", help=config_help + "; its learner section is used")
    sft.add_argument("--lora-rank", type=int, default=None, metavar="N",
                     help="train a LoRA adapter of rank N (merged into OUT_DIR) instead of every weight")
    sft.add_argument("--epochs", type=int, default=1, metavar="N", help="passes over the data (default 1)")
    sft.add_argument("--max-steps", type=int, default=None, metavar="N",
                     help="stop after N optimizer steps (default: all the data, --epochs times)")
    sft.add_argument("--resume", action="store_true",
                     help="continue the run in <run.dir>/sft-<OUT_DIR's name> from its latest checkpoint")
    sft.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    sft.add_argument("overrides", nargs="*", metavar="section.key=value", help=overrides_help)


def run_demos(args: argparse.Namespace) -> int:
    from launch.roles import run_in_process

    try:
        if args.n < 1:
            raise AsyncRLError(f"--n: expected >= 1, got {args.n}")
        config, notes = load_config_explained(args.config, args.overrides)
    except AsyncRLError as exc:
        print(f"async-rl demos: {exc}", file=sys.stderr)
        return 2
    for line in said("demos", config.model.path, notes):
        print(line, file=sys.stderr)

    def entry() -> int:
        from rollout.demos import write_demonstrations

        counts = write_demonstrations(config, Path(args.out), args.n)
        print(json.dumps({"out": str(Path(args.out).resolve()), **counts}), flush=True)
        return 0 if counts["written"] else 1

    return run_in_process("demos", "demos", config, entry)


def sft_run_config(args: argparse.Namespace) -> tuple[Config, dict[str, str]]:
    """The command's config: --config (default: the built-in defaults) with model.path = --model, the LoRA rank,
    every core (unless run.threads_per_process is on the line), and the run directory <run.dir>/sft-<OUT_DIR's
    name> (a fresh one unless --resume), then the overrides; with where the model-following keys' values came from
    (a model's context and a pretrained model's lr unless set: async_rl/model_defaults.py)."""
    if args.epochs < 1:
        raise AsyncRLError(f"--epochs: expected >= 1, got {args.epochs}")
    if args.max_steps is not None and args.max_steps < 1:
        raise AsyncRLError(f"--max-steps: expected >= 1, got {args.max_steps}")
    # One process trains: every core is its own (`async-rl train` shares them among its roles: run.threads_per_process)
    implied = [f"model.path={args.model}", f"run.name=sft-{Path(args.out).name}",
               f"run.threads_per_process={os.cpu_count() or 1}"]
    if args.lora_rank is not None:
        implied.append(f"learner.lora.rank={args.lora_rank}")
    config, notes = load_config_explained(args.config, [*implied, *args.overrides], warm_start=True)
    configured_model_path(config)
    if args.resume:
        if not (config.run_dir / "config.yaml").is_file():
            raise AsyncRLError(f"--resume: {config.run_dir} holds no earlier warm start (no config.yaml)")
        return config, notes
    run = msgspec.structs.replace(config.run, name=fresh_run_name(config))
    return msgspec.structs.replace(config, run=run), notes


def run_sft(args: argparse.Namespace) -> int:
    from launch.roles import run_in_process

    try:
        config, notes = sft_run_config(args)
        if not args.resume:
            refuse_non_empty(Path(args.out), args.force)  # before a run directory or minutes of training
        (config.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        dump_config(config, config.run_dir / "config.yaml")
    except (AsyncRLError, OSError) as exc:
        print(f"async-rl sft: {exc}", file=sys.stderr)
        return 2
    for line in said("sft", config.model.path, notes):
        print(line, file=sys.stderr)

    def entry() -> int:
        from learner.sft import SftPlan, run_sft

        plan = SftPlan(Path(args.data), Path(args.out), args.epochs, force=args.force, resume=args.resume,
                       max_steps=args.max_steps)
        print(json.dumps(run_sft(config, Path(config.model.path), plan)), flush=True)
        return 0

    return run_in_process("sft", "sft", config, entry)
