"""Defaults that follow the model (async_rl/model_defaults.py, docs/models.md): with model.path, model.max_seq_len is
the model's context (capped) and learner.lr a pretrained model's rate unless the command line or the user's config
file sets them; a packaged config writing out the tiny model's default does not set them. The model directories
here hold only config.json, all that the config reads of a model (no weights: nothing is trained)."""

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from project_commands import docs_command, project_command

from async_rl.config import Config
from async_rl.config_load import config_from_dict, load_config, load_config_explained
from async_rl.model_defaults import FULL_LR, LORA_LR, SEQ_LEN_CAP, SFT_FULL_LR, SFT_LORA_LR

REPO = Path(__file__).resolve().parent.parent


def model_dir(root: Path, context: int | None) -> Path:
    root.mkdir(parents=True)
    config = {"model_type": "llama", "vocab_size": 49152}
    if context is not None:
        config["max_position_embeddings"] = context
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture
def workdir(tmp_path) -> Path:
    """A user's directory: `models/smollm2` states SmolLM2's 8,192-token context, `configs/` is the repository's."""
    model_dir(tmp_path / "models" / "smollm2", 8192)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    return tmp_path


def test_the_documented_config_command_prints_the_models_defaults_and_where_they_came_from(workdir):
    command = docs_command("docs/models.md", "async-rl config --config configs/local.yaml model.path=")
    done = subprocess.run([project_command(), *command[1:]], cwd=workdir, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(done.stdout)
    assert (config["model"]["max_seq_len"], config["learner"]["lr"]) == (SEQ_LEN_CAP, FULL_LR) == (2048, 1e-5)
    header = [line for line in done.stdout.splitlines() if line.startswith("#")]
    assert header == [
        "# model.max_seq_len = 2048, the model's context (max_position_embeddings 8192 in models/smollm2/config.json)"
        ", capped at 2048 for this machine's memory",
        "# learner.lr = 1e-05, a pretrained model's RL rate for a full fine-tune"]


def test_a_model_shorter_than_the_cap_gives_its_own_context_and_lora_its_rate(tmp_path):
    model = model_dir(tmp_path / "m", 512)
    config = load_config(None, [f"model.path={model}", "learner.lora.rank=8"])
    assert (config.model.max_seq_len, config.learner.lr) == (512, LORA_LR)


def test_the_command_line_and_the_users_own_file_set_them(workdir):
    model = workdir / "models" / "smollm2"
    config, notes = load_config_explained("local", [f"model.path={model}", "learner.lr=0.0005",
                                                    "model.max_seq_len=4096"])
    assert (config.model.max_seq_len, config.learner.lr) == (4096, 5e-4)
    assert notes["learner.lr"] == "0.0005, set on the command line"
    mine = workdir / "mine.yaml"
    mine.write_text(f"model:\n  path: {model}\nlearner:\n  lr: 0.0005\n")  # the tiny model's value, but chosen
    config, notes = load_config_explained(mine)
    assert (config.model.max_seq_len, config.learner.lr) == (2048, 5e-4)
    assert notes["learner.lr"] == f"0.0005, set in {mine}"


def test_a_packaged_recipe_keeps_its_own_choices(workdir):
    """configs/smollm2-chain.yaml chose 1024 and 1e-5: they differ from the built-in default, so they are set."""
    config, notes = load_config_explained(workdir / "configs" / "smollm2-chain.yaml",
                                          [f"model.path={workdir / 'models' / 'smollm2'}"])
    assert (config.model.max_seq_len, config.learner.lr) == (1024, 1e-5)
    assert notes["model.max_seq_len"].endswith("smollm2-chain.yaml")


def test_without_a_model_the_tiny_models_defaults_stay(tmp_path):
    assert load_config() == load_config("local") == load_config(REPO / "configs" / "local.yaml") == Config()
    assert config_from_dict({}) == Config()
    no_context = model_dir(tmp_path / "m", None)  # a config.json without max_position_embeddings
    config, notes = load_config_explained(None, [f"model.path={no_context}"])
    assert (config.model.max_seq_len, config.learner.lr) == (256, FULL_LR)
    assert "states no max_position_embeddings" in notes["model.max_seq_len"]


def test_a_run_directorys_config_is_what_the_run_resolved(workdir, tmp_path):
    """Every role of a run reads the run directory's config.yaml, where both keys are written: they agree."""
    from async_rl.config_load import dump_config

    config = load_config("local", [f"model.path={workdir / 'models' / 'smollm2'}"])
    dump_config(config, tmp_path / "config.yaml")
    again, notes = load_config_explained(tmp_path / "config.yaml")
    assert again == config and notes["learner.lr"] == f"1e-05, set in {tmp_path / 'config.yaml'}"


def test_a_warm_start_takes_the_warm_start_rate(workdir):
    """`async-rl sft` (warm_start=True) on a pretrained model: ten times RL's rate, as the recipes' warm starts."""
    model = workdir / "models" / "smollm2"
    full, notes = load_config_explained(None, [f"model.path={model}"], warm_start=True)
    lora, _ = load_config_explained(None, [f"model.path={model}", "learner.lora.rank=8"], warm_start=True)
    assert (full.learner.lr, lora.learner.lr) == (SFT_FULL_LR, SFT_LORA_LR) == (1e-4, 1e-3)
    assert notes["learner.lr"] == "0.0001, a pretrained model's warm-start rate for a full fine-tune"
    chosen, _ = load_config_explained(None, [f"model.path={model}", "learner.lr=0.00002"], warm_start=True)
    assert chosen.learner.lr == 2e-5


def test_a_directory_of_the_built_in_tiny_model_keeps_the_tiny_defaults(tmp_path):
    """The tiny model written out (a run's model/, the test servers' model) is random, not pretrained."""
    from async_rl.model import ensure_model_dir

    tiny = ensure_model_dir(Config().model, tmp_path, seed=0)
    config, notes = load_config_explained(None, [f"model.path={tiny}"])
    assert (config.model.max_seq_len, config.learner.lr) == (256, 5e-4)
    assert notes["learner.lr"].endswith("is async-rl's tiny model)")
