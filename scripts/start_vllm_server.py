#!/usr/bin/env python3
"""Start a real vLLM server on the CPU for tests and wait until it serves.

Runs with any Python 3 (stdlib only); the server itself runs with the python of the venv built by
scripts/build_vllm_env.sh.

    python scripts/start_vllm_server.py --model-path DIR --port 8000 [--venv PATH] [--log FILE] [--timeout 300]
        [--max-lora-rank R] [-- EXTRA VLLM ARGS]

Always passes --dtype float32 --enforce-eager --max-model-len 256 (--max-model-len), --logprobs-mode
processed_logprobs (a token's log-prob under the temperature the request asked for, what the learner
recomputes), --enable-scale-out (the token-in/token-out /inference/v1/generate, whose replies carry each
token's weight version) and --weight-transfer-config '{"backend": "async_rl"}' (scripts/vllm_plugin/: the learner's
broadcast of `rollout.vllm.weight_sync: distributed`; it costs nothing until a learner joins, so every server can
take either sync); sets VLLM_SERVER_DEV_MODE=1 (the RL routes: /pause, /resume, /collective_rpc,
/update_weight_version, /weight_info), VLLM_CPU_KVCACHE_SPACE=1 (GiB), VLLM_CPU_OMP_THREADS_BIND=nobind and
OMP_NUM_THREADS (--threads). The CPU attention kernels need a head dimension of 32, 64, 80, 96, 112, 128,
160, 192, 224, 256 or 512 (the default tiny model's 16 fails at the first request).

--max-lora-rank R (> 0: vLLM's 1, 8, 16, 32, 64, ...; >= learner.lora.rank) lets the server load the learner's LoRA
adapters (`rollout.vllm.lora: adapter`): --enable-lora --max-lora-rank R --max-loras 4 --max-cpu-loras 8 and
VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (the /v1/load_lora_adapter and /v1/unload_lora_adapter routes).

On success prints one JSON line {"pid", "pgid", "url", "log", "startup_s"} and exits 0, leaving the server
running in its own process group (stop it with os.killpg(pgid, SIGTERM)); on failure kills what it started,
prints the log's tail to stderr and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from start_sglang_server import launch, server_args, server_url  # noqa: E402  (the same arguments and launch)

WEIGHT_TRANSFER_BACKEND = "async_rl"  # scripts/vllm_plugin/async_rl_vllm_plugin.py, installed by build_vllm_env.sh
DEFAULT_VENV = os.environ.get(
    "ASYNC_RL_VLLM_VENV", os.path.join(os.path.expanduser("~"), ".cache", "async-rl", "vllm-venv"))


def build_command(venv: str, model_path: str, port: int, host: str, max_model_len: int, extra: list[str],
                  max_lora_rank: int = 0) -> list[str]:
    # `vllm serve` asks importlib.metadata for a "vllm" distribution, which vllm-cpu is not: run the module.
    lora = ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", "4", "--max-cpu-loras", "8"]
    return [os.path.join(venv, "bin", "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
            "--host", host, "--port", str(port), "--dtype", "float32", "--enforce-eager",
            "--max-model-len", str(max_model_len), "--logprobs-mode", "processed_logprobs", "--enable-scale-out",
            "--weight-transfer-config", json.dumps({"backend": WEIGHT_TRANSFER_BACKEND}),
            *(lora if max_lora_rank > 0 else []), *extra]


def server_env(threads: int, lora: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    for leak in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP"):  # the server venv sees nothing of the caller's python
        env.pop(leak, None)
    env.update(VLLM_SERVER_DEV_MODE="1", OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def main() -> int:
    ap = server_args(__doc__ or "", DEFAULT_VENV)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--max-lora-rank", type=int, default=0, help="> 0: load LoRA adapters up to this rank")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="extra vLLM args after --")
    args = ap.parse_args()
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    if not os.path.exists(os.path.join(args.venv, "bin", "python")):
        print(f"no vLLM venv at {args.venv}; run scripts/build_vllm_env.sh", file=sys.stderr)
        return 1
    log_path = args.log or os.path.join(args.venv, f"server-{args.port}.log")
    cmd = build_command(args.venv, args.model_path, args.port, args.host, args.max_model_len, extra, args.max_lora_rank)
    url, context = server_url(args.host, args.port, extra)  # with --ssl-certfile: https, checked against its CA
    return launch(cmd, server_env(args.threads, args.max_lora_rank > 0), url, log_path, args.timeout, "vLLM",
                  "/health", context)


if __name__ == "__main__":
    sys.exit(main())
