"""CurveZMQ authentication (async_rl/security.py): `async-rl keys DIR --workers N`, the CURVE sockets of
async_rl/transport.py, the replay's checks of each key (its role, its connection identity, its worker id, its
leases), and TCP without keys refused. Real sockets; a real replay loop, or a real replay process."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import stat
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import zmq
import zmq.utils.monitor
from project_commands import project_command
from rollout_helpers import sglang_settings

from async_rl.config import Config
from async_rl.config_load import config_from_dict, config_to_dict, dump_config
from async_rl.errors import CONFIG_EXIT_CODE, ConfigError
from async_rl.protocol import (
    LOGPROB,
    TOKEN,
    Ack,
    BatchAck,
    BatchRequest,
    Error,
    Heartbeat,
    LeaseGrant,
    LeaseRequest,
    Outcome,
    StageRecord,
    WeightsPublished,
    pack,
)
from async_rl.security import (
    CurveKeys,
    check_transport,
    insecure_endpoints,
    load_keys,
    role_files,
    routing_id,
    sglang_admin_headers,
    sglang_headers,
)
from async_rl.transport import bind_publisher, bind_router, connect_dealer, connect_subscriber, poll, receive, send
from launch.cli import main
from replay.server import build_service
from replay.server import run as run_replay
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


def endpoints(config: Config) -> tuple[str, str]:
    """The endpoints a role checks at its entry: the replay's and the learner's."""
    return config.replay.endpoint, config.learner.publish_endpoint


def check(config: Config) -> None:
    """`check_transport` as every role's entry calls it (`async-rl train` too, launch/roles.py)."""
    check_transport(config.security.curve_dir, config.security.insecure, endpoints(config))


def test_keys_command_writes_a_pair_per_identity_and_never_overwrites(tmp_path, capsys):
    directory = tmp_path / "curve"
    assert main(["keys", str(directory), "--workers", "2"]) == 0
    written = capsys.readouterr().out.split()
    identities = ("replay", "learner", "rollout-0", "rollout-1")
    pairs = [f"{identity}.{suffix}" for identity in identities for suffix in ("key", "key_secret")]
    assert sorted(Path(p).name for p in written) == sorted(pairs)
    for identity in identities:
        assert stat.S_IMODE(os.stat(directory / f"{identity}.key_secret").st_mode) == 0o600
    config = config_from_dict({"security": {"curve_dir": str(directory)}})
    loaded = {identity: load_keys(config.security.curve_dir, identity) for identity in identities}
    assert len({keys.public for keys in loaded.values()}) == 4  # a pair of its own for every worker
    assert loaded["rollout-1"].peers == {"replay": loaded["replay"].public, "learner": loaded["learner"].public}
    workers = {loaded["rollout-0"].public: "rollout-0", loaded["rollout-1"].public: "rollout-1"}
    assert loaded["replay"].client_identities() == {loaded["learner"].public: "learner", **workers}
    assert loaded["learner"].client_identities() == workers  # the weight PUB: the workers only
    before = (directory / "replay.key_secret").read_bytes()
    assert main(["keys", str(directory), "--workers", "2"]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert main(["keys", str(directory), "--workers", "3"]) == 0  # one more worker: its pair added, the rest kept
    assert [Path(p).name for p in capsys.readouterr().out.split()] == ["rollout-2.key", "rollout-2.key_secret"]
    assert (directory / "replay.key_secret").read_bytes() == before
    assert "rollout-2" in load_keys(config.security.curve_dir, "replay").client_identities().values()


def test_the_shared_rollout_key_of_an_older_layout_is_refused_naming_the_fix(tmp_path, keys, capsys):
    """Before per-worker keys every worker shared rollout.key: such a directory stops every role at start."""
    import zmq.auth

    for name in ("replay", "learner"):
        for suffix in ("key", "key_secret"):
            (tmp_path / f"{name}.{suffix}").write_bytes((keys / f"{name}.{suffix}").read_bytes())
    zmq.auth.create_certificates(tmp_path, "rollout")
    config = config_from_dict({"security": {"curve_dir": str(tmp_path)}})
    for identity in ("replay", "learner", "rollout-0"):
        with pytest.raises(ConfigError, match=r"security.curve_dir: .* holds rollout.key.*shared.*"
                                              r"`async-rl keys NEW_DIR --workers N`"):
            load_keys(config.security.curve_dir, identity)
    assert main(["keys", str(tmp_path)]) == 2
    assert "rollout.key" in capsys.readouterr().err and not (tmp_path / "rollout-0.key").exists()


def test_a_bad_key_directory_is_a_config_error_naming_the_key(tmp_path, keys):
    with pytest.raises(ConfigError, match="security.curve_dir: expected a directory"):
        config_from_dict({"security": {"curve_dir": ""}})
    config = config_from_dict({"security": {"curve_dir": str(tmp_path)}})
    with pytest.raises(ConfigError, match=r"security.curve_dir: .*learner.key_secret does not exist .*async-rl keys"):
        load_keys(config.security.curve_dir, "learner")
    with pytest.raises(ConfigError, match=r"rollout-5.key_secret does not exist .*async-rl keys .* --workers 6"):
        load_keys(config.security.curve_dir, "rollout-5")
    (tmp_path / "learner.key_secret").write_bytes((keys / "learner.key_secret").read_bytes())
    with pytest.raises(ConfigError, match=r"security.curve_dir: .* holds no rollout-<i>.key: the learner would admit"):
        load_keys(config.security.curve_dir, "learner")
    (tmp_path / "learner.key_secret").write_text("not a certificate")
    for name in role_files("learner", ["rollout-0"])[1:]:
        (tmp_path / name).write_bytes((keys / name).read_bytes())
    with pytest.raises(ConfigError, match="security.curve_dir: .*learner.key_secret"):
        load_keys(config.security.curve_dir, "learner")
    assert load_keys(config_from_dict({}).security.curve_dir, "replay") is None  # CURVE off by default


def test_tcp_without_keys_is_refused_unless_the_config_says_insecure(caplog):
    tcp = config_from_dict({"replay": {"endpoint": "tcp://replay:5555"}})
    assert insecure_endpoints(tcp.security.curve_dir, endpoints(tcp)) == ["tcp://replay:5555"]
    with pytest.raises(ConfigError, match=r"security.curve_dir: not set, and tcp://replay:5555 would run in the clear"
                                          r".*async-rl keys DIR --workers N.*security.insecure=true"):
        check(tcp)  # every role's entry calls it
    insecure = config_from_dict({"replay": {"endpoint": "tcp://replay:5555"}, "security": {"insecure": True}})
    with caplog.at_level(logging.WARNING, logger="async_rl.security"):
        check(insecure)
        check(config_from_dict({}))  # the local default: Unix sockets, nothing to say
        check(config_from_dict({"replay": {"endpoint": "inproc://replay"}}))
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "UNAUTHENTICATED (security.insecure): tcp://replay:5555" in \
        record.getMessage()
    secure = config_from_dict({"replay": {"endpoint": "tcp://replay:5555"}, "security": {"curve_dir": "/k"}})
    assert insecure_endpoints(secure.security.curve_dir, endpoints(secure)) == []
    check(secure)


def _port_is_free(endpoint: str) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", int(endpoint.rsplit(":", 1)[1])))
        except OSError:
            return False
    return True


def test_every_socket_refuses_tcp_without_keys_whoever_opens_it(tmp_path, caplog):
    """The refusal lives where the sockets are bound and connected (async_rl/transport.py), not in the CLI: a
    library caller that passes no keys gets the same ConfigError, and nothing is bound. `insecure=True` is the
    explicit opt-out (a loud warning); ipc:// needs no keys."""
    context = zmq.Context()
    endpoint = free_endpoint()
    openers = {
        "bind_router": lambda **kw: bind_router(context, endpoint, **kw),
        "bind_publisher": lambda **kw: bind_publisher(context, endpoint, **kw),
        "connect_dealer": lambda **kw: connect_dealer(context, endpoint, "rollout-0", **kw),
        "connect_subscriber": lambda **kw: connect_subscriber(context, endpoint, **kw),
    }
    try:
        for name, open_socket in openers.items():
            with pytest.raises(ConfigError, match=rf"security.curve_dir: not set, and {endpoint} would run in the "
                                                  r"clear.*security.insecure=true"):
                open_socket()
            assert _port_is_free(endpoint), f"{name} bound the port before refusing"
        with caplog.at_level(logging.WARNING, logger="async_rl.security"):
            router = bind_router(context, "tcp://127.0.0.1:*", insecure=True)  # a port no other test can take
            publisher = bind_publisher(context, "tcp://127.0.0.1:*", insecure=True)
            dealer = connect_dealer(context, router.getsockopt_string(zmq.LAST_ENDPOINT), "rollout-0", insecure=True)
            subscriber = connect_subscriber(context, publisher.getsockopt_string(zmq.LAST_ENDPOINT), insecure=True)
        assert sum("UNAUTHENTICATED (security.insecure)" in r.getMessage() for r in caplog.records) == 4
        for opened in (router, publisher, dealer, subscriber):
            opened.close(linger=0)
        bind_router(context, f"ipc://{tmp_path}/replay.ipc").close(linger=0)  # a Unix socket: its permissions guard it
    finally:
        context.destroy(linger=0)  # also what a failed assertion left open


def _learner_run(config: Config, stop: threading.Event) -> None:
    from learner.trainer import run

    run(config, stop)


def _worker_run(config: Config, stop: threading.Event) -> None:
    from rollout.worker import run

    run(config, 0, stop)


@pytest.mark.parametrize("role", ["replay", "learner", "rollout"])
def test_a_role_started_as_a_library_refuses_tcp_without_keys(tmp_path, role):
    """`replay.server.run`, the learner's and the worker's `run` called from Python (a Ray actor, a test, a
    user's script), not through `async-rl`: each refuses TCP without keys at once, naming the fix."""
    config = make_config(tmp_path, None)
    entry = {"replay": lambda stop: run_replay(config, stop), "learner": lambda stop: _learner_run(config, stop),
             "rollout": lambda stop: _worker_run(config, stop)}[role]
    stop, raised = threading.Event(), []

    def start() -> None:
        try:
            entry(stop)
        except Exception as exc:  # noqa: BLE001 - the test reads what it raised
            raised.append(exc)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(60)  # bounds a regression: a role that starts serves until stopped
    started = thread.is_alive()
    stop.set()
    thread.join(60)
    assert not started, f"the {role} started on {config.replay.endpoint} without keys"
    [error] = raised
    assert isinstance(error, ConfigError) and "security.curve_dir: not set" in str(error), error
    assert "security.insecure=true" in str(error)
    assert _port_is_free(config.replay.endpoint) and _port_is_free(config.learner.publish_endpoint)


def test_a_local_run_that_falls_back_to_loopback_tcp_gets_keys_of_its_own(tmp_path):
    """`async-rl train`'s `auto` endpoints are Unix sockets in the run directory; where its path is too long for one
    they are loopback TCP ports, which every user of the machine can reach: the run then gets CURVE keys."""
    from launch.rundir import fresh_run_dir, keys_for_loopback

    deep = tmp_path / ("d" * 90)
    config = fresh_run_dir(config_from_dict({"run": {"dir": str(deep), "name": "r"}, "rollout": {"workers": 2}}))
    assert config.replay.endpoint.startswith("tcp://127.0.0.1:")
    with pytest.raises(ConfigError):
        check(config)
    keyed = keys_for_loopback(config)
    assert keyed.security.curve_dir == str(config.run_dir / "curve")
    assert stat.S_IMODE(os.stat(keyed.security.curve_dir).st_mode) == 0o700
    check(keyed)
    for identity in ("replay", "learner", "rollout-0", "rollout-1"):
        assert load_keys(keyed.security.curve_dir, identity) is not None
    short = fresh_run_dir(config_from_dict({"run": {"dir": str(tmp_path), "name": "s"}}))
    assert short.replay.endpoint.startswith("ipc://") and keys_for_loopback(short) is short
    insecure = config_from_dict({**config_to_dict(config), "security": {"insecure": True}})
    assert keys_for_loopback(insecure) is insecure


def test_the_replay_role_check_refuses_learner_messages_from_a_worker_and_back():
    service = build_service(config_from_dict({}))
    request = BatchRequest(learner_id="learner-0", msg_id=7, policy_version=2**40, max_tokens=64, min_items=1,
                           max_wait_s=0.0)
    [(_, error)] = service.handle(b"rollout-0", request, 0.0, peer="rollout-0")
    assert isinstance(error, Error) and error.code == "unauthorized" and error.detail.startswith("not_learner")
    [(_, error)] = service.handle(b"rollout-0", BatchAck(learner_id="learner-0", msg_id=8, batch_id=0,
                                                         policy_version=0), 0.0, peer="rollout-0")
    assert error.detail.startswith("not_learner")
    [(_, error)] = service.handle(b"learner-0", LeaseRequest(worker_id="rollout-0", msg_id=1), 0.0, peer="learner")
    assert error.detail.startswith("not_rollout")
    assert service.stats_snapshot().rejected == {"not_learner": 2, "not_rollout": 1}
    assert service.policy_version == 0 and service.version_ceiling is None  # nothing of them was taken
    [(_, grant)] = service.handle(b"rollout-0", LeaseRequest(worker_id="rollout-0", msg_id=1), 0.0, peer="rollout-0")
    assert isinstance(grant, LeaseGrant)
    [(_, grant)] = service.handle(b"x", LeaseRequest(worker_id="rollout-1", msg_id=1), 0.0)  # no CURVE: no check
    assert isinstance(grant, LeaseGrant)
    # a replay log of the shared-key layout names the key `rollout`: it spoke for every worker, and replays so
    [(_, grant)] = service.handle(b"rollout-2", LeaseRequest(worker_id="rollout-2", msg_id=1), 0.0, peer="rollout")
    assert isinstance(grant, LeaseGrant)


def _reply(sock: zmq.Socket, timeout_s: float):
    return receive(sock)[1] if poll(sock, timeout_s) else None


HANDSHAKE_OUTCOMES = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "succeeded", zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused_key",
                      zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed_protocol",
                      zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed"}


def _handshake(monitor: zmq.Socket, timeout_s: float = 10.0) -> str | None:
    """The outcome of a client socket's first ZMTP handshake, as its own monitor reports it (HANDSHAKE_OUTCOMES):
    a refusal is an event the client saw (the server's ERROR with status 400 for a key ZAP refused, a mechanism
    mismatch, a server that hung up), not a reply that failed to come."""
    deadline = time.monotonic() + timeout_s
    while monitor.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
        if event in HANDSHAKE_OUTCOMES:
            return HANDSHAKE_OUTCOMES[event]
    return None


def test_a_curve_replay_refuses_clients_without_an_allowed_key(tmp_path, keys, other_keys):
    config = make_config(tmp_path, keys)
    endpoint = config.replay.endpoint
    service, stop = build_service(config), threading.Event()
    thread = threading.Thread(target=run_replay, args=(config, stop, service), daemon=True)
    context = zmq.Context()
    curve_dir = config.security.curve_dir
    rollout, learner = load_keys(curve_dir, "rollout-0"), load_keys(curve_dir, "learner")
    stranger = load_keys(make_config(tmp_path, other_keys).security.curve_dir, "rollout-0")
    impostor = CurveKeys("rollout-0", stranger.public, stranger.secret, rollout.peers)  # knows the server key only
    clients = {
        "plain": connect_dealer(context, endpoint, "plain", insecure=True),  # no CURVE at all
        "wrong_key": connect_dealer(context, endpoint, "wrong", impostor),  # a key not in the key directory
        "wrong_server": connect_dealer(context, endpoint, "mitm", stranger),  # expects another server key
        "rollout": connect_dealer(context, endpoint, "rollout-0", rollout),
        "learner": connect_dealer(context, endpoint, "learner-0", learner),
    }
    monitors = {name: clients[name].get_monitor_socket() for name in ("plain", "wrong_key", "wrong_server", "rollout")}
    thread.start()  # after the monitors: every handshake happens while they watch
    try:
        for name, client in clients.items():
            send(client, LeaseRequest(worker_id="rollout-0" if name == "rollout" else name, msg_id=1))
        assert isinstance(_reply(clients["rollout"], 10.0), LeaseGrant)
        error = _reply(clients["learner"], 10.0)  # the learner's key may not lease
        assert isinstance(error, Error) and error.code == "unauthorized" and error.detail.startswith("not_rollout")
        send(clients["rollout"], BatchRequest(learner_id="learner", msg_id=2, policy_version=2**40, max_tokens=64,
                                              min_items=1, max_wait_s=0.0))
        error = _reply(clients["rollout"], 10.0)
        assert isinstance(error, Error) and error.detail.startswith("not_learner")
        # each refused client saw its handshake fail: ZAP's refusal (status 400); a plain peer's mechanism mismatch
        # (or the server hanging up first, whichever side notices first); a server that cannot read a client of
        # another server key hangs up
        assert _handshake(monitors["rollout"]) == "succeeded"
        assert _handshake(monitors["plain"]) in ("failed_protocol", "failed")
        assert _handshake(monitors["wrong_key"]) == "refused_key"
        assert _handshake(monitors["wrong_server"]) in ("failed_protocol", "failed")
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
        for name, monitor in monitors.items():
            clients[name].disable_monitor()
            monitor.close(linger=0)
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
    service, stop = build_service(config), threading.Event()
    thread = threading.Thread(target=run_replay, args=(config, stop, service), daemon=True)
    thread.start()
    context, dead = zmq.Context(), zmq.Context()
    dead.setsockopt(zmq.RECONNECT_IVL, -1)  # the dead process's socket: open, and never connecting again
    curve_dir = config.security.curve_dir
    rollout = load_keys(curve_dir, "rollout-0")
    probe = connect_dealer(context, config.replay.endpoint, "rollout-1", load_keys(curve_dir, "rollout-1"))
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
    curve_dir = config.security.curve_dir
    subscribers = {
        "rollout": connect_subscriber(context, endpoint, load_keys(config.security.curve_dir, "rollout-0")),
        "plain": connect_subscriber(context, endpoint, insecure=True),
    }
    plain_monitor = subscribers["plain"].get_monitor_socket()  # before the publisher binds: it sees the handshake
    publisher = WeightPublisher(context, endpoint, tmp_path / "weights", 2, load_keys(curve_dir, "learner"))
    try:
        publisher.publish({"w": torch.zeros(2)}, 3)
        deadline = time.monotonic() + 10
        got = None
        while (got is None or not publisher.refused_handshakes) and time.monotonic() < deadline:
            publisher._last_sent = 0.0  # repeat now, not in 2 s
            publisher.republish_if_due()
            got = got or _reply(subscribers["rollout"], 0.1)
        assert isinstance(got, WeightsPublished) and got.version == 3
        assert _handshake(plain_monitor) in ("failed_protocol", "failed")  # the plain subscriber saw itself kept out
        assert publisher.refused_handshakes >= 1  # ... and the publisher counted it
    finally:
        subscribers["plain"].disable_monitor()
        plain_monitor.close(linger=0)
        for sub in subscribers.values():
            sub.close(linger=0)
        publisher.close()
        context.term()


def test_a_plain_heartbeat_is_answered_by_nothing_but_does_not_crash_a_curve_replay(tmp_path, keys):
    """A peer speaking plain ZMTP never reaches `handle`; an authenticated one right after still works."""
    config = make_config(tmp_path, keys)
    service, stop = build_service(config), threading.Event()
    thread = threading.Thread(target=run_replay, args=(config, stop, service), daemon=True)
    thread.start()
    context = zmq.Context()
    plain = connect_dealer(context, config.replay.endpoint, "plain", insecure=True)
    good = connect_dealer(context, config.replay.endpoint, "rollout-0",
                          load_keys(config.security.curve_dir, "rollout-0"))
    try:
        send(plain, Heartbeat(worker_id="rollout-0"))
        send(good, LeaseRequest(worker_id="rollout-0", msg_id=1))
        assert isinstance(_reply(good, 10.0), LeaseGrant)
        deadline = time.monotonic() + 10
        while not service.stats_snapshot().rejected.get("handshake_failed") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service.stats_snapshot().rejected.get("handshake_failed", 0) >= 1  # the plain peer, counted
    finally:
        plain.close(linger=0)
        good.close(linger=0)
        stop.set()
        thread.join(10)
        context.term()

# --- a real replay process: each worker under its own key ---------------------------------------------------


class ReplayProcess:
    """`async-rl replay --config FILE`, as a pod runs it; stopped with SIGTERM, its metrics line read after."""

    def __init__(self, config: Config, tmp_path: Path) -> None:
        self.config, self.log = config, tmp_path / "replay.log"
        path = tmp_path / "config.yaml"
        dump_config(config, path)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen([project_command(), "replay", "--config", str(path)], stdout=log,
                                            stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))

    def wait_listening(self) -> None:
        deadline = time.monotonic() + 60
        while "replay service listening" not in self.log.read_text():
            assert self.process.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.1)

    def stop(self) -> dict:
        """SIGTERM, then the replay's last metrics line."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=60) == 0, self.log.read_text()[-3000:]
        lines = (self.config.run_dir / "metrics" / "replay.jsonl").read_text().splitlines()
        return json.loads(lines[-1])


def _ask(sock: zmq.Socket, message, timeout_s: float = 20.0):
    send(sock, message)
    reply = _reply(sock, timeout_s)
    assert reply is not None, f"no reply to {message}"
    return reply


def test_a_worker_forging_an_outcome_for_another_workers_group_is_refused_and_counted(tmp_path, keys):
    """rollout-1's key holder tries to end, abandon and kill rollout-0's trajectories; the replay refuses each
    (`not_leaseholder`, `worker_not_key`), counts and logs it, and rollout-0's own outcome still counts."""
    config = make_config(tmp_path, keys)
    replay = ReplayProcess(config, tmp_path)
    context = zmq.Context()
    endpoint = config.replay.endpoint
    honest = connect_dealer(context, endpoint, "rollout-0", load_keys(config.security.curve_dir, "rollout-0"))
    forger = connect_dealer(context, endpoint, "rollout-1", load_keys(config.security.curve_dir, "rollout-1"))
    try:
        replay.wait_listening()
        grant = _ask(honest, LeaseRequest(worker_id="rollout-0", msg_id=1, session=1))
        assert isinstance(grant, LeaseGrant)
        group = grant.group_id

        def outcome(msg_id: int, worker_id: str, member: int = 0, **fields) -> Outcome:
            values = {"num_stages": 1, "outcome": 1.0, "success": True} | fields
            return Outcome(msg_id=msg_id, worker_id=worker_id, group_id=group, trajectory_id=f"{group}/{member}",
                           member=member, **values)

        for member in range(4):  # each trajectory's one stage, from its worker
            record = StageRecord(
                msg_id=20 + member, worker_id="rollout-0", group_id=group, trajectory_id=f"{group}/{member}",
                member=member, task_id="t0", stage_index=0, observation_tokens=pack([1, 2], TOKEN),
                action_tokens=pack([3], TOKEN), behaviour_logprobs=pack([-0.5], LOGPROB),
                policy_versions=pack([0], TOKEN), stage_reward=0.5, terminal=True)
            assert isinstance(_ask(honest, record), Ack)

        forged = {
            "its own worker id": outcome(2, "rollout-1"),
            "an abandonment": outcome(3, "rollout-1", member=1, outcome=None, abandoned=True, reason="forged"),
            "the leaseholder's worker id": outcome(4, "rollout-0", member=2),
            "a restart of the leaseholder": Heartbeat(worker_id="rollout-0", group_ids=[group], session=99),
            "a bad value": outcome(5, "rollout-1", member=3, outcome=float("nan")),
        }
        expected = {"its own worker id": "not_leaseholder", "an abandonment": "not_leaseholder",
                    "the leaseholder's worker id": "worker_not_key", "a restart of the leaseholder": "worker_not_key",
                    "a bad value": "nonfinite_outcome"}
        for what, message in forged.items():
            error = _ask(forger, message)
            assert isinstance(error, Error) and error.detail.startswith(expected[what]), (what, error)
        for member in range(4):  # the leaseholder's outcomes count: nothing of the forgeries was taken
            ack = _ask(honest, outcome(10 + member, "rollout-0", member=member))
            assert isinstance(ack, Ack) and not ack.duplicate, (member, ack)
    finally:
        honest.close(linger=0)
        forger.close(linger=0)
        context.term()
        line = replay.stop()
    assert line["rejected_not_leaseholder"] == 2 and line["rejected_worker_not_key"] == 2, line
    assert line["trajectories_finished"] == 4 and line["trajectories_abandoned"] == 0, line
    assert line["workers_restarted"] == 0 and line["groups_started"] == 1, line
    logged = replay.log.read_text()
    assert "not_leaseholder: outcome from worker 'rollout-1' for group" in logged, logged[-3000:]
    assert "worker_not_key: Outcome of worker 'rollout-0' sent with the key of 'rollout-1'" in logged


def test_a_rollout_key_claiming_the_learners_identity_cannot_take_its_connection(tmp_path, keys):
    """A connection's routing identity is bound to its key (security.routing_id): a worker's key that claims
    `learner-0` (as every connection was named before) gets a connection of its own, whose messages are refused
    (`identity_not_key`), and the learner's replies keep reaching the learner (no ZMQ_ROUTER_HANDOVER to it)."""
    config = make_config(tmp_path, keys)
    replay = ReplayProcess(config, tmp_path)
    context = zmq.Context()
    endpoint = config.replay.endpoint
    curve_dir = config.security.curve_dir
    learner_keys, rollout_keys = load_keys(curve_dir, "learner"), load_keys(curve_dir, "rollout-1")
    assert routing_id("learner-0", learner_keys) != routing_id("learner-0", rollout_keys)
    learner = connect_dealer(context, endpoint, "learner-0", learner_keys)
    takers = []
    try:
        replay.wait_listening()

        def ack(msg_id: int) -> BatchAck:  # a batch never served: answered on the sender's connection, harmlessly
            return BatchAck(learner_id="learner-0", msg_id=msg_id, batch_id=10**6 + msg_id, policy_version=0)

        assert isinstance(_ask(learner, ack(1)), Error)
        for claimed in (b"learner-0", routing_id("learner-0", rollout_keys)):  # the bare name; the name as it signs
            taker = _client_socket_with_identity(context, endpoint, claimed, rollout_keys)
            takers.append(taker)
            error = _ask(taker, LeaseRequest(worker_id="rollout-1", msg_id=1))
            assert isinstance(error, Error) and error.detail.startswith("identity_not_key"), error
            error = _ask(taker, ack(2))
            assert isinstance(error, Error) and error.detail.startswith("not_learner"), error
            for msg_id in range(10, 13):  # the learner's replies still come to the learner, and only to it
                reply = _ask(learner, ack(msg_id))
                assert isinstance(reply, Error) and reply.msg_id == msg_id and "not_in_flight" in reply.detail
                assert _reply(taker, 0.2) is None
    finally:
        for sock in [learner, *takers]:
            sock.close(linger=0)
        context.term()
        line = replay.stop()
    assert line["rejected_identity_not_key"] == 2 and line["rejected_not_learner"] == 2, line
    assert line["rejected_batch_not_in_flight"] == 7, line


def _client_socket_with_identity(context: zmq.Context, endpoint: str, identity: bytes, keys: CurveKeys) -> zmq.Socket:
    """A DEALER with a worker's key under a routing identity of the attacker's choosing."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.peers["replay"])
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(endpoint)
    return sock


@pytest.mark.parametrize("command", ["replay", "train"])
def test_tcp_without_keys_does_not_start_unless_the_config_says_insecure(tmp_path, command):
    """`async-rl replay` (a pod) and `async-rl train` (the launcher) on a tcp:// endpoint without
    security.curve_dir stop at once with a config error naming the fix; `security.insecure: true` starts."""
    config = make_config(tmp_path, None)
    path = tmp_path / "config.yaml"
    dump_config(config, path)
    refused = subprocess.run([project_command(), command, "--config", str(path)], capture_output=True, text=True,
                             timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert refused.returncode == (CONFIG_EXIT_CODE if command == "replay" else 2), refused.stderr[-2000:]
    assert "security.curve_dir: not set" in refused.stderr and "security.insecure=true" in refused.stderr
    port = int(config.replay.endpoint.rsplit(":", 1)[1])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # nothing was bound
    if command == "replay":
        insecure = config_from_dict({**config_to_dict(config), "security": {"curve_dir": None, "insecure": True}})
        replay = ReplayProcess(insecure, tmp_path)
        replay.wait_listening()
        assert "UNAUTHENTICATED (security.insecure)" in replay.log.read_text()
        replay.stop()


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
        engine = SGLangEngine(sglang_settings(urls=[url], api_key_file=str(key_file), unavailable_timeout_s=5))
        assert engine.version == 0 and set(server.seen) == {"Bearer s3cret"}
        engine.close()
        with pytest.raises(EngineUnavailable):  # no key: the server refuses every call
            SGLangEngine(sglang_settings(urls=[url], unavailable_timeout_s=0.3))
        assert None in server.seen
        monkeypatch.setenv("SGLANG_API_KEY", "s3cret")  # what the k8s pods get from the sglang-api-key Secret
        assert sglang_headers(None) == {"Authorization": "Bearer s3cret"}
        (tmp_path / "empty").write_text("\n")
        with pytest.raises(ConfigError, match="rollout.sglang.api_key_file: .* is empty"):
            sglang_headers(str(tmp_path / "empty"))
    finally:
        server.shutdown()
        server.server_close()


def test_the_admin_key_is_read_from_its_own_file_or_variable_and_never_from_the_api_keys(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_ADMIN_API_KEY", raising=False)
    monkeypatch.setenv("SGLANG_API_KEY", "worker")
    assert sglang_admin_headers(None) == {}  # the API key is no admin key: without one, the workers load disk
    monkeypatch.setenv("SGLANG_ADMIN_API_KEY", "learner")
    assert sglang_admin_headers(None) == {"Authorization": "Bearer learner"}
    (tmp_path / "admin").write_text("from-file\n")
    assert sglang_admin_headers(str(tmp_path / "admin")) == {"Authorization": "Bearer from-file"}
    (tmp_path / "empty").write_text("")
    with pytest.raises(ConfigError, match="rollout.sglang.admin_key_file: .* is empty"):
        sglang_admin_headers(str(tmp_path / "empty"))
