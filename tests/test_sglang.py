"""The SGLang engine and both weight-sync paths against REAL SGLang servers (CPU, the tiny model).

Two servers are started once per session (tests/conftest.py's `pool`: 30-45 s on these 2 cores) on the version-0
model directory and shared; each test resets them to version 0 first, starting a killed one again (30-45 s more), so
the two tests that kill a server come last in the file and are marked `kills_sglang_server`, which runs them after
the pool's tests in other files too (tests/conftest.py): one restart between them, none after. The server venv is
built by scripts/build_sglang_env.sh when missing (1-2 min); the tests skip only if that build fails.

Log-prob tolerance: SGLang (float32, torch_native attention) and the learner's transformers forward agree to
about 5e-6 on this model; the tests allow LOGPROB_TOL.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from rollout_helpers import sglang_settings
from sglang_server import free_port

from async_rl.config import Config, RolloutConfig, SGLangConfig
from async_rl.loss import token_logprobs
from async_rl.model import WeightsError, load_model
from async_rl.security import sglang_headers
from async_rl.weights.hf_dir import write_hf_dir
from learner.settings import LearnerSettings
from learner.sglang_sync import DistributedWeightSync
from rollout.engines import EngineStopped, EngineUnavailable, SamplingParams
from rollout.engines.sglang import Piece, SGLangEngine

pytestmark = [pytest.mark.sglang, pytest.mark.slow,
              pytest.mark.xdist_group("sglang")]  # one pool of SGLang servers for the whole file

LOGPROB_TOL = 1e-4
EOS = 1  # the tiny model's <eos> (async_rl.model.SPECIALS)
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 12, 13, 14, 15, 16, 17, 18], [1, 20, 21], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def engine_for(urls: list[str], **overrides) -> SGLangEngine:
    return SGLangEngine(sglang_settings(urls=urls, request_timeout_s=30.0, **overrides))


def max_logprob_diff(model: torch.nn.Module, prompts, generations, temperature: float) -> float:
    """Largest |SGLang log-prob − learner recomputation| over every generated token."""
    worst = 0.0
    with torch.no_grad():
        for prompt, generation in zip(prompts, generations, strict=True):
            ids = torch.tensor([prompt + generation.token_ids])
            recomputed = token_logprobs(model(input_ids=ids).logits, ids, temperature)[0, len(prompt) - 1 :]
            worst = max(worst, (recomputed - torch.tensor(generation.logprobs)).abs().max().item())
    return worst


def learner_step(model: torch.nn.Module, favoured_token: int, steps: int = 3) -> dict[str, torch.Tensor]:
    """A learner-like change: AdamW steps raising log π(favoured_token | prompt) on every prompt."""
    model = model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    for _ in range(steps):
        loss = 0.0
        for prompt in PROMPTS:
            logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
            loss = loss - torch.log_softmax(logits, -1)[favoured_token]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_sglang_logprobs_match_the_learner_recomputation(servers):
    engine = engine_for(servers.urls)
    model = load_model(servers.model_dir).eval()
    assert engine.version == 0
    for temperature in (1.0, 0.7):
        params = SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=12)
        generations = engine.generate(PROMPTS, params)
        assert [len(g.token_ids) for g in generations] == [12] * len(PROMPTS)
        assert all(g.versions == [0] * 12 and g.finish_reason == "length" for g in generations)
        diff = max_logprob_diff(model, PROMPTS, generations, temperature)
        print(f"max |sglang - learner| log-prob diff at T={temperature}: {diff:.2e}")
        assert diff < LOGPROB_TOL
    engine.close()


def test_a_stop_token_ends_the_row_and_is_kept(servers):
    engine = engine_for(servers.urls[:1])
    free = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=30))
    stop = next(t for g in free for t in g.token_ids)  # a token the model does emit
    generations = engine.generate(PROMPTS * 4, SamplingParams(temperature=1.0, max_new_tokens=30,
                                                              stop_token_ids=[stop]))
    stopped = [g for g in generations if g.finish_reason == "stop"]
    assert stopped
    # With stop tokens asked for, SGLang also stops at the model's EOS (the agent always lists it anyway).
    ends = {stop, EOS}
    assert all(g.token_ids[-1] in ends and not ends & set(g.token_ids[:-1]) for g in stopped)
    assert any(g.token_ids[-1] == stop for g in stopped)
    engine.close()


def test_disk_sync_moves_every_server_to_the_new_weights(servers, tmp_path):
    disk_sync_moves_every_server(servers, tmp_path, engine_for)


def disk_sync_moves_every_server(servers, tmp_path, engine_for) -> None:
    """Disk sync through `engine_for(urls)`'s engines (tests/test_vllm.py runs it on vLLM servers): every server
    at the new version, its tokens and log-probs the new weights'; a second worker loads nothing; a pruned version
    is replaced by the newest beside it; nothing newer, nothing sent."""
    engine = engine_for(servers.urls)
    model = load_model(servers.model_dir).eval()
    old_model = load_model(servers.model_dir).eval()
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    before = engine.generate(PROMPTS * 4, params)
    favoured = 7
    path = write_hf_dir(learner_step(model, favoured), servers.model_dir, tmp_path / "weights" / "hf-v1")
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "generation_config.json", "manifest.json",
                                                      "model.safetensors"]

    engine.update_weights(1, str(path))

    assert engine.version == 1
    assert [s.model_info()["weight_version"] for s in servers.servers] == ["1", "1"]
    after = engine.generate(PROMPTS * 4, params)
    assert all(g.versions == [1] * 8 for g in after)
    assert sum(g.token_ids.count(favoured) for g in after) > sum(g.token_ids.count(favoured) for g in before)
    diff = max_logprob_diff(model, PROMPTS * 4, after, 1.0)
    print(f"after disk sync: max log-prob diff vs the new weights {diff:.2e}")
    assert diff < LOGPROB_TOL < 100 * LOGPROB_TOL < max_logprob_diff(old_model, PROMPTS * 4, after, 1.0)
    # A second worker sharing these servers finds them at v1 already and loads nothing (the path is not read).
    other = engine_for(servers.urls)
    other.update_weights(1, str(tmp_path / "pruned-long-ago"))
    assert other.version == 1
    # A worker behind the learner is told of v2 after keep_weights pruned it: the newest directory beside it (v3)
    # is loaded in its place. Sent as is, SGLang took the missing path for a Hub repo id and the server died.
    write_hf_dir(learner_step(model, favoured), servers.model_dir, tmp_path / "weights" / "hf-v3")
    engine.update_weights(2, str(tmp_path / "weights" / "hf-v2"))
    assert engine.version == 3 and [s.model_info()["weight_version"] for s in servers.servers] == ["3", "3"]
    with pytest.raises(FileNotFoundError, match="hf-v4 holds no model.safetensors"):  # nothing newer: nothing sent
        engine.update_weights(4, str(tmp_path / "weights" / "hf-v4"))
    assert engine.version == 3 and all(s.model_info()["weight_version"] == "3" for s in servers.servers)
    engine.close()
    other.close()


def flip_a_byte(path: Path) -> None:
    """A bad disk's work: one byte in the middle of the file changed (the tensors' bytes, not the header)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flipped", "torn", "config"])
def test_a_damaged_hf_dir_is_refused_before_any_server_loads_it(servers, tmp_path, how):
    """An hf-v<N>/ whose files do not match the checksums the learner wrote with them (a byte of the weights
    changed, the weights file torn, its config.json changed) is never sent to a server: the servers keep their
    version, the engine counts it (`weights_refused`, on the worker's metrics line) and says which file."""
    engine = engine_for(servers.urls)
    path = write_hf_dir(learner_step(load_model(servers.model_dir), 7), servers.model_dir,
                        tmp_path / "weights" / "hf-v1")
    if how == "flipped":
        flip_a_byte(path / "model.safetensors")
    elif how == "torn":
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    else:
        (path / "config.json").write_text((path / "config.json").read_text().replace("}", ', "x": 1}', 1))
    with pytest.raises(WeightsError, match=r"hf-v1.*(model.safetensors|config.json)"):
        engine.update_weights(1, str(path))
    assert engine.weights_refused == 1
    assert [s.model_info()["weight_version"] for s in servers.servers] == ["0", "0"] and engine.version == 0
    with pytest.raises(WeightsError):  # the same damaged directory again: refused again, counted once
        engine.update_weights(1, str(path))
    assert engine.weights_refused == 1
    good = write_hf_dir(learner_step(load_model(servers.model_dir), 7), servers.model_dir,
                        tmp_path / "weights" / "hf-v2")
    engine.update_weights(2, str(good))
    assert engine.version == 2 and [s.model_info()["weight_version"] for s in servers.servers] == ["2", "2"]
    assert all(server.alive() for server in servers.servers)
    engine.close()


def test_a_directory_pruned_between_the_check_and_the_servers_read_kills_no_server(servers, tmp_path):
    """The learner prunes hf-v<N>/ (learner.keep_weights) at the worst moment: after the worker checked it, before
    the server read it (here: just as /update_weights_from_disk leaves). SGLang, told of a path that is gone, took
    it for a Hub repo id and its scheduler died. The engine loads from its own hard links to the checked files, so
    the server reads exactly what was checked, pruned or not; the links are gone after the load."""
    engine = engine_for(servers.urls)
    weights = tmp_path / "weights"
    path = write_hf_dir(learner_step(load_model(servers.model_dir), 7), servers.model_dir, weights / "hf-v1")
    pruned = []

    def prune_on_load(request) -> None:  # noqa: ANN001 - httpx.Request
        if request.url.path == "/update_weights_from_disk" and path.exists():
            shutil.rmtree(path)  # as HFDirPublisher.prune does (async_rl/weights/hf_dir.py)
            pruned.append(json.loads(request.content)["model_path"])

    engine.http.event_hooks = {"request": [prune_on_load], "response": []}
    engine.update_weights(1, str(path))
    assert pruned and not path.exists(), "the directory was pruned while the first server loaded"
    assert engine.version == 1 and [s.model_info()["weight_version"] for s in servers.servers] == ["1", "1"]
    assert all(server.alive() for server in servers.servers)
    assert engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))[0].versions == [1, 1]
    assert sorted(p.name for p in weights.iterdir()) == [], "the engine's links are removed after the load"
    engine.close()


def test_distributed_sync_pushes_the_learners_tensors_to_every_server(servers):
    model, base = load_model(servers.model_dir).eval(), load_model(servers.model_dir).eval()
    state_dict = learner_step(model, favoured_token=9)
    sglang = SGLangConfig(urls=servers.urls, weight_sync="distributed", dist_master_port=free_port())
    settings = LearnerSettings.from_config(Config(rollout=RolloutConfig(sglang=sglang))).publisher.sglang
    sync = DistributedWeightSync(settings, sglang_headers(sglang.api_key_file))
    try:
        sync.push(state_dict, version=2)
        assert [s.model_info()["weight_version"] for s in servers.servers] == ["2", "2"]
        engine = engine_for(servers.urls, weight_sync="distributed")
        engine.update_weights(2, "")  # the workers' part: note the version, load nothing
        assert engine.version == 2
        after = engine.generate(PROMPTS * 4, SamplingParams(temperature=1.0, max_new_tokens=8))
        assert all(g.versions == [2] * 8 for g in after)
        diff = max_logprob_diff(model, PROMPTS * 4, after, 1.0)
        print(f"after distributed sync: max log-prob diff vs the new weights {diff:.2e}")
        assert diff < LOGPROB_TOL < 100 * LOGPROB_TOL < max_logprob_diff(base, PROMPTS * 4, after, 1.0)
        sync.push(learner_step(model, favoured_token=11, steps=5), version=3)  # a second version, same group
        assert engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))[0].versions == [3, 3]
        engine.close()
    finally:
        sync.close()


@pytest.mark.parametrize("partial", [True, False], ids=["partial", "discard"])
def test_an_aborted_request_is_sent_again_and_carries_the_new_version(servers, tmp_path, partial):
    """pause_mode=abort: an update by another worker aborts our in-flight request; it is sent again on the new
    weights: continuing from the tokens it had (partial rollouts), or from scratch."""
    engine = engine_for(servers.urls[:1], pause_mode="abort", partial_rollouts=partial)
    updater = engine_for(servers.urls[:1], pause_mode="abort")
    path = write_hf_dir(learner_step(load_model(servers.model_dir), 5, steps=2), servers.model_dir,
                        tmp_path / "hf-v1")
    result = {}
    generating = threading.Thread(target=lambda: result.setdefault(
        "g", engine.generate(PROMPTS * 8, SamplingParams(max_new_tokens=200))))
    generating.start()
    servers.servers[0].wait_for_requests()  # the update lands on requests in flight (a fixed 0.3 s guessed it)
    updater.update_weights(1, str(path))
    generating.join(60)
    assert engine.stages_retried > 0 and engine.preemptions > 0
    assert all(len(g.token_ids) == 200 and g.versions == sorted(g.versions) and g.versions[-1] == 1
               for g in result["g"])
    if partial:  # the tokens sampled before the update keep version 0; the rest of the action is version 1
        assert engine.tokens_kept > 0 and engine.tokens_discarded == 0
        assert any(set(g.versions) == {0, 1} for g in result["g"])
    else:
        assert engine.tokens_kept == 0 and engine.tokens_discarded > 0
        assert all(set(g.versions) == {1} for g in result["g"])
    engine.close()
    updater.close()


class Hammer:
    """Aborts every request on `urls` again and again. With `paths` (one loader only): /pause_generation
    {"mode": "abort"}, a weight load labelled with the next version, /continue_generation. Without:
    /abort_request {"abort_all": true}, which pauses nothing (a paused server loads without its update lock, and
    the workers' own concurrent loads would then crash it)."""

    def __init__(self, urls: list[str], paths: list[Path] | None = None, every_s: float = 0.15) -> None:
        self.urls, self.paths, self.every_s = urls, paths, every_s
        self.errors: list[str] = []
        self.version = 0
        self.rounds = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Hammer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self.stop.wait(self.every_s):
                try:
                    if not self.paths:
                        for url in self.urls:
                            http.post(url + "/abort_request", json={"abort_all": True}).raise_for_status()
                    else:
                        self.version += 1
                        path = self.paths[self.version % len(self.paths)]
                        for url in self.urls:
                            self.load(http, url, path)
                    self.rounds += 1
                except httpx.HTTPError as exc:  # reported by the test; never leave a server paused
                    self.errors.append(repr(exc))

    def load(self, http: httpx.Client, url: str, path: Path) -> None:
        """One aborting update of one server: `path`'s weights, labelled with the next version."""
        http.post(url + "/pause_generation", json={"mode": "abort"}).raise_for_status()
        try:
            http.post(url + "/update_weights_from_disk", json={
                "model_path": str(path), "weight_version": str(self.version)}).raise_for_status()
        finally:
            http.post(url + "/continue_generation", json={}).raise_for_status()


def test_repeated_aborting_updates_keep_each_prefix_with_its_version_and_logprobs(servers, tmp_path):
    """A thread aborts the server's requests over and over, loading model A (even versions) or B (odd) each time,
    while long actions are generated. Every row completes; what a row had when it was aborted is kept as is (the
    tokens, the log-probs the server reported then, their versions) and the action goes on from there; versions
    never go back inside an action; and each token's log-prob is that of the weights its version names."""
    model_a = load_model(servers.model_dir).eval()
    model_b = load_model(servers.model_dir).eval()
    path_b = write_hf_dir(learner_step(model_b, 5, steps=2), servers.model_dir, tmp_path / "hf-b")
    engine = engine_for(servers.urls[:1], pause_mode="abort")
    seen = recording_preempted(engine)
    prompts = PROMPTS * 8
    with Hammer(servers.urls[:1], paths=[servers.model_dir, path_b], every_s=0.4) as hammer:
        generations = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=200))
    print(f"{hammer.rounds} aborting updates; {engine.preemptions} rows preempted, {engine.tokens_kept} tokens kept")
    assert not hammer.errors and hammer.rounds >= 2 and engine.preemptions >= 2 and seen
    worst = assert_each_prefix_kept_with_its_version(prompts, generations, seen, model_a, model_b)
    print(f"max |sglang - learner| log-prob diff, each token against its own version: {worst:.2e}")
    engine.close()


def recording_preempted(engine: SGLangEngine) -> list[tuple[list[int], Piece]]:
    """(request ids, piece) of every preempted reply of `engine` that kept tokens, recorded from now on."""
    seen: list[tuple[list[int], Piece]] = []
    send = engine._generate_on

    def recording(server, requests, params):
        pieces = send(server, requests, params)
        seen.extend((ids, p) for (ids, _), p in zip(requests, pieces, strict=True)
                    if p.finish == "preempted" and p.token_ids)
        return pieces

    engine._generate_on = recording
    return seen


def assert_each_prefix_kept_with_its_version(prompts, generations, seen, model_a, model_b) -> float:
    """Every row completed at full length; versions never go back inside an action and some action spans two; the
    prefix each abort left is in the final action unchanged (tokens, the log-probs reported then, versions); and
    every token's log-prob is that of the weights its version names (model A even, B odd) within LOGPROB_TOL.
    Returns the worst log-prob difference."""
    assert all(len(g.token_ids) == 200 and g.finish_reason == "length" for g in generations)
    assert all(g.versions == sorted(g.versions) for g in generations)
    assert any(len(set(g.versions)) > 1 for g in generations)
    finished = {tuple(p + g.token_ids): (p, g) for p, g in zip(prompts, generations, strict=True)}
    for ids, piece in seen:
        whole = ids + piece.token_ids
        matches = [(p, g) for key, (p, g) in finished.items() if key[: len(whole)] == tuple(whole)]
        assert matches, "an aborted prefix is missing from the finished actions"
        # Rows of one prompt can share their first tokens (sampled under other versions): the prefix must be kept
        # as it was in one of the rows it can belong to.
        kept = [(g.logprobs[start : start + len(piece.token_ids)], g.versions[start : start + len(piece.token_ids)])
                for prompt, g in matches for start in [len(ids) - len(prompt)]]
        assert (piece.logprobs, piece.versions) in kept, (piece, kept)
    # On both sides of every switch: the per-token importance ratio is exact for a mixed action.
    worst = 0.0
    with torch.no_grad():
        for prompt, g in zip(prompts, generations, strict=True):
            ids = torch.tensor([prompt + g.token_ids])
            by_version = {parity: token_logprobs(model(input_ids=ids).logits, ids, 1.0)[0, len(prompt) - 1 :]
                          for parity, model in ((0, model_a), (1, model_b))}
            for t, (logprob, version) in enumerate(zip(g.logprobs, g.versions, strict=True)):
                worst = max(worst, abs(by_version[version % 2][t].item() - logprob))
    assert worst < LOGPROB_TOL
    return worst


def test_a_waiting_engine_stops_promptly_when_told(servers):
    """Waiting for a server (none answers) ends at once when the stop event is set; a generate blocked on a paused
    server ends at once on close(). Both raise EngineStopped, not EngineUnavailable."""
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    started = time.monotonic()
    with pytest.raises(EngineStopped):
        SGLangEngine(sglang_settings(urls=[f"http://127.0.0.1:{free_port()}"], unavailable_timeout_s=60), stop)
    assert time.monotonic() - started < 3
    engine = engine_for(servers.urls[:1])
    url = servers.urls[0]
    httpx.post(url + "/pause_generation", json={"mode": "in_place"}, timeout=30).raise_for_status()
    try:
        threading.Timer(0.5, engine.close).start()
        started = time.monotonic()
        with pytest.raises(EngineStopped):
            engine.generate(PROMPTS, SamplingParams(max_new_tokens=4))
        assert time.monotonic() - started < 2
    finally:
        httpx.post(url + "/continue_generation", json={}, timeout=30).raise_for_status()


TRAIN = [
    "wandb.mode=disabled",
    "run.target_success=null",
    "rollout.engine=sglang",
    "rollout.workers=2",
    "rollout.group_size=4",
    "env.kwargs.num_tasks=4",
    "env.kwargs.outcome_delay_s=0.2",
    "learner.min_batch_items=4",
    "learner.batch_wait_s=0.2",
    "algo.max_staleness=2",
]


def train(tmp_path: Path, servers, *overrides: str) -> subprocess.Popen:
    urls = ",".join(servers.urls)
    return subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "train", f"run.dir={tmp_path}", "run.name=t",
         f"model.path={servers.model_dir}", f"rollout.sglang.urls=[{urls}]", *TRAIN, *overrides],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assert_invariants(lines: list[dict], max_staleness: int) -> None:
    assert [m["version"] for m in lines] == list(range(1, len(lines) + 1))
    for m in lines:
        assert m["ledger_residual_max"] < 1e-6
        assert m["staleness_max_immediate"] <= max_staleness


def test_train_with_sglang_servers_and_distributed_sync(servers, tmp_path):
    """Slow: 60 versions through two SGLang servers, the fewest in which the stage reward's climb shows."""
    # A shorter trap task (2 stages, no trap) so that learning shows within a CI-sized budget of 60 versions.
    run = train(tmp_path, servers, "run.max_versions=60", "rollout.sglang.weight_sync=distributed",
                f"rollout.sglang.dist_master_port={free_port()}", "env.kwargs.stages=2", "env.kwargs.traps=0",
                "rollout.group_size=8", "learner.min_batch_items=8", "run.eval_samples_per_task=0")
    out, err = run.communicate(timeout=400)
    assert run.returncode == 0, err[-3000:]
    lines = metrics(tmp_path / "t")
    assert_invariants(lines, max_staleness=2)
    assert len(lines) == 60
    assert [s.model_info()["weight_version"] for s in servers.servers] == ["60", "60"]
    reward = [m["stage_reward_mean"] for m in lines]
    success = [m["success_rate"] for m in lines]
    print("stage reward by version:", [round(r, 2) for r in reward])
    print("success rate by version:", [round(x, 2) for x in success])
    # Learning through SGLang-generated tokens: the stage reward climbs from the random policy's level.
    # The random policy's stage reward is about 0.06: the first versions show 0.00-0.03 only when the learner
    # starts early (40-120 env steps behind v1-v2); on a loaded machine it started late and v1-v5 averaged 0.058
    # over ~900 random-policy steps, against 0.09-0.12 over the last 10 versions (three runs). Whole successes
    # are too rare this early to assert on: one run had a single success in 60 versions (success_rate 1/64
    # once), another none at all with the same stage-reward climb.
    assert sum(reward[-10:]) / 10 >= sum(reward[:5]) / 5 + 0.02


def test_train_through_aborting_weight_updates_loses_nothing(servers, tmp_path):
    """Disk sync in abort mode (each worker's update aborts the other's requests), actions of several tokens, and
    a thread aborting every request on both servers over and over (/abort_request): no worker dies, every row is
    finished, and the ledger balances on every step."""
    run = train(tmp_path, servers, "run.max_versions=12", "rollout.sglang.weight_sync=disk",
                "rollout.sglang.pause_mode=abort", "rollout.max_new_tokens=6", "run.eval_samples_per_task=0")
    run_dir = tmp_path / "t"
    deadline = time.monotonic() + 180
    while len(metrics(run_dir)) < 2:
        assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-3000:] if run.poll() else ""
        time.sleep(0.2)
    with Hammer(servers.urls, every_s=0.3) as hammer:
        out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    assert "died" not in err
    lines = metrics(run_dir)
    assert_invariants(lines, max_staleness=2)
    assert len(lines) == 12
    rollout_logs = "".join((run_dir / "logs" / f"rollout-{i}.log").read_text() for i in range(2))
    print(f"{hammer.rounds} aborting pauses; preemption lines: {rollout_logs.count('preempted by weight updates')}")
    assert not hammer.errors and hammer.rounds > 0 and "preempted by weight updates" in rollout_logs
    assert "stops:" not in rollout_logs and "still failing" not in rollout_logs
    assert rollout_logs.count("(0 records unacked") == 2


def test_a_worker_with_no_server_left_stops_the_run_with_a_clear_message(tmp_path):
    """No server answers: the worker waits rollout.sglang.unavailable_timeout_s, saying so, then gives up."""
    dead = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    # The run ends in seconds; the limit only catches a hang (a loaded machine starts the roles slowly).
    done = subprocess.run(
        [sys.executable, "-m", "launch.cli", "train", f"run.dir={tmp_path}", "run.name=t", *TRAIN,
         "rollout.workers=1", f"rollout.sglang.urls=[{dead}]", "rollout.sglang.unavailable_timeout_s=3",
         "run.max_restarts=0"],
        capture_output=True, text=True, timeout=400,
    )
    assert done.returncode == 1
    assert "rollout-0 died" in done.stderr and f"no SGLang server left of ['{dead}']" in done.stderr
    assert "no SGLang server answers" in done.stderr and "none answered for 3 s" in done.stderr
    assert time.monotonic() - started >= 3


def test_a_stop_string_ends_an_sglang_row_at_the_token_completing_it(servers):
    """Multi-token turns end at a stop string on SGLang as on the torch engine: the completing token is kept."""
    from async_rl.model import load_tokenizer

    tokenizer = load_tokenizer(servers.model_dir)  # word-level trap vocabulary: "B" is its own token
    stop_id = tokenizer.convert_tokens_to_ids("B")
    engine = SGLangEngine(sglang_settings(urls=servers.urls))
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


CODING_TASKS = [
    {"id": "add", "prompt": "def add(a, b):\n    '''Return a + b.'''\n", "entry_point": "add",
     "visible_tests": ["assert add(1, 2) == 3"], "hidden_tests": ["assert add(2, 2) == 4"]},
    {"id": "neg", "prompt": "def neg(a):\n    '''Return -a.'''\n", "entry_point": "neg",
     "visible_tests": ["assert neg(1) == -1"], "hidden_tests": ["assert neg(-3) == 3"]},
]


def test_the_coding_environment_runs_through_real_sglang_servers(servers, tmp_path):
    """The coding env's multi-turn episodes, generated by SGLang and judged in the sandbox: records and outcomes
    flow to the budget. (The servers' tiny model has the trap env's word-level vocabulary, so the code it sees is
    mostly <unk>: this checks the plumbing, not learning; no reward, so no learner version is trained.)"""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps(task) for task in CODING_TASKS) + "\n")
    run = train(tmp_path, servers, "env.name=coding", "env.kwargs={}", f"env.kwargs.tasks_file={tasks}",
                "env.kwargs.eval_fraction=0.5", "env.kwargs.max_turns=2", "rollout.max_new_tokens=16",
                "run.max_env_steps=24", "rollout.workers=1", "run.eval_samples_per_task=2")
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["stop_reason"] == "max_env_steps" and summary["env_steps"] >= 24
    assert summary["env_errors"] == 0
    # The summary's counts are the replay's when the budget was reached, which can precede the first outcome (every
    # stage of the first groups sent before their judgements return); the replay's last metrics line is written at
    # its shutdown, after the in-flight outcomes.
    replay = json.loads((tmp_path / "t" / "metrics" / "replay.jsonl").read_text().splitlines()[-1])
    assert replay["trajectories_finished"] > 0 and replay["groups_closed"] > 0 and replay["env_errors"] == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert result["eval_tasks"] == 1 and result["eval_abandoned"] == 0 and "eval_hidden_fraction" in result


@pytest.mark.kills_sglang_server
def test_a_server_dying_mid_request_is_replaced_by_the_other(servers):
    engine = engine_for(servers.urls)
    victim = servers.servers[1]
    sent = threading.Event()

    def on_request(request) -> None:  # noqa: ANN001 - httpx.Request
        if request.url.port == victim.port and request.url.path == "/generate":
            sent.set()

    # Killed once its /generate left and the server counts it running (a fixed 0.3 s after the call raced the
    # server on an idle machine: its 20 rows were sometimes done before the kill, and nothing was retried; then a
    # fixed 50 ms after the send); 200 tokens take it far longer.
    engine.http.event_hooks = {"request": [on_request], "response": []}
    result = {}
    generating = threading.Thread(target=lambda: result.setdefault(
        "g", engine.generate(PROMPTS * 8, SamplingParams(max_new_tokens=200))))
    generating.start()
    assert sent.wait(30), "the engine sent nothing to the second server"
    victim.wait_for_requests()  # running there (a fixed 50 ms after the send guessed it)
    victim.stop(signal.SIGKILL)
    generating.join(60)
    assert [len(g.token_ids) for g in result["g"]] == [200] * len(PROMPTS) * 8
    assert engine.stages_retried > 0
    assert [s.alive for s in engine.servers] == [True, False]
    engine.close()
    with pytest.raises(EngineUnavailable, match="no SGLang server left"):
        engine_for(servers.urls[1:], unavailable_timeout_s=1.0)


@pytest.mark.kills_sglang_server
def test_a_server_killed_mid_run_loses_no_stage(servers, tmp_path):
    """Slow: a real `async-rl train` run of 14 versions through two SGLang servers, one killed after the 4th
    (the run's final evaluation is skipped: not what this test checks)."""
    run = train(tmp_path, servers, "run.max_versions=14", "run.eval_samples_per_task=0")
    run_dir = tmp_path / "t"
    deadline = time.monotonic() + 360  # ~10 s alone; CI once passed 180 s here with the vLLM tests beside it
    while len(metrics(run_dir)) < 4:
        assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-3000:] if run.poll() else ""
        time.sleep(0.2)
    servers.servers[1].stop(signal.SIGKILL)
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    lines = metrics(run_dir)
    assert_invariants(lines, max_staleness=2)
    assert len(lines) == 14
    rollout_logs = "".join((run_dir / "logs" / f"rollout-{i}.log").read_text() for i in range(2))
    assert f"SGLang server {servers.urls[1]} lost" in rollout_logs
    assert "records unacked" in rollout_logs and "0 records unacked" in rollout_logs
    assert "rejected" not in rollout_logs
    # Every stage record streamed was acked and none was refused; replay counts a (member, stage) once.
    assert rollout_logs.count("(0 records unacked") == 2
    replay_log = (run_dir / "logs" / "replay.log").read_text()
    assert "rejected message" not in replay_log and "bad_messages=0" in replay_log
