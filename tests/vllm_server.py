"""Real vLLM servers for tests: the pool's server kind for vLLM (tests/sglang_server.py's Pool starts, stops and
resets them), loading weights and counting requests through vLLM's own routes."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import httpx
from sglang_server import SGLangServer


class VLLMServer(SGLangServer):
    START: ClassVar[str] = "start_vllm_server.py"
    NAME: ClassVar[str] = "vllm"

    def load(self, model_path: Path, version: int, mode: str = "abort") -> None:
        """Load weights from an HF directory and label them `version`, the scheduler paused (`mode`) meanwhile."""
        with httpx.Client(timeout=60) as http:
            reload_weights(http, self.url, model_path, version, mode)

    def model_info(self) -> dict:
        return httpx.get(self.url + "/weight_info", timeout=10).json()

    def requests_in_flight(self) -> int:
        """Requests the server is running or has queued (its Prometheus gauges)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))))


def reload_weights(http: httpx.Client, url: str, model_path: Path, version: int, mode: str = "abort") -> None:
    """One server at `url` loads an HF directory and labels it `version`, its scheduler paused (`mode`) meanwhile
    and always resumed: vLLM's routes, as rollout/engines/vllm.py calls them."""
    http.post(url + "/pause", params={"mode": mode}).raise_for_status()
    try:
        http.post(url + "/collective_rpc", json={"method": "reload_weights",
                                                 "kwargs": {"weights_path": str(model_path)}}).raise_for_status()
        http.post(url + "/update_weight_version", json={"new_version": str(version)}).raise_for_status()
    finally:
        http.post(url + "/resume").raise_for_status()
