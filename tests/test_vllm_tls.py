"""A vLLM server over TLS (REAL server): the worker's engine verifies it with `rollout.vllm.ca_file`, generates and
loads a version from disk through it; without the CA it gets no server (docs/sglang.md#tls says the same for
SGLang, tests/test_sglang_keys.py)."""

from __future__ import annotations

import pytest
from rollout_helpers import vllm_settings

from async_rl.model import load_model
from async_rl.weights.hf_dir import write_hf_dir
from rollout.engines import EngineUnavailable, SamplingParams
from rollout.engines.vllm import VLLMEngine

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.xdist_group("vllm")]


def test_the_vllm_engine_verifies_the_server_generates_and_loads_a_version_over_tls(vllm_tls_pool, tmp_path):
    (server,) = vllm_tls_pool.servers
    assert server.url.startswith("https://")
    with pytest.raises(EngineUnavailable, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        VLLMEngine(vllm_settings(urls=[server.url], unavailable_timeout_s=1))
    engine = VLLMEngine(vllm_settings(urls=[server.url], request_timeout_s=30.0, ca_file=server.CA))
    try:
        assert engine.version == 0
        assert engine.generate([[1, 5, 6]], SamplingParams(max_new_tokens=2))[0].versions == [0, 0]
        path = write_hf_dir(load_model(vllm_tls_pool.model_dir).state_dict(), vllm_tls_pool.model_dir,
                            tmp_path / "hf-v1")
        engine.update_weights(1, str(path), "hf-dir")  # pause, reload, label, resume: all over TLS
        assert engine.version == 1
        assert engine.generate([[1, 5, 6]], SamplingParams(max_new_tokens=2))[0].versions == [1, 1]
    finally:
        engine.close()
