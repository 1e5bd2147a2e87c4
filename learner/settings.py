"""What each of the learner's components reads of the run's config, one frozen struct per component, built once at
the role's entry (learner/trainer.py `run`, learner/sft.py `run_sft`) by `LearnerSettings.from_config`: the one
reader of `Config` below the entries.

A field keeps its config key's name (`ppo_epochs` is `algo.ppo_epochs`), so a key is followed from its YAML line
to the components that read it by its name; a component gets its own struct and nothing else of the config. One
exception: `StepSettings.loss` is the `algo` section itself, because async_rl/loss.py (outside learner/) takes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from async_rl.config import AlgoConfig, Config
from async_rl.config_load import config_to_dict
from async_rl.telemetry import MetricsSettings


class LayoutSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How a batch is cut into micro-batches and packed rows (learner/pack.py; learner/attention.py `row_tokens`)."""

    micro_batch_tokens: int  # learner.micro_batch_tokens
    packing: bool  # learner.packing
    pack_row_tokens: int | None  # learner.pack_row_tokens


class LoraSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The adapters (learner/lora.py)."""

    rank: int  # learner.lora.rank
    alpha: float  # learner.lora.alpha
    dropout: float  # learner.lora.dropout
    target_modules: tuple[str, ...]  # learner.lora.target_modules


class EngineSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The DeepSpeed engine, its optimizer and the KL reference (learner/engine.py `build_engine`)."""

    device: Literal["auto", "cpu", "cuda"]  # learner.device
    precision: Literal["auto", "fp32", "bf16"]  # learner.precision
    zero_stage: int  # learner.zero_stage
    grad_clip: float  # learner.grad_clip
    optimizer: Literal["adamw", "sgd"]  # learner.optimizer
    lr: float  # learner.lr
    momentum: float  # learner.momentum
    weight_decay: float  # learner.weight_decay
    attention: Literal["auto", "dense", "varlen", "flash", "flex"]  # learner.attention
    activation_checkpointing: bool  # learner.activation_checkpointing
    seed: int  # run.seed
    threads_per_process: int  # run.threads_per_process
    kl_beta: float  # algo.kl_beta (> 0: a frozen reference)
    layout: LayoutSettings
    lora: LoraSettings


class StepSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The optimizer step(s) on one batch (learner/step.py)."""

    ppo_epochs: int  # algo.ppo_epochs
    temperature: float  # rollout.temperature
    grad_clip: float  # learner.grad_clip
    layout: LayoutSettings
    loss: AlgoConfig  # algo: the section async_rl/loss.py takes (`policy_loss`, `aggregate`)


class RequestSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What a BatchRequest asks of the replay (learner/replay_client.py `ReplayClient.next_batch`)."""

    batch_tokens: int  # learner.batch_tokens
    min_batch_items: int  # learner.min_batch_items
    batch_wait_s: float  # learner.batch_wait_s


class ClientSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The learner's replay client (learner/replay_client.py)."""

    endpoint: str  # replay.endpoint
    insecure: bool  # security.insecure (tcp:// without keys allowed)
    request_timeout_s: float  # learner.request_timeout_s
    request: RequestSettings


class SGLangSyncSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The weight transport to SGLang servers: `distributed` is learner/sglang_sync.py's, `disk` an HF directory."""

    urls: tuple[str, ...]  # rollout.sglang.urls
    weight_sync: Literal["disk", "distributed"]  # rollout.sglang.weight_sync
    request_timeout_s: float  # rollout.sglang.request_timeout_s
    pause_mode: Literal["in_place", "abort"]  # rollout.sglang.pause_mode
    dist_backend: Literal["gloo", "nccl"]  # rollout.sglang.dist_backend
    dist_master_addr: str  # rollout.sglang.dist_master_addr
    dist_master_port: int  # rollout.sglang.dist_master_port
    ca_file: str | None = None  # rollout.sglang.ca_file


class VLLMSyncSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The same for vLLM servers (learner/vllm_sync.py), from `rollout.vllm`."""

    urls: tuple[str, ...]  # rollout.vllm.urls
    weight_sync: Literal["disk", "distributed"]  # rollout.vllm.weight_sync
    request_timeout_s: float  # rollout.vllm.request_timeout_s
    pause_mode: Literal["in_place", "abort", "keep"]  # rollout.vllm.pause_mode
    dist_backend: Literal["gloo", "nccl"]  # rollout.vllm.dist_backend
    dist_master_addr: str  # rollout.vllm.dist_master_addr
    dist_master_port: int  # rollout.vllm.dist_master_port
    ca_file: str | None = None  # rollout.vllm.ca_file


class PublisherSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The weight publisher and its transport (learner/publisher.py `make_publisher`)."""

    weights_dir: Path  # <run_dir>/weights
    publish_endpoint: str  # learner.publish_endpoint
    insecure: bool  # security.insecure (tcp:// without keys allowed)
    keep_weights: int  # learner.keep_weights
    engine: str  # rollout.engine
    sglang: SGLangSyncSettings  # rollout.sglang (its weight_sync: with engine sglang)
    vllm: VLLMSyncSettings  # rollout.vllm (its weight_sync: with engine vllm)
    # learner.lora when the adapters alone are published (rollout.engine vllm, rollout.vllm.lora adapter); None:
    # the merged full weights
    adapters: LoraSettings | None


class CheckpointSettings(msgspec.Struct, frozen=True, kw_only=True):
    """When and where the learner checkpoints (learner/trainer.py, learner/sft.py; learner/engine.py writes them)."""

    directory: Path  # <run_dir>/checkpoints
    checkpoint_every: int  # learner.checkpoint_every
    keep_checkpoints: int  # learner.keep_checkpoints


class StopSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The budgets and the target that end training (learner/trainer.py `stop_reason`)."""

    max_versions: int | None  # run.max_versions
    max_env_steps: int | None  # run.max_env_steps
    target_success: float | None  # run.target_success
    max_wall_s: float | None  # run.max_wall_s
    long_success_window: int  # replay.long_success_window (the target counts once that many finished)


class LearnerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The loop's own values (learner/trainer.py: the run directory, when to publish, what a metrics line carries)
    and each component's struct."""

    run_dir: Path  # run.dir / run.name
    publish_every: int  # learner.publish_every
    log_item_ids: bool  # learner.log_item_ids
    max_seq_len: int  # model.max_seq_len (the warm start skips longer conversations)
    batch_tokens: int  # learner.batch_tokens (the warm start's batches)
    seed: int  # run.seed (the warm start's order)
    engine: EngineSettings
    step: StepSettings
    client: ClientSettings
    publisher: PublisherSettings
    checkpoints: CheckpointSettings
    stop: StopSettings
    metrics: MetricsSettings  # the metrics file and W&B (async_rl/telemetry.py), with the run's config to record

    @classmethod
    def from_config(cls, config: Config) -> LearnerSettings:
        """The learner's settings from the run's config: called by the role's entries (learner/trainer.py `run`,
        learner/sft.py `run_sft`) only."""
        learner, algo, run = config.learner, config.algo, config.run
        layout = LayoutSettings(micro_batch_tokens=learner.micro_batch_tokens, packing=learner.packing,
                                pack_row_tokens=learner.pack_row_tokens)
        lora = LoraSettings(rank=learner.lora.rank, alpha=learner.lora.alpha, dropout=learner.lora.dropout,
                            target_modules=tuple(learner.lora.target_modules))
        return cls(
            run_dir=config.run_dir, publish_every=learner.publish_every, log_item_ids=learner.log_item_ids,
            max_seq_len=config.model.max_seq_len, batch_tokens=learner.batch_tokens, seed=run.seed,
            engine=EngineSettings(device=learner.device, precision=learner.precision, zero_stage=learner.zero_stage,
                                  grad_clip=learner.grad_clip, optimizer=learner.optimizer, lr=learner.lr,
                                  momentum=learner.momentum, weight_decay=learner.weight_decay,
                                  attention=learner.attention,
                                  activation_checkpointing=learner.activation_checkpointing, seed=run.seed,
                                  threads_per_process=run.threads_per_process, kl_beta=algo.kl_beta, layout=layout,
                                  lora=lora),
            step=StepSettings(ppo_epochs=algo.ppo_epochs, temperature=config.rollout.temperature,
                              grad_clip=learner.grad_clip, layout=layout, loss=algo),
            client=ClientSettings(endpoint=config.replay.endpoint, insecure=config.security.insecure,
                                  request_timeout_s=learner.request_timeout_s,
                                  request=RequestSettings(batch_tokens=learner.batch_tokens,
                                                          min_batch_items=learner.min_batch_items,
                                                          batch_wait_s=learner.batch_wait_s)),
            publisher=PublisherSettings(
                weights_dir=(config.run_dir / "weights").resolve(), publish_endpoint=learner.publish_endpoint,
                insecure=config.security.insecure, keep_weights=learner.keep_weights, engine=config.rollout.engine,
                # a server engine's transport settings: its section's keys of the same names
                sglang=msgspec.convert(msgspec.to_builtins(config.rollout.sglang), SGLangSyncSettings),
                vllm=msgspec.convert(msgspec.to_builtins(config.rollout.vllm), VLLMSyncSettings),
                adapters=lora if lora.rank > 0 and config.rollout.engine == "vllm"
                and config.rollout.vllm.lora == "adapter" else None),
            checkpoints=CheckpointSettings(directory=config.run_dir / "checkpoints",
                                           checkpoint_every=learner.checkpoint_every,
                                           keep_checkpoints=learner.keep_checkpoints),
            stop=StopSettings(max_versions=run.max_versions, max_env_steps=run.max_env_steps,
                              target_success=run.target_success, max_wall_s=run.max_wall_s,
                              long_success_window=config.replay.long_success_window),
            metrics=MetricsSettings(run_dir=config.run_dir, name=run.name, wandb=config.wandb,
                                    run_config=config_to_dict(config)),
        )

    def for_sft(self) -> LearnerSettings:
        """The settings the warm start (learner/sft.py) trains under: the demonstrations' likelihood has no
        reference, no second epoch over a batch, no entropy bonus; every action token weighs the same (token
        mean)."""
        loss = msgspec.structs.replace(self.step.loss, kl_beta=0.0, ppo_epochs=1, entropy_coef=0.0,
                                       aggregation="token-mean")
        run_config = {**self.metrics.run_config, "algo": msgspec.to_builtins(loss)}  # what W&B records of the run
        return msgspec.structs.replace(self, engine=msgspec.structs.replace(self.engine, kl_beta=0.0),
                                       step=msgspec.structs.replace(self.step, ppo_epochs=1, loss=loss),
                                       metrics=msgspec.structs.replace(self.metrics, run_config=run_config))
