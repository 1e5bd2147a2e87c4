"""Announce new policy versions: the weights through the run's transport, then `latest.json`, then a
`WeightsPublished` notice on PUB.

The transport is an `async_rl.weights` publisher chosen by `make_publisher`: a safetensors file for the built-in
engine, an HF directory or a broadcast into the servers for SGLang and vLLM (`rollout.sglang.weight_sync`,
`rollout.vllm.weight_sync`), a LoRA adapter directory for vLLM under `rollout.vllm.lora: adapter`; the notice and
latest.json carry its format, and every receiver picks its loader by it. The order matters: a worker that sees the
notice (or reads latest.json) always finds complete weights. PUB drops messages to subscribers that connect late
(ZeroMQ's slow joiner), so the latest notice is repeated while idle. A safetensors file and latest.json are written
atomically (a temporary renamed into place) but not fsynced: they hand the policy to the workers, and the durable
copy is the checkpoint (learner/checkpoint.py, fsynced), which a resumed learner publishes again first. A machine
crash may leave a newer file torn; its checksum (async_rl/weights/file.py) makes a worker refuse it and wait for
the next notice. Four fsyncs a version held the learner at ~20 versions a second (docs/results.md, "The quick
start"). A disk that refuses them (full) is an error naming the file, not the learner's end: latest.json keeps
naming the previous version, nothing is announced, and the next publish tries again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zmq

from async_rl.durable import write_atomically
from async_rl.errors import WeightsError
from async_rl.protocol import WeightsPublished
from async_rl.ratelimit import RateLimitedLog
from async_rl.security import CurveKeys
from async_rl.transport import CurveServerSocket, bind_publisher, send
from async_rl.weights.base import Publisher
from async_rl.weights.file import FilePublisher
from async_rl.weights.hf_dir import AdapterDirPublisher, HFDirPublisher
from learner.settings import PublisherSettings

log = logging.getLogger("async_rl.learner")

REPUBLISH_EVERY_S = 2.0
REFUSED_LOG_EVERY_S = 60.0


class WeightPublisher:
    """The learner's rank 0 announcing versions; `transport` writes them (default: safetensors files in
    `weights_dir`)."""

    def __init__(self, context: zmq.Context, endpoint: str, weights_dir: Path, keep: int,
                 curve: CurveKeys | None = None, transport: Publisher | None = None, *,
                 insecure: bool = False) -> None:
        self.weights_dir = weights_dir.resolve()
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.transport = transport if transport is not None else FilePublisher(self.weights_dir)
        self.latest: WeightsPublished | None = None
        # curve: only the rollout keys may subscribe
        self._socket = bind_publisher(context, endpoint, curve, insecure=insecure)
        self._last_sent = 0.0
        self.refused_handshakes = 0
        self._refused_log = RateLimitedLog(log, REFUSED_LOG_EVERY_S)

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> bool:
        """Write, record and announce version `version`; False (logged, naming the file) when the disk refused."""
        try:
            notice = self.transport.write(state_dict, version)
            self._record(notice)
        except (WeightsError, OSError) as exc:
            before = f"v{self.latest.version}" if self.latest is not None else "no version"
            log.error("weights v%d not published: %s; %s still names %s and nothing is announced (the next publish "
                      "tries again)", version, exc, self.weights_dir / "latest.json", before)
            return False
        self.transport.prune(self.keep)
        log.info("published weights v%d (%s)", version, notice.format)
        return True

    def _record(self, notice: WeightsPublished) -> None:
        """Point latest.json at the new weights (atomically: async_rl/durable.py), then announce them."""
        latest = self.weights_dir / "latest.json"
        try:
            write_atomically(latest, json.dumps({"version": notice.version, "path": notice.path,
                                                  "format": notice.format}), durable=False)
        except OSError as exc:
            raise WeightsError(f"{latest}: could not point it at v{notice.version}: {exc}") from None
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

    def close(self) -> None:
        self.transport.close()
        self._socket.close(linger=0)


@dataclass(frozen=True)
class ServerHeaders:
    """The HTTP headers of the learner's calls to the engine's servers: `api` with their API key (reads; async_rl/
    security.py `sglang_headers`, `vllm_headers`), `admin` with SGLang's admin key (`sglang_admin_headers`: its
    weight, pause and abort routes take that key alone; empty where the servers have none)."""

    api: dict[str, str] = field(default_factory=dict)
    admin: dict[str, str] = field(default_factory=dict)


def make_publisher(context: zmq.Context, settings: PublisherSettings, model_dir: Path, curve: CurveKeys | None,
                   server_headers: Callable[[], ServerHeaders] = ServerHeaders) -> WeightPublisher:
    """The publisher the learner's rank 0 uses: its transport by `rollout.engine` and that engine's `weight_sync`
    (`rollout.sglang.weight_sync`, `rollout.vllm.weight_sync`). `curve`: the learner's keys (None: CURVE off);
    `server_headers`: of the transport's calls to the engine's servers, asked for by the transports that make
    them. With SGLang's admin key, the learner loads `disk` versions into the servers itself (the workers' API key
    cannot: learner/sglang_disk.py)."""
    weights_dir = settings.weights_dir
    transport: Publisher = FilePublisher(weights_dir)
    if settings.engine == "sglang" and settings.sglang.weight_sync == "distributed":
        from learner.sglang_sync import DistributedWeightSync  # httpx and the servers' group: server users only

        headers = server_headers()
        transport = DistributedWeightSync(settings.sglang, headers.api, headers.admin)
    elif settings.engine == "sglang" and (headers := server_headers()).admin:
        from learner.sglang_disk import ServerDiskLoad

        transport = ServerDiskLoad(HFDirPublisher(weights_dir, model_dir), settings.sglang, headers.admin)
    elif settings.adapters is not None:  # vLLM servers load each version's LoRA adapters beside their base weights
        from learner.lora import adapter_config

        transport = AdapterDirPublisher(weights_dir, adapter_config(settings.adapters, str(model_dir)))
    elif settings.engine == "vllm" and settings.vllm.weight_sync == "distributed":
        from learner.vllm_sync import VLLMWeightSync

        transport = VLLMWeightSync(settings.vllm, server_headers().api)
    elif settings.engine in ("sglang", "vllm"):  # servers load an HF directory
        transport = HFDirPublisher(weights_dir, model_dir)
    return WeightPublisher(context, settings.publish_endpoint, weights_dir, settings.keep_weights, curve, transport,
                           insecure=settings.insecure)
