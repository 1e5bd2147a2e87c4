"""deploy/'s rendered manifests run as podman pods: `podman kube play` plays Pods (it skips Jobs and StatefulSets), has
no Services and reads secrets from its own store, so this turns each workload into the Pods Kubernetes would make.

    kubectl kustomize --load-restrictor LoadRestrictionsNone deploy/k8s > build/k8s.yaml
    python scripts/podman_kube.py render build/k8s.yaml build/pods --only async-rl-replay,async-rl-rollout
    python scripts/podman_kube.py up build/pods
    python scripts/podman_kube.py down build/pods

render: a Deployment, StatefulSet or Job becomes its Pods with the template's containers, args, env, volumes, secrets
and security context unchanged, and what Kubernetes would have added: the pod names and host names
(<statefulset>-<i>, <job>-<i>), an Indexed Job's JOB_COMPLETION_INDEX and completion-index label, and
restartPolicy Always for Deployments and StatefulSets. Each Service becomes a network alias of the pods it selects
(and <hostname>.<subdomain> for a headless Service's pods). Secrets become podman secrets: as a flat JSON object
where containers read them as env (podman#16269), as a Secret document holding just the volume's `items` where pods
mount them (podman 4.3 ignores `items`), and every secret volume gets `optional: false` (podman#16636: without it a
missing secret panics the play). A Secret the manifests reference but do not define is left to podman's store.
up: the network, the secrets and one `podman kube play` per pod, each with its aliases; down removes them (not the
volumes: they hold the run, as a PersistentVolumeClaim would).
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from build_pod_image import engine_env  # scripts/, beside this file: the same CONTAINERS_CONF

PLAN = "plan.json"


class RenderError(ValueError):
    """The manifests cannot be played as asked (named in the message)."""


def _labels_match(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def _pods_of(workload: dict, scale: dict[str, int]) -> list[dict]:
    """The Pods Kubernetes would run for the workload: name, host name, labels and env it adds, restart policy."""
    kind, name, spec = workload["kind"], workload["metadata"]["name"], workload["spec"]
    template = spec["template"]
    pods = []
    if kind == "Job":
        indexed = spec.get("completionMode") == "Indexed"
        count = scale.get(name, spec.get("completions", 1))
        for i in range(count):
            index = {"labels": {"batch.kubernetes.io/job-completion-index": str(i)},
                     "env": {"JOB_COMPLETION_INDEX": str(i)}} if indexed else {"labels": {}, "env": {}}
            pods.append({"name": f"{name}-{i}" if indexed else name, **index, "restart": None})
    elif kind == "StatefulSet":
        for i in range(scale.get(name, spec.get("replicas", 1))):
            pods.append({"name": f"{name}-{i}", "restart": "Always", "env": {},
                         "labels": {"statefulset.kubernetes.io/pod-name": f"{name}-{i}",
                                    "apps.kubernetes.io/pod-index": str(i)}})
        template = copy.deepcopy(template)
        template["spec"].setdefault("subdomain", spec["serviceName"])  # the governing Service names the pods
    elif kind == "Deployment":
        count = scale.get(name, spec.get("replicas", 1))
        pods = [{"name": name if count == 1 else f"{name}-{i}", "restart": "Always", "labels": {}, "env": {}}
                for i in range(count)]
    else:
        raise RenderError(f"{kind} {name}: podman runs Deployments, StatefulSets and Jobs here, not {kind}")
    out = []
    for pod in pods:
        body = copy.deepcopy(template)
        body["spec"]["hostname"] = pod["name"]
        if pod["restart"]:
            body["spec"]["restartPolicy"] = pod["restart"]
        if body["spec"].get("initContainers") and body["spec"].get("restartPolicy", "Always") == "Always":
            # podman 4.3 restarts a pod's init containers by its policy too: under Always an init container that
            # finished starts again while play removes it, and the play fails. OnFailure restarts the same crashes.
            body["spec"]["restartPolicy"] = "OnFailure"
        labels = {**body.get("metadata", {}).get("labels", {}), **pod["labels"]}
        for c in body["spec"].get("initContainers", []) + body["spec"]["containers"]:
            c["env"] = [{"name": k, "value": v} for k, v in pod["env"].items()] + c.get("env", [])
        out.append({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod["name"], "labels": labels},
                    "spec": body["spec"]})
    return out


def _secret_data(secret: dict) -> dict[str, bytes]:
    data = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
    data.update({k: v.encode() for k, v in (secret.get("stringData") or {}).items()})
    return data


def _base64(data: dict[str, bytes]) -> dict[str, str]:
    return {key: base64.b64encode(value).decode() for key, value in sorted(data.items())}


def render(docs: list[dict], only: set[str] | None = None, scale: dict[str, int] | None = None) -> dict:
    """The plan: {"pods": [{name, doc, aliases}], "secrets": {name: text}, "configmaps": [doc]}."""
    scale = scale or {}
    by_kind: dict[str, dict[str, dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    workloads = [d for k in ("Deployment", "StatefulSet", "Job") for d in by_kind.get(k, {}).values()]
    names = {w["metadata"]["name"] for w in workloads}
    unknown = (only or set()) - names | set(scale) - names
    if unknown:
        raise RenderError(f"no workload named {', '.join(sorted(unknown))} (there are: {', '.join(sorted(names))})")
    pods = [pod for w in workloads if only is None or w["metadata"]["name"] in only for pod in _pods_of(w, scale)]
    secrets_defined = by_kind.get("Secret", {})
    secrets: dict[str, str] = {}
    # podman keeps a named volume for each emptyDir, ConfigMap and Secret volume after its pod: up and down clear them
    scratch: list[str] = []
    empty_dirs: list[str] = []
    for pod in pods:
        spec = pod["spec"]
        for volume in spec.get("volumes", []):
            if "emptyDir" in volume:  # podman 4.3 makes a new directory root-owned 0755, Kubernetes 0777: a named
                del volume["emptyDir"]  # volume of the pod's own, which up creates 0777
                volume["persistentVolumeClaim"] = {"claimName": f"{pod['metadata']['name']}-{volume['name']}"}
                empty_dirs.append(volume["persistentVolumeClaim"]["claimName"])
            elif "configMap" in volume:
                scratch.append(volume["configMap"]["name"])
            source = volume.get("secret")
            if source is None:
                continue
            name = source["secretName"]
            if name in secrets_defined:
                data = _secret_data(secrets_defined[name])
                items = source.pop("items", None)
                if items:  # the volume's own secret, holding its items only, each at its path
                    data = {item["path"]: data[item["key"]] for item in items}
                    name = source["secretName"] = f"{name}.{pod['metadata']['name']}.{volume['name']}"
                secrets[name] = yaml.safe_dump({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
                                                "data": _base64(data)})
            scratch.append(name)
            source["optional"] = bool(source.get("optional", False))  # podman#16636
        for c in spec.get("initContainers", []) + spec["containers"]:
            kept = []
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["name"] not in secrets_defined and ref.get("optional"):
                    continue  # Kubernetes leaves an optional variable of a missing Secret unset
                if ref and ref["name"] in secrets_defined:  # podman#16269: env secrets are flat JSON (base64 values)
                    secrets[ref["name"]] = json.dumps(_base64(_secret_data(secrets_defined[ref["name"]])))
                kept.append(env)
            c["env"] = kept
    aliases: dict[str, list[str]] = {pod["metadata"]["name"]: [] for pod in pods}
    for service in by_kind.get("Service", {}).values():
        name, spec = service["metadata"]["name"], service["spec"]
        for pod in pods:
            if _labels_match(spec.get("selector", {}), pod["metadata"]["labels"]):
                aliases[pod["metadata"]["name"]].append(name)
                if spec.get("clusterIP") == "None" and pod["spec"].get("subdomain") == name:
                    aliases[pod["metadata"]["name"]].append(f"{pod['spec']['hostname']}.{name}")
    return {"pods": [{"name": p["metadata"]["name"], "doc": p, "aliases": aliases[p["metadata"]["name"]]}
                     for p in pods],
            "secrets": secrets, "configmaps": list(by_kind.get("ConfigMap", {}).values()),
            "scratch": sorted(set(scratch)), "empty_dirs": empty_dirs}


def write(plan: dict, out: Path) -> None:
    (out / "pods").mkdir(parents=True, exist_ok=True)
    (out / "secrets").mkdir(exist_ok=True)
    (out / "configmaps.yaml").write_text(yaml.safe_dump_all(plan["configmaps"], sort_keys=False))
    for name, text in plan["secrets"].items():
        path = out / "secrets" / name
        path.write_text(text)
        path.chmod(0o600)
    for pod in plan["pods"]:
        (out / "pods" / f"{pod['name']}.yaml").write_text(yaml.safe_dump(pod["doc"], sort_keys=False))
    summary = {"pods": [{"name": p["name"], "aliases": p["aliases"]} for p in plan["pods"]],
               "secrets": sorted(plan["secrets"]), "scratch": plan["scratch"], "empty_dirs": plan["empty_dirs"]}
    (out / PLAN).write_text(json.dumps(summary, indent=1) + "\n")


def _podman(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["podman", *argv], text=True, capture_output=True, env=engine_env(), timeout=600)
    if check and out.returncode != 0:
        raise RenderError(f"podman {' '.join(argv)} failed ({out.returncode}):\n{out.stdout}{out.stderr}")
    return out


def _podman_version() -> tuple[int, ...]:
    return tuple(int(p) for p in _podman("version", "--format", "{{.Client.Version}}").stdout.split(".")[:2])


def _secret_for_podman(path: Path, version: tuple[int, ...]) -> Path:
    """podman 4 (4.3 checked) writes a volume secret's `data` values into the files as they stand, not base64-decoded
    (podman 5 decodes them, as Kubernetes does): give podman 4 the decoded values."""
    doc = yaml.safe_load(path.read_text())
    if version >= (5,) or not isinstance(doc, dict) or doc.get("kind") != "Secret":
        return path
    doc["data"] = {k: base64.b64decode(v).decode() for k, v in doc["data"].items()}
    raw = path.with_name(path.name + ".podman4")
    raw.write_text(yaml.safe_dump(doc))
    raw.chmod(0o600)
    return raw


def _logs(pod: str) -> str:
    """The end of each of the pod's containers' output (an init container that failed says why here)."""
    listed = _podman("ps", "--all", "--filter", f"pod={pod}", "--format", "{{.ID}} {{.Names}}", check=False).stdout
    text = ""
    for line in listed.splitlines():
        container, name = line.split()
        if not name.endswith("-infra"):
            tail = _podman("logs", "--tail", "20", container, check=False)
            text += f"\n--- {name}:\n{(tail.stdout + tail.stderr).strip()}"
    return text


def up(out: Path, network: str) -> None:
    """Network, secrets, then each pod; a pod whose play fails is removed again, and the error names the cause."""
    plan = json.loads((out / PLAN).read_text())
    version = _podman_version()
    if _podman("network", "exists", network, check=False).returncode != 0:
        _podman("network", "create", network)
    for name in plan["secrets"]:
        _podman("secret", "rm", name, check=False)
        _podman("secret", "create", name, str(_secret_for_podman(out / "secrets" / name, version)))
    for name in plan["scratch"] + plan["empty_dirs"]:  # an emptyDir starts empty; a secret's files are the new ones
        _podman("volume", "rm", "--force", name, check=False)
    for name in plan["empty_dirs"]:
        _podman("volume", "create", name)
        os.chmod(_podman("volume", "inspect", name, "--format", "{{.Mountpoint}}").stdout.strip(), 0o777)
    for pod in plan["pods"]:
        net = network + "".join(f",alias={a}" if i else f":alias={a}" for i, a in enumerate(pod["aliases"]))
        played = _podman("kube", "play", "--network", net, "--configmap", str(out / "configmaps.yaml"),
                         str(out / "pods" / f"{pod['name']}.yaml"), check=False)
        if played.returncode != 0:
            logs = _logs(pod["name"])
            _podman("pod", "rm", "--force", pod["name"], check=False)
            raise RenderError(f"pod {pod['name']}: podman kube play failed: {played.stderr.strip()}{logs}")


def down(out: Path, network: str) -> None:
    plan = json.loads((out / PLAN).read_text())
    for pod in plan["pods"]:
        _podman("pod", "rm", "--force", pod["name"], check=False)
    for name in plan["secrets"]:
        _podman("secret", "rm", name, check=False)
    for name in plan["scratch"] + plan["empty_dirs"]:
        _podman("volume", "rm", "--force", name, check=False)
    _podman("network", "rm", network, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    r = commands.add_parser("render", help="manifests (a file, - for stdin) to pods, secrets and a plan in OUT")
    r.add_argument("manifests")
    r.add_argument("out", type=Path)
    r.add_argument("--only", help="comma-separated workloads to run (default: all)")
    r.add_argument("--scale", action="append", default=[], metavar="NAME=N",
                   help="replicas (or completions) of a workload, as kubectl scale would set")
    for name in ("up", "down"):
        c = commands.add_parser(name, help=f"{name} the pods of a render's OUT")
        c.add_argument("out", type=Path)
        c.add_argument("--network", default="async-rl", help="the podman network the pods share (default async-rl)")
    args = parser.parse_args(argv)
    try:
        if args.command == "render":
            text = sys.stdin.read() if args.manifests == "-" else Path(args.manifests).read_text()
            scale = {}
            for item in args.scale:
                name, _, count = item.partition("=")
                if not count.isdigit():
                    raise RenderError(f"--scale {item}: want NAME=N")
                scale[name] = int(count)
            only = set(args.only.split(",")) if args.only else None
            write(render([d for d in yaml.safe_load_all(text) if d], only, scale), args.out)
        elif args.command == "up":
            up(args.out, args.network)
        else:
            down(args.out, args.network)
    except RenderError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.umask(0o077)  # the secrets' files
    sys.exit(main())
