"""A server started closed (REAL SGLang): a worker's key generates and nothing else, the learner's admin key alone
changes the servers, and every client speaks TLS and verifies the server.

One SGLang server started with `--api-key`, `--admin-api-key` and a certificate from a test CA (tests/conftest.py
`keyed_pool`): SGLang's own admin routes take the admin key alone, so a compromised rollout worker cannot load,
pause, abort or swap weights on the servers every worker shares. With `rollout.sglang.admin_key_file` the learner
loads each `disk` version into the servers itself (learner/sglang_disk.py) and the workers only read the version,
as with the broadcast. `rollout.sglang.ca_file` names the CA every client verifies the servers with.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from rollout_helpers import sglang_settings
from sglang_server import ADMIN_KEY, API_KEY, bearer, free_port

from async_rl.config import Config, RolloutConfig, SGLangConfig
from async_rl.errors import ConfigError, WeightsError
from async_rl.model import load_model
from async_rl.security import sglang_admin_headers, sglang_headers
from learner.publisher import ServerHeaders, make_publisher
from learner.settings import LearnerSettings
from learner.sglang_sync import DistributedWeightSync
from rollout.engines import EngineUnavailable, SamplingParams
from rollout.engines.sglang import SGLangEngine

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.xdist_group("sglang")]

# The routes that change what a server generates with, and a body each would accept from the right key.
ADMIN_ROUTES = {
    "/update_weights_from_disk": {"model_path": "/nonexistent", "weight_version": "666"},
    "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                   "world_size": 2, "group_name": "evil", "backend": "gloo"},
    "/update_weights_from_distributed": {"names": [], "dtypes": [], "shapes": [], "group_name": "evil"},
    "/update_weight_version": {"new_version": "666"},
    "/pause_generation": {"mode": "abort"},
    "/continue_generation": {},
    "/abort_request": {"abort_all": True},
    "/load_lora_adapter": {"lora_name": "evil", "lora_path": "/nonexistent"},
    "/release_memory_occupation": {},
    "/flush_cache": {},
}


@pytest.fixture
def keyed(keyed_pool, tmp_path):
    keyed_pool.reset()
    (tmp_path / "api-key").write_text(API_KEY + "\n")
    (tmp_path / "admin-key").write_text(ADMIN_KEY + "\n")
    return keyed_pool


def ca(keyed) -> str:
    return keyed.servers[0].CA


def test_the_workers_key_generates_and_is_refused_on_every_route_that_changes_the_server(keyed):
    url = keyed.urls[0]
    assert url.startswith("https://")
    for path, body in ADMIN_ROUTES.items():
        for key in (API_KEY, None):
            reply = httpx.post(url + path, json=body, headers=bearer(key) if key else {}, timeout=30, verify=ca(keyed))
            assert reply.status_code == 401, (path, key, reply.status_code, reply.text[:200])
    assert keyed.servers[0].model_info()["weight_version"] == "0"  # nothing above changed it
    generate = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    reply = httpx.post(url + "/generate", json=generate, headers=bearer(API_KEY), timeout=60, verify=ca(keyed))
    assert reply.status_code == 200
    # and the learner's key is not a generation key: each role holds what it needs and no more
    reply = httpx.post(url + "/generate", json=generate, headers=bearer(ADMIN_KEY), timeout=60, verify=ca(keyed))
    assert reply.status_code == 401


def test_a_client_without_the_servers_ca_refuses_the_connection(keyed, tmp_path):
    """TLS is verified, not just on: the system's trust store does not know the test CA, so a worker without
    `rollout.sglang.ca_file` gets no server, and a CA file given for an http:// URL is refused by name."""
    with pytest.raises(EngineUnavailable, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        SGLangEngine(sglang_settings(urls=keyed.urls, api_key_file=str(tmp_path / "api-key"),
                                     unavailable_timeout_s=1))
    plain = keyed.urls[0].replace("https://", "http://")
    with pytest.raises(ConfigError, match=r"rollout.sglang.ca_file: set, but http://127.0.0.1:\d+ is not https://"):
        SGLangEngine(sglang_settings(urls=[plain], ca_file=ca(keyed)))


def test_the_learner_loads_disk_versions_with_the_admin_key_and_the_worker_reads_them(keyed, tmp_path):
    """`weight_sync: disk` with an admin key: the learner's publisher writes hf-v1/, the server loads it, and the
    notice says "distributed" (in the servers already): the worker's engine takes the version from the server."""
    sglang = SGLangConfig(urls=keyed.urls, api_key_file=str(tmp_path / "api-key"),
                          admin_key_file=str(tmp_path / "admin-key"), ca_file=ca(keyed))
    config = Config(rollout=RolloutConfig(engine="sglang", sglang=sglang))
    settings = LearnerSettings.from_config(config).publisher
    settings = msgspec.structs.replace(settings, weights_dir=tmp_path / "weights",
                                       publish_endpoint=f"ipc://{tmp_path}/w.sock")
    headers = ServerHeaders(sglang_headers(sglang.api_key_file), sglang_admin_headers(sglang.admin_key_file))
    assert headers.admin == bearer(ADMIN_KEY) and headers.api == bearer(API_KEY)
    context = zmq.Context()
    with pytest.raises(WeightsError, match="HTTP 401: the server refuses the learner's admin key"):
        make_publisher(context, settings, keyed.model_dir, None, lambda: ServerHeaders(headers.api, headers.api))
    engine = SGLangEngine(sglang_settings(urls=keyed.urls, api_key_file=str(tmp_path / "api-key"), ca_file=ca(keyed)))
    publisher = make_publisher(context, settings, keyed.model_dir, None, lambda: headers)
    try:
        model = load_model(keyed.model_dir)
        assert publisher.publish(model.state_dict(), 1)
        notice = publisher.latest
        assert notice.format == "distributed" and Path(notice.path).name == "hf-v1"
        assert json.loads((tmp_path / "weights" / "latest.json").read_text())["format"] == "distributed"
        assert keyed.servers[0].model_info()["weight_version"] == "1"
        engine.update_weights(notice.version, notice.path, notice.format)
        assert engine.version == 1
        assert engine.generate([[1, 5, 6]], SamplingParams(max_new_tokens=2))[0].versions == [1, 1]
    finally:
        publisher.close()
        engine.close()
        context.destroy(linger=0)


def test_the_broadcast_joins_with_the_admin_key_and_not_with_the_workers(keyed):
    model = load_model(keyed.model_dir).eval()
    sglang = SGLangConfig(urls=keyed.urls, weight_sync="distributed", dist_master_port=free_port(), ca_file=ca(keyed))
    settings = LearnerSettings.from_config(Config(rollout=RolloutConfig(sglang=sglang))).publisher.sglang
    with pytest.raises(RuntimeError, match="HTTP 401: the server refuses the learner's key .*admin_key_file"):
        DistributedWeightSync(settings, bearer(API_KEY))  # the worker's key cannot make the server join a group
    settings = msgspec.structs.replace(settings, dist_master_port=free_port())  # the refused one's store is gone
    sync = DistributedWeightSync(settings, bearer(API_KEY), bearer(ADMIN_KEY))
    try:
        sync.push(model.state_dict(), version=2)
        assert keyed.servers[0].model_info()["weight_version"] == "2"
    finally:
        sync.close()


def test_train_with_keyed_servers_the_learner_loads_every_version(keyed, tmp_path):
    """Slow: `async-rl train` on the closed server with disk sync: the workers generate with the API key, the learner
    loads each version with the admin key, all over verified TLS; the run reaches its versions and the server holds
    the last one."""
    run = subprocess.run(
        [sys.executable, "-m", "launch.cli", "train", f"run.dir={tmp_path}", "run.name=t",
         f"model.path={keyed.model_dir}", f"rollout.sglang.urls=[{keyed.urls[0]}]", "wandb.mode=disabled",
         "run.target_success=null", "rollout.engine=sglang", "rollout.workers=1", "rollout.group_size=4",
         "env.kwargs.num_tasks=4", "learner.min_batch_items=4", "learner.batch_wait_s=0.2",
         "run.max_versions=8", "run.eval_samples_per_task=0",
         f"rollout.sglang.api_key_file={tmp_path / 'api-key'}",
         f"rollout.sglang.admin_key_file={tmp_path / 'admin-key'}", f"rollout.sglang.ca_file={ca(keyed)}"],
        capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in lines] == list(range(1, 9))
    assert keyed.servers[0].model_info()["weight_version"] == "8"
    logs = {p.name: p.read_text() for p in (tmp_path / "t" / "logs").iterdir()}
    learner = "".join(text for name, text in logs.items() if name.startswith("learner"))
    rollout = "".join(text for name, text in logs.items() if name.startswith("rollout"))
    assert "policy version 8 loaded into 1/1 SGLang server(s)" in learner
    assert "loaded from" not in rollout  # the worker loads nothing: it reads the server's version
