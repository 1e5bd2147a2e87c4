"""LoRA in the learner (learner.lora; learner/lora.py): the real DeepSpeed engine and real peft on the tiny model.

The learner's step against a plain peft computation of the project's loss, the merged weights it publishes, the KL
reference with the adapter off, resume, and the errors a bad learner.lora gets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import deepspeed
import pytest
import torch
from deepspeed.utils import safe_get_full_grad
from peft import LoraConfig, get_peft_model
from rollout_helpers import model_dir_for
from safetensors.torch import load_file

from async_rl.config import Config
from async_rl.config_load import config_from_dict, load_config
from async_rl.errors import ConfigError
from async_rl.loss import policy_loss, token_logprobs_and_entropy
from async_rl.model import load_model, load_weights
from async_rl.weights.file import save_weights
from learner import lora
from learner.attention import use_attention
from learner.batch import collate
from learner.engine import CheckpointError, full_state_dict, load_checkpoint, save_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learner_helpers import engine_for, train_on_batch  # noqa: E402
from test_learner import LearnerRun, Sequences  # noqa: E402
from test_learner import make_config as learner_config  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "gate_proj", "down_proj"]}


def make_config(tmp_path: Path, lora_options: dict | None = None, **sections: dict) -> Config:
    # no entropy bonus and one row per micro-batch, as test_learner's configs (the reference losses here have none)
    raw: dict = {"run": {"dir": str(tmp_path), "name": "lora", "seed": 0}, "wandb": {"mode": "disabled"},
                 "algo": {"entropy_coef": 0.0},
                 "learner": {"precision": "fp32", "device": "cpu", "pack_row_tokens": None,
                             "lora": {**LORA, **(lora_options or {})}}}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    config = config_from_dict(raw)
    model_dir_for(config)  # the tiny model of test_learner's items: same seed, sizes and environment
    return config


@pytest.fixture(scope="module")
def items(tmp_path_factory):
    config = learner_config(tmp_path_factory.mktemp("items"))
    return Sequences(config).items(config)


def gathered(engine) -> dict[str, torch.Tensor]:
    """The engine's parameters by name, whole at every ZeRO stage (gathered at ZeRO-3)."""
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
        return {n: p.detach().clone() for n, p in params}


def randomize_adapters(engine, seed: int = 1) -> dict[str, torch.Tensor]:
    """Give every adapter (B included, which peft starts at zero) seeded random values, in the module and in a ZeRO
    optimizer's fp32 master copy; returns them by name."""
    generator = torch.Generator().manual_seed(seed)
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    values = {}
    with torch.no_grad(), deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=0):
        for name, p in named:
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
            values[name] = p.detach().clone()
    if engine.zero_optimization_stage() > 0:
        engine.optimizer.refresh_fp32_params()
    return values


def hand_built_peft(config: Config, adapters: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The same adapters on a fresh copy of the base model, by plain peft (none of the learner's code)."""
    lora_cfg = config.learner.lora
    model = get_peft_model(load_model(model_dir_for(config)), LoraConfig(
        r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=0.0, target_modules=list(lora_cfg.target_modules),
        task_type="CAUSAL_LM"))
    with torch.no_grad():
        named = dict(model.named_parameters())
        assert {n for n, p in named.items() if p.requires_grad} == adapters.keys()
        for name, value in adapters.items():
            named[name].copy_(value)
    return model


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch.model_inputs()).logits


@pytest.mark.parametrize(("zero_stage", "checkpointing"), [(0, False), (1, False), (2, False), (3, False), (0, True)],
                         ids=["zero0", "zero1", "zero2", "zero3", "zero0-activation-checkpointing"])
def test_the_learners_lora_step_is_a_plain_peft_step_and_trains_only_the_adapters(tmp_path, items, zero_stage,
                                                                                  checkpointing):
    """One learner step (AdamW, no clipping) against plain peft and torch on the same batch: the same loss, the same
    adapter gradients (read from DeepSpeed between backward and step, where it gives them: ZeRO-0 and 1) and the
    same adapters after the step (every stage, and with activation checkpointing); the base weights do not move,
    the optimizer holds the adapters alone."""
    config = make_config(tmp_path, learner={"zero_stage": zero_stage, "grad_clip": 0.0, "lr": 1e-2,
                                            "activation_checkpointing": checkpointing, "precision": "fp32",
                                            "device": "cpu", "lora": LORA})
    batch = collate(items)
    engine, reference = engine_for(config)
    learner_grads: dict[str, torch.Tensor] = {}
    try:
        assert reference is None
        adapters = randomize_adapters(engine)
        assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        held = ([t for t in engine.optimizer.fp32_partitioned_groups_flat] if zero_stage == 3  # swapped in to step
                else [p for group in inner.param_groups for p in group["params"]])
        in_optimizer = sum(t.numel() for t in held)
        assert in_optimizer == sum(v.numel() for v in adapters.values()), "the adapters and nothing else"
        if zero_stage <= 1:
            step = engine.step

            def read_grads_then_step(*args, **kwargs):
                for name, p in engine.module.named_parameters():
                    if p.requires_grad:
                        learner_grads[name] = safe_get_full_grad(p).clone()
                return step(*args, **kwargs)

            engine.step = read_grads_then_step
        before = gathered(engine)
        version, results = train_on_batch(engine, None, batch, 0, config)
        assert version == 1 and len(results) == 1
        after = gathered(engine)
    finally:
        engine.destroy()
    for name, value in before.items():
        if name not in adapters:
            assert torch.equal(after[name], value), f"{name} is frozen"
    model = hand_built_peft(config, adapters)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.learner.lr,
                                  weight_decay=config.learner.weight_decay)
    out = model(**batch.model_inputs()).logits
    logp, _ = token_logprobs_and_entropy(out, batch.tokens, config.rollout.temperature)
    loss, _ = policy_loss(logp, batch.behaviour_logp, batch.advantages, batch.staleness(0), batch.loss_mask,
                          config.algo)
    loss.backward()
    assert results[0][0] == pytest.approx(float(loss.detach()), rel=1e-6, abs=1e-7)
    named = dict(model.named_parameters())
    assert any(named[n].grad.abs().max() > 1e-3 for n in adapters)
    for name, grad in learner_grads.items():
        torch.testing.assert_close(grad, named[name].grad, rtol=1e-4, atol=1e-7, msg=name)
    assert len(learner_grads) == (len(adapters) if zero_stage <= 1 else 0)
    optimizer.step()
    for name in adapters:
        # Adam's first step moves each weight by ~lr·sign(gradient): float noise in a gradient near 0 shows here
        torch.testing.assert_close(after[name], named[name].detach(), rtol=0, atol=1e-4, msg=name)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_published_weights_are_the_base_model_with_the_adapter_merged_and_the_model_is_untouched(
        tmp_path, items, zero_stage):
    config = make_config(tmp_path, learner={"zero_stage": zero_stage, "precision": "fp32", "device": "cpu",
                                            "lora": {**LORA, "dropout": 0.1}})
    batch = collate(items)
    engine, _ = engine_for(config)
    try:
        adapters = randomize_adapters(engine)
        merged = full_state_dict(engine)
        state = gathered(engine)
    finally:
        engine.destroy()
    base = load_model(model_dir_for(config))
    assert merged.keys() == base.state_dict().keys(), "the base model's key names, no adapter tensors"
    for name, value in adapters.items():
        assert torch.equal(state[name], value), "merging left the adapters as they were"
    untouched = {n.replace("base_model.model.", "").replace(".base_layer", ""): v for n, v in state.items()
                 if ".lora_" not in n}
    for name, value in base.state_dict().items():
        assert torch.equal(untouched[name], value), f"merging left the base weight {name} as it was"
    path = tmp_path / "v1.safetensors"
    save_weights(merged, path)  # what learner/publisher.py writes and the built-in engine loads (no peft)
    published = load_model(model_dir_for(config))
    load_weights(published, path)
    expected = logits(hand_built_peft(config, adapters).eval(), batch)
    assert not torch.allclose(logits(base, batch), expected, atol=1e-3), "the adapter changes the model"
    torch.testing.assert_close(logits(published, batch), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_published_adapters_are_a_peft_directory_that_peft_loads_as_the_trained_model(tmp_path, items, zero_stage):
    """`rollout.engine: vllm` with `rollout.vllm.lora: adapter` (the default): the learner's publisher writes each
    version's adapters alone as a PEFT adapter directory (lora-v<N>/, what vLLM's /v1/load_lora_adapter reads), and
    plain peft loading it onto the base model computes what the trained model does; old versions are pruned."""
    import zmq
    from peft import PeftModel
    from sglang_server import free_port

    from learner.publisher import make_publisher
    from learner.settings import LearnerSettings

    config = make_config(tmp_path, learner={"zero_stage": zero_stage, "keep_weights": 2,
                                            "publish_endpoint": f"tcp://127.0.0.1:{free_port()}"},
                         security={"insecure": True},
                         rollout={"engine": "vllm", "vllm": {"urls": ["http://127.0.0.1:1"]}})
    settings = LearnerSettings.from_config(config).publisher
    assert settings.adapters is not None
    batch = collate(items)
    engine, _ = engine_for(config)
    context = zmq.Context()
    publisher = make_publisher(context, settings, model_dir_for(config), None)
    try:
        adapters = randomize_adapters(engine)
        for version in (1, 2, 3):
            assert publisher.publish(full_state_dict(engine, adapters=True), version)
    finally:
        engine.destroy()
        publisher.close()
        context.term()
    weights = tmp_path / "lora" / "weights"
    assert sorted(p.name for p in weights.iterdir() if p.is_dir()) == ["lora-v2", "lora-v3"]
    assert json.loads((weights / "latest.json").read_text()) == {
        "version": 3, "path": str(weights / "lora-v3"), "format": "lora-adapter"}
    assert sorted(os.listdir(weights / "lora-v3")) == ["adapter_config.json", "adapter_model.safetensors",
                                                      "manifest.json"]
    loaded = PeftModel.from_pretrained(load_model(model_dir_for(config)), str(weights / "lora-v3")).eval()
    expected = logits(hand_built_peft(config, adapters).eval(), batch)
    assert not torch.allclose(logits(load_model(model_dir_for(config)), batch), expected, atol=1e-3)
    torch.testing.assert_close(logits(loaded, batch), expected, rtol=1e-5, atol=1e-5)


def test_adapters_on_vllm_with_a_distributed_sync_are_refused_naming_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="rollout.vllm.lora: merged"):
        make_config(tmp_path, rollout={"engine": "vllm", "vllm": {"urls": ["http://h:1"],
                                                                  "weight_sync": "distributed"}})
    config = make_config(tmp_path, rollout={"engine": "vllm", "vllm": {"urls": ["http://h:1"], "lora": "merged",
                                                                       "weight_sync": "distributed"}})
    from learner.settings import LearnerSettings

    assert LearnerSettings.from_config(config).publisher.adapters is None  # the merged weights are pushed


def test_the_kl_reference_is_the_base_model_with_the_adapter_off(tmp_path, items):
    config = make_config(tmp_path, algo={"kl_beta": 0.1})
    batch = collate(items)
    engine, reference = engine_for(config)
    try:
        assert isinstance(reference, lora.AdapterOff) and reference.model is engine.module, "no second copy"
        randomize_adapters(engine)
        base_model = load_model(model_dir_for(config))
        use_attention(base_model, engine.module.config._attn_implementation)  # the learner's kernel (bit-exact)
        base = logits(base_model, batch)
        torch.testing.assert_close(logits(reference, batch), base, rtol=0, atol=0)
        assert engine.module.training, "the engine is back in training mode"
        assert not torch.allclose(logits(engine.module, batch), base, atol=1e-3), "the adapter is on again"
        version, results = train_on_batch(engine, reference, batch, 0, config)
        assert version == 1 and results[0][1].kl > 0
    finally:
        engine.destroy()


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_a_resumed_lora_learner_continues_bit_identically(tmp_path, zero_stage):
    """4 versions, then a second learner in the same run dir resumes at v4 (adapters, their Adam state, the RNG that
    adapter dropout draws from) and its v6 is bit-identical to an uninterrupted run's. The checkpoint holds the
    adapters alone; a learner.lora of another rank refuses to resume from it."""
    options = {"checkpoint_every": 2, "keep_checkpoints": 1, "zero_stage": zero_stage,
               "lora": {**LORA, "dropout": 0.1}}
    algo = {"kl_beta": 0.05}

    def config(where: str, versions: int, **lora_options) -> Config:
        learner = {**options, "lora": {**options["lora"], **lora_options}}
        return learner_config(tmp_path / where, learner=learner, algo=algo, run={"max_versions": versions})

    first = LearnerRun(config("a", 4)).start().finish()
    saved = torch.load(next((first.run_dir / "checkpoints" / "v4").glob("*mp_rank_*_model_states.pt")),
                       weights_only=False)
    assert all(".lora_" in k for k in saved["module"]), "adapters only (ZeRO-3: in the optimizer's shards)"
    assert saved.get("frozen_param_fragments") is None, "no frozen base weights"
    resumed = LearnerRun(config("a", 6)).start().finish()
    assert resumed.replay.requests[0].policy_version == 4 and [a.policy_version for a in resumed.replay.acks] == [5, 6]
    straight = LearnerRun(config("b", 6)).start().finish()
    a, b = straight.run_dir / "weights" / "v6.safetensors", resumed.run_dir / "weights" / "v6.safetensors"
    fresh, again = load_file(str(a)), load_file(str(b))
    assert fresh.keys() == again.keys()
    for name, value in fresh.items():
        assert torch.equal(value, again[name]), name
    assert [line["loss"] for line in straight.metrics()] == [line["loss"] for line in resumed.metrics()]
    other = config("a", 8, rank=8)
    engine, _ = engine_for(other)
    try:
        with pytest.raises(CheckpointError, match=r"LoRA \{'rank': 4.*learner.lora asks for LoRA \{'rank': 8"):
            load_checkpoint(engine, first.run_dir / "checkpoints")
    finally:
        engine.destroy()


def test_a_full_fine_tune_checkpoint_is_not_resumed_under_lora(tmp_path):
    full = make_config(tmp_path, learner={"lora": {"rank": 0}})
    engine, _ = engine_for(full)
    try:
        save_checkpoint(engine, tmp_path / "ck", 1)
    finally:
        engine.destroy()
    engine, _ = engine_for(make_config(tmp_path))
    try:
        with pytest.raises(CheckpointError, match=r"written by a full fine-tune .* asks for LoRA"):
            load_checkpoint(engine, tmp_path / "ck")
    finally:
        engine.destroy()
    assert lora.signature(torch.nn.Linear(1, 1)) is None


@pytest.mark.parametrize(("override", "message"), [
    ("learner.lora.rank=-1", "learner.lora.rank: expected int >= 0, got -1"),
    ("learner.lora.dropout=1.0", "learner.lora.dropout: expected float >= 0.0 and < 1.0, got 1.0"),
    ("learner.lora.alpha=0", "learner.lora.alpha: expected float > 0.0, got 0"),
    ("learner.lora.rnak=4", "learner.lora.rnak: unknown key; did you mean learner.lora.rank?"),
    ("learner.lora.target_modules=[]", "learner.lora.target_modules: expected names of the model's linear layers"),
])
def test_a_bad_lora_config_is_named(override, message):
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["learner.lora.rank=4", override])
    assert str(caught.value).startswith(message)


def test_a_target_module_the_model_does_not_have_is_named_with_the_ones_it_has(tmp_path):
    with pytest.raises(ConfigError) as caught:
        engine_for(make_config(tmp_path, {"target_modules": ["q_proj", "qkv_proj"]}))
    assert str(caught.value) == (
        "learner.lora.target_modules: 'qkv_proj' matches no module of the model (its linear layers are named "
        "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj)")
    with pytest.raises(ConfigError, match=r"learner.lora.target_modules: 'embed_tokens' names Embedding modules"):
        engine_for(make_config(tmp_path, {"target_modules": ["embed_tokens"]}))


def test_lora_is_off_by_default_and_a_full_fine_tune_has_no_adapter(tmp_path):
    assert load_config(None, []).learner.lora.rank == 0
    engine, _ = engine_for(make_config(tmp_path, {"rank": 0}))
    try:
        assert not lora.is_adapted(engine.module)
        assert all(p.requires_grad for p in engine.module.parameters())
    finally:
        engine.destroy()


@pytest.mark.slow
def test_the_lora_benchmark_quick_form_measures_both_arms_on_the_same_batches():
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "lora.py"), "--quick"], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    full, adapted = result["full"], result["lora"]
    assert (full["lora_rank"], adapted["lora_rank"]) == (0, 16)
    assert full["trainable"] == full["parameters"] == result["parameters"]
    assert 0 < adapted["trainable"] < full["trainable"] and adapted["state_mib"] < full["state_mib"]
    assert len(full["steps_wall_s"]) == len(adapted["steps_wall_s"]) == 2
    assert result["ratios"]["state_mib"] == pytest.approx(adapted["state_mib"] / full["state_mib"])
    assert 0 < adapted["publish_adapter_mib"] < adapted["publish_merged_mib"]  # what vLLM loads vs every engine
    assert adapted["publish_adapter_s"] > 0 and adapted["publish_merged_s"] > 0
