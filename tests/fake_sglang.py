"""A stand-in for one SGLang server, for tests of the weights' paths without the SGLang venv: the HTTP calls the
engine and the learner make (health, model and server info, the weight-update group, /update_weights_from_disk,
/update_weights_from_distributed), with the distributed group joined for real (torch.distributed over gloo, as
rank `rank_offset`) and every tensor of a broadcast received. No generation.

Run as `python fake_sglang.py PORT OUT_DIR` (only torch, safetensors and the standard library); it writes what it
took to OUT_DIR: `state.json` (its weight version, the directories it loaded, the broadcasts it received) and
`received-v<N>.safetensors` (the tensors of version N's broadcast). `FakeSGLang` starts and stops one.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TIMEOUT = datetime.timedelta(minutes=1)


class _State:
    def __init__(self, out: Path) -> None:
        self.out, self.version, self.loads, self.received, self.group = out, 0, [], [], None
        self.lock = threading.Lock()

    def save(self) -> None:
        (self.out / "state.json").write_text(json.dumps({"version": self.version, "loads": self.loads,
                                                         "received": self.received}))


def _join(body: dict):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, GroupName, PrefixStore, _new_process_group_helper, _world

    store = dist.TCPStore(body["master_address"], body["master_port"], body["world_size"], is_master=False,
                          timeout=TIMEOUT)
    group, _ = _new_process_group_helper(body["world_size"], body["rank_offset"], [], Backend(body["backend"]),
                                         PrefixStore(body["group_name"], store),
                                         group_name=GroupName(body["group_name"]), timeout=TIMEOUT)
    _world.pg_group_ranks[group] = {i: i for i in range(body["world_size"])}
    return group


def _serve(port: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    state = _State(out)
    state.save()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _reply(self, body: dict, status: int = 200) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/get_model_info":
                self._reply({"weight_version": str(state.version)})
            elif self.path == "/get_server_info":
                self._reply({"tp_size": 1})
            else:  # /health, /health_generate
                self._reply({})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/init_weights_update_group":
                state.group = _join(body)
            elif self.path == "/destroy_weights_update_group" and state.group is not None:
                dist.destroy_process_group(state.group)
                state.group = None
            elif self.path == "/update_weights_from_distributed":
                tensors = {}
                for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
                    tensors[name] = torch.empty(shape, dtype=getattr(torch, dtype))
                    dist.broadcast(tensors[name], src=0, group=state.group)
                version = int(body["weight_version"])
                save_file(tensors, str(out / f"received-v{version}.safetensors"))
                with state.lock:
                    state.version = version
                    state.received.append(version)
                    state.save()
            elif self.path == "/update_weights_from_disk":
                path = Path(body["model_path"])
                load_file(str(path / "model.safetensors"))  # it reads what it was sent
                with state.lock:
                    state.version = int(body["weight_version"])
                    state.loads.append({"path": str(path), "files": sorted(p.name for p in path.iterdir())})
                    state.save()
            self._reply({"success": True})

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


class FakeSGLang:
    """One fake server in a child process (its own torch.distributed state), on a free port."""

    def __init__(self, out: Path, port: int) -> None:
        self.out, self.url = out, f"http://127.0.0.1:{port}"
        out.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen([sys.executable, __file__, str(port), str(out)])
        import httpx

        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(self.url + "/health", timeout=1.0)
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError("the fake SGLang server did not start") from None
                time.sleep(0.1)

    def state(self) -> dict:
        return json.loads((self.out / "state.json").read_text())

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), Path(sys.argv[2]))
