"""Typed run configuration: one msgspec Struct per section, loaded from YAML with `section.key=value` overrides.

Everything is validated before any process starts. A wrong key, type or range raises `ConfigError` whose
message names the dotted key, the bad value and what is allowed, e.g.
`algo.max_staleness: expected int >= 0, got -1`.
"""

from __future__ import annotations

import difflib
import importlib.resources
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

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
    # and pending ones), at least 16, at most max_correction_staleness_cap: it follows the judge (replay/guard.py).
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
    # CurveZMQ keys written by `async-rl keys DIR` (docs/deploy.md): with it every ZeroMQ socket is encrypted and
    # only the learner's and the rollout key get in. null: off (a tcp:// endpoint then logs a loud warning).
    curve_dir: str | None = None


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


# The packaged configs (package data, async_rl/configs/<name>.yaml; configs/ in a checkout links to them): `local`
# (the defaults above as a commented file), `cluster` (deploy/k8s), `smollm2` (a real model with a tool).
PACKAGED = importlib.resources.files("async_rl") / "configs"


def packaged_config_names() -> list[str]:
    return sorted(entry.name.removesuffix(".yaml") for entry in PACKAGED.iterdir() if entry.name.endswith(".yaml"))


def configured_model_path(config: Config) -> Path | None:
    """`model.path` checked (a Hugging Face model directory: it has config.json), or None when it is empty. Cheap:
    `async-rl train` runs it before importing torch, so a wrong path is reported at once."""
    if not config.model.path:
        return None
    path = Path(config.model.path)
    if not (path / "config.json").exists():
        raise ConfigError(f"model.path: {path} is not a Hugging Face model directory (no config.json)")
    return path


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats: `3e-4` is a number (YAML 1.1 wants `3.0e-4` and reads `3e-4`
    as a string, which then failed validation as "expected float, got '3e-4'")."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # a SafeLoader: no arbitrary objects


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config of `path` with `a.b=value` overrides applied, validated. `path`: None for the defaults (the structs
    above; nothing is read), a YAML file, or a packaged config by name (`cluster`; a file of that name is `./cluster`).
    A file that does not exist is an error that names it: nothing falls back to the defaults."""
    raw: Any = {}
    if path is not None:
        source, text = _read_config(path)
        try:
            raw = _yaml(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a mapping of sections at the top level, got {type(raw).__name__}")
    for override in overrides:
        _apply_override(raw, override)
    return config_from_dict(raw)


# Keys the code no longer has: (section, key) -> (the value it had by default, why it went). A run directory's
# config.yaml written before (every key is in it) still loads when the key holds that value, which is what the code
# now does; any other value is refused with the reason.
REMOVED_KEYS = {
    ("algo", "hold_immediates"): (False, "the ablation of immediate+correction was removed from the product (its "
                                         "result is in docs/research/log.md; reproducible at commit 6d4d567)"),
    ("algo", "entropy_floor"): (0.0, "the entropy floor was removed (measured, not met: docs/research/log.md; "
                                     "reproducible at commit cceb674)"),
    ("algo", "entropy_floor_step"): (0.005, "the entropy floor was removed (docs/research/log.md)"),
    ("algo", "entropy_floor_max"): (1.0, "the entropy floor was removed (docs/research/log.md)"),
}


def _drop_removed(raw: dict[str, Any]) -> None:
    for (section, key), (default, why) in REMOVED_KEYS.items():
        values = raw.get(section)
        if isinstance(values, dict) and key in values:
            if values[key] != default:
                raise ConfigError(f"{section}.{key}: {why}; only {default!r} is accepted, got {values[key]!r}")
            del values[key]


def _read_config(path: str | Path) -> tuple[str, str]:
    """(what to call it in an error, its text): a packaged config when `path` is one's bare name, else a file."""
    if isinstance(path, str) and path in packaged_config_names():
        resource = PACKAGED / f"{path}.yaml"
        return f"packaged config {path} ({resource})", resource.read_text()
    source = Path(path)
    try:
        return str(source), source.read_text()
    except FileNotFoundError:
        names = ", ".join(packaged_config_names())
        raise ConfigError(f"config file {source} does not exist (a packaged config is named without a path or "
                          f".yaml: {names})") from None
    except OSError as exc:  # a directory, no permission
        raise ConfigError(f"config file {source}: cannot read it: {exc}") from None


def config_from_dict(raw: dict[str, Any]) -> Config:
    _drop_removed(raw)
    _check_keys(raw, Config, "")
    try:
        config = msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc, raw)) from None
    _check_relations(config)
    return config


def config_to_dict(config: Config) -> dict[str, Any]:
    return msgspec.to_builtins(config)


def dump_config(config: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))


def load_run_config(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config of the run in `run_dir` (its config.yaml, with `overrides` on top), pointed at that directory
    wherever the command runs from (`async-rl train --resume`, `async-rl export`). Raises ConfigError naming what
    is missing."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    config = load_config(run_dir / "config.yaml", list(overrides))
    run = msgspec.structs.replace(config.run, dir=str(run_dir.resolve().parent), name=run_dir.resolve().name)
    return msgspec.structs.replace(config, run=run)


def _apply_override(raw: dict[str, Any], override: str) -> None:
    key, sep, text = override.partition("=")
    if not sep or not key or not re.fullmatch(r"[a-z_]+(\.[A-Za-z_][A-Za-z0-9_]*)+", key):
        raise ConfigError(f"override {override!r}: expected section.key=value, e.g. algo.max_staleness=2")
    try:
        value = _yaml(text) if text != "" else ""
    except yaml.YAMLError:
        value = text
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {part} is a value, not a section")
        node = child
    node[leaf] = value


def _struct_type(annotation: Any) -> type[msgspec.Struct] | None:
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return annotation
    return None


def _check_keys(raw: Any, struct: type[msgspec.Struct], prefix: str) -> None:
    if not isinstance(raw, dict):
        where = prefix.rstrip(".") or "config"
        raise ConfigError(f"{where}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(struct, include_extras=True)
    for key, value in raw.items():
        if key not in struct.__struct_fields__:
            close = difflib.get_close_matches(str(key), struct.__struct_fields__, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else ""
            if struct is EnvConfig:
                hint = f"; an environment's own settings go under env.kwargs, e.g. env.kwargs.{key}={raw[key]!r}"
            allowed = ", ".join(struct.__struct_fields__)
            raise ConfigError(f"{prefix}{key}: unknown key{hint} (allowed: {allowed})")
        sub = _struct_type(hints[key])
        if sub is not None:
            _check_keys(value, sub, f"{prefix}{key}.")


def _lookup(raw: Any, dotted: list[str]) -> Any:
    for part in dotted:
        if isinstance(raw, dict) and part in raw:
            raw = raw[part]
        elif isinstance(raw, list) and part.isdigit() and int(part) < len(raw):
            raw = raw[int(part)]
        else:
            return None
    return raw


def _allowed(annotation: Any) -> str:
    """A short human description of what a field accepts."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        base, *metas = typing.get_args(annotation)
        bounds = []
        for meta in metas:
            for name, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                bound = getattr(meta, name, None)
                if bound is not None:
                    bounds.append(f"{op} {bound}")
        return f"{_allowed(base)} {' and '.join(bounds)}".strip()
    if origin is Literal:
        return "one of " + " | ".join(repr(v) for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_allowed(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _field_annotation(dotted: list[str]) -> Any:
    struct: Any = Config
    annotation: Any = None
    for part in dotted:
        hints = typing.get_type_hints(struct, include_extras=True)
        if part not in hints:
            return annotation
        annotation = hints[part]
        struct = _struct_type(annotation) or annotation
    return annotation


def _explain(exc: msgspec.ValidationError, raw: dict[str, Any]) -> str:
    message = str(exc)
    match = re.search(r" - at `\$\.?(.*)`$", message)
    path = match.group(1) if match else ""
    dotted = [p for p in re.split(r"[.\[\]]+", path) if p]
    key = ".".join(dotted) or "config"
    annotation = _field_annotation(dotted)
    got = _lookup(raw, dotted)
    allowed = _allowed(annotation) if annotation is not None else message.split(" - at ")[0]
    return f"{key}: expected {allowed}, got {got!r}"


def _check_relations(config: Config) -> None:
    rollout, replay = config.rollout, config.replay
    if rollout.max_inflight < rollout.group_size:
        raise ConfigError(
            f"rollout.max_inflight: expected >= rollout.group_size ({rollout.group_size}), got {rollout.max_inflight}"
        )
    if any(not stop for stop in rollout.stop):
        raise ConfigError("rollout.stop: expected non-empty stop strings, got an empty one")
    if replay.min_stage_peers > rollout.group_size:
        raise ConfigError(
            f"replay.min_stage_peers: expected <= rollout.group_size ({rollout.group_size}), "
            f"got {replay.min_stage_peers}"
        )
    if rollout.engine == "sglang" and not rollout.sglang.urls:
        raise ConfigError("rollout.sglang.urls: expected at least one server URL when rollout.engine is 'sglang'")
    if config.algo.clip_high <= 0 and config.algo.ppo_epochs > 1:
        raise ConfigError("algo.clip_high: expected > 0 when algo.ppo_epochs > 1")
    learner = config.learner
    if learner.momentum > 0 and learner.optimizer != "sgd":
        raise ConfigError(f"learner.momentum: only learner.optimizer sgd has a momentum, got {learner.momentum} with "
                          f"{learner.optimizer!r}")
    lora = learner.lora
    if lora.rank > 0 and (not lora.target_modules or any(not name.strip() for name in lora.target_modules)):
        raise ConfigError(f"learner.lora.target_modules: expected names of the model's linear layers (e.g. q_proj) "
                          f"when learner.lora.rank > 0, got {lora.target_modules!r}")
    if learner.pack_row_tokens is not None and learner.pack_row_tokens > learner.micro_batch_tokens:
        raise ConfigError(
            f"learner.pack_row_tokens: expected <= learner.micro_batch_tokens ({learner.micro_batch_tokens}), "
            f"got {learner.pack_row_tokens}"
        )
    if config.security.curve_dir is not None and not config.security.curve_dir.strip():
        raise ConfigError("security.curve_dir: expected a directory of CURVE keys (`async-rl keys DIR`) or null, "
                          "got ''")
    for name in ("replay.endpoint", "learner.publish_endpoint"):
        section, field = name.split(".")
        value = getattr(getattr(config, section), field)
        if not re.fullmatch(r"(auto|tcp://[^\s:]+:\d+|ipc://\S+|inproc://\S+)", value):
            raise ConfigError(f"{name}: expected tcp://HOST:PORT, ipc://PATH or auto, got {value!r}")
