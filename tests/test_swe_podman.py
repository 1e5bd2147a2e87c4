"""env.name=swe with a task that names an `image`: the scripted episode of tests/test_swe_worker.py, run by podman
(runc) in a container of a local image built by scripts/build_swe_image.sh (debootstrap + podman import: no
registry). Needs root, podman and runc (tests/podman_tools.py: installed under CI=true); the image is built on first
use (~2 min)."""

from __future__ import annotations

import json
import subprocess

import pytest
from podman_tools import ensure_podman_tools
from project_commands import REPO
from test_swe_env import call, task_file  # noqa: F401 - the hand-written SWE-bench task file, a fixture
from test_swe_worker import run_scripted_group

from rollout.envs.base import checked_judge, checked_reset, checked_step, load_factory

IMAGE = "localhost/async-rl-swe:bookworm"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def image_task_file(task_file, tmp_path_factory):  # noqa: F811
    ensure_podman_tools()  # skipped without them, installed with apt under CI=true
    if subprocess.run(["podman", "image", "exists", IMAGE]).returncode != 0:
        built = subprocess.run([str(REPO / "scripts" / "build_swe_image.sh"), IMAGE], capture_output=True, text=True,
                               timeout=1200)
        assert built.returncode == 0, built.stderr[-2000:]
    record = {**json.loads(task_file.read_text()), "image": IMAGE,
              "repo_dir": str(task_file.parent / "repos" / "stats")}
    path = tmp_path_factory.mktemp("podman") / "tasks.jsonl"
    path.write_text(json.dumps(record) + "\n")
    return path


def test_a_task_with_an_image_runs_the_scripted_episode_in_podman(image_task_file):
    sink = run_scripted_group(image_task_file, 1, 300)
    ((trajectory, judgement, reason),) = sink.outcomes
    assert [reward for _, reward, _ in sink.stages] == [pytest.approx(0.5), 0.0, 1.0, 0.0]
    assert reason == "" and judgement.success and judgement.info["fail_to_pass"] == 1.0
    # the commands ran in the image (Debian's python), not on this host
    factory = load_factory("swe", {"tasks": str(image_task_file), "eval_fraction": 0.0, "max_turns": 6})
    env = factory.make()
    checked_reset("swe", env, factory.tasks("train")[0])
    shown = checked_step("swe", env, call("bash", command="cat /etc/debian_version; python -c 'import sys; "
                                                          "print(sys.prefix)'; touch /etc/x")).observation[0].content
    assert "/usr\n" in shown and "Read-only file system" in shown
    assert not checked_judge("swe", env).success  # nothing changed: the unfixed base fails in the container too
    env.close()
    factory.close()
