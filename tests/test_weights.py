"""Weights by format (issue 55): the learner's publisher (learner/publisher.py `make_publisher`, driven for real)
publishes each format (`safetensors`, `hf-dir`, `distributed` into the session's two REAL SGLang servers over gloo),
and a rollout worker's WeightsFollower, its engine configured for another format, loads it by the notice's format or
refuses it by name; a format no learner writes is refused by name too.

The SGLang tests use tests/conftest.py's pool (`servers`, xdist group "sglang": started once per session, shared
with tests/test_sglang.py, reset to version 0 before each test) and publish from the pool's model directory, so the
shapes match what the servers serve. What a worker sends its servers is read off its engine's HTTP client (a request
hook, as tests/test_sglang.py does); what a server holds, off the server itself: its `weight_version` and every
tensor of the published state through SGLang's `/get_weights_by_name`, compared exactly."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import httpx
import pytest
import torch
import zmq
from rollout_helpers import model_dir_for, sglang_settings
from sglang_server import Pool, free_port

from async_rl.config_load import load_config
from async_rl.model import load_model
from async_rl.protocol import WeightsPublished
from async_rl.security import load_keys, sglang_headers
from async_rl.transport import bind_publisher, connect_subscriber, send
from async_rl.weights.base import WeightsFormatError, loader_for
from learner.publisher import ServerHeaders, WeightPublisher, make_publisher
from learner.settings import LearnerSettings
from rollout.engines.sglang import SGLangEngine
from rollout.engines.thread import EngineThread
from rollout.engines.torch_engine import TorchEngine
from rollout.worker import WeightsFollower

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return model_dir_for(load_config(None, [f"run.dir={tmp_path_factory.mktemp('base')}", "run.seed=1"]))


def new_weights(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v + 0.1 * torch.randn_like(v) for k, v in load_model(model_dir).state_dict().items()}


def learner_config(run_dir: Path, *overrides: str):
    return load_config(None, [f"run.dir={run_dir}", f"learner.publish_endpoint=tcp://127.0.0.1:{free_port()}",
                              "security.insecure=true", *overrides])


def publisher_of(context: zmq.Context, config, model_dir: Path) -> WeightPublisher:
    """The learner's publisher (rank 0's) as the learner's entry builds it from the config."""
    return make_publisher(context, LearnerSettings.from_config(config).publisher, model_dir,
                          load_keys(config.security.curve_dir, "learner"),
                          lambda: ServerHeaders(sglang_headers(config.rollout.sglang.api_key_file)))


class Worker:
    """A rollout worker's weights side: its engine on its thread and its WeightsFollower on the learner's PUB."""

    def __init__(self, context: zmq.Context, engine, endpoint: str, run_dir: Path) -> None:
        self.engine = EngineThread(engine)
        self.socket = connect_subscriber(context, endpoint, None, insecure=True)
        self.follower = WeightsFollower(self.socket, self.engine, run_dir)

    def close(self) -> None:
        self.socket.close(linger=0)
        self.engine.close()
        self.engine.engine.close()


def follow(publisher: WeightPublisher | None, workers: list[Worker], done, timeout_s: float = 30.0) -> None:
    """Run the learner's republish and the workers' syncs (as their loops do) until `done()`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the workers never took the notice"
        if publisher is not None:
            publisher.republish_if_due()
        for worker in workers:
            worker.follower.sync()
        time.sleep(0.05)
    for worker in workers:  # let a load in flight finish
        if worker.follower._loading is not None:
            worker.follower._loading.result()


def loaded(engine: TorchEngine, state: dict[str, torch.Tensor]) -> bool:
    model = engine.model.state_dict()
    return all(torch.equal(model[k], v) for k, v in state.items())


def sglang_worker(context: zmq.Context, servers: Pool, endpoint: str, run_dir: Path,
                  **config) -> tuple[Worker, list[dict]]:
    """A worker on the pool's servers and the weight calls its engine sends them (its HTTP client's request hook):
    each call's server and path, and for a load from disk the directory sent and the files in it as it is sent."""
    engine = SGLangEngine(sglang_settings(urls=servers.urls, request_timeout_s=60.0, **config))
    calls: list[dict] = []

    def on_request(request: httpx.Request) -> None:
        if request.url.path.startswith("/update_weight"):
            call = {"server": f"{request.url.scheme}://{request.url.host}:{request.url.port}",
                    "path": request.url.path}
            model_path = json.loads(request.content or b"{}").get("model_path")
            if model_path is not None:
                call["model_path"] = model_path
                call["files"] = sorted(p.name for p in Path(model_path).iterdir())
            calls.append(call)

    engine.http.event_hooks = {"request": [on_request], "response": []}
    return Worker(context, engine, endpoint, run_dir), calls


def versions(servers: Pool) -> list[str]:
    return [server.model_info()["weight_version"] for server in servers.servers]


def serves(servers: Pool, state: dict[str, torch.Tensor]) -> bool:
    """Whether every server holds exactly these tensors (SGLang's /get_weights_by_name, whole: all rows; it maps the
    HF names onto its fused parameters)."""
    for server in servers.servers:
        for name, tensor in state.items():
            reply = httpx.post(server.url + "/get_weights_by_name", timeout=30,
                               json={"name": name, "truncate_size": tensor.shape[0]})
            reply.raise_for_status()
            served = torch.tensor(reply.json(), dtype=torch.float32)
            if served.shape != tensor.shape or not torch.equal(served, tensor.float()):
                return False
    return True


@pytest.mark.sglang
@pytest.mark.xdist_group("sglang")
def test_safetensors_published_loads_in_the_built_in_engine_and_sglang_refuses_it_by_name(servers, tmp_path, caplog):
    model_dir = servers.model_dir
    config = learner_config(tmp_path / "run")  # rollout.engine: torch
    context = zmq.Context()
    publisher = publisher_of(context, config, model_dir)
    built_in = Worker(context, TorchEngine(model_dir, seed=0), config.learner.publish_endpoint, config.run_dir)
    sglang, sent = sglang_worker(context, servers, config.learner.publish_endpoint,
                                 config.run_dir)  # weight_sync: disk, an hf-dir worker
    try:
        state = new_weights(model_dir, 1)
        with caplog.at_level(logging.ERROR, logger="async_rl.rollout"):
            assert publisher.publish(state, 1)
            assert publisher.latest.format == "safetensors"
            follow(publisher, [built_in, sglang],
                   lambda: built_in.engine.version == 1 and sglang.follower.refused == (1, "safetensors"))
        assert loaded(built_in.engine.engine, state)
        assert sglang.engine.version == 0 and sent == [], "nothing was sent to the servers"
        assert versions(servers) == ["0", "0"]
        assert any("policy version 1 not loaded: the SGLang engine cannot load weights of format 'safetensors'"
                   in record.getMessage() and "it loads 'hf-dir', 'distributed'" in record.getMessage()
                   for record in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        built_in.close()
        sglang.close()
        publisher.close()
        context.term()


@pytest.mark.sglang
@pytest.mark.xdist_group("sglang")
def test_an_hf_dir_published_for_sglang_loads_in_a_distributed_sglang_worker_and_in_the_built_in_engine(
        servers, tmp_path):
    model_dir = servers.model_dir
    config = learner_config(tmp_path / "run", "rollout.engine=sglang", f"rollout.sglang.urls={servers.urls}")
    context = zmq.Context()
    publisher = publisher_of(context, config, model_dir)  # weight_sync: disk
    built_in = Worker(context, TorchEngine(model_dir, seed=0), config.learner.publish_endpoint, config.run_dir)
    sglang, sent = sglang_worker(context, servers, config.learner.publish_endpoint, config.run_dir,
                                 weight_sync="distributed")
    try:
        state = new_weights(model_dir, 2)
        assert publisher.publish(state, 1)
        assert publisher.latest.format == "hf-dir" and publisher.latest.path.endswith("hf-v1")
        follow(publisher, [built_in, sglang], lambda: built_in.engine.version == 1 and sglang.engine.version == 1)
        assert loaded(built_in.engine.engine, state)
        # One load per server, both through one view of links to the checked files, as with weight_sync: disk.
        assert sorted(call["server"] for call in sent) == sorted(servers.urls)
        assert {call["path"] for call in sent} == {"/update_weights_from_disk"}
        [view] = {call["model_path"] for call in sent}
        assert Path(view).name.startswith(".sglang-load-hf-v1-") and not Path(view).exists()
        assert all("manifest.json" in call["files"] and "model.safetensors" in call["files"] for call in sent)
        assert versions(servers) == ["1", "1"] and serves(servers, state)

        # The loader checks the directory's manifest: a changed file is refused, never loaded, in either engine.
        assert publisher.publish(new_weights(model_dir, 3), 2)
        weights_file = Path(publisher.latest.path) / "model.safetensors"
        data = bytearray(weights_file.read_bytes())
        data[-10] ^= 0xFF
        weights_file.write_bytes(bytes(data))
        follow(publisher, [built_in, sglang], lambda: built_in.engine.engine.weights_refused == 1
               and sglang.engine.engine.weights_refused == 1)
        assert built_in.engine.version == 1 and sglang.engine.version == 1 and loaded(built_in.engine.engine, state)
        assert len(sent) == 2 and versions(servers) == ["1", "1"] and serves(servers, state)
    finally:
        built_in.close()
        sglang.close()
        publisher.close()
        context.term()


@pytest.mark.sglang
@pytest.mark.xdist_group("sglang")
def test_distributed_weights_pushed_to_sglang_are_taken_by_a_disk_worker_and_refused_by_name_by_the_built_in_engine(
        servers, tmp_path, caplog):
    model_dir = servers.model_dir
    config = learner_config(tmp_path / "run", "rollout.engine=sglang", f"rollout.sglang.urls={servers.urls}",
                            "rollout.sglang.weight_sync=distributed", "rollout.sglang.dist_backend=gloo",
                            f"rollout.sglang.dist_master_port={free_port()}")
    context = zmq.Context()
    publisher = publisher_of(context, config, model_dir)  # joins the servers' group, as rank 0
    built_in = Worker(context, TorchEngine(model_dir, seed=0), config.learner.publish_endpoint, config.run_dir)
    sglang, sent = sglang_worker(context, servers, config.learner.publish_endpoint,
                                 config.run_dir)  # weight_sync: disk
    try:
        state = new_weights(model_dir, 4)
        with caplog.at_level(logging.ERROR, logger="async_rl.rollout"):
            assert publisher.publish(state, 1)
            assert (publisher.latest.format, publisher.latest.path) == ("distributed", "")
            follow(publisher, [built_in, sglang],
                   lambda: sglang.engine.version == 1 and built_in.follower.refused == (1, "distributed"))
        assert versions(servers) == ["1", "1"] and serves(servers, state), "every server holds the pushed tensors"
        assert sent == [], "the disk worker took the servers' version and loaded nothing"
        assert built_in.engine.version == 0 and not loaded(built_in.engine.engine, state)
        assert any("policy version 1 not loaded: the built-in engine cannot load weights of format 'distributed'"
                   in record.getMessage() and "it loads 'safetensors', 'hf-dir'" in record.getMessage()
                   for record in caplog.records), [r.getMessage() for r in caplog.records]
        refusals = len(caplog.records)
        until = time.monotonic() + 2.5  # the learner repeats its notice every 2 s
        follow(publisher, [built_in], lambda: time.monotonic() > until)
        assert len(caplog.records) == refusals, "a refused notice repeated by the learner is not refused again"

        # A worker that starts later catches up from latest.json, by the format recorded there.
        late, late_sent = sglang_worker(context, servers, config.learner.publish_endpoint, config.run_dir)
        assert late.engine.version == 1 and late_sent == []
        late.close()
    finally:
        built_in.close()
        sglang.close()
        publisher.close()
        context.term()


@pytest.mark.parametrize(("weights_format", "what"), [
    ("gguf", "a format no async-rl learner of this version writes"),
    ("lora-adapter", "a PEFT LoRA adapter directory"),  # written for vLLM servers (rollout.vllm.lora: adapter)
])
def test_a_format_the_engine_cannot_load_is_refused_by_name(model_dir, tmp_path, caplog, weights_format, what):
    context = zmq.Context()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = bind_publisher(context, endpoint, None, insecure=True)
    built_in = Worker(context, TorchEngine(model_dir, seed=0), endpoint, tmp_path)
    try:
        notice = WeightsPublished(version=3, path=str(tmp_path / "lora-v3"), format=weights_format)
        with caplog.at_level(logging.ERROR, logger="async_rl.rollout"):
            follow(None, [built_in], lambda: send(pub, notice) or built_in.follower.refused == (3, weights_format))
        assert built_in.engine.version == 0
        assert any(f"the built-in engine cannot load weights of format {weights_format!r} ({what}"
                   in record.getMessage() for record in caplog.records)
    finally:
        built_in.close()
        pub.close(linger=0)
        context.term()
    with pytest.raises(WeightsFormatError, match="receiver X cannot load weights of format 'hf-dir'"):
        loader_for({"safetensors": lambda version, path: None}, "hf-dir", "receiver X")
