"""The learner at scale: packed rows, token-budgeted micro-batches, balanced rank shards, device and precision.

The numerical tests run the tiny model of async_rl/model.py and the project's loss on seeded random items of mixed
lengths; the engine tests run real DeepSpeed engines. The 2-rank ZeRO-3 run under torchrun is in
tests/test_learner.py (test_two_ranks_at_zero3_under_torchrun_train_like_one_process).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from learner_helpers import activation_checkpointing_on, engine_for
from rollout_helpers import model_dir_for

from async_rl.config import Config
from async_rl.config_load import config_from_dict
from async_rl.errors import ConfigError
from async_rl.loss import policy_loss, token_logprobs_and_entropy
from async_rl.model import load_model
from async_rl.protocol import ADVANTAGE, LOGPROB, MASK, TOKEN, TrainItem, pack
from learner.attention import row_tokens, select_attention, use_attention
from learner.batch import collate, collate_rows
from learner.engine import (
    backend_for,
    deepspeed_config,
    enable_activation_checkpointing,
    local_gpu,
    select_device,
    select_precision,
)
from learner.pack import MicroBatch, balance_shards, pack_rows, padding_fraction, plan_shards
from learner.settings import LearnerSettings
from learner.step import rank_micro_batches, train_on_items

# This machine has no GPU: the device-selection tests pass torch's answer for one as a plain flag. That flag is
# the only stand-in here (a fake GPU), named as such; everything else is the real code.
FAKE_GPU_PRESENT = True


def make_config(tmp_path: Path, **sections: dict) -> Config:
    # fp32 wherever the engine runs (the CPU here, the GPU on a GPU machine): these tests compare layouts to 1e-5;
    # bf16 is tests/test_gpu.py's.
    raw: dict = {"run": {"dir": str(tmp_path), "name": "scale", "seed": 0}, "wandb": {"mode": "disabled"},
                 "algo": {"entropy_coef": 0.1}, "learner": {"precision": "fp32", "pack_row_tokens": None}}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return config_from_dict(raw)


def settings_of(config: Config) -> LearnerSettings:
    """The learner's settings, as its entry builds them."""
    return LearnerSettings.from_config(config)


def random_items(config: Config, count: int = 10, seed: int = 0) -> list[TrainItem]:
    """Items of 2..20 tokens from the tiny model's vocabulary, some action tokens masked in, mixed advantages."""
    rng = np.random.default_rng(seed)
    vocab = load_model(model_dir_for(config)).config.vocab_size
    items = []
    for n in range(count):
        length = int(rng.integers(2, 21))
        mask = (rng.random(length) < 0.5).astype(int)
        mask[0] = 0
        mask[-1] = 1
        correction = n % 3 == 0
        items.append(TrainItem(
            item_id=n, kind="correction" if correction else "immediate", group_id=f"g{n // 4}",
            trajectory_id=f"t{n}", tokens=pack(rng.integers(3, vocab, length).tolist(), TOKEN),
            loss_mask=pack(mask.tolist(), MASK), advantages=pack((rng.normal(size=length) * mask).tolist(), ADVANTAGE),
            behaviour_logprobs=pack((rng.uniform(-5, -1, length) * mask).tolist(), LOGPROB),
            policy_versions=pack([0] * length, TOKEN),
        ))
    return items


def loss_and_grads(model: torch.nn.Module, batch, config: Config, scale: float = 1.0):
    """The project's loss (TIS form + entropy bonus) on one tensor batch, backward into `model`'s .grad."""
    logits = model(**batch.model_inputs()).logits
    logp, entropy = token_logprobs_and_entropy(logits, batch.tokens, entropy=True)
    loss, _ = policy_loss(logp, batch.behaviour_logp, batch.advantages, batch.staleness(0), batch.loss_mask,
                          config.algo, entropy=entropy)
    (loss * scale).backward()
    return float(loss.detach()) * scale, logp


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    config = make_config(tmp_path_factory.mktemp("scale"))
    return config, random_items(config)


# learner.attention choices that run on this machine in fp32 (flash-attention has no fp32 kernel; FlexAttention
# has no backward on CPU).
ATTENTION_HERE = ["dense", "varlen"] + (["flex"] if torch.cuda.is_available() else [])


def model_attending(config: Config, attention: str) -> torch.nn.Module:
    model = load_model(model_dir_for(config))
    use_attention(model, select_attention(attention, "cuda" if attention == "flex" else "cpu", False))
    return model.to("cuda") if attention == "flex" else model


def on_model_device(batch, model: torch.nn.Module):  # noqa: ANN001, ANN201 - TrainBatch
    return batch.to(next(model.parameters()).device)


@pytest.mark.parametrize("attention", ATTENTION_HERE)
@pytest.mark.parametrize("entropy_per", ["step", "credit"])
def test_packed_and_padded_losses_and_gradients_match(setup, entropy_per, attention):
    """One packed row of all items (position ids, no attention mask) through each attention implementation that
    runs here against one right-padded row per item through sdpa (today's dense path); with the entropy bonus on
    every trained token (step) or weighted by each token's |advantage| (credit). The padded batch through the same
    implementation (its padding mask instead of position ids) gives the same too."""
    base, items = setup
    config = make_config(Path(base.run.dir), algo={"entropy_coef": 0.1, "entropy_per": entropy_per})
    padded, packed = load_model(model_dir_for(config)), model_attending(config, attention)
    padded_here = model_attending(config, attention)
    padded_batch = collate(items)
    packed_batch = collate_rows(items, [list(range(len(items)))], packed=True)
    assert packed_batch.tokens.shape == (1, sum(len(i.token_ids()) for i in items))
    loss_padded, logp_padded = loss_and_grads(padded, padded_batch, config)
    for model, batch in ((packed, packed_batch), (padded_here, padded_batch)):
        loss, logp = loss_and_grads(model, on_model_device(batch, model), config)
        assert loss == pytest.approx(loss_padded, rel=1e-5, abs=1e-6)
        # every trained token's log-prob is the same, so attention stayed within each sequence
        on_padded, on_here = padded_batch.loss_mask.bool(), batch.loss_mask.bool()
        assert int(on_padded.sum()) == int(on_here.sum()) > 0
        torch.testing.assert_close(logp.cpu()[on_here], logp_padded[on_padded], rtol=1e-5, atol=1e-5)
        g_padded, g_here = grads(padded), grads(model)
        assert g_padded.keys() == g_here.keys()
        for name, g in g_padded.items():
            torch.testing.assert_close(g_here[name].cpu(), g, rtol=1e-5, atol=1e-6, msg=name)


def test_attention_selection_and_its_errors():
    """auto: flash-attention's varlen kernel on a GPU that has flash_attn; else torch's sdpa per sequence for packed
    rows longer than 64 tokens, the dense mask for shorter or unpacked rows; choices that cannot run are named."""
    assert select_attention("auto", "cpu", flash_installed=True, row_tokens=4096) == "sdpa_varlen"
    assert select_attention("auto", "cuda", flash_installed=False, row_tokens=128) == "sdpa_varlen"
    assert select_attention("auto", "cpu", False, row_tokens=64) == "sdpa"
    assert select_attention("auto", "cpu", False, row_tokens=None) == "sdpa"
    assert select_attention("auto", "cuda", flash_installed=True, row_tokens=64) == "flash_attention_2"
    assert select_attention("auto", "cuda", flash_installed=True) == "flash_attention_2"
    assert select_attention("dense", "cpu", False, 4096) == "sdpa"
    assert select_attention("varlen", "cpu", False, 64) == "sdpa_varlen"
    assert select_attention("flex", "cuda", False) == "flex_attention"
    config = make_config(Path("/unused"))  # pack_row_tokens null here: a row is a micro-batch
    assert row_tokens(settings_of(config).engine.layout) == config.learner.micro_batch_tokens == 4096
    assert row_tokens(settings_of(make_config(Path("/unused"), learner={"pack_row_tokens": 64})).engine.layout) == 64
    assert row_tokens(settings_of(make_config(Path("/unused"), learner={"packing": False})).engine.layout) is None
    with pytest.raises(ConfigError, match="learner.attention: flex needs a GPU"):
        select_attention("flex", "cpu", False)
    with pytest.raises(ConfigError, match="learner.attention: flash needs the flash_attn package"):
        select_attention("flash", "cuda", False)
    with pytest.raises(ConfigError, match="learner.attention"):
        make_config(Path("/unused"), learner={"attention": "eager"})


@pytest.mark.parametrize("aggregation,entropy_per", [("token-mean", "step"), ("seq-mean-token-sum", "step"),
                                                     ("token-sum", "step"), ("token-sum", "credit")])
@pytest.mark.parametrize("packing", [True, False])
def test_micro_batches_over_ranks_accumulate_the_whole_batch_gradient(setup, aggregation, entropy_per, packing):
    """Two ranks' micro-batches (32-token budget), scaled and summed, then averaged over ranks as DeepSpeed does,
    give the whole padded batch's loss and gradient, with the entropy bonus on every token or weighted by credit."""
    base, items = setup
    config = make_config(Path(base.run.dir), algo={"entropy_coef": 0.1, "aggregation": aggregation,
                                                   "entropy_per": entropy_per},
                         learner={"micro_batch_tokens": 32, "packing": packing})
    whole, parts = load_model(model_dir_for(config)), load_model(model_dir_for(config))
    expected, _ = loss_and_grads(whole, collate(items), config)
    world, total, micro_counts = 2, 0.0, []
    for rank in range(world):
        micro = rank_micro_batches(items, rank, world, settings_of(config).step)
        micro_counts.append(len(micro))
        for batch, scale in micro:
            assert batch.tokens.numel() <= 32 or len(batch) == 1
            loss, _ = loss_and_grads(parts, batch, config, scale / world)
            total += loss
    assert micro_counts[0] == micro_counts[1] > 1
    assert total == pytest.approx(expected, rel=1e-5, abs=1e-6)
    for name, g in grads(whole).items():
        torch.testing.assert_close(grads(parts)[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_shards_are_balanced_by_tokens_and_cover_every_item_once():
    lengths = [10, 9, 8, 1, 1, 1, 30, 2]
    shares = balance_shards(lengths, 2)
    assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
    assert [sum(lengths[i] for i in share) for share in shares] == [31, 31]  # items[rank::2]: 49 vs 13
    assert balance_shards([5], 3) == [[0], [], []]


def test_rows_are_packed_first_fit_decreasing_and_micro_batches_keep_the_budget():
    lengths = [7, 5, 3, 3, 2, 12]
    rows = pack_rows(list(range(6)), lengths, row_tokens=8)
    assert rows == [[5], [0], [1, 2], [3, 4]]  # the 12-token item alone: longer than a row
    plans = plan_shards(lengths, 1, micro_batch_tokens=16, packing=True, pack_row_tokens=8)
    assert [m.rows for m in plans[0]] == [((5,),), ((1, 2), (0,)), ((3, 4),)]  # rows longest first
    for micro in plans[0]:
        rows_, width = micro.shape(lengths)
        assert rows_ * width <= 16 or rows_ == 1
    # 32 real tokens in 12 + 2 x 8 + 5 slots
    assert padding_fraction(plans, lengths) == pytest.approx(1 - 32 / (12 + 2 * 8 + 5))


def test_ranks_with_fewer_micro_batches_get_masked_fillers():
    lengths = [20, 2, 2]
    plans = plan_shards(lengths, 2, micro_batch_tokens=4, packing=True)
    assert [len(plan) for plan in plans] == [1, 1]
    plans = plan_shards(lengths, 3, micro_batch_tokens=2, packing=False)
    assert [len(plan) for plan in plans] == [1, 1, 1]
    plans = plan_shards([20, 20, 2], 2, micro_batch_tokens=20, packing=False)
    assert plans[0] == [MicroBatch(rows=((0,),)), MicroBatch(rows=((2,),))]
    assert plans[1] == [MicroBatch(rows=((1,),)), MicroBatch(rows=((2,),), filler=True)]  # the shortest item, masked


def test_device_precision_and_backend_selection():
    learner = settings_of(make_config(Path("/unused"), learner={"precision": "auto"})).engine
    assert select_device(learner, cuda_available=False) == "cpu"
    assert select_device(learner, cuda_available=FAKE_GPU_PRESENT) == "cuda"
    assert select_precision(learner, "cuda", bf16_supported=True) == "bf16"
    assert select_precision(learner, "cuda", bf16_supported=False) == "fp32"
    assert select_precision(learner, "cpu", bf16_supported=False) == "fp32"
    assert (backend_for("cuda"), backend_for("cpu")) == ("nccl", "gloo")
    pinned = settings_of(make_config(Path("/unused"), learner={"device": "cpu", "precision": "fp32"})).engine
    assert select_device(pinned, cuda_available=FAKE_GPU_PRESENT) == "cpu"
    assert select_precision(pinned, "cuda", bf16_supported=True) == "fp32"
    with pytest.raises(ConfigError, match="learner.device: cuda"):
        select_device(settings_of(make_config(Path("/unused"), learner={"device": "cuda"})).engine, False)
    with pytest.raises(ConfigError, match="learner.precision: bf16 needs a CUDA device"):
        select_precision(settings_of(make_config(Path("/unused"), learner={"precision": "bf16"})).engine, "cpu", False)


def test_each_rank_takes_its_own_gpu_and_a_rank_without_one_is_named():
    assert [local_gpu(rank, device_count=8) for rank in range(8)] == list(range(8))
    with pytest.raises(ConfigError, match="LOCAL_RANK is 1 and torch sees 1 GPU") as raised:
        local_gpu(1, device_count=1)  # two ranks on a one-GPU node (the 2-rank test on an H100 did this)
    assert "--nproc_per_node" in str(raised.value) and "learner.device=cpu" in str(raised.value)


def test_activation_checkpointing_is_enabled_under_either_name_transformers_gives_it(tmp_path):
    """transformers 5.24 has activation_checkpointing_enable; 5.17 (the H200 image's) has only
    gradient_checkpointing_enable, and build_engine called the former there. The stand-in is a module with the
    older release's method alone (no such release is installed here)."""
    class OlderRelease(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
            self.kwargs = gradient_checkpointing_kwargs
            self.layer.gradient_checkpointing = True

    older = OlderRelease()
    assert not activation_checkpointing_on(older)
    enable_activation_checkpointing(older)
    assert activation_checkpointing_on(older) and older.kwargs == {"use_reentrant": False}
    current = load_model(model_dir_for(make_config(tmp_path)))
    enable_activation_checkpointing(current)
    assert activation_checkpointing_on(current)


def test_deepspeed_config_for_bf16_and_caller_owned_accumulation():
    config = make_config(Path("/unused"), learner={"zero_stage": 3})
    engine = settings_of(config).engine
    fp32, bf16 = deepspeed_config(engine, "fp32"), deepspeed_config(engine, "bf16")
    assert fp32["managed_gradient_accumulation"] is False and "bf16" not in fp32
    assert bf16["bf16"] == {"enabled": True} and bf16["data_types"] == {"grad_accum_dtype": "fp32"}
    zero0 = make_config(Path("/unused"))
    assert "data_types" not in deepspeed_config(settings_of(zero0).engine, "bf16")  # ZeRO-0: DeepSpeed's rule
    # DeepSpeed clips (and all-reduces the norm) except in a world of one at ZeRO-0 in fp32, where torch clips
    assert deepspeed_config(settings_of(zero0).engine, "fp32", ranks=1)["gradient_clipping"] == 0.0
    unclipped = make_config(Path("/unused"), learner={"grad_clip": 0.0, "zero_stage": 3})
    # DeepSpeed's default is 1.0
    assert deepspeed_config(settings_of(unclipped).engine, "fp32", ranks=2)["gradient_clipping"] == 0.0
    assert deepspeed_config(settings_of(zero0).engine, "fp32", ranks=2)["gradient_clipping"] == zero0.learner.grad_clip
    assert fp32["gradient_clipping"] == bf16["gradient_clipping"] == config.learner.grad_clip


def test_bad_learner_keys_are_named():
    with pytest.raises(ConfigError, match="learner.pack_row_tokens: expected <= learner.micro_batch_tokens"):
        make_config(Path("/unused"), learner={"micro_batch_tokens": 64, "pack_row_tokens": 128})
    with pytest.raises(ConfigError, match="learner.device: expected one of 'auto' | 'cpu' | 'cuda', got 'tpu'"):
        make_config(Path("/unused"), learner={"device": "tpu"})


@pytest.mark.parametrize("entropy_per", ["step", "credit"])
def test_a_micro_batched_packed_checkpointed_engine_takes_the_same_steps_as_one_padded_batch(setup, entropy_per):
    """Real DeepSpeed engines, two steps on the same batch: one padded micro-batch versus packed 24-token
    micro-batches (accumulated, one optimizer step each) with activation checkpointing; the first step's loss is
    the whole batch's (with the entropy bonus on every token, or weighted by credit)."""
    base, items = setup
    results = []
    algo = {"entropy_coef": 0.1, "kl_beta": 0.05, "entropy_per": entropy_per}
    for learner in ({"packing": False}, {"micro_batch_tokens": 24, "activation_checkpointing": True}):
        config = make_config(Path(base.run.dir), learner=learner, algo=algo)
        engine, reference = engine_for(config)
        try:
            assert activation_checkpointing_on(engine.module) == learner.get("activation_checkpointing", False)
            step = settings_of(config).step
            assert (len(rank_micro_batches(items, 0, 1, step)) > 1) == ("micro_batch_tokens" in learner)
            version, losses = train_on_items(engine, reference, items, 0, step)
            version, more = train_on_items(engine, reference, items, version, step)
            results.append(([loss for loss, _ in losses + more], [s for _, s in losses + more],
                            {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}, version))
        finally:
            engine.destroy()
    (losses_a, stats_a, weights_a, version_a), (losses_b, stats_b, weights_b, version_b) = results
    assert version_a == version_b == 2
    assert losses_b == pytest.approx(losses_a, rel=1e-5)
    padded = load_model(model_dir_for(base))
    whole, _ = loss_and_grads(padded, collate(items), make_config(Path(base.run.dir), algo=algo))
    assert losses_a[0] == pytest.approx(whole, rel=1e-5)  # the KL is 0 at the reference's weights
    for a, b in zip(stats_a, stats_b, strict=True):
        assert (b.is_ratio_mean, b.kl, b.entropy) == pytest.approx((a.is_ratio_mean, a.kl, a.entropy), rel=1e-5)
        assert b.is_ratio_max == pytest.approx(a.is_ratio_max, rel=1e-5)
    initial = load_model(model_dir_for(base)).state_dict()
    assert max(float((weights_a[k] - v).abs().max()) for k, v in initial.items()) > 5e-4  # two steps of lr 5e-4
    # Adam divides by the gradient's scale: where a gradient is near its eps (1e-8), float rounding moves the step
    # itself. On an H100 one element of 8,192 in one tensor had a gradient of 7e-9 (1e-5 of that tensor's median)
    # and differed by 8.4e-6 between the layouts. Those elements are held to the learning rate's scale; the rest
    # to 5e-6.
    first_grads = {name: p.grad for name, p in padded.named_parameters() if p.grad is not None}
    for name, weight in weights_a.items():
        tiny = first_grads[name].abs() < 1e-7 if name in first_grads else torch.zeros_like(weight, dtype=torch.bool)
        torch.testing.assert_close(weights_b[name][~tiny], weight[~tiny], rtol=1e-5, atol=5e-6,
                                   msg=lambda text, name=name: f"{name}: {text}")
        assert all(float(d) <= 4 * base.learner.lr for d in (weights_b[name][tiny] - weight[tiny]).abs()), name


def test_a_world_of_one_clips_gradients_with_torch_before_the_step(setup, monkeypatch):
    base, items = setup
    config = make_config(Path(base.run.dir), learner={"grad_clip": 1e-3})
    engine, _ = engine_for(config)
    try:
        assert engine.gradient_clipping() == 0  # DeepSpeed's clipping (with its norm all-reduce) is off here
        norms, step = [], engine.step

        def recorded_step(*args, **kwargs):
            grads_ = [p.grad for p in engine.module.parameters() if p.grad is not None]
            norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads_]))))
            return step(*args, **kwargs)

        monkeypatch.setattr(engine, "step", recorded_step)
        version, _ = train_on_items(engine, None, items, 0, settings_of(config).step)
        assert version == 1 and norms[0] == pytest.approx(1e-3, rel=1e-4)
    finally:
        engine.destroy()
