"""The roles' shared receive loop (async_rl/transport.py `Inbox`) over real sockets: a malformed frame and an
unexpected message are counted and logged, never raised, and the messages around them still arrive in order."""

from __future__ import annotations

import logging
import time

import zmq

from async_rl.protocol import Ack, Heartbeat
from async_rl.transport import Inbox, bind_router, connect_dealer, poll, receive, send


def test_an_inbox_skips_and_counts_a_malformed_frame_and_an_unexpected_message(tmp_path, caplog):
    context = zmq.Context()
    endpoint = f"ipc://{tmp_path}/inbox"
    router = bind_router(context, endpoint)
    dealer = connect_dealer(context, endpoint, "rollout-0")
    try:
        send(dealer, Heartbeat(worker_id="rollout-0"))  # so the router learns the dealer's identity
        assert poll(router, 10.0)
        identity, _ = receive(router)
        send(router, Ack(msg_id=1), identity)
        router.send_multipart([identity, b"\x93not a message"])
        send(router, Heartbeat(worker_id="not for a worker"), identity)
        send(router, Ack(msg_id=2), identity)
        inbox = Inbox(dealer, "replay", logging.getLogger("test.inbox"))
        got = []
        deadline = time.monotonic() + 10.0
        while len(got) < 3 and time.monotonic() < deadline:
            for message in inbox.messages(0.5):
                if isinstance(message, Ack):
                    got.append(message.msg_id)
                else:
                    inbox.unexpected(message)
                    got.append(type(message).__name__)
        assert got == [1, "Heartbeat", 2]
        assert inbox.bad == 2
        assert "malformed message from replay" in caplog.text and "unexpected Heartbeat from replay" in caplog.text
        assert inbox.next(0.05) is None  # nothing left: no wait past the timeout, no exception
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
        context.term()
