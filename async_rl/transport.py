"""ZeroMQ plumbing: open the few socket kinds the system uses and move protocol messages over them.

Sockets are opened here and closed by their owner (`with` or `.close(linger=0)`); nothing else in the project
touches raw frames. A frame that does not decode raises `ProtocolError` carrying the sender's identity, so a
service can count it, answer `Error`, and carry on.
"""

from __future__ import annotations

import zmq

from async_rl.errors import ProtocolError
from async_rl.protocol import AnyMessage, Message, decode, encode


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


def bind_router(context: zmq.Context, endpoint: str, max_message_bytes: int | None = None) -> zmq.Socket:
    """A ROUTER bound at `endpoint`. With `max_message_bytes` (ZMQ_MAXMSGSIZE), a peer that sends a bigger frame
    is disconnected by ZeroMQ before the frame is buffered (a DEALER reconnects on its own)."""
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    if max_message_bytes is not None:
        socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 0)  # replies to a vanished peer are dropped, never raise
    socket.bind(bind_address(endpoint))
    return socket


def connect_dealer(context: zmq.Context, endpoint: str, identity: str) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IDENTITY, identity.encode())
    socket.connect(endpoint)
    return socket


def bind_publisher(context: zmq.Context, endpoint: str) -> zmq.Socket:
    socket = context.socket(zmq.PUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(bind_address(endpoint))
    return socket


def connect_subscriber(context: zmq.Context, endpoint: str) -> zmq.Socket:
    socket = context.socket(zmq.SUB)
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
    frames = socket.recv_multipart()
    identity = frames[0] if socket.type == zmq.ROUTER else None
    body = frames[1:] if identity is not None else frames
    if len(body) != 1:
        raise BadFrame(f"expected one message frame, got {len(body)}", identity)
    try:
        return identity, decode(body[0])
    except ProtocolError as exc:
        raise BadFrame(str(exc), identity) from None


def poll(socket: zmq.Socket, timeout_s: float) -> bool:
    return bool(socket.poll(int(timeout_s * 1000)))
