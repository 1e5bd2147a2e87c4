"""deploy/k8s's replay, learner and rollout pods, in the roles' CPU image built here, training under `podman kube play`.

The image is deploy/Dockerfile.cpu built by scripts/build_pod_image.py (a debootstrap base, no registry; cached by
a hash of its inputs); the pods are `kubectl kustomize` of a copy of deploy/k8s rendered by scripts/podman_kube.py
(docs/deploy.md, "The pods under podman"). The config is configs/cluster.yaml with what this machine lacks swapped
out, as tests/test_multihost.py does (no GPU, no model directory, no SGLang servers: the tiny model and the torch
engine, small budgets); CURVE stays on with the keys mounted from the async-rl-curve Secret. From the rendered pods
only what that swap forces goes: the rollout pods' init container that waits for the servers, and the learner's
`--nproc-per-node=gpu` (one process, no GPU). Needs root and podman, buildah, runc and debootstrap: skipped without
them, but under CI=true they are installed with apt and a failure fails.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from launch.cli import main as async_rl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import build_pod_image  # noqa: E402
import podman_kube  # noqa: E402
from podman_tools import ensure_podman_tools  # noqa: E402

pytestmark = pytest.mark.slow
VERSIONS = 12  # the learner's budget (run.max_versions)
NETWORK = "async-rl"  # podman_kube.py's default, as docs/deploy.md runs it
VOLUME = "async-rl-shared"  # the PersistentVolumeClaim's name: podman's named volume
CURVE = {  # the files each pod's key volume holds (docs/deploy.md, "Secrets")
    "async-rl-replay": {"replay.key_secret", "learner.key", *(f"rollout-{i}.key" for i in range(4))},
    "async-rl-learner-0": {"learner.key_secret", "replay.key", *(f"rollout-{i}.key" for i in range(4))},
    **{f"async-rl-rollout-{i}": {f"rollout-{i}.key_secret", "replay.key", "learner.key"} for i in range(2)},
}


@pytest.fixture(scope="module")
def image() -> str:
    """The roles' image, built (or found in the cache); the tools installed with apt under CI=true."""
    ensure_podman_tools()
    start = time.monotonic()
    assert build_pod_image.main([]) == 0, (build_pod_image.CACHE / "build.log").read_text()[-4000:]
    print(f"image ready in {time.monotonic() - start:.0f} s")
    return build_pod_image.default_tag()


def podman(*argv: str, check: bool = True) -> str:
    out = subprocess.run(["podman", *argv], capture_output=True, text=True, timeout=120)
    assert not check or out.returncode == 0, out.stderr
    return out.stdout.strip()


def logs(container: str) -> str:
    """The container's output (podman logs writes its stderr on stderr)."""
    out = subprocess.run(["podman", "logs", container], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=120)
    return out.stdout


def cpu_config(config: dict) -> dict:
    """configs/cluster.yaml with what this machine cannot provide swapped out (tests/test_multihost.py's swap)."""
    config["run"].update(name="podman", max_versions=VERSIONS, threads_per_process=1, eval_samples_per_task=0)
    config["model"] = {"path": "", "max_seq_len": 256}  # the tiny model (no model directory on a volume here)
    config["env"]["kwargs"] = {"num_tasks": 8, "stages": 3, "choices": 4, "traps": 1}
    config["rollout"].update(engine="torch", workers=2, max_inflight=8, group_size=4)
    config["rollout"].pop("sglang")  # no SGLang server here (tests/test_sglang.py covers that engine)
    config["learner"].update(lr=5e-4, batch_tokens=1024, min_batch_items=8, batch_wait_s=0.5, checkpoint_every=0,
                             log_item_ids=True)
    config["algo"]["groups_per_step"] = 2
    config["wandb"] = {"mode": "disabled"}
    assert config["security"]["curve_dir"] == "/etc/async-rl/curve"  # CURVE stays on, keys from the Secret
    return config


def kustomize(directory: Path) -> list[dict]:
    """`kubectl kustomize` as docs/deploy.md runs it, or, without kubectl, its resources and generators expanded."""
    kubectl = shutil.which("kubectl")
    if kubectl:
        out = subprocess.run([kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(directory)],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        return [doc for doc in yaml.safe_load_all(out) if doc]
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs = [d for name in kustomization["resources"] for d in yaml.safe_load_all((directory / name).read_text()) if d]
    for generator in kustomization["configMapGenerator"]:
        data = {key: (directory / source).read_text() for key, _, source in
                (spec.rpartition("=") for spec in generator["files"])}
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data})
    for generator in kustomization["secretGenerator"]:
        data = {Path(f).name: (directory / f).read_text() for f in generator.get("files", [])}
        for env in generator.get("envs", []):
            lines = (directory / env).read_text().splitlines()
            data.update(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))
        docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": generator["name"]},
                     "stringData": data})
    return docs


@pytest.fixture(scope="module")
def manifests(tmp_path_factory) -> list[dict]:
    """deploy/k8s rendered as docs/deploy.md deploys it, with the CPU config, the example env files and fresh keys."""
    here = tmp_path_factory.mktemp("k8s")
    shutil.copytree(ROOT / "deploy" / "k8s", here / "deploy" / "k8s")
    shutil.copytree(ROOT / "configs", here / "configs")
    config = cpu_config(yaml.safe_load((ROOT / "configs" / "cluster.yaml").read_text()))
    (here / "configs" / "cluster.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    for example in (here / "deploy" / "k8s" / "secrets").glob("*.env.example"):
        shutil.copy(example, example.with_suffix(""))
    assert async_rl(["keys", str(here / "deploy" / "k8s" / "secrets" / "curve"), "--workers", "4"]) == 0
    docs = kustomize(here / "deploy" / "k8s")
    for doc in docs:
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        if doc["kind"] == "StatefulSet" and doc["metadata"]["name"] == "async-rl-rollout":  # the torch engine:
            # no inference servers to wait for
            spec["initContainers"] = [c for c in spec["initContainers"] if c["name"] != "wait-for-servers"]
        if doc["metadata"]["name"] == "async-rl-learner" and doc["kind"] == "Job":  # no GPU: one process
            script = spec["containers"][0]["command"][2]
            spec["containers"][0]["command"][2] = script.replace("--nproc-per-node=gpu", "--nproc-per-node=1")
    return docs


def test_podman_render_makes_the_pods_kubernetes_would_run(manifests):
    """render (no podman needed): each workload's pods with the template's containers as they are, plus what the
    controllers add; Services as aliases; the Secrets as podman reads them."""
    plan = podman_kube.render(copy.deepcopy(manifests), None, {"async-rl-rollout": 2, "sglang": 1})
    pods = {pod["name"]: pod for pod in plan["pods"]}
    assert set(pods) == {"async-rl-replay", "async-rl-learner-0", "async-rl-rollout-0", "async-rl-rollout-1",
                         "sglang-0", "sglang-router"}
    templates = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in manifests if "template" in d.get(
        "spec", {})}
    for name, pod in pods.items():
        spec = pod["doc"]["spec"]
        template = templates[name.rsplit("-", 1)[0] if name[-1].isdigit() else name]
        assert spec["hostname"] == name and spec["securityContext"] == template["securityContext"]
        for rendered, original in zip(spec.get("initContainers", []) + spec["containers"],
                                      template.get("initContainers", []) + template["containers"], strict=True):
            index = [{"name": "JOB_COMPLETION_INDEX", "value": "0"}] if name == "async-rl-learner-0" else []
            env = [e for e in original.get("env", []) if not e.get("valueFrom", {}).get("secretKeyRef", {}).get(
                "name", "").startswith("vllm-api-key")]  # the other engine's optional Secret: not generated
            assert rendered == {**original, "env": index + env}, name
    learner = pods["async-rl-learner-0"]
    assert learner["doc"]["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] == "0"
    assert learner["doc"]["spec"]["restartPolicy"] == "Never"
    assert {"async-rl-learner", "async-rl-learner-0.async-rl-learner-workers"} <= set(learner["aliases"])
    assert pods["async-rl-replay"]["aliases"] == ["async-rl-replay"]
    assert pods["async-rl-replay"]["doc"]["spec"]["restartPolicy"] == "Always"
    assert pods["async-rl-rollout-1"]["doc"]["spec"]["restartPolicy"] == "OnFailure"  # it has init containers
    assert "sglang-0.sglang" in pods["sglang-0"]["aliases"]
    for name, files in CURVE.items():  # each key volume a Secret of its items alone (podman ignores `items`)
        (volume,) = [v for v in pods[name]["doc"]["spec"]["volumes"] if v["name"] in ("curve", "curve-all")
                     and "secret" in v]
        assert volume["secret"]["optional"] is False  # podman#16636
        secret = yaml.safe_load(plan["secrets"][volume["secret"]["secretName"]])
        expected = files if volume["name"] == "curve" else {f"rollout-{i}.key_secret" for i in range(4)} | {
            "replay.key", "learner.key"}
        assert set(secret["data"]) == expected
    (wandb,) = [name for name in plan["secrets"] if name.startswith("async-rl-wandb")]
    assert json.loads(plan["secrets"][wandb]) == {"WANDB_API_KEY": ""}  # podman#16269: flat JSON, base64 values
    assert {"async-rl-rollout-0-curve", "async-rl-rollout-0-tmp"} <= set(plan["empty_dirs"])
    with pytest.raises(podman_kube.RenderError, match="no workload named async-rl-nope"):
        podman_kube.render(manifests, {"async-rl-nope"})


def documented(command: str) -> list[str]:
    """docs/deploy.md's `python scripts/podman_kube.py COMMAND ...` line, as an argv for this interpreter."""
    (line,) = [line for line in (ROOT / "docs" / "deploy.md").read_text().splitlines()
               if line.startswith(f"python scripts/podman_kube.py {command} ")]
    return [sys.executable, str(ROOT / "scripts" / "podman_kube.py"), *shlex.split(line)[2:]]


def run_documented(command: str, cwd: Path) -> None:
    out = subprocess.run(documented(command), cwd=cwd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


def down(out: Path) -> None:
    podman_kube.down(out, NETWORK)
    podman("volume", "rm", "--force", VOLUME, check=False)


def state(container: str) -> dict:
    return json.loads(podman("inspect", container))[0]


def test_podman_pods_train_from_the_image_and_a_killed_rollout_pod_rejoins(image, manifests, tmp_path):
    """docs/deploy.md's render and up, as printed, on the manifests; its down at the end."""
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "k8s.yaml").write_text(yaml.safe_dump_all(manifests, sort_keys=False))
    run_documented("render", tmp_path)
    out = tmp_path / "build" / "pods"
    down(out)  # what an earlier, interrupted run left
    try:
        run_documented("up", tmp_path)
        volume = Path(podman("volume", "inspect", VOLUME, "--format", "{{.Mountpoint}}"))
        run_dir = volume / "runs" / "podman"
        killed_at_acks, seen, frozen_until = None, {}, None
        deadline = time.monotonic() + 600
        while state("async-rl-learner-0-learner")["State"]["Status"] in ("created", "running"):
            assert time.monotonic() < deadline, logs("async-rl-learner-0-learner")[-3000:]
            seen.update(_seen_from_the_host(set(CURVE) - set(seen)))
            if killed_at_acks is None and _acks(run_dir, "rollout-1") > 0:  # it has joined: now it dies, as a
                killed_at_acks = _acks(run_dir, "rollout-1")  # crash would kill it
                os.kill(state("async-rl-rollout-1-rollout")["State"]["Pid"], signal.SIGKILL)
                # The other worker frozen until the restarted one's records are acked (at most 90 s, within
                # replay.lease_timeout_s: it keeps its leases): the run cannot end on its records alone first.
                podman("pause", "async-rl-rollout-0-rollout")
                frozen_until = time.monotonic() + 90
            if frozen_until and (_acks(run_dir, "rollout-1") > killed_at_acks or time.monotonic() > frozen_until):
                podman("unpause", "async-rl-rollout-0-rollout")
                frozen_until = None
            time.sleep(1)
        learner_done = time.monotonic()
        if frozen_until:
            podman("unpause", "async-rl-rollout-0-rollout")
        # On a loaded machine rollout-1 may come up so late that the learner reaches its budget on rollout-0's
        # records before rollout-1's first ack, or before the restarted one's: the replay stays up (a Deployment)
        # and acks records after the learner is done, so the kill and the rejoin are then watched there.
        while time.monotonic() < learner_done + 240:
            seen.update(_seen_from_the_host(set(CURVE) - set(seen)))
            if killed_at_acks is None and _acks(run_dir, "rollout-1") > 0:
                killed_at_acks = _acks(run_dir, "rollout-1")
                os.kill(state("async-rl-rollout-1-rollout")["State"]["Pid"], signal.SIGKILL)
            if killed_at_acks is not None and _acks(run_dir, "rollout-1") > killed_at_acks and set(seen) == set(
                    CURVE):
                break
            time.sleep(1)
        learner = state("async-rl-learner-0-learner")
        rollout_1 = logs("async-rl-rollout-1-rollout")
        assert learner["State"]["ExitCode"] == 0, logs("async-rl-learner-0-learner")[-3000:]
        # Each pod's main process: uid 10001, its own network stack (the host's is none of them), its key files.
        assert set(seen) == set(CURVE), f"never saw running: {set(CURVE) - set(seen)}"
        assert {pod: s["uid"] for pod, s in seen.items()} == {pod: "10001" for pod in CURVE}
        assert all(s["read_only_root"] for s in seen.values())  # readOnlyRootFilesystem: true, as the manifests say
        assert len({s["net"] for s in seen.values()}) == len(CURVE) and os.readlink("/proc/self/ns/net") not in {
            s["net"] for s in seen.values()}
        assert {pod: s["curve"] for pod, s in seen.items()} == CURVE
        assert killed_at_acks is not None, "rollout-1 had nothing acked within 240 s of the learner's end"
        rollout = state("async-rl-rollout-1-rollout")
        assert rollout["RestartCount"] >= 1 and rollout["State"]["Status"] == "running", rollout_1[-3000:]
        # The restarted worker's records were acked: it rejoined.
        assert _acks(run_dir, "rollout-1") > killed_at_acks, (
            rollout_1[-5000:] + "\n--- replay ---\n" + logs("async-rl-replay-replay")[-5000:])

        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["versions"] == VERSIONS and summary["stop_reason"] == "max_versions"
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert len(lines) == VERSIONS and all(m["ledger_residual_max"] < 1e-6 for m in lines)
        assert lines[-1]["rejected"] == 0  # over CURVE: every pod's key let in, nothing refused
        trained = [item for m in lines for item in m["item_ids"]]
        assert trained and len(trained) == len(set(trained))  # nothing trained twice across the restart
        assert (run_dir / "weights" / f"v{VERSIONS}.safetensors").exists()
    finally:
        run_documented("down", tmp_path)
        down(out)


@pytest.mark.parametrize("bad", ["image", "secret"])
def test_podman_play_of_a_missing_image_or_secret_fails_naming_it(image, manifests, tmp_path, bad):
    """No pod waiting forever: `up` fails at once with podman's error, which names what is missing."""
    docs = copy.deepcopy(manifests)
    replay = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "async-rl-replay")
    if bad == "image":
        missing = replay["spec"]["template"]["spec"]["containers"][0]["image"] = "async-rl:0.0.0-missing"
    else:  # the Secret never created (kustomize generated none; nobody ran `podman secret create`)
        (missing,) = [d["metadata"]["name"] for d in docs
                      if d["kind"] == "Secret" and d["metadata"]["name"].startswith("async-rl-curve")]
        docs = [d for d in docs if d["metadata"]["name"] != missing]
    out = tmp_path / "pods"
    podman_kube.write(podman_kube.render(docs, {"async-rl-replay"}), out)
    down(out)
    try:
        with pytest.raises(podman_kube.RenderError, match=re.escape(missing)) as error:
            podman_kube.up(out, NETWORK)
        assert "async-rl-replay" in str(error.value)
        assert subprocess.run(["podman", "pod", "exists", "async-rl-replay"]).returncode == 1  # nothing left waiting
    finally:
        down(out)


def _seen_from_the_host(pods: set[str]) -> dict[str, dict]:
    """For each running pod's main container: its process's uid, network namespace, CURVE key files and whether its
    root filesystem is read-only."""
    seen = {}
    for pod in pods:
        role = pod.removeprefix("async-rl-").split("-")[0]
        inspected = state(f"{pod}-{role}")
        found = inspected["State"]
        if found["Status"] != "running" or not found["Pid"]:
            continue
        proc = Path(f"/proc/{found['Pid']}")
        try:
            uid = next(line.split()[1] for line in (proc / "status").read_text().splitlines()
                       if line.startswith("Uid:"))
            seen[pod] = {"uid": uid, "net": os.readlink(proc / "ns" / "net"),
                         "read_only_root": inspected["HostConfig"]["ReadonlyRootfs"],
                         "curve": {p.name for p in (proc / "root" / "etc" / "async-rl" / "curve").iterdir()}}
        except (FileNotFoundError, ProcessLookupError):
            continue  # it exited meanwhile
    return seen


def _acks(run_dir: Path, worker: str) -> int:
    journal = run_dir / "acks" / f"{worker}.jsonl"
    return journal.read_text().count('"k":"ack"') if journal.exists() else 0
