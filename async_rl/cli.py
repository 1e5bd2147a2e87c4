"""The `async-rl` command: `train` runs every role on this machine; `replay|learner|rollout` run one role (a pod);
`keys DIR` writes the CURVE keys of a cluster (async_rl/security.py)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from async_rl.config import Config, load_config
from async_rl.errors import CONFIG_EXIT_CODE, AsyncRLError, ConfigError

ROLES = {
    "train": "Run every role on this machine (replay, learner, rollout workers as separate processes), then "
    "evaluate the final weights. The local default.",
    "replay": "Run the replay service (one pod): leases, the credit ledger, training items, batches.",
    "learner": "Run the DeepSpeed learner (one pod, or every rank under torchrun).",
    "rollout": "Run one rollout worker (one pod each): environments, the inference engine, stage records.",
    "evaluate": "Evaluate the run's latest published weights on every task of the environment's eval split.",
    "config": "Print the resolved, validated config.",
}
KEYS_HELP = ("Write one CurveZMQ key pair per role (replay, learner, rollout) into DIR: <role>.key (public) and "
             "<role>.key_secret. Point security.curve_dir at DIR (docs/deploy.md says which files each pod mounts).")
OVERRIDES_HELP = "overrides of config keys, e.g. algo.max_staleness=2 env.kwargs.stages=5 (anywhere on the line)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="async-rl",
        description="Asynchronous off-policy RL for long-horizon LLM agents. `async-rl ROLE --help` describes a role.",
    )
    roles = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    for role, text in ROLES.items():
        sub = roles.add_parser(role, help=text.split(". ")[0], description=text)
        sub.add_argument("--config", default=None, metavar="FILE", help="YAML config (default: configs/local.yaml)")
        if role == "train":
            sub.add_argument("--resume", default=None, metavar="RUN_DIR",
                             help="continue the run in RUN_DIR (its config.yaml; overrides apply on top): the learner "
                                  "resumes from its latest checkpoint, logs and metrics.jsonl continue")
        if role == "rollout":
            sub.add_argument("--index", type=int, default=0, help="this worker's index N (its id is rollout-N)")
        if role == "evaluate":
            sub.add_argument("--blind", action="store_true",
                             help="replace every tool answer (observation after an action) by a fixed string")
        sub.add_argument("overrides", nargs="*", metavar="section.key=value", help=OVERRIDES_HELP)
    keys = roles.add_parser("keys", help=KEYS_HELP.split(": ")[0], description=KEYS_HELP)
    keys.add_argument("dir", metavar="DIR", help="directory for the keys (created; existing keys are not overwritten)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Options and overrides in any order: `train --config FILE a.b=1` and `train a.b=1 --config FILE` alike."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ROLES and not any(a in ("-h", "--help") for a in argv):
        sub = parser._subparsers._group_actions[0].choices[argv[0]]  # type: ignore[union-attr]
        namespace = sub.parse_intermixed_args(argv[1:])
        namespace.role = argv[0]
        return namespace
    return parser.parse_args(argv)


def configure_logging(role: str, config: Config) -> None:
    logging.basicConfig(
        level=config.run.log_level,
        format=f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if role == "replay":
        return  # the replay imports neither transformers nor torch: a restarted replay is back in about a second
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "keys":
        from async_rl.security import create_keys

        try:
            written = create_keys(args.dir)
        except (AsyncRLError, OSError) as exc:
            print(f"async-rl keys: {exc}", file=sys.stderr)
            return 2
        print("\n".join(str(path) for path in written))
        return 0
    resume = getattr(args, "resume", None)
    try:
        if resume is not None and args.config is not None:
            raise AsyncRLError("--resume RUN_DIR takes the run's own config.yaml; leave out --config")
        if resume is not None:
            from async_rl.launcher import resume_config

            config = resume_config(resume, args.overrides)
        else:
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
    if args.role == "train":
        from async_rl.launcher import preflight

        try:
            # before torch is imported: a wrong model.path or run.dir is reported at once
            preflight(config, resume is not None)
        except AsyncRLError as exc:
            print(f"async-rl train: {exc}", file=sys.stderr)
            return 2
    configure_logging(role, config)
    if args.role in ("train", "replay", "learner", "rollout"):
        from async_rl.security import warn_if_insecure

        warn_if_insecure(config)
    try:
        if args.role != "replay":
            import torch

            torch.set_num_threads(config.run.threads_per_process)
        if args.role == "train":
            from async_rl.launcher import train

            return train(config, resume=resume is not None)
        if args.role == "replay":
            from replay.service import run as run_replay

            run_replay(config)
        elif args.role == "evaluate":
            import json

            from rollout.evaluate import evaluate

            print(json.dumps(evaluate(config, max(1, config.run.eval_samples_per_task), blind=args.blind)), flush=True)
        elif args.role == "learner":
            from learner.trainer import run as run_learner

            run_learner(config)
        else:
            from rollout.worker import run as run_rollout

            run_rollout(config, args.index)
    except AsyncRLError as exc:
        logging.getLogger(f"async_rl.{args.role}").error("%s", exc)
        print(f"async-rl {args.role}: {exc}", file=sys.stderr)
        from async_rl.security import ROLES as SERVICE_ROLES  # lazily, as above: zmq is not needed until here

        if isinstance(exc, ConfigError) and args.role in SERVICE_ROLES:
            return CONFIG_EXIT_CODE  # a launcher or pod restart would meet the same error
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
