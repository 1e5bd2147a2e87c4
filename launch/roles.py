"""One command in this process: a cluster role (`replay`, `learner`, `rollout`, the command a pod runs and
`async-rl train` starts for each child), `evaluate`, or `train`'s launcher itself: its logging, thread count, entry
point, and a failure turned into an exit code."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from async_rl.config import Config
from async_rl.errors import CONFIG_EXIT_CODE, AsyncRLError, ConfigError

# Commands that import no torch or transformers in their own process: the replay (a restarted replay is back in
# about a second) and `train`'s launcher, whose roles are forked from a server that imported them (it imported both
# here before starting that server: 2.3 CPU-s, ~3 s on the shared 2-core machine, before any role could start).
NO_TORCH = ("replay", "train")


def configure_logging(name: str, config: Config) -> None:
    logging.basicConfig(
        level=config.run.log_level,
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if name not in NO_TORCH:
        quiet_transformers()


def quiet_transformers() -> None:
    """No progress bars and only errors from transformers."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def run_train(config: Config, args: argparse.Namespace) -> int:
    from launch.train import train

    return train(config, resume=args.resume is not None)


def run_replay(config: Config, args: argparse.Namespace) -> None:
    from replay.server import run

    run(config)


def run_learner(config: Config, args: argparse.Namespace) -> None:
    from learner.trainer import run

    run(config)


def run_rollout(config: Config, args: argparse.Namespace) -> None:
    from rollout.worker import run

    run(config, args.index)


def run_evaluate(config: Config, args: argparse.Namespace) -> None:
    """The final weights on every task of the eval split: one JSON line on stdout."""
    import json

    from rollout.evaluate import evaluate

    print(json.dumps(evaluate(config, max(1, config.run.eval_samples_per_task), blind=args.blind)), flush=True)


ENTRY_POINTS: dict[str, Callable[[Config, argparse.Namespace], int | None]] = {
    "train": run_train, "replay": run_replay, "learner": run_learner, "rollout": run_rollout, "evaluate": run_evaluate,
}


def run_in_process(command: str, name: str, config: Config, entry: Callable[[], int | None]) -> int:
    """Logging as `name` (rollout-N for a worker), the configured thread count (NO_TORCH import no torch), then
    `entry`. An AsyncRLError is logged and printed in one line, exit 2; a ConfigError of a service role exits
    CONFIG_EXIT_CODE, which the launcher and a pod's restart policy do not retry (it would stop the same way)."""
    configure_logging(name, config)
    try:
        if command == "train":  # the roles' entries and sockets refuse it themselves (async_rl/transport.py)
            from async_rl.security import check_transport

            # TCP without CURVE: refused unless security.insecure says so, before the run directory is made
            check_transport(config.security.curve_dir, config.security.insecure,
                            (config.replay.endpoint, config.learner.publish_endpoint))
        if command not in NO_TORCH:
            import torch

            torch.set_num_threads(config.run.threads_per_process)
        return entry() or 0
    except AsyncRLError as exc:
        logging.getLogger(f"async_rl.{command}").error("%s", exc)
        print(f"async-rl {command}: {exc}", file=sys.stderr)
        from async_rl.security import ROLES as SERVICE_ROLES  # lazily, as above: zmq is not needed until here

        if isinstance(exc, ConfigError) and command in SERVICE_ROLES:
            return CONFIG_EXIT_CODE  # a launcher or pod restart would meet the same error
        return 2
    except KeyboardInterrupt:
        return 130
