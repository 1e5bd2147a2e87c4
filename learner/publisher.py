"""Announce new policy versions: weights file, then `latest.json`, then a `WeightsPublished` notice on PUB.

The order matters: a worker that sees the notice (or reads latest.json) always finds a complete file. PUB drops
messages to subscribers that connect late (ZeroMQ's slow joiner), so the latest notice is repeated while idle.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
import zmq

from async_rl.model import save_weights
from async_rl.protocol import WeightsPublished
from async_rl.ratelimit import RateLimitedLog
from async_rl.security import CurveKeys
from async_rl.transport import CurveServerSocket, bind_publisher, send

log = logging.getLogger("async_rl.learner")

REPUBLISH_EVERY_S = 2.0
REFUSED_LOG_EVERY_S = 60.0


class WeightPublisher:
    def __init__(self, context: zmq.Context, endpoint: str, weights_dir: Path, keep: int,
                 curve: CurveKeys | None = None) -> None:
        self.weights_dir = weights_dir.resolve()
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.latest: WeightsPublished | None = None
        self._socket = bind_publisher(context, endpoint, curve)  # curve: only the rollout key may subscribe
        self._last_sent = 0.0
        self.refused_handshakes = 0
        self._refused_log = RateLimitedLog(log, REFUSED_LOG_EVERY_S)

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        path = self.weights_dir / f"v{version}.safetensors"
        save_weights(state_dict, path)
        self._record(WeightsPublished(version=version, path=str(path)))
        self._prune()
        log.info("published weights v%d", version)

    def _record(self, notice: WeightsPublished) -> None:
        """Point latest.json at the new weights, then announce them."""
        latest = self.weights_dir / "latest.json"
        staging = latest.with_suffix(".json.tmp")
        staging.write_text(json.dumps({"version": notice.version, "path": notice.path}))
        os.replace(staging, latest)
        self.latest = notice
        self._announce()

    def republish_if_due(self) -> None:
        """Repeat the latest notice for subscribers that joined after it was first sent."""
        if isinstance(self._socket, CurveServerSocket):  # CURVE on: report subscribers without the rollout key
            refused = len(self._socket.refused_handshakes())
            self.refused_handshakes += refused
            if refused:
                self._refused_log("refused", logging.WARNING, "%d subscriber handshakes refused so far (no CURVE or "
                                  "not the rollout key)", self.refused_handshakes)
        if self.latest is not None and time.monotonic() - self._last_sent >= REPUBLISH_EVERY_S:
            self._announce()

    def _announce(self) -> None:
        send(self._socket, self.latest)
        self._last_sent = time.monotonic()

    def _prune(self) -> None:
        files = sorted(self.weights_dir.glob("v*.safetensors"), key=lambda p: int(p.stem[1:]))
        for old in files[: -self.keep]:
            old.unlink(missing_ok=True)

    def close(self) -> None:
        self._socket.close(linger=0)
