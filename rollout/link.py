"""The worker's side of the DEALER -> ROUTER conversation with the replay service.

At-least-once delivery: every StageRecord and Outcome is kept until its `Ack` arrives and resent, with the same
msg_id, after `ack_timeout_s`; the replay service dedupes by msg_id. Heartbeats keep the worker's leases alive.
Replies echo the msg_id of the message they answer.

The resend timers run on a clock that advances only while replies can be read: a gap between two reads longer
than `READ_GAP_S` (the owner was busy: a long evaluation step, a weight load, a stalled machine) counts as
`READ_GAP_S`, so a record is resent only when its ack had time to arrive and did not, never because nobody looked.
A rejection is logged at most once a minute per reason, with a count; `rejected` counts them by code.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import zmq

from async_rl.protocol import (
    Ack,
    Acks,
    Error,
    Heartbeat,
    LeaseDenied,
    LeaseGrant,
    LeaseRequest,
    Message,
    Outcome,
    StageRecord,
)
from async_rl.ratelimit import RateLimitedLog
from async_rl.transport import Inbox, send
from rollout.ack_journal import AckJournal

log = logging.getLogger("async_rl.rollout")

READ_GAP_S = 0.5  # the most one gap between two reads of the socket adds to the resend clock
REJECT_LOG_EVERY_S = 60.0

LeaseReply = LeaseGrant | LeaseDenied


@dataclass
class _Unacked:
    message: StageRecord | Outcome
    sent_at: float


class ReplayLink:
    def __init__(self, socket: zmq.Socket, worker_id: str, ack_timeout_s: float, heartbeat_s: float,
                 journal: AckJournal | None = None) -> None:
        self.socket = socket
        self.journal = journal  # what was sent and acked, journalled first (rollout/ack_journal.py)
        self.socket.setsockopt(zmq.SNDTIMEO, 0)  # never block on a full queue: an unsent record is resent later
        self.worker_id = worker_id
        self.ack_timeout_s = ack_timeout_s
        self.heartbeat_s = heartbeat_s
        # msg_ids start at the wall clock in microseconds so a restarted worker never reuses an id replay has seen.
        self._next_msg_id = time.time_ns() // 1000
        self.session = time.time_ns()  # this process: a restarted worker's old leases are abandoned at once
        self.unacked: dict[int, _Unacked] = {}
        self.lease_request: LeaseRequest | None = None  # awaiting its LeaseGrant / LeaseDenied
        self._answered_lease = -1  # msg_id of the last lease request answered: a second reply to it is a resend's
        self._lease_sent_at = 0.0
        self._heartbeat_at = 0.0
        self._read_clock = 0.0  # seconds during which replies could be read (the resend timers' clock)
        self._last_read = time.monotonic()
        self.resends = 0
        self.inbox = Inbox(socket, "replay", log)  # its `bad`: malformed or unexpected replies
        self.duplicate_lease_replies = 0
        self.duplicate_acks = 0  # acks saying the replay already had the record (a resend it had stored)
        self.rejected: Counter[str] = Counter()  # Error replies by code
        self._reject_log = RateLimitedLog(log, REJECT_LOG_EVERY_S)

    def next_msg_id(self) -> int:
        self._next_msg_id += 1
        return self._next_msg_id

    def send_reliably(self, message: StageRecord | Outcome) -> None:
        if self.journal is not None:
            self.journal.sent(message)
        self.unacked[message.msg_id] = _Unacked(message, self._read_clock)
        self._send(message)

    def request_lease(self) -> None:
        self.lease_request = LeaseRequest(worker_id=self.worker_id, msg_id=self.next_msg_id(), session=self.session)
        self._lease_sent_at = self._read_clock
        self._send(self.lease_request)

    def _advance_read_clock(self, reading: bool) -> None:
        """`reading`: the time since the last call was spent reading (all of it counts); else at most READ_GAP_S."""
        now = time.monotonic()
        elapsed = now - self._last_read
        self._read_clock += elapsed if reading else min(elapsed, READ_GAP_S)
        self._last_read = now

    def handle_replies(self, timeout_s: float) -> list[LeaseReply]:
        """Handle every reply waiting (up to `timeout_s` for the first); return the answers to our lease request."""
        replies: list[LeaseReply] = []
        self._advance_read_clock(reading=False)
        for reply in self.inbox.messages(timeout_s):
            if isinstance(reply, Ack):
                self._acked([reply.msg_id])
                self.duplicate_acks += reply.duplicate
            elif isinstance(reply, Acks):  # a round's acks in one message
                self._acked(reply.msg_ids)
                self.duplicate_acks += len(reply.duplicates)
            elif isinstance(reply, LeaseGrant | LeaseDenied):
                if self.lease_request is not None and reply.msg_id == self.lease_request.msg_id:
                    self.lease_request = None
                    self._answered_lease = reply.msg_id
                    replies.append(reply)
                elif reply.msg_id == self._answered_lease:  # the answer to a resend of a request already answered
                    self.duplicate_lease_replies += 1  # (the replay grants a resent request its first group again)
                else:
                    log.warning("ignoring a lease reply to no open request (msg_id %d): %s", reply.msg_id, reply)
            elif isinstance(reply, Error):
                self._rejected(reply)
            else:
                self.inbox.unexpected(reply)
        self._advance_read_clock(reading=True)
        return replies

    def _acked(self, msg_ids: list[int]) -> None:
        """Off the resend list; the first ack of each journalled, their lines in one write."""
        entries = [self.unacked.pop(msg_id, None) for msg_id in msg_ids]
        if self.journal is not None:
            self.journal.acked(*(entry.message for entry in entries if entry is not None))

    def tick(self, group_ids: list[str]) -> None:
        """Resend what is overdue for an ack (or a lease reply) on the read clock; send a heartbeat when due."""
        clock, now = self._read_clock, time.monotonic()
        for entry in self.unacked.values():
            if clock - entry.sent_at >= self.ack_timeout_s:
                entry.sent_at = clock
                self.resends += 1
                self._send(entry.message)
        if self.lease_request is not None and clock - self._lease_sent_at >= self.ack_timeout_s:
            self._lease_sent_at = clock
            self._send(self.lease_request)
        if now >= self._heartbeat_at:
            self._heartbeat_at = now + self.heartbeat_s
            self._send(Heartbeat(worker_id=self.worker_id, group_ids=group_ids, session=self.session))

    def _rejected(self, error: Error) -> None:
        """Replay refused a message: resending the same bytes cannot help, so stop resending it."""
        self.rejected[error.code] += 1
        self._reject_log(error.code, logging.ERROR, "replay rejected msg_id %d (%s): %s", error.msg_id, error.code,
                         error.detail)
        self.unacked.pop(error.msg_id, None)
        if self.lease_request is not None and error.msg_id == self.lease_request.msg_id:
            self.lease_request = None  # the worker asks again with a fresh request

    def _send(self, message: Message) -> None:
        try:
            send(self.socket, message)
        except zmq.Again:
            log.warning("replay is not taking messages; %s will be resent", type(message).__name__)
