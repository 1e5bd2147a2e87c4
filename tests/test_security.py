"""CurveZMQ authentication (async_rl/security.py): `async-rl keys DIR`, the CURVE sockets of async_rl/transport.py,
the replay's role check. Real sockets, a real replay loop."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import zmq

from async_rl.config import SGLangConfig
from async_rl.config_load import config_from_dict
from async_rl.errors import ConfigError
from async_rl.protocol import (
    BatchAck,
    BatchRequest,
    Error,
    Heartbeat,
    LeaseGrant,
    LeaseRequest,
    WeightsPublished,
)
from async_rl.security import (
    ROLE_FILES,
    ROLES,
    CurveKeys,
    insecure_endpoints,
    load_keys,
    sglang_headers,
    warn_if_insecure,
)
from async_rl.transport import connect_dealer, connect_subscriber, poll, receive, send
from launch.cli import main
from replay.server import run as run_replay
from replay.service import ReplayService
from rollout.engines.base import EngineUnavailable


def free_endpoint() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("curve")
    assert main(["keys", str(directory)]) == 0  # `async-rl keys DIR`, as docs/deploy.md prints it
    return directory


@pytest.fixture(scope="module")
def other_keys(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("other-curve")
    assert main(["keys", str(directory)]) == 0
    return directory


def make_config(tmp_path: Path, curve_dir: Path | None, **replay):
    return config_from_dict({
        "run": {"dir": str(tmp_path), "name": "sec"},
        "replay": {"endpoint": free_endpoint(), **replay},
        "learner": {"publish_endpoint": free_endpoint()},
        "security": {"curve_dir": None if curve_dir is None else str(curve_dir)},
    })


def test_keys_command_writes_one_pair_per_role_and_never_overwrites(tmp_path, capsys):
    directory = tmp_path / "curve"
    assert main(["keys", str(directory)]) == 0
    written = capsys.readouterr().out.split()
    assert sorted(Path(p).name for p in written) == sorted(f"{r}.{s}" for r in ROLES for s in ("key", "key_secret"))
    for role in ROLES:
        assert stat.S_IMODE(os.stat(directory / f"{role}.key_secret").st_mode) == 0o600
    config = config_from_dict({"security": {"curve_dir": str(directory)}})
    loaded = {role: load_keys(config, role) for role in ROLES}
    assert loaded["rollout"].peers["replay"] == loaded["replay"].public  # one key pair per role, shared
    assert loaded["replay"].client_roles() == {loaded["learner"].public: "learner", loaded["rollout"].public: "rollout"}
    before = (directory / "replay.key_secret").read_bytes()
    assert main(["keys", str(directory)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert (directory / "replay.key_secret").read_bytes() == before


def test_a_bad_key_directory_is_a_config_error_naming_the_key(tmp_path, keys):
    with pytest.raises(ConfigError, match="security.curve_dir: expected a directory"):
        config_from_dict({"security": {"curve_dir": ""}})
    config = config_from_dict({"security": {"curve_dir": str(tmp_path)}})
    with pytest.raises(ConfigError, match=r"security.curve_dir: .*learner.key_secret does not exist .*async-rl keys"):
        load_keys(config, "learner")
    (tmp_path / "learner.key_secret").write_text("not a certificate")
    for name in ROLE_FILES["learner"][1:]:
        (tmp_path / name).write_bytes((keys / name).read_bytes())
    with pytest.raises(ConfigError, match="security.curve_dir: .*learner.key_secret"):
        load_keys(config, "learner")
    assert load_keys(config_from_dict({}), "replay") is None  # CURVE off by default


def test_a_tcp_endpoint_without_keys_is_a_loud_warning(caplog):
    tcp = config_from_dict({"replay": {"endpoint": "tcp://replay:5555"}})
    assert insecure_endpoints(tcp) == ["tcp://replay:5555"]
    with caplog.at_level(logging.WARNING, logger="async_rl.security"):
        warn_if_insecure(tcp)  # every role calls it at start (launch/roles.py)
        warn_if_insecure(config_from_dict({}))  # the local default: Unix sockets, nothing to say
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "UNAUTHENTICATED: tcp://replay:5555" in record.getMessage()
    assert "async-rl keys DIR" in record.getMessage()
    secure = config_from_dict({"replay": {"endpoint": "tcp://replay:5555"}, "security": {"curve_dir": "/k"}})
    assert insecure_endpoints(secure) == []


def test_the_replay_role_check_refuses_learner_messages_from_a_worker_and_back():
    service = ReplayService(config_from_dict({}))
    request = BatchRequest(learner_id="learner", msg_id=7, policy_version=2**40, max_tokens=64, min_items=1,
                           max_wait_s=0.0)
    [(_, error)] = service.handle(b"w", request, 0.0, peer="rollout")
    assert isinstance(error, Error) and error.code == "unauthorized" and error.detail.startswith("not_learner")
    [(_, error)] = service.handle(b"w", BatchAck(learner_id="learner", msg_id=8, batch_id=0, policy_version=0), 0.0,
                                  peer="rollout")
    assert error.detail.startswith("not_learner")
    [(_, error)] = service.handle(b"l", LeaseRequest(worker_id="rollout-0", msg_id=1), 0.0, peer="learner")
    assert error.detail.startswith("not_rollout")
    assert service.stats_snapshot().rejected == {"not_learner": 2, "not_rollout": 1}
    assert service.policy_version == 0 and service.version_ceiling is None  # nothing of them was taken
    [(_, grant)] = service.handle(b"w", LeaseRequest(worker_id="rollout-0", msg_id=1), 0.0, peer="rollout")
    assert isinstance(grant, LeaseGrant)
    [(_, grant)] = service.handle(b"x", LeaseRequest(worker_id="rollout-1", msg_id=1), 0.0)  # no CURVE: no check
    assert isinstance(grant, LeaseGrant)


def _reply(sock: zmq.Socket, timeout_s: float):
    return receive(sock)[1] if poll(sock, timeout_s) else None


def test_a_curve_replay_refuses_clients_without_an_allowed_key(tmp_path, keys, other_keys):
    config = make_config(tmp_path, keys)
    endpoint = config.replay.endpoint
    service, stop = ReplayService(config), threading.Event()
    thread = threading.Thread(target=run_replay, args=(config, stop, service), daemon=True)
    thread.start()
    context = zmq.Context()
    rollout, learner = load_keys(config, "rollout"), load_keys(config, "learner")
    stranger = load_keys(make_config(tmp_path, other_keys), "rollout")
    impostor = CurveKeys("rollout", stranger.public, stranger.secret, rollout.peers)  # knows the server key only
    clients = {
        "plain": connect_dealer(context, endpoint, "plain"),  # no CURVE at all
        "wrong_key": connect_dealer(context, endpoint, "wrong", impostor),  # a key not in the key directory
        "wrong_server": connect_dealer(context, endpoint, "mitm", stranger),  # expects another server key
        "rollout": connect_dealer(context, endpoint, "rollout-0", rollout),
        "learner": connect_dealer(context, endpoint, "learner", learner),
    }
    try:
        for name, client in clients.items():
            send(client, LeaseRequest(worker_id=name, msg_id=1))
        assert isinstance(_reply(clients["rollout"], 10.0), LeaseGrant)
        error = _reply(clients["learner"], 10.0)  # the learner's key may not lease
        assert isinstance(error, Error) and error.code == "unauthorized" and error.detail.startswith("not_rollout")
        send(clients["rollout"], BatchRequest(learner_id="learner", msg_id=2, policy_version=2**40, max_tokens=64,
                                              min_items=1, max_wait_s=0.0))
        error = _reply(clients["rollout"], 10.0)
        assert isinstance(error, Error) and error.detail.startswith("not_learner")
        for name in ("plain", "wrong_key", "wrong_server"):
            assert _reply(clients[name], 0.5) is None, f"{name} got an answer"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            rejected = service.stats_snapshot().rejected
            if rejected.get("handshake_refused_key", 0) >= 1 and rejected.get("handshake_failed", 0) >= 2:
                break
            time.sleep(0.05)
        assert rejected.get("handshake_refused_key", 0) >= 1, rejected  # ZAP refused the unknown key
        assert rejected.get("handshake_failed", 0) >= 2, rejected  # no CURVE; the wrong server key
        stats = service.stats_snapshot()
        assert stats.groups_started == 1 and service.policy_version == 0  # only rollout-0 got in
        assert stats.rejected["not_learner"] == 1 and stats.rejected["not_rollout"] == 1
    finally:
        for client in clients.values():
            client.close(linger=0)
        stop.set()
        thread.join(10)
        context.term()
    assert not thread.is_alive()


def test_a_restarted_peer_is_heard_while_the_replay_still_holds_its_old_connection(tmp_path, keys):
    """A worker (or learner) killed while its link was down leaves a connection the replay still believes open (no
    FIN ever reached it); its restarted process connects under the same identity and must be heard, not dropped
    (benchmarks/chaos.py stalled on a learner so: ZMQ_ROUTER_HANDOVER)."""
    config = make_config(tmp_path, keys)
    service, stop = ReplayService(config), threading.Event()
    thread = threading.Thread(target=run_replay, args=(config, stop, service), daemon=True)
    thread.start()
    context, dead = zmq.Context(), zmq.Context()
    dead.setsockopt(zmq.RECONNECT_IVL, -1)  # the dead process's socket: open, and never connecting again
    rollout = load_keys(config, "rollout")
    probe = connect_dealer(context, config.replay.endpoint, "rollout-1", rollout)
    send(probe, LeaseRequest(worker_id="rollout-1", msg_id=1))
    assert isinstance(_reply(probe, 10.0), LeaseGrant)  # the replay listens: a socket that never retries may connect
    probe.close(linger=0)
    old = connect_dealer(dead, config.replay.endpoint, "rollout-0", rollout)
    new = None
    try:
        send(old, LeaseRequest(worker_id="rollout-0", msg_id=1, session=1))
        assert isinstance(_reply(old, 10.0), LeaseGrant)
        new = connect_dealer(context, config.replay.endpoint, "rollout-0", rollout)  # the restarted process
        send(new, LeaseRequest(worker_id="rollout-0", msg_id=1, session=2))
        assert isinstance(_reply(new, 10.0), LeaseGrant), "the restarted process was not heard"
        assert service.stats_snapshot().workers_restarted == 1
    finally:
        for client in (old, new):
            if client is not None:
                client.close(linger=0)
        stop.set()
        thread.join(10)
        context.term()
        dead.term()
    assert not thread.is_alive()


def test_a_curve_publisher_reaches_only_the_rollout_key(tmp_path, keys):
    import torch

    from learner.publisher import WeightPublisher

    config = make_config(tmp_path, keys)
    endpoint = config.learner.publish_endpoint
    context = zmq.Context()
    publisher = WeightPublisher(context, endpoint, tmp_path / "weights", 2, load_keys(config, "learner"))
    subscribers = {
        "rollout": connect_subscriber(context, endpoint, load_keys(config, "rollout")),
        "plain": connect_subscriber(context, endpoint),
    }
    try:
        publisher.publish({"w": torch.zeros(2)}, 3)
        deadline = time.monotonic() + 10
        got = None
        while (got is None or not publisher.refused_handshakes) and time.monotonic() < deadline:
            publisher._last_sent = 0.0  # repeat now, not in 2 s
            publisher.republish_if_due()
            got = got or _reply(subscribers["rollout"], 0.1)
        assert isinstance(got, WeightsPublished) and got.version == 3
        assert _reply(subscribers["plain"], 0.3) is None
        assert publisher.refused_handshakes >= 1  # the plain subscriber was kept out, and counted
    finally:
        for sub in subscribers.values():
            sub.close(linger=0)
        publisher.close()
        context.term()


def test_a_plain_heartbeat_is_answered_by_nothing_but_does_not_crash_a_curve_replay(tmp_path, keys):
    """A peer speaking plain ZMTP never reaches `handle`; an authenticated one right after still works."""
    config = make_config(tmp_path, keys)
    service, stop = ReplayService(config), threading.Event()
    thread = threading.Thread(target=run_replay, args=(config, stop, service), daemon=True)
    thread.start()
    context = zmq.Context()
    plain = connect_dealer(context, config.replay.endpoint, "plain")
    good = connect_dealer(context, config.replay.endpoint, "rollout-0", load_keys(config, "rollout"))
    try:
        send(plain, Heartbeat(worker_id="rollout-0"))
        send(good, LeaseRequest(worker_id="rollout-0", msg_id=1))
        assert isinstance(_reply(good, 10.0), LeaseGrant)
    finally:
        plain.close(linger=0)
        good.close(linger=0)
        stop.set()
        thread.join(10)
        context.term()

# The authenticated run (`async-rl train` on TCP with CURVE on, to its end, honest traffic never refused) is
# tests/test_wire_fuzz.py: it runs one and fuzzes it.


class _KeyedServer(ThreadingHTTPServer):
    """A stand-in for an SGLang server started with `--api-key KEY`: 401 without `Authorization: Bearer KEY`."""

    def __init__(self, key: str) -> None:
        self.key, self.seen = key, []
        super().__init__(("127.0.0.1", 0), _KeyedHandler)


class _KeyedHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        self.server.seen.append(self.headers.get("Authorization"))
        ok = self.headers.get("Authorization") == f"Bearer {self.server.key}"
        body = json.dumps({"weight_version": "0"} if self.path == "/get_model_info" else {}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_the_sglang_client_sends_the_api_key_from_its_file(tmp_path, monkeypatch):
    from rollout.engines.sglang import SGLangEngine  # httpx: only SGLang users need it

    server = _KeyedServer("s3cret")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    key_file = tmp_path / "api-key"
    key_file.write_text("s3cret\n")  # as a mounted Secret file may end
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    try:
        engine = SGLangEngine(SGLangConfig(urls=[url], api_key_file=str(key_file), unavailable_timeout_s=5))
        assert engine.version == 0 and set(server.seen) == {"Bearer s3cret"}
        engine.close()
        with pytest.raises(EngineUnavailable):  # no key: the server refuses every call
            SGLangEngine(SGLangConfig(urls=[url], unavailable_timeout_s=0.3))
        assert None in server.seen
        monkeypatch.setenv("SGLANG_API_KEY", "s3cret")  # what the k8s pods get from the sglang-api-key Secret
        assert sglang_headers(SGLangConfig(urls=[url])) == {"Authorization": "Bearer s3cret"}
        (tmp_path / "empty").write_text("\n")
        with pytest.raises(ConfigError, match="rollout.sglang.api_key_file: .* is empty"):
            sglang_headers(SGLangConfig(urls=[url], api_key_file=str(tmp_path / "empty")))
    finally:
        server.shutdown()
        server.server_close()
