"""`async-rl train --ray ADDRESS` on a real Ray cluster: a head and two worker nodes on this machine, each `ray start`
in its own network namespace with its own address (tests/ray_cluster.py), as three machines would be. The driver
runs in the head's namespace (as `ray job submit` runs it there).

One run trains the quick start's task (trap) to VERSIONS versions with the learner's two ranks (gloo) on the two
worker nodes and a rollout worker on each; midway the raylet of the node holding learner rank 1 is SIGKILLed (the node
is gone): its actors come back on the other worker node, the run finishes, and benchmarks/chaos_check.py's join of
the workers' journals with the learner's per-item log finds no acknowledged stage lost and none trained twice. The
`ray job submit` command runs as docs/deploy.md prints it. Bad input: no cluster at the address, a placement the
cluster cannot hold, a relative run.dir.

The Ray tests share one cluster (module scope, one xdist group) and take about 3 minutes here; needs root and
network namespaces (`ip netns`)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from netns import namespaces_unavailable
from ray_cluster import RayCluster, node_env
from sglang_server import under_ci

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from chaos_check import check  # noqa: E402

VERSIONS = 30  # about 2 s a version once the backlog is trained: the kill lands mid-run
KILL_AT = 3  # versions trained before the raylet is killed

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


def need_namespaces() -> None:
    """The cluster's nodes need network namespaces: without them the tests are skipped, but fail under CI (CI=true:
    a skip would hide that no Ray test ran)."""
    reason = namespaces_unavailable()
    if reason is not None:
        if under_ci():
            pytest.fail(f"the Ray tests need network namespaces, and under CI they must run: {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Head: 1 CPU (the replay's); each worker node 4 CPUs: a learner rank and a rollout worker each, and room for
    the other node's two when one is lost."""
    need_namespaces()
    head, worker = documented_starts()
    cluster = RayCluster({"head": 1, "node-1": 4, "node-2": 4}, tmp_path_factory.mktemp("ray-nodes"), head, worker)
    try:
        yield cluster.open()
    finally:
        cluster.close()


def documented_starts() -> tuple[str, str]:
    """The two `ray start` commands docs/deploy.md prints (head, then every other node), without their comments: the
    cluster's nodes run them, with the flags this machine needs added (tests/ray_cluster.py)."""
    lines = [line.split("#")[0].strip() for line in (ROOT / "docs" / "deploy.md").read_text().splitlines()
             if line.startswith("ray start ")]
    assert len(lines) == 2 and "--head" in lines[0] and "--address=HEAD:" in lines[1], lines
    return lines[0], lines[1]


def run_config(path: Path, runs: Path, **sections: dict) -> Path:
    """The quick start's task (trap, the tiny model, CPU) made small, as a config file; `sections` on top."""
    config = {
        "run": {"dir": str(runs), "name": "ray", "max_versions": VERSIONS, "target_success": None,
                "threads_per_process": 1, "eval_samples_per_task": 0},
        "env": {"kwargs": {"num_tasks": 8, "stages": 3, "choices": 4, "traps": 1}},
        "rollout": {"workers": 2, "max_inflight": 8, "group_size": 4},
        "learner": {"lr": 5e-4, "batch_tokens": 1024, "min_batch_items": 8, "batch_wait_s": 0.5,
                    "checkpoint_every": 2},
        "algo": {"groups_per_step": 2},
        "wandb": {"mode": "disabled"},
        "ray": {"learner_ranks": 2, "learner_placement": "SPREAD"},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def train(cluster: RayCluster, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cluster.in_namespace(cluster.head, ["async-rl", "train", *args]), env=node_env(),
                          capture_output=True, text=True, timeout=timeout)


# --- bad input ----------------------------------------------------------------------------------------------------


def test_ray_refuses_a_relative_run_dir(tmp_path):
    config = run_config(tmp_path / "run.yaml", Path("runs"))
    done = subprocess.run([sys.executable, "-m", "launch.cli", "train", "--ray", "auto", "--config", str(config)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path, env=node_env())
    assert done.returncode == 2, done.stderr
    assert "run.dir: 'runs' is a relative path" in done.stderr and "absolute path" in done.stderr
    assert not (tmp_path / "runs").exists()


def test_ray_config_keys_are_typed_and_a_wrong_one_is_refused_by_name(tmp_path):
    done = subprocess.run([sys.executable, "-m", "launch.cli", "config", "ray.learner_rank=2"], capture_output=True,
                          text=True, timeout=60, env=node_env())
    assert done.returncode == 2 and "ray.learner_rank: unknown key" in done.stderr, done.stderr
    assert "learner_ranks" in done.stderr  # the allowed keys are named
    done = subprocess.run([sys.executable, "-m", "launch.cli", "config", "ray.learner_placement=WIDE"],
                          capture_output=True, text=True, timeout=60, env=node_env())
    assert done.returncode == 2 and "ray.learner_placement" in done.stderr, done.stderr


def test_ray_without_a_cluster_at_the_address_fails_within_seconds(tmp_path):
    config = run_config(tmp_path / "run.yaml", tmp_path / "runs")
    with __import__("socket").socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "launch.cli", "train", "--ray", f"127.0.0.1:{port}", "--config",
                           str(config)], capture_output=True, text=True, timeout=60, env=node_env())
    assert done.returncode == 2, done.stderr
    assert f"--ray 127.0.0.1:{port}: no Ray cluster answers there" in done.stderr
    assert "ray start --head" in done.stderr
    assert time.monotonic() - started < 30  # the interpreter's imports included; the refusal itself is immediate


def test_ray_refuses_a_placement_the_cluster_cannot_hold_naming_what_it_asked_and_has(cluster, tmp_path):
    gpus = run_config(tmp_path / "gpus.yaml", tmp_path / "runs", ray={"learner_gpus": 1})
    started = time.monotonic()
    done = train(cluster, "--ray", cluster.head_address, "--config", str(gpus))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "not enough resources on the Ray cluster: the run asks for 5 CPUs and 2 GPUs" in done.stderr
    assert "the cluster has 3 node(s) with 9 CPUs and 0 GPUs" in done.stderr
    # room in total (7 of 9 CPUs), but only two nodes hold a rank's bundle of 2 CPUs: refused naming the strategy
    wide = run_config(tmp_path / "wide.yaml", tmp_path / "runs", ray={"learner_cpus": 2, "rollout_cpus": 0,
                                                                      "learner_placement": "STRICT_SPREAD",
                                                                      "learner_ranks": 3})
    done = train(cluster, "--ray", cluster.head_address, "--config", str(wide))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "the learner's placement group cannot be placed: the run asks for 7 CPUs and 0 GPUs" in done.stderr
    assert "STRICT_SPREAD needs one node per rank" in done.stderr
    per_node = done.stderr.split("per node: CPUs [")[1].split("]")[0]
    assert sorted(float(c) for c in per_node.split(",")) == [1.0, 4.0, 4.0]
    assert time.monotonic() - started < 60
    assert not (tmp_path / "runs").exists()  # nothing was started


def test_ray_a_role_that_keeps_failing_stops_the_run_with_its_own_error(cluster, tmp_path):
    """A worker whose engine has no server fails at its start; Ray starts it again (run.max_restarts=1), it fails
    again, and the driver stops the run naming the role, its restarts and the role's own error."""
    config = run_config(tmp_path / "run.yaml", tmp_path / "runs", run={"max_restarts": 1},
                        rollout={"workers": 1, "engine": "sglang",
                                 "sglang": {"urls": ["http://127.0.0.1:9"], "unavailable_timeout_s": 1}},
                        ray={"learner_ranks": 1})
    done = train(cluster, "--ray", cluster.head_address, "--config", str(config), timeout=180)
    assert done.returncode == 1, done.stderr[-3000:]
    stderr = " ".join(done.stderr.split())  # the console wraps long lines
    assert "rollout-0 failed" in stderr and "after 1 restart(s); the run is stopped" in stderr
    assert "--resume" in stderr and "no SGLang server left of ['http://127.0.0.1:9']" in stderr
    assert done.stderr.count("rollout-0 died; Ray started it again") == 1


# --- the job submit form ------------------------------------------------------------------------------------------


def documented_submits() -> tuple[str, str]:
    """The two `ray job submit` lines docs/deploy.md prints: a new run, and a run continued."""
    lines = [line.strip() for line in (ROOT / "docs" / "deploy.md").read_text().splitlines()
             if line.strip().startswith("ray job submit ")]
    assert len(lines) == 2 and "--config run.yaml" in lines[0] and "--resume" in lines[1], lines
    return lines[0], lines[1]


def submit(cluster: RayCluster, line: str, cwd: Path, **placeholders: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Run a documented `ray job submit` line in the head's namespace, HEAD and `placeholders` filled in; (the
    process, the run's result line from the job's streamed logs)."""
    for name, value in {"HEAD": cluster.net.address(cluster.head), **placeholders}.items():
        line = line.replace(name, value)
    done = subprocess.run(cluster.in_namespace(cluster.head, shlex.split(line)), env=node_env(), cwd=cwd,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "succeeded" in done.stdout + done.stderr
    printed = re.findall(r'\{"final_success_rate".*\}', done.stdout)  # the job's logs, streamed
    assert printed, done.stdout[-4000:]
    return done, json.loads(printed[-1])


def test_ray_job_submit_runs_and_resumes_as_docs_deploy_prints_it(cluster, tmp_path):
    new, resume = documented_submits()
    work = tmp_path / "submit"  # the working directory the job uploads: the config alone
    work.mkdir()
    run_config(work / "run.yaml", tmp_path / "runs", run={"max_versions": 3}, rollout={"workers": 1},
               ray={"learner_ranks": 1})
    _, result = submit(cluster, new, work)
    run_dir = tmp_path / "runs" / "ray"
    assert result["versions"] == 3 and result["stop_reason"] == "max_versions"
    assert json.loads((run_dir / "summary.json").read_text())["versions"] == 3
    _, result = submit(cluster, resume, work, **{"/shared/runs/NAME": str(run_dir), "=N": "=5"})
    assert result["versions"] == 5 and result["run_dir"] == str(run_dir)
    assert "resumed from checkpoint v" in (run_dir / "logs" / "learner.log").read_text()


# --- the run: placement, a node lost, the journals' join ----------------------------------------------------------


def test_ray_trains_across_nodes_and_survives_a_killed_raylet(cluster, tmp_path):
    config = run_config(tmp_path / "run.yaml", tmp_path / "runs",
                        learner={"log_item_ids": True}, replay={"compact_every": 100_000_000})
    run_dir = tmp_path / "runs" / "ray"
    out, err = (tmp_path / "driver.out").open("w"), (tmp_path / "driver.err").open("w")
    driver = subprocess.Popen(cluster.in_namespace(cluster.head, ["async-rl", "train", "--ray", cluster.head_address,
                                                                  "--config", str(config)]),
                              env=node_env(), stdout=out, stderr=err)
    node = {cluster.net.address(host): host for host in cluster.cpus}
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and driver.poll() is None and _version(run_dir) < KILL_AT:
            time.sleep(0.5)
        assert driver.poll() is None and _version(run_dir) >= KILL_AT, (tmp_path / "driver.err").read_text()[-3000:]
        first = _first_placement(run_dir)
        # the placement: the replay on the head, the ranks on two different nodes, a worker on each worker node
        assert node[first["replay"]] == "head"
        assert first["learner"] != first["learner-1"] and {node[first["learner"]], node[first["learner-1"]]} == \
            {"node-1", "node-2"}
        assert {node[first["rollout-0"]], node[first["rollout-1"]]} == {"node-1", "node-2"}
        victim = node[first["learner-1"]]
        survivor = ({"node-1", "node-2"} - {victim}).pop()
        killed_at = time.time()
        cluster.raylet(victim).kill()  # SIGKILL: the node is gone
        driver.wait(timeout=240)
    finally:
        if driver.poll() is None:
            driver.terminate()
            driver.wait(timeout=60)
        out.close()
        err.close()
    stdout, stderr = (tmp_path / "driver.out").read_text(), (tmp_path / "driver.err").read_text()
    assert driver.returncode == 0, stderr[-4000:]
    result = json.loads(stdout.splitlines()[-1])
    assert result["versions"] == VERSIONS and result["stop_reason"] == "max_versions"
    # every actor that was on the lost node came back on the surviving worker node
    history = json.loads((run_dir / "ray" / "placement.json").read_text())
    moved = {h["role"]: h["node_ip"] for h in history if h["at"] > killed_at}
    lost = [role for role, ip in first.items() if node[ip] == victim]
    assert lost and all(node.get(moved.get(role)) == survivor for role in lost), (lost, moved)
    assert all(node[ip] != victim for ip in result["nodes"].values())
    assert "starting every rank again" in stderr
    assert "learner rank 1 of world size 2" in (run_dir / "logs" / "learner-1.log").read_text()
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    resumed = [int(v) for v in re.findall(r"resumed from checkpoint v(\d+)", learner_log)]
    assert resumed and resumed[0] < VERSIONS  # the ranks came back mid-run and trained the rest
    # the journals' join: nothing acknowledged lost, nothing trained twice
    numbers, problems = check(run_dir, run_dir / "replay", run_dir / "replay", VERSIONS)
    assert numbers["acked_stages_lost"] == 0 and numbers["stages_trained_twice"] == 0, (numbers, problems)
    assert numbers["items_trained_twice"] == 0 and numbers["acked_stages_trained"] > 0
    assert problems == [], problems  # among them: no process of the run left on any node


def _version(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []
    return json.loads(lines[-1])["version"] if lines else 0


def _first_placement(run_dir: Path) -> dict[str, str]:
    """Role -> the node address it was first placed on (the driver's record)."""
    first: dict[str, str] = {}
    for entry in json.loads((run_dir / "ray" / "placement.json").read_text()) if (
            run_dir / "ray" / "placement.json").exists() else []:
        first.setdefault(entry["role"], entry["node_ip"])
    return first
