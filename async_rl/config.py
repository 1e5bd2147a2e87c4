"""Typed run configuration: one msgspec Struct per section, each field with its default and its bounds (the
defaults are the default run: async_rl/configs/local.yaml writes them out). Loading YAML and overrides into them,
with errors that name the key: async_rl/config_load.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from async_rl.errors import ConfigError

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0.0)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]

UpdateMode = Literal["immediate+correction", "outcome-only", "immediate-only"]
CreditMode = Literal["outcome+step", "outcome"]


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class RunConfig(_Section):
    name: str = "local"  # run name; files go to <dir>/<name>/
    dir: str = "runs"  # parent directory of run directories
    seed: int = 0  # seeds model init, sampling and the learner
    max_env_steps: PosInt | None = None  # budget: stop after this many environment steps (stage records)
    # budget: stop after this many learner optimizer steps (the default run stops at target_success long before)
    max_versions: PosInt | None = 10_000
    target_success: Fraction | None = 0.8  # stop early once success_rate_long reaches this (None: never)
    max_wall_s: PosFloat | None = None  # stop after this many seconds
    eval_samples_per_task: NonNegInt = 16  # after `train`: evaluate the final weights on every eval task (0: skip)
    eval_every: NonNegInt = 0  # during training, rollout-0 evaluates every N policy versions into metrics (0: off)
    eval_max_tasks: PosInt | None = None  # evaluate on at most this many eval tasks (None: all)
    metrics_every_s: PosFloat = 10.0  # the rollout workers and the replay write a metrics line this often
    threads_per_process: PosInt = 1  # torch threads per process (2 cores are shared by all roles locally)
    # async-rl train starts a learner or rollout worker that died again, at most this many times each, then stops
    max_restarts: NonNegInt = 3
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


class ModelConfig(_Section):
    path: str = ""  # a local Hugging Face model directory; empty builds the tiny model below (random init)
    hidden_size: PosInt = 64
    num_layers: PosInt = 2
    num_heads: PosInt = 4
    num_kv_heads: PosInt = 2
    intermediate_size: PosInt = 128
    # The tiny model's positions, and every trajectory's context limit (the runner ends a trajectory there; the
    # replay refuses longer ones): set it to the real model's context with model.path.
    max_seq_len: PosInt = 256


class EnvConfig(_Section):
    # A built-in environment (`trap`, `hunt`, `coding`) or an import path `package.module:callable` returning an
    # EnvFactory (rollout/envs/base.py; docs/environments.md). Checked when a run starts, not here: the kernel
    # knows no environment.
    name: str = "trap"
    # Keyword arguments of the environment's factory, e.g. env.kwargs.stages=5 (each env documents its own).
    kwargs: dict[str, Any] = {}
    seed: int = 0  # seeds the order in which rollout workers draw tasks (each worker adds its index)


class SGLangConfig(_Section):
    urls: list[str] = []  # SGLang servers (or one sglang-router URL)
    weight_sync: Literal["disk", "distributed"] = "disk"
    pause_mode: Literal["in_place", "abort"] = "in_place"
    request_timeout_s: PosFloat = 60.0
    max_retries: NonNegInt = 2  # a prompt is sent again at most this often after a server *failed* it
    # A request a weight update aborted is not a failure: it is sent again until it completes. With
    # partial_rollouts the tokens generated before the abort are kept (with their log-probs and versions) and the
    # same action continues from them on the new weights; without, they are discarded and the action restarts.
    partial_rollouts: bool = True
    # When no server answers (all restarting or unreachable), generation waits this long, probing them, before the
    # worker gives up with "no SGLang server left" (EngineUnavailable); start-up waits the same way.
    unavailable_timeout_s: PosFloat = 300.0
    dist_backend: Literal["gloo", "nccl"] = "gloo"
    dist_master_addr: str = "127.0.0.1"
    dist_master_port: PosInt = 29620
    # A file holding the servers' API key (they run with `--api-key`; clients send `Authorization: Bearer <key>`).
    # null: the SGLANG_API_KEY environment variable when it is set and non-empty, else no key. Never the key itself.
    api_key_file: str | None = None


class RolloutConfig(_Section):
    engine: Literal["torch", "sglang"] = "torch"
    workers: PosInt = 1  # rollout worker processes started by `async-rl train`
    group_size: Annotated[int, msgspec.Meta(ge=2)] = 16  # G trajectories per task
    temperature: PosFloat = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    # At most this many action tokens per turn (a turn also ends at EOS or a stop string); null: the environment's
    # suggestion (its factory's max_action_tokens: 1 for trap, 2 for hunt), else 256.
    max_new_tokens: PosInt | None = None
    stop: list[str] = []  # stop strings: a turn's action ends right after the first one it produces
    # How the turns of an env with tools() are parsed into tool calls (rollout/tool_parser.py): hermes:
    # <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks (Qwen2.5, Hermes); none: no parsing (every
    # Action has no calls). Envs without tools() get the text either way.
    tool_parser: Literal["hermes", "none"] = "hermes"
    max_inflight: PosInt = 32  # trajectories one worker keeps going at once, across groups (>= group_size)
    # An engine call starts once 3/4 of the trajectories in flight wait for it, or the first of them has waited this
    # long (rollout/agent.py): more rows share a call's fixed cost. 0: a call takes whoever waits at once.
    engine_batch_wait_s: NonNegFloat = 0.002
    # Where the built-in torch engine runs (the sglang engine ignores it: its servers have their own GPUs). cpu: the
    # default, so the workers leave a local GPU to the learner; cuda: each worker loads the model onto the current
    # GPU (fp32, as the learner publishes it or upcast from bf16); auto: cuda when torch sees one.
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    # The built-in engine keeps each trajectory's keys and values between turns, so a turn feeds only its new tokens
    # (rollout/engines/prefix_cache.py): at most this many MiB, least recently used dropped first; 0: off (every
    # turn prefills its whole context again). A weight update clears it.
    prefix_cache_mib: NonNegFloat = 1024.0
    ack_timeout_s: PosFloat = 5.0  # resend an unacknowledged record after this long (counted while acks can be read)
    # Time limits of env calls (rollout/plugin_calls.py): a reset or step (a tool call) past step_timeout_s, or a
    # judge past judge_timeout_s, abandons its trajectory (counted as plugin_timeouts) and its thread is written off.
    # null: the env factory's own `step_timeout_s` / `judge_timeout_s` when it declares them, else 300 s / 900 s.
    step_timeout_s: PosFloat | None = None
    judge_timeout_s: PosFloat | None = None
    heartbeat_s: PosFloat = 2.0
    sglang: SGLangConfig = msgspec.field(default_factory=SGLangConfig)


class ReplayConfig(_Section):
    # ROUTER that rollout workers and learners connect to: tcp://HOST:PORT, ipc://PATH, or "auto" (async-rl train
    # only: a Unix socket in the run directory, which no other run on the machine can collide with).
    endpoint: str = "auto"
    stage_group_timeout_s: PosFloat = 30.0  # a stage group is complete after this long with >= min_stage_peers
    min_stage_peers: Annotated[int, msgspec.Meta(ge=2)] = 2
    lease_timeout_s: PosFloat = 120.0  # a group whose worker is silent this long is abandoned
    batch_ack_timeout_s: PosFloat = 120.0  # a batch not acked this long goes back to the queue
    success_window: PosInt = 64  # success_rate is over the last this-many finished trajectories
    # success_rate_long (the stop rule `run.target_success` and final_success_rate) is over this many. Outcomes
    # within a group are strongly correlated, so the window's real sample size is its number of groups: 64 (4
    # groups) or even 512 (32 groups) touched 0.9 on lucky streaks while the policy evaluated at ~0.7.
    long_success_window: PosInt = 2048
    # Versions in a message (a stage record's token versions, a BatchRequest's or BatchAck's) may be at most
    # algo.ppo_epochs + this above the version the learner can honestly have (docs/architecture.md, "Validation
    # at the edge"); the rest is refused as `version_ahead`.
    max_version_lead: NonNegInt = 2
    vocab_size: PosInt | None = None  # token ids >= this are refused when set (the replay does not load the model)
    max_message_bytes: PosInt = 64 * 2**20  # ZMQ_MAXMSGSIZE of the replay's ROUTER: a bigger frame drops the peer
    # The correction-staleness guard (algo.correction_guard) never holds the learner longer than this for one
    # group: its unfinished trajectories are then abandoned (a judge that never answers cannot stall the run).
    guard_abandon_s: PosFloat = 300.0
    # At most this many groups wait for their workers' outcomes at once (leased, some trajectory neither finished nor
    # abandoned): a lease granted at the cap first gives up the group idle longest (no record or outcome since; its
    # unfinished trajectories abandoned, as for an expired lease), so a worker that heartbeats but never finishes
    # cannot grow the replay's memory without bound (docs/architecture.md, "Stopping and failure").
    max_open_groups: PosInt = 4096
    # A write-ahead log in <run dir>/replay/ (docs/architecture.md, "A durable replay"): each poll round's inputs
    # are written before its replies are sent, so nothing acknowledged is lost to a crash, and the replay started
    # again with the same config rebuilds its state from the log. false: memory only.
    durable: bool = True
    fsync: bool = True  # fsync the log once per round (false: a killed process loses nothing, a power cut may)
    # Log entries between snapshots (a snapshot replaces the log before it). A restart replays at most this many
    # (28 000 took 1.2 s of CPU); each snapshot writes the live state (open groups, queue).
    compact_every: PosInt = 20_000


LLAMA_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(_Section):
    # LoRA adapters through peft (learner/lora.py; docs/architecture.md, "LoRA"): only the adapters train and sit in
    # the optimizer; the published weights are the base with the adapter merged in. 0: off (full fine-tune).
    rank: NonNegInt = 0
    alpha: PosFloat = 16.0  # the adapter's update is scaled by alpha / rank
    # Dropout on the adapter's input while training (also in the PPO epochs' proximal log-probs): > 0 makes the
    # trained log-probs noisy against the behaviour's, so the importance ratio at v0 is no longer 1.
    dropout: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.0
    # Linear layers that get an adapter, by name (the last part of a module's dotted name, as peft matches them);
    # each must match a module of the model (checked when the learner loads it). Default: Llama's attention and MLP
    # projections.
    target_modules: list[str] = msgspec.field(default_factory=lambda: list(LLAMA_PROJECTIONS))


class LearnerConfig(_Section):
    publish_endpoint: str = "auto"  # PUB of new policy versions; same forms as replay.endpoint
    lr: PosFloat = 5e-4
    # adamw: torch's AdamW (fused kernel); sgd: plain SGD, each step lr × the gradient, so that two steps on two
    # halves of a loss move the weights as one step on their sum (what benchmarks/delay.py --optimizer sgd checks).
    optimizer: Literal["adamw", "sgd"] = "adamw"
    momentum: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.0  # SGD's momentum (learner.optimizer: sgd only)
    weight_decay: NonNegFloat = 0.0
    grad_clip: NonNegFloat = 1.0  # 0 disables
    zero_stage: Annotated[int, msgspec.Meta(ge=0, le=3)] = 0
    batch_tokens: PosInt = 4096  # token budget of one batch, counted as batch_budget says
    # How the replay counts a batch against batch_tokens: padded, the longest item x items (one right-padded row
    # per item); packed, the sum of the items' tokens (what a packing learner computes, within a micro-batch's
    # padding). The correction guard sizes pending work the same way (docs/algorithm.md, "Staleness").
    batch_budget: Literal["padded", "packed"] = "padded"
    min_batch_items: PosInt = 64  # wait for at least this many items ...
    batch_wait_s: NonNegFloat = 2.0  # ... or this long, whichever comes first
    publish_every: PosInt = 1  # write weights and announce a version every N steps
    # DeepSpeed checkpoint (weights, optimizer, RNG) every N versions and at the end (0: only at the end). A learner
    # restarted in the run directory resumes from the latest; the replay keeps what it needs to roll back the acks
    # above it, so N bounds the work a crash loses (docs/architecture.md, "Resume after a crash").
    checkpoint_every: NonNegInt = 50
    keep_checkpoints: PosInt = 2  # the newest N checkpoints (and N set aside as damaged) are kept on disk
    log_item_ids: bool = False  # each metrics line lists the replay item ids it trained (tests/test_faults.py)
    keep_weights: PosInt = 3  # published weight files kept on disk
    # A BatchRequest with no Batch after this long is sent again (the replay may have restarted and lost it).
    request_timeout_s: PosFloat = 30.0
    # Hardware (docs/architecture.md, "Learner at scale"). auto: cuda when torch sees a GPU (NCCL between ranks),
    # else cpu (gloo). precision auto: bf16 (DeepSpeed bf16, fp32 master weights) on a GPU that supports it, else fp32.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # One optimizer step per batch, accumulated over micro-batches of at most this many tokens (rows x longest
    # row, padding included); a sequence longer than this is a micro-batch of its own.
    micro_batch_tokens: PosInt = 4096
    # Sequences laid end to end in rows of at most pack_row_tokens, attention kept per sequence through position
    # ids; false: one right-padded sequence per row. null row length: micro_batch_tokens (one row per micro-batch,
    # what the varlen kernels want); with learner.attention dense a row costs its length squared, so shorter:
    # 64 keeps the default run's padding at ~5% at about the unpacked learner's speed (docs/benchmarks.md).
    packing: bool = True
    pack_row_tokens: PosInt | None = 64
    # The kernel packed rows attend through (learner/attention.py): dense, sdpa with a block-diagonal mask; varlen,
    # torch's sdpa on each sequence alone; flash, flash-attention's varlen kernel (GPU, flash_attn installed);
    # flex, FlexAttention with a document BlockMask (GPU). auto: flash where it can run, else varlen for packed rows
    # over 64 tokens, dense for shorter or unpacked rows (docs/results.md, "Packed attention").
    attention: Literal["auto", "dense", "varlen", "flash", "flex"] = "auto"
    activation_checkpointing: bool = False  # recompute activations in backward (HF gradient checkpointing)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)


class AlgoConfig(_Section):
    updates: UpdateMode = "immediate+correction"
    credit: CreditMode = "outcome+step"
    omega: NonNegFloat = 1.0  # weight of stage credit (ω)
    gamma: Fraction = 0.95  # discount of the stage return-to-go (γ)
    eps: PosFloat = 1e-6  # ε in the normalizations
    is_cap: PosFloat = 2.0  # truncation of the importance ratio (TIS)
    staleness_decay: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0  # weight × decay**staleness
    max_staleness: NonNegInt = 4  # admission bound, and hard bound for immediate items
    # Corrections later than this are dropped (counted as credit_dropped), and the guard holds the learner rather
    # than drop one (algo.correction_guard). auto: twice the longest outcome delay in learner versions (recent groups
    # and pending ones), at least 16, at most max_correction_staleness_cap (the cap until the first outcomes are in),
    # raised where the admitted corrections would not fit before their deadlines: it follows the judge
    # (replay/guard.py).
    max_correction_staleness: NonNegInt | Literal["auto"] = "auto"
    max_correction_staleness_cap: PosInt = 1024  # auto's ceiling: the stalest correction a run will train
    groups_per_step: PosInt = 8  # groups one learner step is expected to consume (admission rule)
    ppo_epochs: PosInt = 1  # > 1 switches to the decoupled PPO loss
    clip_low: Fraction = 0.2
    clip_high: NonNegFloat = 0.28
    # token-mean: Σ ℓ / (the batch's action tokens); seq-mean-token-sum: Σ ℓ / (items · seq_norm) (Dr. GRPO);
    # token-sum: Σ ℓ / token_norm, a per-token weight that does not depend on what the batch holds.
    aggregation: Literal["token-mean", "seq-mean-token-sum", "token-sum"] = "token-mean"
    seq_norm: PosFloat = 8.0  # fixed normalizer of seq-mean-token-sum (Dr. GRPO)
    token_norm: PosFloat = 256.0  # fixed normalizer of token-sum (action tokens)
    kl_beta: NonNegFloat = 0.0  # KL to the initial policy (k3); 0 = off
    # − coef · H(π) per action token (exploration bonus; 0 = off, the design's loss): without it 3–6 of 16 trap tasks
    # stay trapped on some seeds (docs/algorithm.md, "Entropy bonus")
    entropy_coef: NonNegFloat = 0.2
    # step (the default): on every trained action token (immediate+correction trains a token twice, over ~5× the
    # steps); credit: on every trained action token, weighted by |its advantage in the item| (A_imm or C), so a token
    # whose stage credit and outcome disagree (an immediate push undone by its correction) gets more bonus than one
    # whose credit came in one piece: the one rule that met every delayed-judge target measured with traps, slower
    # on the hunt (docs/research/log.md).
    entropy_per: Literal["step", "credit"] = "step"
    # Never let the learner run so far ahead of outcomes still being judged that their corrections would pass
    # max_correction_staleness (docs/algorithm.md, "Staleness"): credit_dropped stays 0.
    correction_guard: bool = True
    # async: rollout runs ahead of the learner (admission by max_staleness); sync: lock-step rounds of
    # groups_per_step groups: generate the round, train exactly its items, then the next round.
    mode: Literal["async", "sync"] = "async"


class WandbConfig(_Section):
    # disabled: no W&B (the metrics.jsonl files are always written); offline: run files to sync later (`wandb sync`);
    # online: live. Each role runs its own wandb-core service, ~40 s of the default run on 2 cores: ask for it.
    mode: Literal["offline", "online", "disabled"] = "disabled"
    project: str = "async-rl"
    entity: str | None = None
    tags: list[str] = []


class SecurityConfig(_Section):
    # CurveZMQ keys written by `async-rl keys DIR --workers N` (docs/deploy.md): with it every ZeroMQ socket is
    # encrypted and only the learner's and the workers' keys get in, each worker under its own key. null: off.
    curve_dir: str | None = None
    # true: run tcp:// endpoints without curve_dir, unauthenticated and in the clear (a loud warning); false: every
    # role refuses to start so. ipc:// and inproc:// endpoints (async-rl train on one machine) need neither.
    insecure: bool = False


class Config(_Section):
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    env: EnvConfig = msgspec.field(default_factory=EnvConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    replay: ReplayConfig = msgspec.field(default_factory=ReplayConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    algo: AlgoConfig = msgspec.field(default_factory=AlgoConfig)
    wandb: WandbConfig = msgspec.field(default_factory=WandbConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) / self.run.name


def configured_model_path(config: Config) -> Path | None:
    """`model.path` checked (a Hugging Face model directory: it has config.json), or None when it is empty. Cheap:
    `async-rl train` runs it before importing torch, so a wrong path is reported at once."""
    if not config.model.path:
        return None
    path = Path(config.model.path)
    if not (path / "config.json").exists():
        raise ConfigError(f"model.path: {path} is not a Hugging Face model directory (no config.json)")
    return path
