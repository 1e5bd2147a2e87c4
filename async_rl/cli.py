"""The `async-rl` command: `train` runs every role on this machine; `replay|learner|rollout` run one role (a pod)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from async_rl.config import Config, load_config
from async_rl.errors import AsyncRLError

USAGE = """\
async-rl train   [--config FILE] [section.key=value ...]   all roles on this machine (the local default)
async-rl replay  [--config FILE] [section.key=value ...]   the replay service (one pod)
async-rl learner [--config FILE] [section.key=value ...]   the DeepSpeed learner (one pod, or under torchrun)
async-rl rollout [--config FILE] [--index N] [section.key=value ...]   one rollout worker (one pod each)
async-rl evaluate [--config FILE] [section.key=value ...]  success of the run's latest weights on every task
async-rl config  [--config FILE] [section.key=value ...]   print the resolved, validated config
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="async-rl", usage=USAGE)
    parser.add_argument("role", choices=["train", "replay", "learner", "rollout", "evaluate", "config"])
    parser.add_argument("--config", default=None, help="YAML config (default: configs/local.yaml)")
    parser.add_argument("--index", type=int, default=0, help="rollout worker index (rollout only)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser


def configure_logging(role: str, config: Config) -> None:
    logging.basicConfig(
        level=config.run.log_level,
        format=f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except AsyncRLError as exc:
        print(f"async-rl: config error: {exc}", file=sys.stderr)
        return 2
    if args.role == "config":
        import yaml

        from async_rl.config import config_to_dict

        print(yaml.safe_dump(config_to_dict(config), sort_keys=False), end="")
        return 0
    if args.role in ("replay", "learner", "rollout"):
        for key, value in (("replay.endpoint", config.replay.endpoint),
                           ("learner.publish_endpoint", config.learner.publish_endpoint)):
            if value == "auto":
                print(f"async-rl: config error: {key}: 'auto' is for async-rl train; a pod needs tcp://HOST:PORT "
                      "(see configs/cluster.yaml)", file=sys.stderr)
                return 2
    role = f"rollout-{args.index}" if args.role == "rollout" else args.role
    configure_logging(role, config)
    try:
        import torch

        torch.set_num_threads(config.run.threads_per_process)
        if args.role == "train":
            from async_rl.launcher import train

            return train(config)
        if args.role == "replay":
            from replay.service import run as run_replay

            run_replay(config)
        elif args.role == "evaluate":
            import json

            from rollout.evaluate import evaluate

            print(json.dumps(evaluate(config, max(1, config.run.eval_samples_per_task))), flush=True)
        elif args.role == "learner":
            from learner.trainer import run as run_learner

            run_learner(config)
        else:
            from rollout.worker import run as run_rollout

            run_rollout(config, args.index)
    except AsyncRLError as exc:
        logging.getLogger(f"async_rl.{args.role}").error("%s", exc)
        print(f"async-rl {args.role}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
