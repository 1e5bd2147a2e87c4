"""The `async-rl` command line: every documented form parses, and each role's --help describes that role."""

from __future__ import annotations

import pytest

from async_rl.cli import ROLES, main, parse_args


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
