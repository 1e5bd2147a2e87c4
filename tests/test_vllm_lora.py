"""LoRA adapters in REAL vLLM servers (`rollout.vllm.lora: adapter`): the learner's adapter directory, loaded by the
vLLM engine beside the unchanged base weights, gives the merged model's log-probs; rows run to their end on the
adapter they were sent with; a torn directory and a server that cannot load adapters are refused by name; a whole
`async-rl train` publishes adapters alone.

One server started with `--max-lora-rank 8` (tests/conftest.py `vllm_lora_pool`, about 25 s), beside test_vllm.py's
pool (one of whose servers plays the server without LoRA).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_sglang import LOGPROB_TOL, PROMPTS, flip_a_byte, max_logprob_diff
from test_vllm import engine_for, rows_sent, train_with_vllm_servers

from async_rl.errors import WeightsError
from async_rl.model import load_model
from async_rl.weights.hf_dir import write_adapter_dir
from learner.lora import adapter_config, adapter_state_dict, merged_state_dict, wrap
from learner.settings import LoraSettings
from rollout.engines import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.xdist_group("vllm")]

LORA = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj", "down_proj"))


@pytest.fixture
def lora_server(vllm_lora_pool):
    vllm_lora_pool.reset()
    return vllm_lora_pool


def adapter(model_dir: Path, seed: int, target: Path) -> tuple[Path, torch.nn.Module]:
    """A trained-looking adapter (B drawn, not zero) written as the learner publishes it, and the merged model the
    learner would sample from."""
    torch.manual_seed(seed)
    model = wrap(load_model(model_dir), LORA)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.3)
    path = write_adapter_dir(adapter_state_dict(model), adapter_config(LORA, str(model_dir)), target)
    merged = load_model(model_dir).eval()
    merged.load_state_dict(merged_state_dict(model))
    return path, merged


def test_an_adapter_loaded_into_vllm_samples_as_the_merged_model_and_old_ones_are_unloaded(lora_server, tmp_path):
    """Each adapter's rows sample from the learner's merged model (log-probs within LOGPROB_TOL, versions exact),
    the base weights never move, the engine keeps its last two adapters loaded, and unloads all at close."""
    server, model_dir = lora_server.servers[0], lora_server.model_dir
    engine = engine_for(lora_server.urls)
    models = {}
    for version in (1, 2, 3):
        path, models[version] = adapter(model_dir, version, tmp_path / "weights" / f"lora-v{version}")
        engine.update_weights(version, str(path), "lora-adapter")
        assert engine.version == version
        generations = engine.generate(PROMPTS, SamplingParams(max_new_tokens=30))
        assert all(g.versions == [version] * 30 for g in generations)
        assert max_logprob_diff(models[version], PROMPTS, generations, 1.0) < LOGPROB_TOL
        assert max_logprob_diff(load_model(model_dir).eval(), PROMPTS, generations, 1.0) > 0.05  # not the base's
    assert sorted(server.adapters()) == [f"{engine.name}-2-v2", f"{engine.name}-3-v3"]  # v1 unloaded
    assert server.model_info()["weight_version"] == "0"  # the base weights never moved
    views = [p.name for p in (tmp_path / "weights").iterdir() if p.name.startswith(".sglang-load-")]
    assert len(views) == 2  # the kept adapters' views (the server may read them again); v1's removed
    # a learner resumed from its v2 checkpoint publishes v3 again, other weights under the same version: a new adapter
    path, again = adapter(model_dir, 33, tmp_path / "weights" / "lora-v3")
    engine.update_weights(3, str(path), "lora-adapter")
    generations = engine.generate(PROMPTS, SamplingParams(max_new_tokens=30))
    assert max_logprob_diff(again, PROMPTS, generations, 1.0) < LOGPROB_TOL
    assert sorted(server.adapters()) == [f"{engine.name}-3-v3", f"{engine.name}-4-v3"]
    engine.close()
    assert server.adapters() == [] and not any(p.name.startswith(".sglang-") for p in (tmp_path / "weights").iterdir())


def test_rows_in_flight_finish_on_their_adapter_and_new_rows_take_the_new_one(lora_server, tmp_path):
    """An adapter update needs no pause: a row already sent runs to its end on the adapter it named (every token
    carries that version, none is preempted), rows sent after it on the new one; each token's log-prob is its own
    version's merged model's. Another worker's engine on the same server stays on the base weights."""
    model_dir = lora_server.model_dir
    v1, model_1 = adapter(model_dir, 1, tmp_path / "lora-v1")
    v2, model_2 = adapter(model_dir, 2, tmp_path / "lora-v2")
    engine, other = engine_for(lora_server.urls), engine_for(lora_server.urls)
    engine.update_weights(1, str(v1), "lora-adapter")
    engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))  # a fresh server's first LoRA step takes ~2 s
    result = {}

    def generate() -> None:
        result["rows"] = engine.generate(PROMPTS * 8, SamplingParams(max_new_tokens=100))
        result["done"] = time.monotonic()

    generating = threading.Thread(target=generate)
    sent = rows_sent(engine)
    generating.start()
    assert sent.wait(30), "no row was sent in 30 s"
    engine.update_weights(2, str(v2), "lora-adapter")  # ~10 ms; the rows take about a second
    updated = time.monotonic()
    after = engine.generate(PROMPTS, SamplingParams(max_new_tokens=20))
    generating.join(120)
    rows = result["rows"]
    assert result["done"] > updated, "the rows had finished before the update: nothing was checked"
    assert engine.preemptions == 0 and engine.stages_retried == 0
    assert all(len(set(g.versions)) == 1 for g in rows), "a row changed adapter midway"
    assert any(g.versions[0] == 1 for g in rows)  # sent before the update (one sent after it would take v2)
    for version, model in ((1, model_1), (2, model_2)):
        mine = [index for index, g in enumerate(rows) if g.versions[0] == version]
        prompts = [(PROMPTS * 8)[index] for index in mine]
        assert max_logprob_diff(model, prompts, [rows[index] for index in mine], 1.0) < LOGPROB_TOL
    assert all(g.versions == [2] * 20 for g in after)
    assert max_logprob_diff(model_2, PROMPTS, after, 1.0) < LOGPROB_TOL
    assert other.version == 0
    base = other.generate(PROMPTS, SamplingParams(max_new_tokens=10))
    assert max_logprob_diff(load_model(model_dir).eval(), PROMPTS, base, 1.0) < LOGPROB_TOL
    engine.close()
    other.close()


def test_a_torn_adapter_is_refused_before_any_server_reads_it(lora_server, tmp_path):
    path, _ = adapter(lora_server.model_dir, 1, tmp_path / "weights" / "lora-v1")
    flip_a_byte(path / "adapter_model.safetensors")
    engine = engine_for(lora_server.urls)
    with pytest.raises(WeightsError, match="adapter_model.safetensors"):
        engine.update_weights(1, str(path), "lora-adapter")
    assert engine.version == 0 and engine.weights_refused == 1 and lora_server.servers[0].adapters() == []
    with pytest.raises(FileNotFoundError, match="pruned"):
        engine.update_weights(2, str(tmp_path / "weights" / "lora-v2"), "lora-adapter")
    engine.close()


def test_a_server_started_without_lora_is_refused_naming_the_fix(vllm_servers, tmp_path):
    path, _ = adapter(vllm_servers.model_dir, 1, tmp_path / "lora-v1")
    engine = engine_for(vllm_servers.urls[:1])
    with pytest.raises(RuntimeError, match="--max-lora-rank") as refused:
        engine.update_weights(1, str(path), "lora-adapter")
    assert "rollout.vllm.lora: merged" in str(refused.value)
    assert engine.version == 0
    engine.close()


def test_train_with_lora_adapters_loaded_by_vllm(lora_server, tmp_path):
    """`async-rl train rollout.engine=vllm learner.lora.rank=4`: the learner publishes each version's adapters alone
    (lora-v<N>/, no hf-v<N>/), both workers load them into the one server beside its unchanged base, and the run
    trains every version with the ledger balanced and nothing lost."""
    train_with_vllm_servers(lora_server, tmp_path, "learner.lora.rank=4", servers_at="0")
    run = tmp_path / "t"
    weights = sorted(p.name for p in (run / "weights").iterdir() if p.is_dir() and not p.name.startswith("."))
    assert weights and all(name.startswith("lora-v") for name in weights), weights
    logs = "".join((run / "logs" / f"rollout-{i}.log").read_text() for i in range(2))
    assert "policy version 12: LoRA adapter" in logs
    assert lora_server.servers[0].adapters() == []  # each worker unloaded its own at exit
    # `async-rl export RUN OUT` merges the latest adapters into the base: W + (alpha / r) B A, checked by hand here
    done = subprocess.run([sys.executable, "-m", "launch.cli", "export", str(run), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    exported = load_file(tmp_path / "out" / "model.safetensors")
    base = load_model(lora_server.model_dir).state_dict()
    latest = run / "weights" / weights[-1]
    config = json.loads((latest / "adapter_config.json").read_text())
    adapters = load_file(latest / "adapter_model.safetensors")
    changed = set()
    for key, a in adapters.items():
        if ".lora_A." in key:
            module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            b = adapters[key.replace(".lora_A.", ".lora_B.")]
            expected = base[f"{module}.weight"] + config["lora_alpha"] / config["r"] * (b @ a)
            torch.testing.assert_close(exported[f"{module}.weight"], expected, rtol=1e-5, atol=1e-6)
            changed.add(f"{module}.weight")
    assert changed and all(torch.equal(exported[k], v) for k, v in base.items() if k not in changed and k in exported)
