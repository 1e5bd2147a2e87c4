"""CurveZMQ authentication of the ZeroMQ sockets (docs/architecture.md, "Security").

`async-rl keys DIR` writes one CURVE key pair per role with `zmq.auth.create_certificates`: `replay.key` (public)
and `replay.key_secret` (both keys), the same for `learner` and `rollout`. With `security.curve_dir` set, every
socket is encrypted and authenticated:

* the replay's ROUTER is a CURVE server (the replay's key pair); it admits only the learner's and the rollout
  key (a ZAP handler), and tells the replay which of the two sent each message (the frame's `User-Id`);
* the learner's weight PUB is a CURVE server (the learner's key pair); it admits only the rollout key;
* learner and rollout workers connect as CURVE clients with their own key pair and the server's public key.

So each pod needs its own `<role>.key_secret` and the public keys of the others: `ROLE_FILES` lists them.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from async_rl.config import Config, SGLangConfig
from async_rl.errors import ConfigError

ROLES = ("replay", "learner", "rollout")
# Who may connect to the socket each role binds (the replay's ROUTER, the learner's PUB).
CLIENTS = {"replay": ("learner", "rollout"), "learner": ("rollout",), "rollout": ()}
# The files each role reads from security.curve_dir: its own secret, and the public keys of its peers.
ROLE_FILES = {
    "replay": ("replay.key_secret", "learner.key", "rollout.key"),
    "learner": ("learner.key_secret", "replay.key", "rollout.key"),
    "rollout": ("rollout.key_secret", "replay.key", "learner.key"),
}

ZAP_DOMAIN = "async-rl"  # the ZAP domain of every CURVE server socket

log = logging.getLogger("async_rl.security")


@dataclass(frozen=True)
class CurveKeys:
    """One role's CURVE keys: its own pair, and the public keys (Z85) of the roles it talks to."""

    role: str
    public: bytes
    secret: bytes
    peers: dict[str, bytes]  # role -> public key

    def client_roles(self) -> dict[bytes, str]:
        """Public key -> role, for the roles allowed to connect to the socket this role binds."""
        return {self.peers[role]: role for role in CLIENTS[self.role]}


def create_keys(directory: str | Path) -> list[Path]:
    """Write a fresh key pair per role into `directory` (created; existing keys are never overwritten)."""
    directory = Path(directory)
    existing = [directory / f"{role}.{suffix}" for role in ROLES for suffix in ("key", "key_secret")]
    taken = [path for path in existing if path.exists()]
    if taken:
        raise ConfigError(f"{directory}: already holds {', '.join(p.name for p in taken)}; refusing to overwrite "
                          "keys (delete them first to rotate)")
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for role in ROLES:
        public, secret = zmq.auth.create_certificates(directory, role)
        os.chmod(secret, stat.S_IRUSR | stat.S_IWUSR)  # the secret half: owner only
        written += [Path(public), Path(secret)]
    return written


def load_keys(config: Config, role: str) -> CurveKeys | None:
    """The keys `role` needs from `security.curve_dir`, or None when CURVE is off. A missing or malformed file is
    a ConfigError naming `security.curve_dir`, the file, and how to make keys."""
    curve_dir = config.security.curve_dir
    if curve_dir is None:
        return None
    directory = Path(curve_dir)
    own, *peer_files = ROLE_FILES[role]
    public, secret = _read(directory, own, secret=True)
    peers = {name.split(".")[0]: _read(directory, name, secret=False)[0] for name in peer_files}
    return CurveKeys(role=role, public=public, secret=secret, peers=peers)


def _read(directory: Path, name: str, secret: bool) -> tuple[bytes, bytes | None]:
    path = directory / name
    if not path.is_file():
        raise ConfigError(f"security.curve_dir: {path} does not exist (create the keys with `async-rl keys "
                          f"{directory}`; docs/deploy.md says which files each pod mounts)")
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


def insecure_endpoints(config: Config) -> list[str]:
    """The tcp:// endpoints of a config without CURVE: anyone who reaches them may lease, forge outcomes or ack
    batches. Roles log a warning naming them."""
    if config.security.curve_dir is not None:
        return []
    return [e for e in (config.replay.endpoint, config.learner.publish_endpoint) if e.startswith("tcp://")]


def warn_if_insecure(config: Config) -> None:
    endpoints = insecure_endpoints(config)
    if endpoints:
        log.warning("UNAUTHENTICATED: %s without security.curve_dir: any peer that reaches these ports can take "
                    "leases, forge outcomes and ack batches (create keys with `async-rl keys DIR`; "
                    "docs/deploy.md)", ", ".join(endpoints))


def sglang_headers(config: SGLangConfig) -> dict[str, str]:
    """The HTTP headers of every request to the SGLang servers: `Authorization: Bearer <key>` with a key from
    `rollout.sglang.api_key_file` (or, without one, a non-empty SGLANG_API_KEY), else none."""
    if config.api_key_file is not None:
        path = Path(config.api_key_file)
        try:
            key = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"rollout.sglang.api_key_file: cannot read {path}: {exc.strerror}") from None
        if not key:
            raise ConfigError(f"rollout.sglang.api_key_file: {path} is empty")
    else:
        key = os.environ.get("SGLANG_API_KEY", "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


class _RoleAuthenticator(ThreadAuthenticator):
    """ZAP handler: admits the CURVE public keys of the allowed roles only; the User-Id of a connection is the
    role name, so the server knows whether the learner or a rollout worker sent a message."""

    def __init__(self, context: zmq.Context, roles_by_key: dict[bytes, str]) -> None:
        super().__init__(context, log=logging.getLogger("async_rl.security.zap"))
        self.roles_by_key = dict(roles_by_key)

    def callback(self, domain: str, key: bytes) -> bool:  # the credentials provider of configure_curve_callback
        return key in self.roles_by_key

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.roles_by_key[z85.encode(client_public_key)]


def start_authenticator(context: zmq.Context, keys: CurveKeys) -> ThreadAuthenticator:
    authenticator = _RoleAuthenticator(context, keys.client_roles())
    authenticator.start()
    authenticator.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=authenticator)
    return authenticator
