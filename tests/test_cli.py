"""The `async-rl` command line: every documented form parses (every `async-rl` line in README and docs loads its
config), and each role's --help describes that role."""

from __future__ import annotations

import pytest

from launch.cli import ROLES, main, parse_args


@pytest.mark.parametrize("role", sorted(ROLES))
def test_each_role_help_describes_that_role(role, capsys):
    with pytest.raises(SystemExit) as info:
        main([role, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: async-rl {role}")
    assert ROLES[role].split(".")[0] in " ".join(out.split())  # the role's own description, rewrapped
    assert "section.key=value" in out


def test_the_top_level_help_lists_the_roles(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(role in out for role in ROLES)


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--config", "my.yaml", "algo.omega=0.5", "env.kwargs.stages=5"],
        ["train", "algo.omega=0.5", "--config", "my.yaml", "env.kwargs.stages=5"],
        ["train", "algo.omega=0.5", "env.kwargs.stages=5", "--config", "my.yaml"],
    ],
)
def test_overrides_may_come_before_or_after_the_config_file(argv):
    args = parse_args(argv)
    assert args.role == "train" and args.config == "my.yaml"
    assert args.overrides == ["algo.omega=0.5", "env.kwargs.stages=5"]


def test_role_options_parse_where_documented():
    rollout = parse_args(["rollout", "--config", "configs/cluster.yaml", "--index", "3"])
    assert rollout.index == 3 and rollout.overrides == []
    learner = parse_args(["learner", "--config", "configs/cluster.yaml"])
    assert learner.role == "learner" and learner.config == "configs/cluster.yaml"
    assert parse_args(["evaluate", "--blind", "run.name=x"]).blind is True


def test_a_wrong_role_or_option_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["trian"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["train", "--index", "2"])  # --index belongs to rollout
    assert info.value.code == 2


def test_resume_names_what_is_wrong_before_anything_starts(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path / "nowhere")]) == 2
    assert f"--resume: {tmp_path / 'nowhere'} is not a run directory (no config.yaml)" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path), "--config", "configs/local.yaml"]) == 2
    assert "leave out --config" in capsys.readouterr().err
    args = parse_args(["train", "--resume", "runs/local", "run.max_versions=20"])
    assert args.resume == "runs/local" and args.overrides == ["run.max_versions=20"]


def documented_commands() -> list[tuple[str, str, str | None]]:
    """Every `async-rl ROLE ...` line inside a ``` block of README.md and docs/*.md (continuation lines joined, an
    env-var prefix such as `PYTHONPATH=.` and a trailing `# comment` dropped; `torchrun ... -m launch.cli ROLE ...`
    read as `async-rl ROLE ...`), where it was found, and the error the docs say it gives (a next line
    `# async-rl: config error: ...`), if any. docs/research/ is not scanned: it cites commands as they were run at
    the commits it names, some with options since removed."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    found: list[list] = []
    for doc in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]:
        in_block, pending = False, ""
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_block, pending = not in_block, ""
                continue
            if not in_block:
                continue
            stripped = line.strip()
            expected = stripped.removeprefix("# async-rl: config error: ")
            if expected != stripped and found and found[-1][0] == f"{doc.name}:{number - 1}":
                found[-1][2] = expected
                continue
            line = pending + stripped
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            command = re.sub(r"\s+#\s.*$", "", line)
            command = re.sub(r"^(\w+=\S*\s+)+", "", command)  # PYTHONPATH=. async-rl ...
            command = re.sub(r"\s+>\s*\S+$", "", command)  # async-rl config --schema > FILE: the shell's
            for part in re.split(r"\s*(?:&&|;)\s*", command):
                module = re.search(r"(?:^|\s)-m (?:launch|async_rl)\.cli (.+)$", part)  # torchrun ... -m launch.cli
                if part.startswith("async-rl ") or module:
                    found.append([f"{doc.name}:{number}", f"async-rl {module.group(1)}" if module else part, None])
    return [tuple(entry) for entry in found]


@pytest.mark.parametrize("where, command, error", documented_commands(), ids=lambda value: value)
def test_every_documented_async_rl_command_parses_and_its_config_loads(where, command, error, monkeypatch):
    """The docs print these exactly; each must parse, and its config file plus overrides must load (what `async-rl`
    checks before starting anything), or fail with the error the docs print under it. `async-rl train --config FILE
    key=value` was once documented and broken."""
    import shlex
    from pathlib import Path

    from async_rl.config_load import load_config
    from async_rl.errors import ConfigError

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # the docs' paths (configs/...) are the repo's
    argv = shlex.split(command)[1:]
    if "--help" in argv:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0, where
        return
    args = parse_args(argv)
    if args.role == "keys":
        assert args.dir, where
        return
    if args.role in ("model", "export"):  # no config: tests/test_models_io.py runs them
        assert args.out_dir, where
        return
    if args.role == "swe":  # no config: tests/test_swe_make.py runs it
        assert args.package and args.out, where
        return
    if args.role in ("demos", "sft"):  # their model directory need not exist here (tests/test_warm_start.py runs them)
        assert load_config(args.config, args.overrides).env.name, where
        return
    assert args.role in ROLES, where
    if getattr(args, "resume", None):
        return
    if args.config and Path(args.config).is_absolute() and not Path(args.config).exists():
        assert args.config.startswith("/config/"), where  # a pod's mounted config (docs/deploy.md): parsed only
        return
    if error is None:
        load_config(args.config, args.overrides)
    else:
        with pytest.raises(ConfigError) as info:
            load_config(args.config, args.overrides)
        assert str(info.value) == error, where


def test_the_runs_summary_carries_the_rollout_sides_sandbox_counts(tmp_path):
    """summary.json (the learner's) gets, from the launcher once every role stopped, the sandbox executions of the
    rollout workers and how many ran without namespaces (each worker's cumulative count on its metrics lines; a
    worker restarted counts from 0 again, so each process's last count is summed), and so does the printed result."""
    import json

    from rich.console import Console

    from async_rl.config_load import load_config
    from launch.supervise import Child
    from launch.train import _result

    config = load_config(None, [f"run.dir={tmp_path}", "run.name=t"])
    run_dir = config.run_dir
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"versions": 3, "stop_reason": "max_versions"}))

    def lines(*counts: tuple[int, int]) -> str:
        return "".join(json.dumps({"sandbox_executions": n, "sandbox_executions_without_namespaces": w}) + "\n"
                       for n, w in counts)

    (run_dir / "metrics" / "rollout-0.jsonl").write_text(lines((2, 1), (5, 4)))
    (run_dir / "metrics" / "rollout-1.jsonl").write_text(lines((3, 3), (7, 6), (1, 1), (2, 2)) + '{"torn')  # restarted
    result = _result(config, Child("learner", None, run_dir / "logs" / "learner.log", None), Console(quiet=True))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["sandbox_executions"] == 5 + 7 + 2 and summary["sandbox_executions_without_namespaces"] == 4 + 6 + 2
    assert summary["versions"] == 3 and summary["stop_reason"] == "max_versions"
    assert result["sandbox_executions_without_namespaces"] == 12 and result["sandbox_executions"] == 14


def test_the_train_launcher_imports_neither_torch_nor_transformers(tmp_path):
    """`async-rl train`'s own process (its modules and run_in_process) leaves torch and transformers to the fork
    server its roles are forked from: importing them here first (2.3 CPU-s) held back the server's start."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "from async_rl.config_load import load_config\n"
        "from launch.roles import run_in_process\n"
        "import launch.train  # noqa: F401 - the launcher's flow\n"
        f"config = load_config(None, ['run.dir={tmp_path}', 'run.name=t'])\n"
        "run_in_process('train', 'train', config,\n"
        "               lambda: print([m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules]))\n"
    )
    repo = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(repo)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
