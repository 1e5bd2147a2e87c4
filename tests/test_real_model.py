"""A real pretrained model through real processes: SmolLM2-135M-Instruct, imported by `async-rl model import`,
trained by `async-rl train` with the recipe configs/smollm2.yaml, on the built-in `tasks` env with its calculator
(docs/models.md) and on the user's tool env of docs/environments.md, written outside the project (with LoRA).

Each command is run as the docs print it, from a directory where `models/smollm2` is the imported model, plus the
test's own budget (`run.max_versions`, `run.dir`, W&B off). On these 2 cores one learner step of the real model takes
tens of seconds, so each run trains one or two versions.
"""

import json
import os
import shlex
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import msgspec
import pytest
import torch
from project_commands import docs_command, project_command
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_rl.protocol import Outcome, StageRecord, decode
from replay.log_format import Entry, Received, read_frames

REPO = Path(__file__).resolve().parent.parent
ASYNC_RL = project_command()
BUDGET = ["run.max_versions=1", "run.max_wall_s=600", "run.eval_samples_per_task=0", "wandb.mode=disabled",
          "run.metrics_every_s=5"]


def train(workdir: Path, command: list[str], run_dir: Path, *extra: str) -> dict:
    """Run a documented `... async-rl train ...` command in `workdir` with the test's budget; its final JSON line.
    The recipe's run.dir and run.name (runs/smollm2, relative to `workdir`) stay: `run_dir` is where it writes."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    while "=" in command[0]:  # leading VAR=value assignments, as the shell applies them
        key, value = command.pop(0).split("=", 1)
        env[key] = str((workdir / value).resolve()) if key == "PYTHONPATH" else value
    assert command[:2] == ["async-rl", "train"], command
    args = [ASYNC_RL, *command[1:], *BUDGET, *extra]
    done = subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((run_dir / "logs").glob("*.log")))
    assert done.returncode == 0, done.stderr[-3000:] + logs
    return json.loads(done.stdout.strip().splitlines()[-1])


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def received(run_dir: Path) -> list[tuple[float, object]]:
    """(replay clock, message) of every StageRecord and Outcome the replay stored, from its write-ahead log."""
    entries = msgspec.msgpack.Decoder(Entry)
    out = []
    for segment in sorted((run_dir / "replay").glob("wal-*.log")):
        for payload in read_frames(segment.read_bytes())[0]:
            entry = entries.decode(payload)
            if isinstance(entry, Received):
                message = decode(entry.message)
                if isinstance(message, StageRecord | Outcome):
                    out.append((entry.now, message))
    return out


@pytest.fixture
def workdir(tmp_path, smollm2) -> Path:
    """A user's directory: `models/smollm2` is the imported model (the recipe's model.path), `configs/` the repo's."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "smollm2").symlink_to(smollm2)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    return tmp_path


@pytest.mark.slow
def test_the_recipe_trains_smollm2_on_the_tasks_env_with_a_responsive_worker(workdir):
    """docs/models.md's recipe: tool specs reach the real model through its template; the records carry the real
    tokenizer's ids; the ledger holds; and with engine calls of seconds the worker's messaging stays clean (issue
    41): no resend, no rejection, no lease granted twice, and each outcome reaches the replay within a second of
    its judge returning (a 1 s judge: `judge_latency_s` is what the env took)."""
    run_dir = workdir / "runs" / "smollm2"
    command = docs_command("README.md", "async-rl train --config configs/smollm2.yaml")
    assert command == docs_command("docs/models.md", "async-rl train --config configs/smollm2.yaml")
    result = train(workdir, command, run_dir, "env.kwargs.judge_delay_s=1.0")
    assert result["versions"] >= 1, result
    assert Path(result["run_dir"]).resolve() == run_dir.resolve()

    tokenizer = AutoTokenizer.from_pretrained(workdir / "models" / "smollm2")
    messages = received(run_dir)
    records = [m for _, m in messages if isinstance(m, StageRecord)]
    first = tokenizer.decode(next(r for r in records if r.stage_index == 0).observation_ids())
    assert "<tools>" in first and '"name": "calculator"' in first and "State the final answer" in first, first
    assert max(int(r.action_ids().max()) for r in records) >= 259  # beyond any tiny model's vocabulary
    assert len(tokenizer) == 49152

    terminal_at = {r.trajectory_id: at for at, r in messages if isinstance(r, StageRecord) and r.terminal}
    outcomes = [(at, o) for at, o in messages if isinstance(o, Outcome) and not o.abandoned]
    assert outcomes
    # the judge sleeps 1 s after the terminal stage; the outcome follows at once. Only the upper bound: both times
    # are when the replay logged the message, and a replay starved of CPU for a moment logs the terminal stage late
    # (CI: 0.57 s apart); that the judge took its second is checked below, from the worker's own figure
    for at, outcome in outcomes:
        assert 0.0 < at - terminal_at[outcome.trajectory_id] < 2.0, (outcome.trajectory_id, at)

    rollout = lines(run_dir / "metrics" / "rollout-0.jsonl")
    assert all("tool_calls" in line and "tool_call_errors" in line for line in rollout)
    last = rollout[-1]
    assert last["resends"] == 0 and last["duplicate_lease_replies"] == 0 and last["plugin_timeouts"] == 0
    assert not [k for k in last if k.startswith("rejected_")], last
    judged = [line["judge_latency_s_mean"] for line in rollout if line["trajectories_finished"]]
    assert judged and all(1.0 <= value < 1.2 for value in judged), judged
    replay = lines(run_dir / "metrics" / "replay.jsonl")[-1]
    assert replay["rejected"] == 0 and replay["closed_group_resends"] == 0, replay
    learner = lines(run_dir / "metrics.jsonl")
    assert learner and all(line["ledger_residual_max"] < 1e-6 for line in learner)

    export = docs_command("README.md", "async-rl export runs/smollm2")  # as printed, then load it as a user would
    done = subprocess.run([ASYNC_RL, *export[1:]], cwd=workdir, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    exported = AutoModelForCausalLM.from_pretrained(workdir / export[-1])
    published = load_file(str(run_dir / "weights" / f"v{result['versions']}.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(exported.state_dict()[name], published[name])
    assert AutoTokenizer.from_pretrained(workdir / export[-1]).chat_template == tokenizer.chat_template


def python_block(page: str, start: str) -> str:
    """The ```python block of `page` whose text starts with `start`."""
    text = (REPO / page).read_text()
    begin = text.index("```python\n" + start) + len("```python\n")
    return text[begin : text.index("```", begin)]


@pytest.mark.slow
def test_a_user_tool_env_written_outside_the_project_is_warmed_up_then_trained_and_calls_its_tool(workdir):
    """docs/environments.md's complete tool-using example, saved as add_env.py in the user's directory, warmed up
    on its own demonstrations file with `async-rl sft` (LoRA) and trained by the commands printed under it: its tool
    specs reach the model, the warmed-up model calls `add` in training, the run trains, the ledger holds."""
    (workdir / "add_env.py").write_text(python_block("docs/environments.md", '"""Add two numbers with a tool'))
    (workdir / "add_demos.py").write_text(python_block("docs/environments.md", '"""add_demos.py'))
    warm = docs_command("docs/environments.md", "python add_demos.py && async-rl sft")
    assert warm[:3] == ["python", "add_demos.py", "&&"]
    done = subprocess.run([sys.executable, "add_demos.py"], cwd=workdir, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and len((workdir / "add_demos.jsonl").read_text().splitlines()) == 32, done.stderr
    done = subprocess.run([ASYNC_RL, *warm[4:], "--max-steps", "3", "run.dir=runs", "wandb.mode=disabled"],
                          cwd=workdir, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1])["steps"] == 3
    run_dir = workdir / "runs" / "smollm2"
    command = docs_command("docs/environments.md", "PYTHONPATH=. async-rl train --config configs/smollm2.yaml "
                                                   "env.name=add_env:factory env.kwargs={} env.kwargs.digits=1 "
                                                   "model.path=")
    # The test's budget beyond BUDGET: one version of one group (the recipe's is two), and no group started past it
    # (`algo.max_staleness=0`): groups the run never trains would share the 2 cores with the learner's step.
    result = train(workdir, command, run_dir, "learner.lora.rank=8", "learner.lr=0.0001", "algo.groups_per_step=1",
                   "learner.min_batch_items=4", "algo.max_staleness=0")
    assert result["versions"] >= 1, result

    tokenizer = AutoTokenizer.from_pretrained(workdir / "models" / "smollm2")
    by_trajectory: dict[str, list[StageRecord]] = defaultdict(list)
    for _, message in received(run_dir):
        if isinstance(message, StageRecord):
            by_trajectory[message.trajectory_id].append(message)
    first = tokenizer.decode(next(iter(by_trajectory.values()))[0].observation_ids())
    assert '"name": "add"' in first and "What is " in first, first
    rollout = lines(run_dir / "metrics" / "rollout-0.jsonl")
    assert all("tool_calls" in line for line in rollout) and rollout[-1]["env_errors"] == 0
    assert sum(line["tool_calls"] for line in rollout) > 0  # the warm start taught it the tool
    assert all(line["ledger_residual_max"] < 1e-6 for line in lines(run_dir / "metrics.jsonl"))
    assert (run_dir / "weights" / "latest.json").exists()

    # The same warmed-up model with `add` served by an MCP server instead (docs/environments.md's MCP line, on
    # SmolLM2's recipe): the server is started over stdio in the worker, lists `add`, and the model calls it.
    # The questions as add_env asks them (the page's have two- and three-digit answers); stopped at one version.
    (workdir / "examples").symlink_to(REPO / "examples")
    (workdir / "sums.jsonl").write_text("".join(
        json.dumps({"question": f"What is {a} + {b}? Answer with <answer>N</answer>.", "answer": a + b}) + "\n"
        for a in range(1, 5) for b in range(1, 5)))
    mcp_line = (REPO / "docs" / "environments.md").read_text().split("### MCP tools", 1)[1]
    argv = shlex.split(mcp_line.split("```bash\n", 1)[1].split("```", 1)[0].strip())
    assert argv[:2] == ["async-rl", "train"] and "env.kwargs.tasks_file=examples/mcp_tasks.jsonl" in argv
    mcp_dir = workdir / "runs" / "mcp"
    path = f"PATH={Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # `python` is the tests'
    result = train(workdir, [path, "async-rl", "train", "--config", "configs/smollm2.yaml", "env.kwargs={}",
                             *argv[2:]], mcp_dir, "env.kwargs.tasks_file=sums.jsonl", "model.path=models/smollm2-add",
                   "run.name=mcp", "learner.lora.rank=8", "learner.lr=0.0001", "algo.groups_per_step=1",
                   "learner.min_batch_items=4", "algo.max_staleness=0")
    assert result["versions"] >= 1, result
    rollout = lines(mcp_dir / "metrics" / "rollout-0.jsonl")
    counts = rollout[-1]  # the mcp_* counts are the worker's since it started, the others per line
    assert counts["mcp_starts"] >= 1 and counts["mcp_start_failures"] == 0 and counts["mcp_failures"] == 0, counts
    assert sum(line["env_errors"] for line in rollout) == 0
    assert counts["mcp_calls"] > 0  # the warmed-up model called the server's `add`


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2-chain")
def test_the_warm_start_recipe_runs_as_printed_and_the_warmed_up_model_calls_its_tool(workdir, chain_warm_start):
    """The README's warm-start recipe, each command as printed (docs/models.md prints the same), in a quick form:
    demonstrations of the chain env's train split, two SFT steps (the `chain_warm_start` fixture, shared with the
    real_model benchmark's test), one RL version; the warmed-up model calls `lookup` in training and the run's
    records carry the calls."""
    demos = docs_command("README.md", "async-rl demos --config configs/smollm2-chain.yaml")
    sft = docs_command("README.md", "async-rl sft --model models/smollm2")
    command = docs_command("README.md", "async-rl train --config configs/smollm2-chain.yaml")
    for printed in (demos, sft, command):
        assert printed == docs_command("docs/models.md", " ".join(printed[:4]))
    assert json.loads((chain_warm_start / "demos.json").read_text())["written"] == 100
    assert json.loads((chain_warm_start / "sft.json").read_text())["steps"] == 2
    warm = chain_warm_start / "models" / "smollm2-chain"
    assert (warm / "model.safetensors").is_file() and "models/smollm2-chain" in sft
    (workdir / "models" / "smollm2-chain").symlink_to(warm)
    (workdir / "runs").mkdir()
    run_dir = workdir / "runs" / "smollm2-chain"
    result = train(workdir, command, run_dir, "algo.groups_per_step=1", "learner.min_batch_items=4",
                   "algo.max_staleness=0")
    assert result["versions"] >= 1, result
    rollout = lines(run_dir / "metrics" / "rollout-0.jsonl")
    assert sum(line["tool_calls"] for line in rollout) > 0 and rollout[-1]["env_errors"] == 0
    assert all(line["ledger_residual_max"] < 1e-6 for line in lines(run_dir / "metrics.jsonl"))


@pytest.mark.slow
def test_the_documented_agent_warmed_up_on_smollm2_calls_its_tool_and_earns_stage_rewards(workdir):
    """docs/environments.md's agent warm start on a real model: examples/weather_agent.py (written only against the
    `openai` client), its demonstrations written and fine-tuned on by the printed commands (LoRA), then trained by the
    printed `env.name=agent` command from the warmed-up SmolLM2: its completions arrive as stages rendered with the
    agent's tool, the model calls the tool, the agent's `async_rl.reward` calls arrive as stage rewards, a version
    is trained and the ledger holds."""
    (workdir / "examples").symlink_to(REPO / "examples")
    warm = docs_command("docs/environments.md", "python examples/weather_demos.py && async-rl sft")
    assert warm[:3] == ["python", "examples/weather_demos.py", "&&"]
    done = subprocess.run([sys.executable, *warm[1:2]], cwd=workdir, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    demos = lines(workdir / "weather_demos.jsonl")
    assert len(demos) == 5 and all(d["tools"][0]["function"]["name"] == "weather" for d in demos)  # train split only
    done = subprocess.run([ASYNC_RL, *warm[4:], "run.dir=runs", "wandb.mode=disabled"], cwd=workdir,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1])["steps"] == 3  # 3 epochs of one batch
    run_dir = workdir / "runs" / "smollm2"
    command = docs_command("docs/environments.md",
                           "PYTHONPATH=examples async-rl train --config configs/smollm2.yaml env.name=agent")
    result = train(workdir, command, run_dir, "algo.groups_per_step=1", "learner.min_batch_items=4",
                   "algo.max_staleness=0")
    assert result["versions"] >= 1, result

    tokenizer = AutoTokenizer.from_pretrained(workdir / "models" / "smollm2")
    stages = [m for _, m in received(run_dir) if isinstance(m, StageRecord)]
    first = tokenizer.decode(stages[0].observation_ids())
    assert '"name": "weather"' in first and "What is the weather in" in first, first
    assert any(s.stage_reward == pytest.approx(0.1) for s in stages)  # the agent's async_rl.reward(client, 0.1)
    rollout = lines(run_dir / "metrics" / "rollout-0.jsonl")
    counts = rollout[-1]  # the agent's counts since the worker started
    assert counts["agent_tool_calls"] > 0  # the warm start taught it the tool
    assert counts["agent_completions"] > 0 and counts["agent_rewards"] > 0 and counts["agent_errors"] == 0
    assert all(line["ledger_residual_max"] < 1e-6 for line in lines(run_dir / "metrics.jsonl"))
