"""CurveZMQ authentication of the ZeroMQ sockets (docs/architecture.md, "Security").

`async-rl keys DIR --workers N` writes one CURVE key pair per identity with `zmq.auth.create_certificates`:
`replay.key` (public) and `replay.key_secret` (both keys), the same for `learner` and for each rollout worker
`rollout-<i>` (i < N). With `security.curve_dir` set, every socket is encrypted and authenticated:

* the replay's ROUTER is a CURVE server (the replay's key pair); it admits only the learner's and the workers' keys
  (a ZAP handler), and tells the replay which identity sent each message (the frame's `User-Id`: `learner`,
  `rollout-3`), so it can hold a worker to its own worker id and its own leases;
* the learner's weight PUB is a CURVE server (the learner's key pair); it admits only the workers' keys;
* learner and rollout workers connect as CURVE clients with their own key pair and the server's public key, under
  a routing identity bound to their secret key (`routing_id`): no other key can claim their connection.

So each pod needs its own secret and the public keys of the others: `role_files` lists them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import ssl
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from async_rl.errors import ConfigError

ROLES = ("replay", "learner", "rollout")
# Who may connect to the socket each role binds (the replay's ROUTER, the learner's PUB), by role.
CLIENTS = {"replay": ("learner", "rollout"), "learner": ("rollout",), "rollout": ()}
WORKER = re.compile(r"rollout-(\d+)")  # a rollout worker's identity: its worker id, its key's name
LEGACY_FILES = ("rollout.key", "rollout.key_secret")  # the one key all workers shared before per-worker keys

ZAP_DOMAIN = "async-rl"  # the ZAP domain of every CURVE server socket

log = logging.getLogger("async_rl.security")


def worker_identity(index: int) -> str:
    """Rollout worker `index`'s identity: its worker id, and the name of its key pair."""
    return f"rollout-{index}"


def role_of(identity: str) -> str:
    """The role of an authenticated identity: `rollout-3` -> `rollout`, `learner` -> `learner`."""
    return identity.split("-", 1)[0]


def owns(identity: str, name: str) -> bool:
    """Whether the key authenticated as `identity` may speak as `name` (a worker id, a connection's routing name): a
    worker's key only as itself; the learner's key as any learner rank (`learner-0`). A replay log written before
    per-worker keys names the shared key `rollout`, which spoke for every worker."""
    return name == identity or (identity in ROLES and name.startswith(identity + "-"))


def role_files(identity: str, workers: Sequence[str] = ()) -> list[str]:
    """The files `identity` reads from security.curve_dir: its own secret and its peers' public keys (`workers`: the
    rollout identities the replay and the learner admit)."""
    if identity in ("replay", "learner"):
        peer = "learner" if identity == "replay" else "replay"
        return [f"{identity}.key_secret", f"{peer}.key", *(f"{worker}.key" for worker in workers)]
    if WORKER.fullmatch(identity) is None:
        raise ValueError(f"{identity!r}: expected replay, learner or rollout-<i>")
    return [f"{identity}.key_secret", "replay.key", "learner.key"]


@dataclass(frozen=True)
class CurveKeys:
    """One identity's CURVE keys: its own pair, and the public keys (Z85) of the identities it talks to."""

    identity: str
    public: bytes
    secret: bytes
    peers: dict[str, bytes]  # identity -> public key

    def client_identities(self) -> dict[bytes, str]:
        """Public key -> identity, for the identities allowed to connect to the socket this identity binds."""
        allowed = CLIENTS[role_of(self.identity)]
        return {public: name for name, public in self.peers.items() if role_of(name) in allowed}


def routing_id(name: str, keys: CurveKeys | None) -> bytes:
    """The ZeroMQ identity under which the replay's ROUTER knows a DEALER's connection. With CURVE it is `name.` and a
    MAC of the name under the holder's secret key: the same for a restarted process of the same holder (its new
    connection takes over its old one, ZMQ_ROUTER_HANDOVER), and out of reach of every other key, so no other key's
    connection can take it over (docs/architecture.md, "Security")."""
    if keys is None:
        return name.encode()
    tag = hashlib.blake2b(name.encode(), key=keys.secret, digest_size=12).hexdigest()
    return f"{name}.{tag}".encode()


def routing_name(identity: bytes) -> str:
    """The name part of a routing identity (`routing_id`): what the connection claims to be."""
    return identity.split(b".", 1)[0].decode(errors="replace")


def create_keys(directory: str | Path, workers: int) -> list[Path]:
    """Write a key pair for the replay, the learner and each of `workers` rollout workers into `directory`
    (created). Pairs already there are kept, never overwritten: a larger `workers` adds the new workers' keys."""
    directory = Path(directory)
    if workers < 1:
        raise ConfigError(f"--workers: expected at least 1 rollout worker, got {workers}")
    _refuse_legacy(directory, "write the per-worker keys into a new directory")
    names = ["replay", "learner", *(worker_identity(i) for i in range(workers))]
    missing = []
    for name in names:
        pair = [directory / f"{name}.{suffix}" for suffix in ("key", "key_secret")]
        present = [path.exists() for path in pair]
        if any(present) and not all(present):
            half = pair[present.index(True)]
            raise ConfigError(f"{directory}: holds {half.name} without its other half; refusing to overwrite keys "
                              f"(delete {half.name} to write a new pair for {name})")
        if not any(present):
            missing.append(name)
    if not missing:
        raise ConfigError(f"{directory}: already holds the keys of replay, learner and rollout-0..{workers - 1}; "
                          "refusing to overwrite keys (delete them first to rotate)")
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in missing:
        public, secret = zmq.auth.create_certificates(directory, name)
        os.chmod(secret, stat.S_IRUSR | stat.S_IWUSR)  # the secret half: owner only
        written += [Path(public), Path(secret)]
    return written


def load_keys(curve_dir: str | None, identity: str) -> CurveKeys | None:
    """The keys `identity` (replay, learner, rollout-<i>) needs from `curve_dir` (security.curve_dir), or None when
    CURVE is off. The replay and the learner admit every `rollout-<i>.key` there. A missing or malformed file is a
    ConfigError naming `security.curve_dir`, the file, and how to make keys."""
    if curve_dir is None:
        return None
    directory = Path(curve_dir)
    own = role_files(identity)[0]
    if not (directory / own).is_file():
        _refuse_legacy(directory, "point security.curve_dir at it")
    public, secret = _read(directory, own, secret=True)
    assert secret is not None  # _read(secret=True) refuses a file without one
    workers: list[str] = []
    if identity in ("replay", "learner"):
        found = (WORKER.fullmatch(path.name.removesuffix(".key")) for path in directory.glob("rollout-*.key"))
        workers = [match[0] for match in sorted((m for m in found if m), key=lambda m: int(m[1]))]
        if not workers:
            _refuse_legacy(directory, "point security.curve_dir at it")
            raise ConfigError(f"security.curve_dir: {directory} holds no rollout-<i>.key: the {identity} would admit "
                              f"no worker (create the keys with `async-rl keys {directory} --workers N`; "
                              "docs/deploy.md says which files each pod mounts)")
    peers = {name.removesuffix(".key"): _read(directory, name, secret=False)[0]
             for name in role_files(identity, workers)[1:]}
    return CurveKeys(identity=identity, public=public, secret=secret, peers=peers)


def _refuse_legacy(directory: Path, fix: str) -> None:
    """Keys of an older async-rl, whose rollout workers all shared `rollout.key`: a ConfigError naming the fix."""
    legacy = [name for name in LEGACY_FILES if (directory / name).exists()]
    if legacy:
        raise ConfigError(f"security.curve_dir: {directory} holds {legacy[0]}, the one key every rollout worker shared "
                          f"in an older async-rl; each worker now has its own key: write them with `async-rl keys "
                          f"NEW_DIR --workers N` and {fix} (docs/deploy.md)")


def _read(directory: Path, name: str, secret: bool) -> tuple[bytes, bytes | None]:
    path = directory / name
    if not path.is_file():
        hint = f" --workers {int(m[1]) + 1}" if (m := WORKER.match(name)) else ""
        raise ConfigError(f"security.curve_dir: {path} does not exist (create the keys with `async-rl keys "
                          f"{directory}{hint}`; docs/deploy.md says which files each pod mounts)")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"security.curve_dir: {path} is not a CURVE certificate: {exc}") from None
    if secret and secret_key is None:
        raise ConfigError(f"security.curve_dir: {path} holds no secret key")
    for key in (public, secret_key):
        if key is not None and len(key) != 40:
            raise ConfigError(f"security.curve_dir: {path}: a CURVE key is 40 Z85 characters, got {len(key)}")
    return public, secret_key


def insecure_endpoints(curve_dir: str | None, endpoints: Sequence[str]) -> list[str]:
    """The tcp:// ones of a run's `endpoints` (replay.endpoint, learner.publish_endpoint) without CURVE (`curve_dir`,
    security.curve_dir, unset): anyone who reaches them may lease, forge outcomes or ack batches. ipc:// (a Unix
    socket, guarded by its file's permissions) and inproc:// are not among them."""
    if curve_dir is not None:
        return []
    return [e for e in endpoints if e.startswith("tcp://")]


def check_transport(curve_dir: str | None, insecure: bool, endpoints: Sequence[str]) -> None:
    """Every role at its start: TCP without CURVE (`insecure_endpoints`) is refused (a ConfigError naming the keys
    and the fixes) unless `insecure` (security.insecure: true) says so in so many words; then it is a loud
    warning. The sockets check it again as they are bound or connected (`check_socket`), whoever opens them."""
    _refuse_or_warn(insecure_endpoints(curve_dir, endpoints), insecure)


def check_socket(endpoint: str, curve: CurveKeys | None, insecure: bool) -> None:
    """Every socket as it is bound or connected (async_rl/transport.py): a tcp:// endpoint without CURVE keys is
    refused as in `check_transport` unless `insecure` (security.insecure: true), so a role started as a library
    (`replay.server.run`, the learner's and worker's `run`, a Ray actor, a test) refuses as the CLI does."""
    _refuse_or_warn([endpoint] if curve is None and endpoint.startswith("tcp://") else [], insecure)


def _refuse_or_warn(exposed: list[str], insecure: bool) -> None:
    if not exposed:
        return
    if not insecure:
        raise ConfigError(f"security.curve_dir: not set, and {', '.join(exposed)} would run in the clear: anyone "
                          "who reaches these ports could take leases, forge outcomes and ack batches. Create keys "
                          "with `async-rl keys DIR --workers N` and set security.curve_dir=DIR, use ipc:// endpoints "
                          "(or auto) on one machine, or set security.insecure=true to run unauthenticated anyway")
    log.warning("UNAUTHENTICATED (security.insecure): %s without security.curve_dir: any peer that reaches these "
                "ports can take leases, forge outcomes and ack batches (create keys with `async-rl keys DIR`; "
                "docs/deploy.md)", ", ".join(exposed))


def sglang_headers(api_key_file: str | None) -> dict[str, str]:
    """The HTTP headers of every request to the SGLang servers: `Authorization: Bearer <key>` with a key from
    `api_key_file` (rollout.sglang.api_key_file; or, without one, a non-empty SGLANG_API_KEY), else none."""
    return bearer_headers(api_key_file, "SGLANG_API_KEY", "rollout.sglang.api_key_file")


def sglang_admin_headers(admin_key_file: str | None) -> dict[str, str]:
    """The learner's headers for the SGLang servers' admin routes (weights, pause, abort, LoRA: their
    `--admin-api-key`): `rollout.sglang.admin_key_file`, else a non-empty SGLANG_ADMIN_API_KEY, else none. A
    rollout worker never asks for them: its API key can generate and nothing else."""
    return bearer_headers(admin_key_file, "SGLANG_ADMIN_API_KEY", "rollout.sglang.admin_key_file")


def vllm_headers(api_key_file: str | None) -> dict[str, str]:
    """The same for the vLLM servers: `rollout.vllm.api_key_file`, else a non-empty VLLM_API_KEY, else none."""
    return bearer_headers(api_key_file, "VLLM_API_KEY", "rollout.vllm.api_key_file")


def server_tls(urls: list[str] | tuple[str, ...], ca_file: str | None, setting: str) -> ssl.SSLContext | bool:
    """The `verify` of an HTTP client of the servers at `urls`: an SSL context trusting `ca_file` (`setting`, e.g.
    rollout.sglang.ca_file), or True (the system's trust store, for https:// URLs). ConfigError naming `setting`
    when the file cannot be read as certificates, or when it is set for an http:// URL (nothing would use it)."""
    if ca_file is None:
        return True
    plain = [url for url in urls if not url.startswith("https://")]
    if plain:
        raise ConfigError(f"{setting}: set, but {', '.join(plain)} is not https://: start the servers with "
                          "--ssl-keyfile and --ssl-certfile and use https:// URLs, or leave it null")
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{setting}: cannot load {ca_file} as CA certificates: {exc}") from None


def bearer_headers(key_file: str | None, env_var: str, setting: str) -> dict[str, str]:
    """`Authorization: Bearer <key>` with the key read from `key_file` (ConfigError naming `setting` when it cannot
    be read or is empty), or without one from a non-empty `env_var`; else no header."""
    if key_file is not None:
        path = Path(key_file)
        try:
            key = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror}") from None
        if not key:
            raise ConfigError(f"{setting}: {path} is empty")
    else:
        key = os.environ.get(env_var, "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


class _IdentityAuthenticator(ThreadAuthenticator):
    """ZAP handler: admits the CURVE public keys of the allowed identities only; the User-Id of a connection is the
    identity its key belongs to (`learner`, `rollout-3`), so the server knows who sent each message."""

    def __init__(self, context: zmq.Context, identities_by_key: dict[bytes, str]) -> None:
        super().__init__(context, log=logging.getLogger("async_rl.security.zap"))
        self.identities_by_key = dict(identities_by_key)

    def callback(self, domain: str, key: bytes) -> bool:  # the credentials provider of configure_curve_callback
        return key in self.identities_by_key

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.identities_by_key[z85.encode(client_public_key)]


def start_authenticator(context: zmq.Context, keys: CurveKeys) -> ThreadAuthenticator:
    authenticator = _IdentityAuthenticator(context, keys.client_identities())
    authenticator.start()
    authenticator.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=authenticator)
    return authenticator
