"""A multi-host run on one machine: every pod role in its own Linux network namespace, talking TCP as pods would.

Five namespaces stand for five pods: the replay, two learner nodes (a 2-rank learner under torchrun's static
rendezvous, one rank per node, as deploy/k8s/learner.yaml runs it) and two rollout workers. Each has its own
address on a bridge that lives in a sixth namespace (the "switch"), and its own /etc/hosts (`ip netns exec` mounts
/etc/netns/NAME/hosts over /etc/hosts), so the config uses the Service names of deploy/k8s:
`tcp://async-rl-replay:5555`, `tcp://async-rl-learner:5556`, `async-rl-learner-0.async-rl-learner-workers`.
The config is configs/cluster.yaml with only what this machine lacks swapped out (no GPU, no SGLang server, no
model directory on a volume: the tiny model and the torch engine; small budgets; CURVE keys from `async-rl keys`
in place of the mounted Secret). The run directory stands for the shared volume every pod mounts.

Needs root and network namespaces (`ip netns`); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from netns import Network, namespaces_unavailable

from launch.cli import main as async_rl

ROOT = Path(__file__).resolve().parents[1]
NAMES = {  # namespace role -> the names it answers to (tests/netns.py numbers the addresses in this order)
    "replay": ["async-rl-replay"],
    "learner-0": ["async-rl-learner", "async-rl-learner-0.async-rl-learner-workers"],
    "learner-1": ["async-rl-learner-1.async-rl-learner-workers"],
    "rollout-0": [],
    "rollout-1": [],
}
VERSIONS = 8

pytestmark = [pytest.mark.slow, pytest.mark.skipif(namespaces_unavailable() is not None,
                                                   reason=str(namespaces_unavailable()))]


@pytest.fixture
def network():
    net = Network(NAMES)
    try:
        yield net.open()
    finally:
        net.close()


def cluster_config(tmp_path: Path) -> Path:
    """configs/cluster.yaml as shipped, with what this machine cannot provide swapped out."""
    config = yaml.safe_load((ROOT / "configs" / "cluster.yaml").read_text())
    config["run"].update(dir=str(tmp_path), name="multihost", max_versions=VERSIONS, threads_per_process=1,
                         eval_samples_per_task=0)
    config["model"] = {"path": "", "max_seq_len": 256}  # the tiny model (no model directory on a volume here)
    config["env"]["kwargs"] = {"num_tasks": 8, "stages": 3, "choices": 4, "traps": 1}
    config["rollout"].update(engine="torch", workers=2, max_inflight=8, group_size=4)
    config["rollout"].pop("sglang")  # no SGLang server on this machine (tests/test_sglang.py covers that engine)
    config["learner"].update(lr=5e-4, batch_tokens=1024, min_batch_items=8, batch_wait_s=0.5, checkpoint_every=0)
    config["algo"]["groups_per_step"] = 2
    config["wandb"] = {"mode": "disabled"}
    # CURVE stays on, as shipped: the keys the async-rl-curve Secret would mount (`async-rl keys DIR`).
    assert config["security"]["curve_dir"] == "/etc/async-rl/curve"
    assert async_rl(["keys", str(tmp_path / "curve")]) == 0
    config["security"]["curve_dir"] = str(tmp_path / "curve")
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _role_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="eth0")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _start(network: Network, role: str, argv: list[str], logs: Path) -> subprocess.Popen:
    log = (logs / f"{role}.log").open("w")
    return subprocess.Popen(["ip", "netns", "exec", network.ns(role), *argv], stdout=log, stderr=subprocess.STDOUT,
                            env=_role_env(), cwd=logs, start_new_session=True)


def _net_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def test_pod_roles_in_their_own_network_namespaces_train_over_tcp(network, tmp_path):
    config = cluster_config(tmp_path)
    logs = tmp_path / "pod-logs"
    logs.mkdir()
    cli = [sys.executable, "-m", "launch.cli"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                "--master-addr=async-rl-learner-0.async-rl-learner-workers", "--master-port=29500",
                "--max-restarts=0"]
    processes = {
        "replay": _start(network, "replay", [*cli, "replay", "--config", str(config)], logs),
        **{f"learner-{i}": _start(network, f"learner-{i}",
                                  [*torchrun, f"--node-rank={i}", "-m", "launch.cli", "learner", "--config",
                                   str(config)], logs) for i in range(2)},
        **{f"rollout-{i}": _start(network, f"rollout-{i}",
                                  [*cli, "rollout", "--config", str(config), "--index", str(i)], logs)
           for i in range(2)},
    }
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and any(processes[f"learner-{i}"].poll() is None for i in range(2)):
            for name, process in processes.items():
                assert process.poll() is None or name.startswith("learner"), \
                    f"{name} exited with {process.returncode}:\n{(logs / f'{name}.log').read_text()[-3000:]}"
            time.sleep(0.5)
        for i in range(2):
            code = processes[f"learner-{i}"].poll()
            assert code == 0, f"learner-{i}: {code}\n{(logs / f'learner-{i}.log').read_text()[-3000:]}"
        # Five pods, five network stacks: no role could have reached another over a shared loopback.
        namespaces = {_net_namespace(p.pid) for name, p in processes.items() if not name.startswith("learner")}
        assert len(namespaces) == 3 and _net_namespace(os.getpid()) not in namespaces
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    run_dir = tmp_path / "multihost"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == VERSIONS and summary["stop_reason"] == "max_versions"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics and all(m["ledger_residual_max"] < 1e-6 for m in metrics)
    assert metrics[-1]["rejected"] == 0  # over CURVE: every pod's key let in, nothing refused
    assert metrics[-1]["env_steps"] > 0 and sum(m["items_immediate"] + m["items_correction"] for m in metrics) > 0
    assert (run_dir / "weights" / f"v{VERSIONS}.safetensors").exists()  # rank 0 published over the shared volume
    for i in range(2):  # one rank per node: torchrun's rendezvous crossed the namespaces
        assert f"learner rank {i} of world size 2" in (logs / f"learner-{i}.log").read_text()
