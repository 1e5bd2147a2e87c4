"""The learner's checkpoints and published weights, and every role's metrics file, on a disk that fills or
corrupts them (docs/architecture.md, "Resume after a crash"): a write the disk refuses names its file and leaves the
previous one in use; a checkpoint or weights file torn or changed after a node crash is caught by its checksum, and
the learner's resume and the rollout worker fall back to the newest one that passes. A real 2 MiB..64 MiB tmpfs
fills (mounting needs root)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import zmq
from disk_helpers import fill
from learner_helpers import engine_for
from rollout_helpers import model_dir_for
from test_learner import LearnerRun
from test_learner import make_config as learner_config
from test_rollout import ReplayDouble, publisher, running_worker, zmq_context  # noqa: F401 - fixtures
from test_rollout import make_config as worker_config

from async_rl.config_load import config_to_dict, load_config
from async_rl.model import WeightsError, load_model
from async_rl.telemetry import MetricsSettings, RoleMetrics
from async_rl.weights.file import read_weights, save_weights
from learner.checkpoint import CheckpointError
from learner.engine import load_checkpoint, save_checkpoint
from learner.publisher import WeightPublisher
from learner.replay_client import ResumeRefused
from rollout.engines.thread import EngineThread
from rollout.engines.torch_engine import TorchEngine
from rollout.worker import WeightsFollower


def damage(path: Path, how: str) -> None:
    """What a node crash or a bad disk does to a file: its tail torn off, or one byte in its middle changed."""
    data = path.read_bytes()
    middle = len(data) // 2
    changed = data[:middle] + bytes([data[middle] ^ 0x10]) + data[middle + 1 :]
    path.write_bytes(data[:middle] if how == "torn" else changed)


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(64, 64, generator=generator),
            "layer.bias": torch.randn(64, generator=generator)}


# --- SGLang's hf-v<N>/ directories ---------------------------------------------------------------------------


def test_an_hf_dir_load_view_reads_the_checked_files_after_the_directory_is_pruned(tmp_path: Path):
    """What a rollout worker hands an SGLang server (rollout/engines/sglang.py): hard links to an hf-v<N>/'s files,
    checked against its manifest; the learner's prune of the directory leaves the view whole, a damaged file
    shows in the check, a directory without a manifest cannot be checked, and stale views are pruned."""
    from async_rl.durable import manifest_problem
    from async_rl.model import WeightsError
    from async_rl.weights.hf_dir import load_view, prune_stale_load_views, write_hf_dir

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    path = write_hf_dir(weights(0), model_dir, tmp_path / "weights" / "hf-v1")
    view = load_view(path)
    shutil.rmtree(path)  # the learner's prune, while a server reads the view
    assert manifest_problem(view) is None and torch.equal(read_weights(view / "model.safetensors")["layer.bias"],
                                                          weights(0)["layer.bias"])
    damaged = write_hf_dir(weights(1), model_dir, tmp_path / "weights" / "hf-v2")
    damage(damaged / "model.safetensors", "flipped")
    assert "model.safetensors does not match its checksum" in manifest_problem(load_view(damaged))
    (damaged / "manifest.json").unlink()
    with pytest.raises(WeightsError, match="hf-v2: no manifest.json"):
        load_view(damaged)
    with pytest.raises(FileNotFoundError):
        load_view(tmp_path / "weights" / "hf-v3")  # pruned before: nothing to link
    views = sorted(p.name for p in (tmp_path / "weights").iterdir() if p.name.startswith(".sglang-load-"))
    assert len(views) == 2, views  # the failed ones removed their own
    prune_stale_load_views(tmp_path / "weights", older_than_s=3600)
    assert len([p for p in (tmp_path / "weights").iterdir() if p.name.startswith(".sglang-load-")]) == 2
    prune_stale_load_views(tmp_path / "weights", older_than_s=-1)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["hf-v2"]


# --- weights files -------------------------------------------------------------------------------------------


@contextmanager
def learner_engine(tmp_path: Path) -> Iterator:
    """A DeepSpeed engine on the tiny model of a learner config in `tmp_path`, destroyed after."""
    config = learner_config(tmp_path)
    model_dir_for(config)
    engine, _ = engine_for(config)
    try:
        yield engine
    finally:
        engine.destroy()


@pytest.mark.parametrize("how", ["torn", "flipped"])
def test_a_weights_file_torn_or_changed_after_it_was_written_is_refused_by_name(tmp_path: Path, how: str):
    path = tmp_path / "v3.safetensors"
    save_weights(weights(3), path)
    assert all(torch.equal(read_weights(path)[k], v) for k, v in weights(3).items())
    damage(path, how)
    with pytest.raises(WeightsError, match=rf"{path}: "):
        read_weights(path)


def test_a_publish_the_full_disk_refuses_names_the_file_and_leaves_the_previous_version_published(
        small_disk: Path, caplog):
    context = zmq.Context()
    weights_out = WeightPublisher(context, "tcp://127.0.0.1:*", small_disk / "weights", keep=3, insecure=True)
    try:
        assert weights_out.publish(weights(1), 1)
        filler = fill(small_disk)
        with caplog.at_level(logging.ERROR, logger="async_rl.learner"):
            assert not weights_out.publish(weights(2), 2), "refused: not published, and the learner goes on"
        error = next(r.getMessage() for r in caplog.records if "weights v2 not published" in r.getMessage())
        assert str(small_disk / "weights" / "v2.safetensors") in error and "No space left" in error, error
        assert sorted(p.name for p in (small_disk / "weights").iterdir()) == ["latest.json", "v1.safetensors"]
        assert json.loads((small_disk / "weights" / "latest.json").read_text())["version"] == 1
        assert weights_out.latest.version == 1
        filler.unlink()
        assert weights_out.publish(weights(3), 3), "space came back: the next publish goes through"
        assert json.loads((small_disk / "weights" / "latest.json").read_text())["version"] == 3
    finally:
        weights_out.close()
        context.term()


def test_a_publish_is_renamed_into_place_without_fsync_and_a_checkpoint_is_fsynced(tmp_path: Path, monkeypatch):
    """Published weights hand the policy to the workers (~20 a second in the default run): written and renamed, no
    fsync; the checkpoint is the durable copy (its files and manifest fsynced), and the file names are whole."""
    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    context = zmq.Context()
    weights_out = WeightPublisher(context, "tcp://127.0.0.1:*", tmp_path / "weights", keep=3, insecure=True)
    try:
        assert weights_out.publish(weights(1), 1)
    finally:
        weights_out.close()
        context.term()
    assert synced == []
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["latest.json", "v1.safetensors"]
    assert read_weights(tmp_path / "weights" / "v1.safetensors").keys() == weights(1).keys()
    with learner_engine(tmp_path / "run") as engine:
        save_checkpoint(engine, tmp_path / "checkpoints", 1)
    assert any("checkpoints" in path for path in synced), synced


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> tuple[Path, dict[int, Path]]:
    """The tiny model and three published versions of it (v3, v4, v5), as a learner writes them."""
    run = tmp_path_factory.mktemp("run")
    model_dir = model_dir_for(load_config(None, [f"run.dir={run}", "run.seed=1"]))
    base = load_model(model_dir).state_dict()
    files = {}
    for version in (3, 4, 5):
        torch.manual_seed(version)
        files[version] = run / "weights" / f"v{version}.safetensors"
        save_weights({k: v + 0.1 * torch.randn_like(v) for k, v in base.items()}, files[version])
    return model_dir, files


@pytest.mark.parametrize("how", ["torn", "flipped"])
def test_a_worker_told_of_a_damaged_weights_file_loads_the_newest_one_that_passes(model_files, tmp_path: Path,
                                                                                  how: str, caplog):
    model_dir, published = model_files
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    files = {v: weights_dir / p.name for v, p in published.items()}
    for version, file in files.items():
        file.write_bytes(published[version].read_bytes())
    damage(files[5], how)
    engine = EngineThread(TorchEngine(model_dir, seed=0))
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    try:
        follower = WeightsFollower(socket, engine, tmp_path)  # no latest.json: stays at v0
        with caplog.at_level(logging.WARNING, logger="async_rl.rollout"):
            follower.engine.submit(follower._load, 5, str(files[5])).result()  # what a notice of v5 does
        assert engine.version == 4, "v5 failed its check: the newest older file that passes"
        loaded = engine.engine.model.state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in read_weights(files[4]).items())
        messages = [r.getMessage() for r in caplog.records]
        assert any(f"could not load policy version 5 from {files[5]}" in m for m in messages), messages
        assert any("loaded policy version 4" in m and "in place of version 5" in m for m in messages), messages
        damage(files[4], how)
        follower.engine.submit(follower._load, 5, str(files[5])).result()
        assert engine.version == 4, "never below the version loaded: v4 stays, not v3"
    finally:
        socket.close(linger=0)
        context.term()
        engine.close()


def test_a_late_worker_whose_latest_weights_are_damaged_starts_from_the_version_before(
        tmp_path, zmq_context, publisher, caplog):  # noqa: F811 - fixtures
    replay = ReplayDouble(zmq_context, ["g0"], group_size=2)
    config = worker_config(tmp_path, replay, publisher)
    model = load_model(model_dir_for(config))
    weights_dir = config.run_dir / "weights"
    for version in (4, 5):
        save_weights(model.state_dict(), weights_dir / f"v{version}.safetensors")
    (weights_dir / "latest.json").write_text(json.dumps({"version": 5, "path": str(weights_dir / "v5.safetensors")}))
    damage(weights_dir / "v5.safetensors", "flipped")
    with caplog.at_level(logging.WARNING, logger="async_rl.rollout"), running_worker(config):
        replay.serve_until(lambda: len(replay.records()) >= 1)
    assert replay.records()[0].versions().tolist() == [4], "not garbage, not a refusal to start: v4"
    assert any(str(weights_dir / "v5.safetensors") in r.getMessage() for r in caplog.records)


# --- learner checkpoints ---------------------------------------------------------------------------------------


def module_weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def step_weights(engine, seed: int) -> None:
    """Move the weights as a step would (a different state to checkpoint)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in engine.module.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))


@pytest.mark.parametrize("how", ["torn", "flipped"])
def test_a_resume_skips_a_damaged_newest_checkpoint_for_the_one_before(tmp_path: Path, how: str, caplog):
    directory = tmp_path / "ck"
    with learner_engine(tmp_path) as engine:
        assert save_checkpoint(engine, directory, 2, keep=2)
        at_v2 = module_weights(engine)
        step_weights(engine, 1)
        assert save_checkpoint(engine, directory, 4, keep=2)
        assert (directory / "latest").read_text() == "v4" and (directory / "v4" / "manifest.json").exists()
        step_weights(engine, 2)
        damage(directory / "v4" / "mp_rank_00_model_states.pt", how)
        with caplog.at_level(logging.WARNING, logger="async_rl.learner"):
            # v2's state goes on as version 2, never as v4 with v4's updates lost (the replay rolls back to v2)
            assert load_checkpoint(engine, directory) == 2
        assert all(torch.equal(v, module_weights(engine)[k]) for k, v in at_v2.items()), "v2's weights, exactly"
        warning = next(r.getMessage() for r in caplog.records if "resuming from checkpoint v2" in r.getMessage())
        assert str(directory / "v4") in warning and "mp_rank_00_model_states.pt" in warning, warning
        assert "at version 2" in warning and "as version 4" not in warning, warning
        assert sorted(p.name for p in directory.iterdir()) == ["latest", "v2", "v4.corrupt"], "set aside"

        (directory / "latest").write_text("v")  # a torn `latest` too: the newest checkpoint that passes
        assert load_checkpoint(engine, directory) == 2
        damage(directory / "v2" / "mp_rank_00_model_states.pt", how)
        with pytest.raises(CheckpointError, match=r"no checkpoint in .*ck can be resumed from: .*latest: names no "
                                                  r"checkpoint .*v2: mp_rank_00_model_states.pt .* Restore the "
                                                  r"directory from a backup, or move it away"):
            load_checkpoint(engine, directory)


def test_a_failed_save_under_the_name_of_a_checkpoint_set_aside_is_never_resumed_from(tmp_path: Path):
    """The 50-minute chaos soak's learner crash loop (2026-11-29): v4 torn, the resume fell back to v2 and set v4
    aside, but `latest` still named v4; the next save of v4 met a full disk, and since `latest` named it its partial
    files were kept; every restart then took that manifest-less v4 for one written before manifests existed and
    died reading it. Now a resume points `latest` at what it resumed, and a checkpoint without a manifest is
    trusted only in a directory where no checkpoint has one."""
    directory = tmp_path / "ck"
    with learner_engine(tmp_path) as engine:
        assert save_checkpoint(engine, directory, 2, keep=2)
        assert save_checkpoint(engine, directory, 4, keep=2)
        damage(directory / "v4" / "mp_rank_00_model_states.pt", "torn")
        assert load_checkpoint(engine, directory) == 2
        assert (directory / "latest").read_text() == "v2", "`latest` names what the resume went on from"
        partial = directory / "v4"  # a save of v4 again, cut short by a full disk
        partial.mkdir()
        (partial / "mp_rank_00_model_states.pt").write_bytes(b"PK\x03\x04" + b"\0" * 124)
        assert load_checkpoint(engine, directory) == 2
        (directory / "latest").write_text("v4")  # even with `latest` naming it (an older learner's pointer)
        assert load_checkpoint(engine, directory) == 2


def test_a_save_keeps_only_the_newest_checkpoints_set_aside_as_damaged(tmp_path: Path):
    """A disk whose checkpoints are torn again and again does not fill with the damaged ones (benchmarks/chaos.py's
    learner volume did, 1 MB a tear): a save keeps the newest `keep` set aside as it keeps the newest `keep`
    checkpoints, and the resume is unchanged."""
    directory = tmp_path / "ck"
    with learner_engine(tmp_path) as engine:
        assert save_checkpoint(engine, directory, 2, keep=2)
        for version in (1, 3, 5):  # as `set_aside` leaves them
            shutil.copytree(directory / "v2", directory / f"v{version}.corrupt")
        assert save_checkpoint(engine, directory, 4, keep=2)
        assert save_checkpoint(engine, directory, 6, keep=2)
        assert sorted(p.name for p in directory.iterdir()) == ["latest", "v3.corrupt", "v4", "v5.corrupt", "v6"]
        assert load_checkpoint(engine, directory) == 6


@pytest.mark.parametrize("small_disk", ["64m"], indirect=True)
def test_a_checkpoint_the_full_disk_refuses_names_its_directory_and_the_previous_one_resumes(
        small_disk: Path, tmp_path: Path, caplog):
    directory = small_disk / "checkpoints"
    with learner_engine(tmp_path) as engine:
        assert save_checkpoint(engine, directory, 2, keep=2)
        at_v2 = module_weights(engine)
        step_weights(engine, 1)
        filler = fill(small_disk)
        with caplog.at_level(logging.ERROR, logger="async_rl.learner"):
            assert not save_checkpoint(engine, directory, 4, keep=2), "refused: not a checkpoint, not a crash"
        error = next(r.getMessage() for r in caplog.records if "checkpoint v4 could not be written" in r.getMessage())
        assert str(directory / "v4") in error, error
        assert sorted(p.name for p in directory.iterdir()) == ["latest", "v2"], "no half-written v4 left"
        assert (directory / "latest").read_text() == "v2"
        filler.unlink()
        assert load_checkpoint(engine, directory) == 2
        assert all(torch.equal(v, module_weights(engine)[k]) for k, v in at_v2.items())
        step_weights(engine, 2)
        assert save_checkpoint(engine, directory, 6, keep=2), "space came back: the next one is written"
        assert load_checkpoint(engine, directory) == 6


def test_a_learner_resumed_past_a_damaged_checkpoint_goes_on_from_the_version_of_the_one_before(tmp_path: Path):
    """The trainer's side: v4 (the newest checkpoint) damaged, the learner restarts with v2's weights, optimizer and
    RNG as version 2, never as v4 with the updates of versions 3..4 lost: it reports v2 as its checkpoint (the oldest
    it keeps, the replay's rollback point all along), trains versions 3.. again and publishes them anew."""
    keep = {"checkpoint_every": 2, "keep_checkpoints": 2, "keep_weights": 10}
    first = LearnerRun(learner_config(tmp_path, learner=keep, run={"max_versions": 6})).start().finish()
    checkpoints, published = first.run_dir / "checkpoints", first.run_dir / "weights"
    assert (checkpoints / "latest").read_text() == "v6"
    # the rollback point it reports is the oldest checkpoint it keeps: v4 is written after the ack of v4, so the
    # request for v5 says v2, the one for v6 says v2 (v4 and v2 kept), never more than a fallback could reach
    assert [r.checkpoint for r in first.replay.requests] == [-1, -1, 2, 2, 2, 2][:len(first.replay.requests)]
    damage(checkpoints / "v6" / "mp_rank_00_model_states.pt", "flipped")
    resumed = LearnerRun(learner_config(tmp_path, learner=keep, run={"max_versions": 6})).start().finish()
    request = resumed.replay.requests[0]
    assert (request.policy_version, request.checkpoint) == (4, 4), "v4's version, and v4 reported as it"
    assert request.session > first.replay.requests[0].session
    assert [ack.policy_version for ack in resumed.replay.acks] == [5, 6], "versions 5 and 6 trained again"
    assert (published / "v6.safetensors").exists(), "published anew by the resumed learner"
    assert (checkpoints / "v6.corrupt").is_dir() and (checkpoints / "latest").read_text() == "v6"
    assert resumed.summary is not None and resumed.summary["versions"] == 6


def test_a_learner_the_replay_cannot_roll_back_to_its_fallback_stops_naming_the_damage(tmp_path: Path):
    """A replay that made the acks above the learner's fallback checkpoint final (it refuses the resume,
    `bad_resume`) stops the learner with an error that names the checkpoint skipped and what is wrong with it."""
    keep = {"checkpoint_every": 2, "keep_checkpoints": 2, "keep_weights": 10}
    first = LearnerRun(learner_config(tmp_path, learner=keep, run={"max_versions": 4})).start().finish()
    checkpoints = first.run_dir / "checkpoints"
    damage(checkpoints / "v4" / "mp_rank_00_model_states.pt", "torn")
    refused = LearnerRun(learner_config(tmp_path, learner=keep, run={"max_versions": 6}),
                         refuse_resume="the learner restarted at version 2, but its latest reported checkpoint is 4")
    with pytest.raises(ResumeRefused, match=r"bad_resume: .* checkpoint is 4.*resumed from checkpoint v2 because "
                                            r".*v4: mp_rank_00_model_states.pt has \d+ bytes, its manifest \d+ "
                                            r"\(torn\)"):
        refused.start().finish()
    again = LearnerRun(learner_config(tmp_path, learner=keep, run={"max_versions": 6}),  # restarted by the launcher
                       refuse_resume="the learner restarted at version 2, but its latest reported checkpoint is 4")
    with pytest.raises(ResumeRefused, match=r"resumed from checkpoint v2 because .*v4.corrupt: set aside as damaged"):
        again.start().finish()


def test_a_metrics_line_the_full_disk_refuses_is_dropped_whole_and_named_not_fatal(small_disk: Path, caplog):
    config = load_config(None, [f"run.dir={small_disk}", "run.name=r"])
    metrics = RoleMetrics(MetricsSettings(run_dir=config.run_dir, name=config.run.name, wandb=config.wandb,
                                          run_config=config_to_dict(config)), "replay")
    try:
        metrics.write({"n": 0})
        filler = fill(small_disk)
        with caplog.at_level(logging.ERROR, logger="async_rl.telemetry"):
            for n in range(1, 400):  # ~40 KB: more than the page the file has
                metrics.write({"n": n, "pad": "x" * 100})
        assert metrics.dropped > 0
        error = next(r.getMessage() for r in caplog.records if "a metrics line was dropped" in r.getMessage())
        assert str(metrics.path) in error and "No space left" in error, error
        filler.unlink()
        metrics.write({"n": "after"})
    finally:
        metrics.close()
    lines = [json.loads(line) for line in metrics.path.read_text().splitlines()]  # every line whole
    assert lines[0] == {"n": 0} and lines[-1] == {"n": "after"} and len(lines) == 401 - metrics.dropped
