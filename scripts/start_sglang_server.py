#!/usr/bin/env python3
"""Start a real SGLang server on the CPU for tests and wait until it serves.

Runs with any Python 3 (stdlib only); the server itself runs with the python of
the venv built by scripts/build_sglang_env.sh.

    python scripts/start_sglang_server.py --model-path DIR --port 30000 \
        [--venv PATH] [--log FILE] [--timeout 300] [--build] [-- EXTRA SGLANG ARGS]

Always passes --device cpu --dtype float32 --max-total-tokens 8192 and (unless
--no-sleep-on-idle) --sleep-on-idle; sets SGLANG_USE_CPU_ENGINE=1 and
OMP_NUM_THREADS=1 (--threads).  E.g. add `-- --skip-tokenizer-init` for a model
directory without tokenizer files (then only input_ids prompts are accepted).

On success prints one JSON line: {"pid": ..., "pgid": ..., "url": ..., "log": ...,
"startup_s": ...} and exits 0, leaving the server running in its own process
group.  Stop it with:  kill -TERM -- -<pgid>   (or os.killpg(pgid, SIGTERM)).
On failure it kills what it started, prints the log tail to stderr, exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_VENV = os.environ.get(
    "ASYNC_RL_SGLANG_VENV",
    os.path.join(os.path.expanduser("~"), ".cache", "async-rl", "sglang-venv"),
)


def build_command(venv: str, model_path: str, port: int, host: str, extra: list[str]) -> list[str]:
    return [
        os.path.join(venv, "bin", "python"),
        "-m",
        "sglang.launch_server",
        "--model-path", model_path,
        "--host", host,
        "--port", str(port),
        "--device", "cpu",
        "--dtype", "float32",
        "--max-total-tokens", "8192",
        *extra,
    ]


# Without --sleep-on-idle the idle scheduler process busy-polls one core at 100%.
DEFAULT_EXTRA = ["--sleep-on-idle"]


def server_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for leak in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP"):  # the server venv sees nothing of the caller's python
        env.pop(leak, None)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, path: str = "/health_generate",
                 context: ssl.SSLContext | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url + path, timeout=10, context=context) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.5)
    return False


def server_args(doc: str, default_venv: str) -> argparse.ArgumentParser:
    """The arguments every start script takes (start_vllm_server.py too)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--venv", default=default_venv)
    ap.add_argument("--log", default=None, help="server log file (default: <venv>/server-<port>.log)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for the server")
    return ap


def main() -> int:
    ap = server_args(__doc__ or "", DEFAULT_VENV)
    ap.add_argument("--build", action="store_true", help="run build_sglang_env.sh first")
    ap.add_argument("--no-sleep-on-idle", action="store_true",
                    help="do not pass --sleep-on-idle (the idle scheduler then spins a core)")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="extra sglang args after --")
    args = ap.parse_args()
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    if not args.no_sleep_on_idle:
        extra = [a for a in DEFAULT_EXTRA if a not in extra] + extra

    if args.build:
        env = dict(os.environ, ASYNC_RL_SGLANG_VENV=args.venv)
        subprocess.run(["bash", os.path.join(HERE, "build_sglang_env.sh")], env=env, check=True,
                       stdout=subprocess.DEVNULL)
    if not os.path.exists(os.path.join(args.venv, "bin", "python")):
        print(f"no SGLang venv at {args.venv}; run scripts/build_sglang_env.sh", file=sys.stderr)
        return 1

    log_path = args.log or os.path.join(args.venv, f"server-{args.port}.log")
    cmd = build_command(args.venv, args.model_path, args.port, args.host, extra)
    url, context = server_url(args.host, args.port, extra)
    return launch(cmd, server_env(args.threads), url, log_path, args.timeout, "SGLang", "/health_generate", context)


def server_url(host: str, port: int, extra: list[str]) -> tuple[str, ssl.SSLContext | None]:
    """The server's URL, and with `--ssl-certfile` among its arguments (TLS, docs/sglang.md#tls) the context the
    readiness check verifies it with (the CAs of `--ssl-ca-certs`, else the certificate itself, as a self-signed
    one). Shared with start_vllm_server.py."""
    def value(flag: str) -> str | None:
        return extra[extra.index(flag) + 1] if flag in extra[:-1] else None

    certfile = value("--ssl-certfile")
    if certfile is None:
        return f"http://{host}:{port}", None
    return f"https://{host}:{port}", ssl.create_default_context(cafile=value("--ssl-ca-certs") or certfile)


def launch(cmd: list[str], env: dict[str, str], url: str, log_path: str, timeout: float, name: str,
           health_path: str, context: ssl.SSLContext | None = None) -> int:
    """Start `cmd` in its own process group, logging to `log_path`; print its JSON line once `health_path`
    answers 200 (exit status 0), or kill it and print the log's tail (1). Shared with start_vllm_server.py."""
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    if not wait_healthy(url, proc, timeout, health_path, context):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        with open(log_path, "rb") as f:
            tail = f.read()[-4000:].decode(errors="replace")
        print(f"{name} server did not become healthy (exit={proc.returncode}); log {log_path}:\n{tail}",
              file=sys.stderr)
        return 1
    print(json.dumps({"pid": proc.pid, "pgid": proc.pid, "url": url, "log": log_path,
                      "startup_s": round(time.monotonic() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
