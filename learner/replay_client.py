"""The learner's side of the replay conversation: ask for a batch, wait for it, ack it after the optimizer step.

The replay service may hold a request until it has items, so a request is waited for in short slices (stop
signals stay responsive). It is sent again after the service rejected it with `Error`, and after
`learner.request_timeout_s` without an answer: a replay that restarted lost it, and would never answer. A re-sent
request has a new msg_id and replaces the parked one at the replay (one per learner identity); a `Batch` that
answers any request still open is taken, so a batch the replay served just before the re-send is trained, not
left to time out. A BatchAck is sent again until the replay answers it: the learner has trained the batch, and a
replay that lost the ack would serve its items again (benchmarks/chaos.py found this: docs/results.md, "Chaos
soak").
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable

import zmq

from async_rl.errors import AsyncRLError
from async_rl.protocol import Ack, Acks, Batch, BatchAck, BatchRequest, Error
from async_rl.ratelimit import RateLimitedLog
from async_rl.security import CurveKeys
from async_rl.transport import Inbox, connect_dealer, send
from learner.settings import RequestSettings

log = logging.getLogger("async_rl.learner")


class ResumeRefused(AsyncRLError):
    """The replay cannot roll back to this learner's checkpoint (docs/architecture.md, "Resume after a crash")."""

POLL_SLICE_S = 0.1
RETRY_AFTER_ERROR_S = 0.5
ACK_TIMEOUT_S = 5.0  # a BatchAck unanswered this long is sent again
ACK_GIVE_UP_S = 30.0  # ... until answered, or, once the learner is stopping, this long after the first
OPEN_REQUESTS = 8  # msg_ids of requests not yet answered that a Batch may still answer
RESEND_LOG_EVERY_S = 300.0  # a long wait for items re-sends every request_timeout_s: warn this often at most


class ReplayClient:
    def __init__(self, context: zmq.Context, endpoint: str, learner_id: str, request_timeout_s: float = 30.0,
                 curve: CurveKeys | None = None, *, insecure: bool = False) -> None:
        self.learner_id = learner_id
        self.request_timeout_s = request_timeout_s
        self.resent_requests = 0
        self.resent_acks = 0
        self._socket = connect_dealer(context, endpoint, learner_id, curve, insecure=insecure)
        self._inbox = Inbox(self._socket, "replay", log)
        self._msg_ids = itertools.count(1)
        self._open: deque[int] = deque(maxlen=OPEN_REQUESTS)
        self._acked_copies: deque[int] = deque(maxlen=OPEN_REQUESTS)  # of acks answered: late replies to the rest
        self._resend_log = RateLimitedLog(log, RESEND_LOG_EVERY_S)
        # This process (time-based, so a restarted learner's is larger): its first request tells the replay that a
        # learner (re)started; `checkpoint` is the version of the latest durable checkpoint, reported with every
        # request (docs/architecture.md, "Resume after a crash").
        self.session = time.time_ns()
        self.checkpoint = -1

    def next_batch(
        self, version: int, request: RequestSettings, should_stop: Callable[[], bool], while_idle: Callable[[], None],
    ) -> Batch | None:
        """The next batch to train at `version`, or None once `should_stop()` says so."""
        msg_id = self._request(version, request)
        sent_at = time.monotonic()
        while not should_stop():
            while_idle()
            reply = self._receive(POLL_SLICE_S)
            if isinstance(reply, Batch) and reply.msg_id in self._open:
                self._open.remove(reply.msg_id)
                return reply
            if isinstance(reply, Error) and reply.msg_id in self._open:
                self._open.remove(reply.msg_id)
                log.warning("replay rejected batch request %d (%s): %s", reply.msg_id, reply.code, reply.detail)
                if reply.detail.startswith(("bad_resume", "old_session")):
                    raise ResumeRefused(f"the replay refused this learner's resume: {reply.detail}")
                if reply.msg_id == msg_id:
                    time.sleep(RETRY_AFTER_ERROR_S)
                    msg_id, sent_at = self._request(version, request), time.monotonic()
            elif reply is not None and getattr(reply, "msg_id", None) in self._acked_copies:
                log.debug("a late reply to a copy of an ack already answered: %s", reply)
            elif reply is not None:
                log.warning("ignoring unexpected %s while waiting for batch request %d", type(reply).__name__, msg_id)
            elif time.monotonic() - sent_at >= self.request_timeout_s:
                self._log_resend(msg_id)
                msg_id, sent_at = self._request(version, request), time.monotonic()
        return None

    def ack(self, batch: Batch, version: int, trained: bool = True,
            should_stop: Callable[[], bool] = lambda: False, hopeless: Callable[[], bool] = lambda: False) -> bool:
        """Tell the replay the batch is trained (its credit is now `issued`), or with `trained=False` that its step
        was refused, and wait for its answer; True once acknowledged. Unanswered, the ack is sent again every
        ACK_TIMEOUT_S: a replay killed before it logged the ack (or held by a full disk, then killed) has the batch
        in flight still, and would requeue it after replay.batch_ack_timeout_s, and the learner would train its
        items twice. An Ack to any of the copies counts; an Error (e.g. batch_not_in_flight: an earlier copy was
        taken) ends it. Only a stop (`should_stop`) ends the wait unanswered, after ACK_GIVE_UP_S, or at once when
        no answer can come (`hopeless`: the launcher that started this learner, and its replay, are gone)."""
        sent: set[int] = set()
        started = time.monotonic()
        while True:
            msg_id = next(self._msg_ids)
            sent.add(msg_id)
            send(self._socket, BatchAck(learner_id=self.learner_id, msg_id=msg_id, batch_id=batch.batch_id,
                                        policy_version=version, trained=trained))
            answer = self._ack_answer(batch, sent, lambda: should_stop() and hopeless())
            if answer is not None:
                self._acked_copies.extend(sent)
                return answer
            if should_stop() and (hopeless() or time.monotonic() - started >= ACK_GIVE_UP_S):
                log.error("no Ack for batch %d after %.1f s, stopping%s: the replay may requeue it and its items be "
                          "trained again", batch.batch_id, time.monotonic() - started,
                          " (the launcher that started this learner is gone, its replay with it)" if hopeless() else "")
                return False
            self.resent_acks += 1
            log.warning("no Ack for batch %d within %.0f s: sending it again (%d so far)", batch.batch_id,
                        ACK_TIMEOUT_S, self.resent_acks)

    def _ack_answer(self, batch: Batch, sent: set[int], give_up: Callable[[], bool]) -> bool | None:
        """The replay's answer to the copies `sent` of a BatchAck within ACK_TIMEOUT_S (or until `give_up()`):
        True (Ack), False (Error), None (none)."""
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while time.monotonic() < deadline and not give_up():
            reply = self._receive(POLL_SLICE_S)
            if isinstance(reply, Ack) and reply.msg_id in sent:
                return True
            if isinstance(reply, Acks) and sent.intersection(reply.msg_ids):  # copies acked in one replay round
                return True
            if isinstance(reply, Error) and reply.msg_id in sent:
                log.warning("replay rejected ack of batch %d (%s): %s", batch.batch_id, reply.code, reply.detail)
                return False
            if reply is not None and getattr(reply, "msg_id", None) not in self._acked_copies:
                log.warning("ignoring unexpected %s while waiting for the ack of batch %d",
                            type(reply).__name__, batch.batch_id)
        return None

    def _request(self, version: int, request: RequestSettings) -> int:
        msg_id = next(self._msg_ids)
        send(self._socket, BatchRequest(
            learner_id=self.learner_id, msg_id=msg_id, policy_version=version, max_tokens=request.batch_tokens,
            min_items=request.min_batch_items, max_wait_s=request.batch_wait_s, session=self.session,
            checkpoint=min(self.checkpoint, version),
        ))
        self._open.append(msg_id)
        return msg_id

    def _log_resend(self, msg_id: int) -> None:
        self.resent_requests += 1
        self._resend_log("resend", logging.WARNING, "no batch for request %d after %.0f s: sending it again (a "
                         "restarted replay loses parked requests)", msg_id, self.request_timeout_s)

    def _receive(self, timeout_s: float) -> object | None:
        return self._inbox.next(timeout_s)

    @property
    def bad_messages(self) -> int:
        """Malformed frames from the replay so far."""
        return self._inbox.bad

    def close(self) -> None:
        self._socket.close(linger=0)
