"""The learner on a real NVIDIA GPU: bf16 weights and activations with fp32 master weights, NCCL, the GPU memory
metric, and `async-rl train` with its learner on the GPU; the built-in rollout engine there too (rollout.device).

These tests skip on a machine without CUDA (CI has none). On a GPU machine the rest of the learner's tests run
there too: tests/test_learner.py and tests/test_learner_scale.py build their engines with learner.device auto, so
they train on the GPU in fp32 (they compare runs to 1e-4, which bf16 cannot meet); the 2-rank ZeRO-3 test runs on
the GPU only where there are two. Run on an H200 on 2026-11-26 (docs/results.md, "gpu_learner").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rollout_helpers import model_dir_for
from safetensors.torch import load_file

from async_rl.loss import token_logprobs
from async_rl.model import load_model, load_weights
from async_rl.weights.file import save_weights
from learner.settings import LearnerSettings
from learner.step import train_on_items
from rollout.engines import SamplingParams
from rollout.engines.torch_engine import TorchEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learner_helpers import engine_for  # noqa: E402
from test_learner import LearnerRun, make_config  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)")
REPO = Path(__file__).resolve().parent.parent


def test_bf16_engine_keeps_fp32_master_weights_and_learns_what_fp32_learns(tmp_path):
    """The same items, three steps each: bf16 (precision auto on a GPU) against fp32 on the same GPU. The bf16
    engine's optimizer updates fp32 copies of bf16 weights, the losses agree to bf16's precision, and each weight
    tensor moves about as far in both."""
    results = {}
    for precision in ("auto", "fp32"):
        config = make_config(tmp_path / precision, learner={"precision": precision})
        items = LearnerRun(config).items
        engine, reference = engine_for(config)
        try:
            assert engine.device.type == "cuda"
            weights = {p.dtype for p in engine.module.parameters()}
            if precision == "auto":
                assert engine.bfloat16_enabled() and weights == {torch.bfloat16}
                master = [p for group in engine.optimizer.optimizer.param_groups for p in group["params"]]
                assert master and {p.dtype for p in master} == {torch.float32}
            else:
                assert not engine.bfloat16_enabled() and weights == {torch.float32}
            version, losses, settings = 0, [], LearnerSettings.from_config(config).step
            for _ in range(3):
                version, step = train_on_items(engine, reference, items, version, settings)
                losses += [loss for loss, _ in step]
            results[precision] = losses, {k: v.float().cpu() for k, v in engine.module.state_dict().items()}
        finally:
            engine.destroy()
    (bf16_losses, bf16_weights), (fp32_losses, fp32_weights) = results["auto"], results["fp32"]
    assert all(torch.isfinite(torch.tensor(bf16_losses)))
    # Measured on an H200: the first step 0.0433 vs 0.0450 (the forward's precision alone), then 1.173 vs 1.147 and
    # 0.653 vs 0.626 as the two runs' weights drift apart by bf16 rounding (4% at most).
    assert bf16_losses == pytest.approx(fp32_losses, rel=0.1, abs=5e-3)
    initial = load_model(model_dir_for(make_config(tmp_path / "auto"))).state_dict()
    for name, weight in fp32_weights.items():
        moved = float((weight - initial[name]).abs().max())
        assert float((bf16_weights[name] - initial[name]).abs().max()) == pytest.approx(moved, rel=0.5, abs=2e-3)


def test_a_bf16_learner_run_reports_its_gpu_memory_and_near_one_ratios_at_v0(tmp_path):
    """The whole learner (replay client, steps, publishing, checkpoints) on the GPU in bf16: each metrics line
    carries the GPU's peak memory, and the first step's IS ratio is 1 to bf16's precision (behaviour log-probs
    came from the same v0 weights in fp32 on the CPU: the mismatch is the precision's, ~1e-3)."""
    run = LearnerRun(make_config(tmp_path, learner={"precision": "auto"}), delay_s=0.3).start().finish()
    lines = run.metrics()
    assert [line["version"] for line in lines] == [1, 2, 3, 4]
    assert all(0 < line["gpu_peak_gib"] < 1 for line in lines)
    assert lines[0]["is_ratio_mean"] == pytest.approx(1.0, abs=5e-3)
    assert (run.run_dir / "checkpoints" / "latest").read_text().strip() == "v4"
    # Published in the training precision (half the bytes of fp32); a rollout engine's fp32 model loads them.
    path = run.run_dir / "weights" / "v4.safetensors"
    assert {t.dtype for t in load_file(str(path)).values()} == {torch.bfloat16}
    fresh, initial = load_model(model_dir_for(run.config)), load_model(model_dir_for(run.config))
    load_weights(fresh, path)
    assert {p.dtype for p in fresh.parameters()} == {torch.float32}
    assert any(not torch.equal(a, b) for a, b in zip(fresh.parameters(), initial.parameters(), strict=True))


def test_async_rl_train_with_its_learner_on_the_gpu(tmp_path):
    """`async-rl train` (the README's command form) with learner.device=cuda: replay, rollout worker (CPU) and a
    bf16 NCCL learner as separate processes; it trains, checkpoints and stops at its budget."""
    done = subprocess.run(
        [sys.executable, "-m", "launch.cli", "train", f"run.dir={tmp_path}", "run.name=gpu", "learner.device=cuda",
         "run.max_versions=60", "run.eval_samples_per_task=0", "wandb.mode=disabled"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["versions"] == 60 and summary["stop_reason"] == "max_versions"
    log = (tmp_path / "gpu" / "logs" / "learner.log").read_text()
    assert "cuda:0, bf16 (nccl)" in log
    lines = [json.loads(line) for line in (tmp_path / "gpu" / "metrics.jsonl").read_text().splitlines()
             if line.endswith("}")]
    learner = [line for line in lines if "gpu_peak_gib" in line]
    assert len(learner) >= 60 and all(line["gpu_peak_gib"] > 0 for line in learner)


def test_the_built_in_engine_on_the_gpu_samples_the_log_probs_the_cpu_recomputes(tmp_path):
    """rollout.device=cuda: TorchEngine on the GPU (fp32). Its behaviour log-probs equal a full-sequence
    recomputation on the CPU (what the learner's importance ratio relies on), and bf16 weights as a bf16 learner
    publishes them load into its fp32 model."""
    model_dir = model_dir_for(make_config(tmp_path))
    engine = TorchEngine(model_dir, seed=0, device="cuda")
    assert {p.device.type for p in engine.model.parameters()} == {"cuda"}
    prompts = [[5, 9, 3, 11], [7], [4, 12, 6]]
    generations = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    model = load_model(model_dir).eval()
    for prompt, generation in zip(prompts, generations, strict=True):
        tokens = torch.tensor([prompt + generation.token_ids])
        with torch.no_grad():
            expected = token_logprobs(model(tokens).logits, tokens, 1.0)[0, len(prompt) - 1 :]
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=1e-4, rtol=0)
    moved = {name: (value + 0.1).to(torch.bfloat16) for name, value in model.state_dict().items()}
    save_weights(moved, tmp_path / "v3.safetensors")
    engine.update_weights(3, str(tmp_path / "v3.safetensors"))
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    assert all(g.versions == [3] * 2 for g in engine.generate(prompts, SamplingParams(max_new_tokens=2)))


def test_async_rl_train_with_learner_and_rollout_on_the_gpu(tmp_path):
    """`async-rl train learner.device=cuda rollout.device=cuda`: the learner and two rollout workers share the GPU;
    the run trains and stops at its budget."""
    done = subprocess.run(
        [sys.executable, "-m", "launch.cli", "train", f"run.dir={tmp_path}", "run.name=gpu", "learner.device=cuda",
         "rollout.device=cuda", "rollout.workers=2", "run.max_versions=30", "run.eval_samples_per_task=0",
         "wandb.mode=disabled"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["versions"] == 30 and summary["env_steps"] > 0
    for worker in ("rollout-0", "rollout-1"):
        assert "built-in engine on cuda" in (tmp_path / "gpu" / "logs" / f"{worker}.log").read_text()
