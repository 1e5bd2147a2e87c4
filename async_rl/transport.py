"""ZeroMQ plumbing: open the few socket kinds the system uses and move protocol messages over them.

Sockets are opened here and closed by their owner (`with` or `.close(linger=0)`); nothing else in the project
touches raw frames. A frame that does not decode raises `ProtocolError` carrying the sender's identity, so a
service can count it, answer `Error`, and carry on.

With `curve` keys (async_rl/security.py) every socket speaks CurveZMQ: a binding socket is a CURVE server whose
ZAP handler admits only the public keys of its allowed clients (and stops with the socket), and counts the
handshakes it refused; a connecting socket is a CURVE client of the server role's public key, and a DEALER's
routing identity is bound to its secret key (`security.routing_id`). A tcp:// endpoint without keys is refused
here, whoever opens the socket, unless the caller passes `insecure=True` (security.insecure: true;
`security.check_socket`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import zmq
import zmq.utils.monitor

from async_rl.errors import ProtocolError
from async_rl.protocol import AnyMessage, Message, decode, encode
from async_rl.security import ZAP_DOMAIN, CurveKeys, check_socket, routing_id, start_authenticator

# Handshake failures a CURVE server counts, by the reason it reports (ReplayStats.rejected for the replay).
HANDSHAKE_EVENTS = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake_refused_key",  # ZAP said no: a key not in security.curve_dir
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_failed",  # no CURVE (plain peer) or the wrong server key
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed",
}


class BadFrame(ProtocolError):
    def __init__(self, detail: str, identity: bytes | None) -> None:
        super().__init__(detail)
        self.identity = identity


def bind_address(endpoint: str) -> str:
    """Where the owner of an endpoint binds: peers connect to `tcp://replay-service:5555`, the replay pod binds
    `tcp://*:5555`. Loopback and ipc:// endpoints bind as written."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        if host not in ("127.0.0.1", "localhost", "*", "0.0.0.0", "[::1]"):
            return f"tcp://*:{port}"
    return endpoint


class CurveServerSocket(zmq.Socket):
    """A binding socket with CURVE on: it owns the context's ZAP handler and a monitor of refused handshakes."""

    _authenticator = None
    _monitor = None

    def refused_handshakes(self) -> list[str]:
        """The handshakes refused since the last call, each by reason (HANDSHAKE_EVENTS); never blocks."""
        reasons: list[str] = []
        while self._monitor is not None and self._monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self._monitor)["event"]
            if event in HANDSHAKE_EVENTS:
                reasons.append(HANDSHAKE_EVENTS[event])
        return reasons

    def close(self, linger: int | None = None) -> None:
        if self._monitor is not None:
            self.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        super().close(linger)
        if self._authenticator is not None:
            _release_authenticator(self.context)
            self._authenticator = None


_authenticators: dict[int, list] = {}  # id(context) -> [authenticator, sockets using it]
_authenticators_lock = threading.Lock()


def _acquire_authenticator(context: zmq.Context, keys: CurveKeys):
    """One ZAP handler per context (ZeroMQ allows one), shared by the CURVE servers bound in it."""
    with _authenticators_lock:
        entry = _authenticators.get(id(context))
        if entry is None:
            entry = _authenticators[id(context)] = [start_authenticator(context, keys), 0]
        entry[1] += 1
        return entry[0]


def _release_authenticator(context: zmq.Context) -> None:
    with _authenticators_lock:
        entry = _authenticators[id(context)]
        entry[1] -= 1
        if entry[1] == 0:
            del _authenticators[id(context)]
            entry[0].stop()


def _server_socket(context: zmq.Context, kind: int, curve: CurveKeys | None) -> zmq.Socket:
    if curve is None:
        return context.socket(kind)
    socket = context.socket(kind, socket_class=CurveServerSocket)
    socket._authenticator = _acquire_authenticator(context, curve)
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
    socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    socket._monitor = socket.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    return socket


def _client_socket(context: zmq.Context, kind: int, curve: CurveKeys | None, server_role: str) -> zmq.Socket:
    socket = context.socket(kind)
    if curve is not None:
        socket.setsockopt(zmq.CURVE_SERVERKEY, curve.peers[server_role])
        socket.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
        socket.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
    return socket


def bind_router(
    context: zmq.Context, endpoint: str, max_message_bytes: int | None = None, curve: CurveKeys | None = None,
    *, insecure: bool = False,
) -> zmq.Socket:
    """A ROUTER bound at `endpoint`. With `max_message_bytes` (ZMQ_MAXMSGSIZE), a peer that sends a bigger frame
    is disconnected by ZeroMQ before the frame is buffered (a DEALER reconnects on its own). With `curve` (the
    replay's keys) it admits only the learner's and the workers' keys. A new connection under an identity in use
    takes it over (ZMQ_ROUTER_HANDOVER); with CURVE an identity is out of reach of every other key
    (`security.routing_id`), so only the same key's new connection can."""
    check_socket(endpoint, curve, insecure)
    socket = _server_socket(context, zmq.ROUTER, curve)
    socket.setsockopt(zmq.LINGER, 0)
    if max_message_bytes is not None:
        socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 0)  # replies to a vanished peer are dropped, never raise
    # A peer that connects under an identity already in use takes it over. Without it ZeroMQ keeps the first
    # connection and drops everything the new one sends: a learner or worker killed while its link was down leaves
    # a connection the replay still believes open (no FIN ever came), and its restarted process, under the same
    # identity, was never heard (benchmarks/chaos.py stalled on it: docs/results.md, "Chaos soak").
    socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
    socket.bind(bind_address(endpoint))
    return socket


def connect_dealer(context: zmq.Context, endpoint: str, identity: str, curve: CurveKeys | None = None,
                   *, insecure: bool = False) -> zmq.Socket:
    """A DEALER connected to the replay's ROUTER as `identity` (`learner-0`, `rollout-3`); with `curve` a CURVE client
    of the replay's key whose routing identity is `identity` bound to its secret key (`security.routing_id`)."""
    check_socket(endpoint, curve, insecure)
    socket = _client_socket(context, zmq.DEALER, curve, "replay")
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IDENTITY, routing_id(identity, curve))
    socket.connect(endpoint)
    return socket


def bind_publisher(context: zmq.Context, endpoint: str, curve: CurveKeys | None = None,
                   *, insecure: bool = False) -> zmq.Socket:
    """The learner's weight PUB (with `curve`, the learner's keys: only the workers' keys may subscribe)."""
    check_socket(endpoint, curve, insecure)
    socket = _server_socket(context, zmq.PUB, curve)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(bind_address(endpoint))
    return socket


def connect_subscriber(context: zmq.Context, endpoint: str, curve: CurveKeys | None = None,
                       *, insecure: bool = False) -> zmq.Socket:
    """A SUB of the learner's weight PUB (with `curve`, a worker's keys)."""
    check_socket(endpoint, curve, insecure)
    socket = _client_socket(context, zmq.SUB, curve, "learner")
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    return socket


def send(socket: zmq.Socket, message: Message, identity: bytes | None = None) -> None:
    """Send one message; on a ROUTER pass the peer's identity."""
    payload = encode(message)
    if identity is None:
        socket.send(payload)
    else:
        socket.send_multipart([identity, payload])


def receive(socket: zmq.Socket) -> tuple[bytes | None, AnyMessage]:
    """Receive one message: (sender identity on a ROUTER else None, message). Raises BadFrame."""
    identity, message, _ = receive_from(socket)
    return identity, message


def receive_from(socket: zmq.Socket) -> tuple[bytes | None, AnyMessage, str | None]:
    """Like `receive`, plus the sender's authenticated identity on a CURVE server (the `User-Id` its ZAP handler
    set: "learner", "rollout-3"), else None."""
    if not isinstance(socket, CurveServerSocket):
        frames = socket.recv_multipart()
        peer = None
    else:
        parts = socket.recv_multipart(copy=False)
        user = parts[-1].get("User-Id")  # a string, set by our ZAP handler
        peer = None if user is None else str(user)
        frames = [part.bytes for part in parts]
    identity = frames[0] if socket.type == zmq.ROUTER else None
    body = frames[1:] if identity is not None else frames
    if len(body) != 1:
        raise BadFrame(f"expected one message frame, got {len(body)}", identity)
    try:
        return identity, decode(body[0]), peer
    except ProtocolError as exc:
        raise BadFrame(str(exc), identity) from None


def poll(socket: zmq.Socket, timeout_s: float) -> bool:
    return bool(socket.poll(int(timeout_s * 1000)))


class Inbox:
    """A client socket's receive loop, shared by the roles (the worker's replies and weights notices, the learner's
    replies): poll, receive, and count and log what is not a message for us instead of raising, since a role never
    crashes on a bad frame (`bad`: malformed frames and unexpected messages together)."""

    def __init__(self, socket: zmq.Socket, source: str, logger: logging.Logger) -> None:
        self.socket, self.source, self.log = socket, source, logger
        self.bad = 0

    def messages(self, timeout_s: float) -> Iterator[AnyMessage]:
        """Every message waiting, waiting up to `timeout_s` for the first; a malformed frame is counted and skipped."""
        while poll(self.socket, timeout_s):
            timeout_s = 0.0
            try:
                _, message = receive(self.socket)
            except BadFrame as exc:
                self.bad += 1
                self.log.warning("ignoring a malformed message from %s (%d so far): %s", self.source, self.bad, exc)
                continue
            yield message

    def next(self, timeout_s: float) -> AnyMessage | None:
        """One message within `timeout_s`, or None (none came, or what came was malformed)."""
        return next(self.messages(timeout_s), None)

    def unexpected(self, message: AnyMessage) -> None:
        """A well-formed message this receiver has no use for: counted and logged."""
        self.bad += 1
        self.log.warning("ignoring an unexpected %s from %s", type(message).__name__, self.source)
