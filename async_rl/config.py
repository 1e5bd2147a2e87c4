"""Typed run configuration: one msgspec Struct per section, each field with its default, its bounds and its meaning
(`doc`; the defaults are the default run: async_rl/configs/local.yaml writes them out). Loading YAML and overrides
into them, with errors that name the key: async_rl/config_load.py; the reference built from the meanings:
async_rl/config_docs.py.
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


def doc(meaning: str) -> msgspec.Meta:
    """A key's meaning, written once beside its field: `async-rl config --explain` shows it, docs/configuration.md's
    tables are generated from it (async_rl/config_docs.py), and the JSON schema (`async-rl config --schema`) carries
    it as the key's description."""
    return msgspec.Meta(description=meaning)

UpdateMode = Literal["immediate+correction", "outcome-only", "immediate-only"]
CreditMode = Literal["outcome+step", "outcome"]


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class RunConfig(_Section):
    name: Annotated[str, doc(
        "run name: files go to `<run.dir>/<run.name>/` (a later run with the same name gets `-2`, `-3`, ...)"
    )] = "local"
    dir: Annotated[str, doc("parent directory of run directories")] = "runs"
    seed: Annotated[int, doc("seeds model init, sampling and the learner")] = 0
    max_env_steps: Annotated[PosInt | None, doc(
        "budget: stop after this many environment steps (stage records)"
    )] = None
    max_versions: Annotated[PosInt | None, doc(
        "budget: stop after this many learner optimizer steps (a safety cap; the target stops the quick start "
        "first)"
    )] = 10_000
    target_success: Annotated[Fraction | None, doc(
        "stop once the success rate over `replay.long_success_window` trajectories reaches it (`null`: never)"
    )] = 0.8
    max_wall_s: Annotated[PosFloat | None, doc("stop after this many seconds")] = None
    eval_samples_per_task: Annotated[NonNegInt, doc(
        "after `train`, evaluate the final weights on every eval task with this many samples (0: skip)"
    )] = 16
    eval_every: Annotated[NonNegInt, doc(
        "during training, rollout-0 evaluates every N policy versions into the metrics (0: off)"
    )] = 0
    eval_max_tasks: Annotated[PosInt | None, doc("evaluate on at most this many eval tasks (`null`: all)")] = None
    metrics_every_s: Annotated[PosFloat, doc(
        "the rollout workers and the replay write a metrics line this often"
    )] = 10.0
    threads_per_process: Annotated[PosInt, doc(
        "torch threads per process (2 cores are shared by all roles locally)"
    )] = 1
    max_restarts: Annotated[NonNegInt, doc(
        "`async-rl train` restarts a learner or rollout worker that died at most this many times each"
    )] = 3
    log_level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], doc(
        "`DEBUG`, `INFO`, `WARNING` or `ERROR`"
    )] = "INFO"


class ModelConfig(_Section):
    path: Annotated[str, doc(
        "a local Hugging Face model directory ([models.md](models.md)); empty builds the tiny model below (random"
        " init)"
    )] = ""
    hidden_size: Annotated[PosInt, doc("the tiny model's width")] = 64
    num_layers: Annotated[PosInt, doc("the tiny model's layers")] = 2
    num_heads: Annotated[PosInt, doc("the tiny model's attention heads")] = 4
    num_kv_heads: Annotated[PosInt, doc("the tiny model's key/value heads")] = 2
    intermediate_size: Annotated[PosInt, doc("the tiny model's MLP width")] = 128
    max_seq_len: Annotated[PosInt, doc(
        "The tiny model's positions, and every trajectory's context limit (the runner ends a trajectory there; "
        "the replay refuses longer ones, `async-rl sft` skips longer conversations). Unset with model.path: the "
        "model's context (its config.json's max_position_embeddings), capped at 2048 for a 24 GiB CPU machine "
        "([models.md](models.md#defaults-that-follow-the-model))."
    )] = 256


class EnvConfig(_Section):
    name: Annotated[str, doc(
        "A built-in environment (`trap`, `hunt`, `chain`, `tasks`, `coding`, `agent`, `verifiers`, `swe`) or an "
        "import path `package.module:callable` returning an EnvFactory (rollout/envs/base.py; docs/environments.md). "
        "Checked when a run starts, not here: the kernel knows no environment."
    )] = "trap"
    kwargs: Annotated[dict[str, Any], doc(
        "keyword arguments of the environment's factory, e.g. `env.kwargs.stages=5` (each environment documents "
        "its own)"
    )] = {}
    seed: Annotated[int, doc("the order in which rollout workers draw tasks (each worker adds its index)")] = 0


class SGLangConfig(_Section):
    urls: Annotated[list[str], doc(
        "SGLang servers (or one sglang-router URL); required with `rollout.engine: sglang`"
    )] = []
    weight_sync: Annotated[Literal["disk", "distributed"], doc(
        "`disk` (the learner's HF directory) or `distributed` (NCCL/gloo broadcast)"
    )] = "disk"
    pause_mode: Annotated[Literal["in_place", "abort"], doc(
        "how a weight update pauses generation: `in_place` or `abort`"
    )] = "in_place"
    request_timeout_s: Annotated[PosFloat, doc("one HTTP request's limit")] = 60.0
    max_retries: Annotated[NonNegInt, doc(
        "a prompt a server *failed* is sent again at most this often (an abort by a weight update is not a "
        "failure)"
    )] = 2
    partial_rollouts: Annotated[bool, doc(
        "A request a weight update aborted is not a failure: it is sent again until it completes. With "
        "partial_rollouts the tokens generated before the abort are kept (with their log-probs and versions) and "
        "the same action continues from them on the new weights; without, they are discarded and the action "
        "restarts."
    )] = True
    unavailable_timeout_s: Annotated[PosFloat, doc(
        "When no server answers (all restarting or unreachable), generation waits this long, probing them, before"
        " the worker gives up with \"no SGLang server left\" (EngineUnavailable); start-up waits the same way."
    )] = 300.0
    dist_backend: Annotated[Literal["gloo", "nccl"], doc(
        "the broadcast's backend with `weight_sync: distributed` (`gloo` or `nccl`)"
    )] = "gloo"
    dist_master_addr: Annotated[str, doc("the learner's rank 0 for the broadcast")] = "127.0.0.1"
    dist_master_port: Annotated[PosInt, doc("its port")] = 29620
    api_key_file: Annotated[str | None, doc(
        "A file holding the servers' API key (they run with `--api-key`; clients send `Authorization: Bearer "
        "<key>`). null: the SGLANG_API_KEY environment variable when it is set and non-empty, else no key. Never "
        "the key itself."
    )] = None
    admin_key_file: Annotated[str | None, doc(
        "A file holding the servers' admin key (they run with `--admin-api-key` as well as `--api-key`: then only "
        "this key reaches their weight, pause, abort and LoRA routes, and the API key only generation and "
        "reads). Read by the learner alone, which then loads every version into the servers itself (with "
        "`weight_sync: disk` too); rollout workers hold the API key, which can generate and nothing else. null: "
        "SGLANG_ADMIN_API_KEY when set and non-empty, else none (workers load disk versions themselves) "
        "([sglang](sglang.md#keys))"
    )] = None
    ca_file: Annotated[str | None, doc(
        "With `https://` URLs (servers started with `--ssl-keyfile` and `--ssl-certfile`): the CA certificates "
        "that signed the servers' certificate, for every client of the servers (workers and learner). null: the "
        "system's trust store. Set with an `http://` URL: refused ([sglang](sglang.md#tls))"
    )] = None


class VLLMConfig(_Section):
    urls: Annotated[list[str], doc(
        "vLLM servers (started as scripts/start_vllm_server.py does: `VLLM_SERVER_DEV_MODE=1`, "
        "`--enable-scale-out`, `--logprobs-mode processed_logprobs`, `--weight-transfer-config "
        "'{\"backend\": \"async_rl\"}'` with scripts/vllm_plugin/ installed); required with `rollout.engine: vllm`"
    )] = []
    weight_sync: Annotated[Literal["disk", "distributed"], doc(
        "`disk` (the learner's HF directory, loaded with vLLM's `reload_weights`) or `distributed` (the learner "
        "broadcasts every tensor over NCCL/gloo into the servers' `async_rl` weight-transfer backend, "
        "scripts/vllm_plugin/)"
    )] = "disk"
    pause_mode: Annotated[Literal["in_place", "abort", "keep"], doc(
        "How a weight update pauses generation (vLLM's `/pause?mode=`): `in_place` (`wait`: running requests "
        "finish on the old weights), `abort` (they come back aborted and continue as partial rollouts) or `keep` "
        "(they are frozen and continue on the new weights in the server, each token's version recorded)"
    )] = "in_place"
    lora: Annotated[Literal["adapter", "merged"], doc(
        "Under `learner.lora`: `adapter` (the learner publishes each version's adapters alone, a PEFT directory "
        "`lora-v<N>/` of a few MB, which the servers load beside their base weights with `/v1/load_lora_adapter`: "
        "start them with `--enable-lora --max-lora-rank R` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`, as "
        "scripts/start_vllm_server.py `--max-lora-rank R` does; each row runs to its end on the adapter of the "
        "version it started under, with no pause) or `merged` (the merged full weights, as a full fine-tune's: "
        "`weight_sync` and `pause_mode` apply)"
    )] = "adapter"
    request_timeout_s: Annotated[PosFloat, doc("one HTTP request's limit")] = 60.0
    max_retries: Annotated[NonNegInt, doc(
        "a prompt a server *failed* is sent again at most this often (an abort by a weight update is not a "
        "failure)"
    )] = 2
    partial_rollouts: Annotated[bool, doc(
        "as `rollout.sglang.partial_rollouts`: an aborted request keeps its tokens and continues from them"
    )] = True
    unavailable_timeout_s: Annotated[PosFloat, doc(
        "When no server answers, generation (and start-up) waits this long, probing them, before the worker "
        "gives up (EngineUnavailable)."
    )] = 300.0
    dist_backend: Annotated[Literal["gloo", "nccl"], doc(
        "the broadcast's backend with `weight_sync: distributed` (`gloo` or `nccl`)"
    )] = "gloo"
    dist_master_addr: Annotated[str, doc("the learner's rank 0 for the broadcast")] = "127.0.0.1"
    dist_master_port: Annotated[PosInt, doc("its port")] = 29621
    api_key_file: Annotated[str | None, doc(
        "A file holding the servers' API key (`--api-key`); null: the VLLM_API_KEY environment variable when it "
        "is set and non-empty, else no key. Never the key itself."
    )] = None
    ca_file: Annotated[str | None, doc(
        "as `rollout.sglang.ca_file`, for vLLM servers started with `--ssl-keyfile` and `--ssl-certfile`"
    )] = None


VLLM_PAUSE_MODES = {"in_place": "wait", "abort": "abort", "keep": "keep"}  # rollout.vllm.pause_mode → /pause?mode=


class RolloutConfig(_Section):
    engine: Annotated[Literal["torch", "sglang", "vllm"], doc(
        "`torch` (the built-in batched sampler), `sglang` (SGLang servers, [sglang.md](sglang.md)) or `vllm` "
        "(vLLM servers, `rollout.vllm`)"
    )] = "torch"
    workers: Annotated[PosInt, doc("rollout worker processes started by `async-rl train`")] = 1
    group_size: Annotated[Annotated[int, msgspec.Meta(ge=2)], doc("G trajectories per task (≥ 2)")] = 16
    temperature: Annotated[PosFloat, doc("sampling temperature")] = 1.0
    top_p: Annotated[Annotated[float, msgspec.Meta(gt=0.0, le=1.0)], doc(
        "nucleus sampling; keep 1 for exact importance ratios ([algorithm.md](algorithm.md#loss-losspolicy_loss))"
    )] = 1.0
    max_new_tokens: Annotated[PosInt | None, doc(
        "At most this many action tokens per turn (a turn also ends at EOS or a stop string); null: the "
        "environment's suggestion (its factory's max_action_tokens: 1 for trap, 2 for hunt), else 256."
    )] = None
    stop: Annotated[list[str], doc("stop strings: an action ends right after the first one it produces")] = []
    tool_parser: Annotated[Literal["hermes", "none"], doc(
        "How the turns of an env with tools() are parsed into tool calls (rollout/tool_parser.py): hermes: "
        "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> blocks (Qwen2.5, Hermes); none: no parsing "
        "(every Action has no calls). Envs without tools() get the text either way."
    )] = "hermes"
    max_inflight: Annotated[PosInt, doc(
        "trajectories one worker keeps going at once, across groups (≥ `rollout.group_size`)"
    )] = 32
    engine_batch_wait_s: Annotated[NonNegFloat, doc(
        "An engine call starts once 3/4 of the trajectories in flight wait for it, or the first of them has "
        "waited this long (rollout/runner.py): more rows share a call's fixed cost. 0: a call takes whoever waits "
        "at once."
    )] = 0.002
    inline_budget_s: Annotated[NonNegFloat, doc(
        "A worker runs its env's resets, steps and judges on its own loop thread while each returns within this "
        "many seconds (rollout/inline_calls.py): an instant env then costs no thread hand-off per call. A call "
        "still running past it moves the loop to a new thread, and that kind of call runs on a pool until 64 in a "
        "row return within a quarter of it. "
        "0: every call on a pool."
    )] = 0.02
    device: Annotated[Literal["auto", "cpu", "cuda"], doc(
        "Where the built-in torch engine runs (the sglang engine ignores it: its servers have their own GPUs). "
        "cpu: the default, so the workers leave a local GPU to the learner; cuda: each worker loads the model "
        "onto the current GPU (fp32, as the learner publishes it or upcast from bf16); auto: cuda when torch sees"
        " one."
    )] = "cpu"
    prefix_cache_mib: Annotated[NonNegFloat, doc(
        "the built-in engine keeps each trajectory's keys and values between turns, so a turn feeds only its new "
        "tokens; at most this many MiB (least recently used dropped first), cleared by a weight update; `0`: "
        "every turn prefills its whole context again ([how](../rollout/engines/prefix_cache.py))"
    )] = 1024.0
    ack_timeout_s: Annotated[PosFloat, doc(
        "resend an unacknowledged record after this long (counted while acks can be read)"
    )] = 5.0
    step_timeout_s: Annotated[PosFloat | None, doc(
        "Time limits of env calls (rollout/plugin_calls.py): a reset or step (a tool call) past step_timeout_s, "
        "or a judge past judge_timeout_s, abandons its trajectory (counted as plugin_timeouts) and its thread is "
        "written off. null: the env factory's own `step_timeout_s` / `judge_timeout_s` when it declares them, "
        "else 300 s / 900 s."
    )] = None
    judge_timeout_s: Annotated[PosFloat | None, doc(
        "a judge past this abandons its trajectory; `null`: the env's own, else 900 s"
    )] = None
    heartbeat_s: Annotated[PosFloat, doc("how often a worker tells the replay its groups are alive")] = 2.0
    sglang: SGLangConfig = msgspec.field(default_factory=SGLangConfig)
    vllm: VLLMConfig = msgspec.field(default_factory=VLLMConfig)


class ReplayConfig(_Section):
    endpoint: Annotated[str, doc(
        "ROUTER that rollout workers and learners connect to: tcp://HOST:PORT, ipc://PATH, or \"auto\" (async-rl "
        "train only: a Unix socket in the run directory, which no other run on the machine can collide with)."
    )] = "auto"
    stage_group_timeout_s: Annotated[PosFloat, doc(
        "a stage group is complete after this long with ≥ `replay.min_stage_peers` members in"
    )] = 30.0
    min_stage_peers: Annotated[Annotated[int, msgspec.Meta(ge=2)], doc(
        "members a timed-out stage group needs for an immediate update"
    )] = 2
    lease_timeout_s: Annotated[PosFloat, doc("a group whose worker is silent this long is abandoned")] = 120.0
    batch_ack_timeout_s: Annotated[PosFloat, doc("a batch not acknowledged this long goes back to the queue")] = 120.0
    success_window: Annotated[PosInt, doc("`success_rate` is over the last this-many finished trajectories")] = 64
    long_success_window: Annotated[PosInt, doc(
        "success_rate_long (the stop rule `run.target_success` and final_success_rate) is over this many. "
        "Outcomes within a group are strongly correlated, so the window's real sample size is its number of "
        "groups: 64 (4 groups) or even 512 (32 groups) touched 0.9 on lucky streaks while the policy evaluated at"
        " ~0.7."
    )] = 2048
    max_version_lead: Annotated[NonNegInt, doc(
        "Versions in a message (a stage record's token versions, a BatchRequest's or BatchAck's) may be at most "
        "algo.ppo_epochs + this above the version the learner can honestly have (docs/architecture.md, "
        "\"Validation at the edge\"); the rest is refused as `version_ahead`."
    )] = 2
    vocab_size: Annotated[PosInt | None, doc(
        "token ids >= this are refused when set (the replay does not load the model)"
    )] = None
    max_message_bytes: Annotated[PosInt, doc(
        "the largest frame the replay accepts (64 MiB); a bigger one drops the peer"
    )] = 64 * 2**20
    guard_abandon_s: Annotated[PosFloat, doc(
        "The correction-staleness guard (algo.correction_guard) never holds the learner longer than this for one "
        "group: its unfinished trajectories are then abandoned (a judge that never answers cannot stall the run)."
    )] = 300.0
    max_open_groups: Annotated[PosInt, doc(
        "At most this many groups wait for their workers' outcomes at once (leased, some trajectory neither "
        "finished nor abandoned): a lease granted at the cap first gives up the group idle longest (no record or "
        "outcome since; its unfinished trajectories abandoned, as for an expired lease), so a worker that "
        "heartbeats but never finishes cannot grow the replay's memory without bound (docs/architecture.md, "
        "\"Stopping and failure\")."
    )] = 4096
    durable: Annotated[bool, doc(
        "A write-ahead log in <run dir>/replay/ (docs/architecture.md, \"A durable replay\"): each poll round's "
        "inputs are written before its replies are sent, so nothing acknowledged is lost to a crash, and the "
        "replay started again with the same config rebuilds its state from the log. false: memory only."
    )] = True
    fsync: Annotated[bool, doc(
        "fsync the log once per round (false: a killed process loses nothing, a power cut may)"
    )] = True
    compact_every: Annotated[PosInt, doc(
        "Log entries between snapshots (a snapshot replaces the log before it). A restart replays at most this "
        "many (28 000 took 1.2 s of CPU); each snapshot writes the live state (open groups, queue)."
    )] = 20_000


LLAMA_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(_Section):
    rank: Annotated[NonNegInt, doc(
        "LoRA adapters through peft (learner/lora.py; docs/architecture.md, \"LoRA\"): only the adapters train and "
        "sit in the optimizer; the published weights are the base with the adapter merged in. 0: off (full "
        "fine-tune)."
    )] = 0
    alpha: Annotated[PosFloat, doc("the adapter's update is scaled by alpha / rank")] = 16.0
    dropout: Annotated[Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)], doc(
        "Dropout on the adapter's input while training (also in the PPO epochs' proximal log-probs): > 0 makes "
        "the trained log-probs noisy against the behaviour's, so the importance ratio at v0 is no longer 1."
    )] = 0.0
    target_modules: Annotated[list[str], doc(
        "Linear layers that get an adapter, by name (the last part of a module's dotted name, as peft matches "
        "them); each must match a module of the model (checked when the learner loads it). Default: Llama's "
        "attention and MLP projections."
    )] = msgspec.field(default_factory=lambda: list(LLAMA_PROJECTIONS))


class LearnerConfig(_Section):
    publish_endpoint: Annotated[str, doc("PUB of new policy versions; the same forms as `replay.endpoint`")] = "auto"
    lr: Annotated[PosFloat, doc(
        "learning rate: the tiny model's; unset with model.path, a pretrained model's (RL: 1e-5 full fine-tune, 1e-4 "
        "with learner.lora.rank > 0; `async-rl sft`: ten times that; "
        "[models.md](models.md#defaults-that-follow-the-model))"
    )] = 5e-4
    optimizer: Annotated[Literal["adamw", "sgd"], doc(
        "adamw: torch's AdamW (fused kernel); sgd: plain SGD, each step lr × the gradient, so that two steps on "
        "two halves of a loss move the weights as one step on their sum (what benchmarks/delay.py --optimizer sgd"
        " checks)."
    )] = "adamw"
    momentum: Annotated[Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)], doc(
        "SGD's momentum (`learner.optimizer: sgd` only)"
    )] = 0.0
    weight_decay: Annotated[NonNegFloat, doc("weight decay")] = 0.0
    grad_clip: Annotated[NonNegFloat, doc("gradient norm clip (0: off)")] = 1.0
    zero_stage: Annotated[Annotated[int, msgspec.Meta(ge=0, le=3)], doc("DeepSpeed ZeRO stage (0–3)")] = 0
    batch_tokens: Annotated[PosInt, doc("token budget of one batch, counted as `learner.batch_budget` says")] = 4096
    batch_budget: Annotated[Literal["padded", "packed"], doc(
        "How the replay counts a batch against batch_tokens: padded, the longest item x items (one right-padded "
        "row per item); packed, the sum of the items' tokens (what a packing learner computes, within a "
        "micro-batch's padding). The correction guard sizes pending work the same way (docs/algorithm.md, "
        "\"Staleness\")."
    )] = "padded"
    min_batch_items: Annotated[PosInt, doc("wait for at least this many items ...")] = 64
    batch_wait_s: Annotated[NonNegFloat, doc("... or this long, whichever comes first")] = 2.0
    publish_every: Annotated[PosInt, doc("write weights and announce a version every N steps")] = 1
    checkpoint_every: Annotated[NonNegInt, doc(
        "DeepSpeed checkpoint (weights, optimizer, RNG) every N versions and at the end (0: only at the end). A "
        "learner restarted in the run directory resumes from the latest; the replay keeps what it needs to roll "
        "back the acks above it, so N bounds the work a crash loses (docs/architecture.md, \"Resume after a "
        "crash\")."
    )] = 50
    keep_checkpoints: Annotated[PosInt, doc(
        "the newest N checkpoints are kept, and the newest N set aside as damaged (`v<N>.corrupt`). A resume past "
        "a damaged one falls back to the newest that passes and goes on at its version: the learner reports the "
        "oldest it keeps to the replay, which keeps the acks above that one undoable"
    )] = 2
    log_item_ids: Annotated[bool, doc(
        "each metrics line lists the replay item ids it trained (the fault tests)"
    )] = False
    keep_weights: Annotated[PosInt, doc("published weight files kept")] = 3
    request_timeout_s: Annotated[PosFloat, doc(
        "A BatchRequest with no Batch after this long is sent again (the replay may have restarted and lost it)."
    )] = 30.0
    device: Annotated[Literal["auto", "cpu", "cuda"], doc(
        "Hardware (docs/architecture.md, \"Learner at scale\"). auto: cuda when torch sees a GPU (NCCL between "
        "ranks), else cpu (gloo). precision auto: bf16 (DeepSpeed bf16, fp32 master weights) on a GPU that "
        "supports it, else fp32."
    )] = "auto"
    precision: Annotated[Literal["auto", "fp32", "bf16"], doc("`bf16` on a GPU that supports it, else `fp32`")] = "auto"
    micro_batch_tokens: Annotated[PosInt, doc(
        "One optimizer step per batch, accumulated over micro-batches of at most this many tokens (rows x longest"
        " row, padding included); a sequence longer than this is a micro-batch of its own."
    )] = 4096
    packing: Annotated[bool, doc(
        "Sequences laid end to end in rows of at most pack_row_tokens, attention kept per sequence through "
        "position ids; false: one right-padded sequence per row. null row length: micro_batch_tokens (one row per"
        " micro-batch, what the varlen kernels want); with learner.attention dense a row costs its length "
        "squared, so shorter: 64 keeps the default run's padding at ~5% at about the unpacked learner's speed "
        "(docs/benchmarks.md)."
    )] = True
    pack_row_tokens: Annotated[PosInt | None, doc(
        "a packed row's length (`null`: `learner.micro_batch_tokens`); with `learner.attention: dense` a row "
        "costs its length squared, so short"
    )] = 64
    attention: Annotated[Literal["auto", "dense", "varlen", "flash", "flex"], doc(
        "the kernel packed rows attend through: `dense` (sdpa, block-diagonal mask), `varlen` (torch's sdpa per "
        "sequence, no mask), `flash` (flash-attention's varlen kernel; GPU, flash_attn), `flex` (FlexAttention, "
        "document BlockMask; GPU); `auto`: `flash` where it runs, else `varlen` for packed rows over 64 tokens "
        "and `dense` for shorter or unpacked rows ([architecture](architecture.md#learner-at-scale))"
    )] = "auto"
    activation_checkpointing: Annotated[bool, doc(
        "recompute activations in backward (HF gradient checkpointing)"
    )] = False
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)


class AlgoConfig(_Section):
    """The learning rule's knobs; what each does is in [algorithm.md](algorithm.md)."""

    updates: Annotated[UpdateMode, doc(
        "or `outcome-only` (no immediate items), `immediate-only` (no corrections)"
    )] = "immediate+correction"
    immediate_hold: Annotated[NonNegFloat, doc(
        "how long an immediate item waits for its group's outcome before a learner may train it, in outcome-only "
        "learner steps' worth of generation (`algo.groups_per_step` × `rollout.group_size` finished trajectories, "
        "timed at the rate the replay measures): an outcome that lands within it supersedes the item and its "
        "correction carries the whole credit in one update (an instant judge trains as `outcome-only`), a later one"
        " finds it trained; 0: at once. `immediate+correction` in `async` mode only "
        "([algorithm](algorithm.md#immediate-hold-algoimmediate_hold))"
    )] = 1.0
    credit: Annotated[CreditMode, doc(
        "`A_final = A_out + ω·A_step`; or `outcome` (`A_final = A_out`)"
    )] = "outcome+step"
    omega: Annotated[NonNegFloat, doc("ω, the weight of stage credit")] = 1.0
    gamma: Annotated[Fraction, doc("γ, the discount of the stage return-to-go")] = 0.95
    eps: Annotated[PosFloat, doc("ε in the normalizations")] = 1e-6
    is_cap: Annotated[PosFloat, doc("truncation of the importance ratio (TIS)")] = 2.0
    staleness_decay: Annotated[Annotated[float, msgspec.Meta(gt=0.0, le=1.0)], doc(
        "each token's weight × decay^staleness"
    )] = 1.0
    max_staleness: Annotated[NonNegInt, doc("admission bound, and hard bound for immediate items")] = 4
    max_correction_staleness: Annotated[NonNegInt | Literal["auto"], doc(
        "learner versions a correction may lag its tokens; the guard holds the learner rather than drop one. "
        "`auto`: twice the longest outcome delay in learner versions (the last 64 groups' and every pending "
        "one's), at least 16, at most `algo.max_correction_staleness_cap`, and the cap until the first group's "
        "outcomes are in, so it follows the judge; raised further when the corrections already admitted would not"
        " fit in the batches before their deadlines (it holds the learner only at the cap); a number fixes it "
        "(every metrics line's `correction_bound` is the bound in use, `correction_bound_needed` what the run "
        "needed: [algorithm.md](algorithm.md#staleness-stalenesspy))"
    )] = "auto"
    max_correction_staleness_cap: Annotated[PosInt, doc(
        "`auto`'s ceiling: the stalest correction a run will train; past it the guard holds the learner as a "
        "fixed bound would"
    )] = 1024
    groups_per_step: Annotated[PosInt, doc(
        "groups one learner step is expected to consume (the admission rule; the round size in `sync` mode)"
    )] = 8
    ppo_epochs: Annotated[PosInt, doc("> 1 switches to the decoupled PPO loss")] = 1
    clip_low: Annotated[Fraction, doc("PPO's lower clip (with `algo.ppo_epochs` > 1)")] = 0.2
    clip_high: Annotated[NonNegFloat, doc("PPO's upper clip")] = 0.28
    aggregation: Annotated[Literal["token-mean", "seq-mean-token-sum", "token-sum"], doc(
        "token-mean: Σ ℓ / (the batch's action tokens); seq-mean-token-sum: Σ ℓ / (items · seq_norm) (Dr. GRPO); "
        "token-sum: Σ ℓ / token_norm, a per-token weight that does not depend on what the batch holds."
    )] = "token-mean"
    seq_norm: Annotated[PosFloat, doc("the fixed normalizer of `seq-mean-token-sum`")] = 8.0
    token_norm: Annotated[PosFloat, doc("the fixed normalizer of `token-sum`")] = 256.0
    kl_beta: Annotated[NonNegFloat, doc("KL to the initial policy (k3); 0: off")] = 0.0
    entropy_coef: Annotated[NonNegFloat, doc(
        "entropy bonus `− c·H(π)` per action token: keeps the trap task's policies off the traps "
        "([why](algorithm.md#entropy-bonus-algoentropy_coef))"
    )] = 0.2
    entropy_per: Annotated[Literal["step", "credit"], doc(
        "step (the default): on every trained action token (immediate+correction trains a token twice, over ~5× "
        "the steps); credit: on every trained action token, weighted by |its advantage in the item| (A_imm or C),"
        " so a token whose stage credit and outcome disagree (an immediate push undone by its correction) gets "
        "more bonus than one whose credit came in one piece: the one rule that met every delayed-judge target "
        "measured with traps, slower on the hunt (docs/research/log.md)."
    )] = "step"
    correction_guard: Annotated[bool, doc(
        "Never let the learner run so far ahead of outcomes still being judged that their corrections would pass "
        "max_correction_staleness (docs/algorithm.md, \"Staleness\"): credit_dropped stays 0."
    )] = True
    mode: Annotated[Literal["async", "sync"], doc(
        "async: rollout runs ahead of the learner (admission by max_staleness); sync: lock-step rounds of "
        "groups_per_step groups: generate the round, train exactly its items, then the next round."
    )] = "async"


class WandbConfig(_Section):
    mode: Annotated[Literal["offline", "online", "disabled"], doc(
        "disabled: no W&B (the metrics.jsonl files are always written); offline: run files to sync later (`wandb "
        "sync`); online: live. Each role runs its own wandb-core service, ~40 s of the default run on 2 cores: "
        "ask for it."
    )] = "disabled"
    project: Annotated[str, doc(
        "the W&B project; every role is its own W&B run, grouped per training run"
    )] = "async-rl"
    entity: Annotated[str | None, doc("the W&B entity")] = None
    tags: Annotated[list[str], doc("tags on every role's run")] = []


class SecurityConfig(_Section):
    curve_dir: Annotated[str | None, doc(
        "CurveZMQ keys written by `async-rl keys DIR --workers N`: every ZeroMQ socket encrypted and "
        "authenticated, each rollout worker under its own key ([architecture.md](architecture.md#security)); "
        "`null`: off"
    )] = None
    insecure: Annotated[bool, doc(
        "`true`: run tcp:// endpoints without `curve_dir`, unauthenticated and in the clear (a loud warning in "
        "every role); `false`: every role refuses to start so, and every socket refuses to open so, whoever "
        "opens it. ipc:// and inproc:// endpoints (`async-rl train` on one machine) need neither"
    )] = False


class RayConfig(_Section):
    """`async-rl train --ray ADDRESS`: how the roles are placed on a Ray cluster (launch/ray_run.py)."""

    learner_ranks: Annotated[PosInt, doc(
        "the learner's ranks, one placement-group bundle each; torch.distributed (gloo on CPU, NCCL on GPUs) runs "
        "over the ranks' own node addresses"
    )] = 1
    learner_cpus: Annotated[NonNegFloat, doc("CPUs of each learner rank's bundle")] = 1.0
    learner_gpus: Annotated[NonNegFloat, doc("GPUs of each learner rank's bundle (0 with `learner.device: cpu`)")] = 0.0
    learner_placement: Annotated[Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"], doc(
        "the placement group's strategy: `PACK` (as few nodes as fit), `STRICT_PACK` (one node), `SPREAD` (as many "
        "nodes as fit), `STRICT_SPREAD` (one node per rank)"
    )] = "PACK"
    rollout_cpus: Annotated[NonNegFloat, doc("CPUs of each rollout worker's actor (spread over the nodes)")] = 1.0
    rollout_gpus: Annotated[NonNegFloat, doc(
        "GPUs of each rollout worker's actor (its torch engine, or SGLang/vLLM servers it starts beside it)"
    )] = 0.0
    replay_cpus: Annotated[NonNegFloat, doc(
        "CPUs of the replay's actor (placed on the driver's node if it fits)"
    )] = 1.0
    connect_timeout_s: Annotated[PosFloat, doc(
        "how long the driver tries to reach the cluster at `--ray ADDRESS` before it gives up with an error"
    )] = 15.0
    placement_timeout_s: Annotated[PosFloat, doc(
        "how long the driver waits for the learner's placement group (an autoscaler may be adding nodes) before it "
        "gives up naming what it asked and what the cluster has"
    )] = 120.0
    runtime_env: Annotated[dict[str, Any], doc(
        "Ray's `runtime_env` for every role's actor, e.g. `{pip: [...], env_vars: {...}}` (`{}`: the nodes' own "
        "Python environment, which must have async-rl installed)"
    )] = {}


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
    ray: RayConfig = msgspec.field(default_factory=RayConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) / self.run.name


def configured_model_path(config: Config) -> Path | None:
    """`model.path` checked (a Hugging Face model directory: it has config.json), or None when it is empty. Cheap:
    `async-rl train` runs it before importing torch, so a wrong path is reported at once."""
    return checked_model_path(config.model.path)


def checked_model_path(model_path: str) -> Path | None:
    """`configured_model_path` for the value of `model.path` itself (what a component below a role's entry gets)."""
    if not model_path:
        return None
    path = Path(model_path)
    if not (path / "config.json").exists():
        raise ConfigError(f"model.path: {path} is not a Hugging Face model directory (no config.json)")
    return path
