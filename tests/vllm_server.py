"""Real vLLM servers for tests: the pool's server kind for vLLM (tests/sglang_server.py's Pool starts, stops and
resets them), loading weights and counting requests through vLLM's own routes."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import httpx
from sglang_server import SGLangServer, make_test_certificates


class VLLMServer(SGLangServer):
    START: ClassVar[str] = "start_vllm_server.py"
    NAME: ClassVar[str] = "vllm"
    ARGS: ClassVar[tuple[str, ...]] = ("--max-model-len", "512")  # rows long enough for an update to land in

    def load(self, model_path: Path, version: int, mode: str = "abort") -> None:
        """Load weights from an HF directory and label them `version`, the scheduler paused (`mode`) meanwhile."""
        with httpx.Client(timeout=60) as http:
            reload_weights(http, self.url, model_path, version, mode)

    def model_info(self) -> dict:
        return httpx.get(self.url + "/weight_info", timeout=10).json()


class VLLMLoraServer(VLLMServer):
    """A vLLM server that loads LoRA adapters (rank up to 8)."""

    ARGS: ClassVar[tuple[str, ...]] = ("--max-lora-rank", "8")  # (and 256 tokens, the script's default)

    def adapters(self) -> list[str]:
        """The LoRA adapters it has loaded, by name."""
        models = httpx.get(self.url + "/v1/models", timeout=10).json()["data"]
        return [model["id"] for model in models if model.get("parent")]


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


def tls_vllm_server(cert_dir: Path) -> type[VLLMServer]:
    """A `VLLMServer` class whose servers speak TLS with a certificate for 127.0.0.1 from a fresh test CA written to
    `cert_dir` (tests/sglang_server.py `make_test_certificates`); its `CA` is the file clients verify it with."""
    ca, tls = make_test_certificates(cert_dir)
    return type("TLSVLLMServer", (VLLMServer,), {"ARGS": (*VLLMServer.ARGS, "--", *tls), "CA": ca})
