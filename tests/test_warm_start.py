"""The warm start: demonstrations from an env (`async-rl demos`), their rendering and assistant-only loss mask,
the SFT loss, malformed files refused by line, the `chain` env's stages, and `async-rl sft` then `async-rl train`
then `async-rl export` through real processes on a tiny model that has SmolLM2's tokenizer and chat template."""

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from project_commands import project_command

from async_rl.config_load import load_config
from async_rl.env_types import Action, ToolCall, ToolResult
from async_rl.loss import sft_loss, token_logprobs
from async_rl.model import load_tokenizer
from learner.sft import batches, demonstration_items
from learner.sft_data import DemonstrationError, parse_line, read_demonstrations, render
from rollout.demos import write_demonstrations
from rollout.envs.base import EnvError, load_factory
from rollout.envs.chain import ChainSettings, make_task
from rollout.prompting import Prompter

ASYNC_RL = project_command()
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def chain_config(tmp_path: Path, *extra: str):
    return load_config(None, ["env.name=chain", "env.kwargs.num_tasks=40", f"run.dir={tmp_path}", *extra])


def call(key: str, number: int = 0) -> dict:
    return {"type": "function", "id": f"call_{number}",
            "function": {"name": "lookup", "arguments": json.dumps({"key": key})}}


# --- the chain env ---------------------------------------------------------------------------------------------------


def test_each_chain_call_that_advances_pays_a_stage_reward_and_only_the_chain_number_succeeds():
    settings = ChainSettings(hops=3, step_reward=0.1)
    task = make_task(7, settings)
    env = load_factory("chain", {"hops": 3}).make()
    keys, number = task.data["keys"], task.data["answer"]
    assert "starts a chain" in env.reset(task) and keys[0] in env.reset(task)
    wrong = env.step(Action("", [ToolCall("lookup", {"key": keys[1]}, "call_0")]))  # skips the first key
    assert wrong.reward == 0.0 and not wrong.done and wrong.observation[0].content == keys[2]
    for position, key in enumerate(keys):
        result = env.step(Action("", [ToolCall("lookup", {"key": key}, "call_0")]))
        expected = keys[position + 1] if position + 1 < len(keys) else number
        assert result.reward == pytest.approx(0.1) and result.observation == [ToolResult(expected, "lookup", "call_0")]
    again = env.step(Action("", [ToolCall("lookup", {"key": keys[0]}, "call_0")]))
    assert again.reward == 0.0  # a call that does not advance the solution earns nothing
    assert env.step(Action(f"<answer>{number}</answer>", [])).done
    judgement = env.judge()
    assert judgement.success and judgement.score == 1.0
    assert judgement.info["chain_reached"] == 1.0 and judgement.info["called_tool"] == 1.0


def test_a_key_not_in_the_chain_is_an_error_answer_and_a_wrong_number_fails():
    env = load_factory("chain", {}).make()
    task = make_task(0, ChainSettings())
    env.reset(task)
    result = env.step(Action("", [ToolCall("lookup", {"key": "nope"}, "call_0")]))
    assert result.reward == 0.0 and result.observation[0].content.startswith("error: no key")
    env.step(Action("it is 1000", []))  # untagged: its last number
    judgement = env.judge()
    assert not judgement.success and judgement.info["tool_errors"] == 1.0


def test_at_a_fork_the_decoy_is_a_dead_end_and_the_other_key_still_advances():
    settings = ChainSettings(hops=3, forks=2)
    task = make_task(3, settings)
    keys, decoys = task.data["keys"], task.data["decoys"]
    env = load_factory("chain", {"hops": 3, "forks": 2}).make()
    assert "dead end" in env.reset(task)
    first = env.step(Action("", [ToolCall("lookup", {"key": keys[0]}, "call_0")]))
    shown = first.observation[0].content.split(" or ")
    assert sorted(shown) == sorted([keys[1], decoys["0"]["key"]]) and first.reward == pytest.approx(0.1)
    dead = env.step(Action("", [ToolCall("lookup", {"key": decoys["0"]["key"]}, "call_0")]))
    assert dead.observation[0].content == "dead end" and dead.reward == 0.0 and not dead.done
    recovered = env.step(Action("", [ToolCall("lookup", {"key": keys[1]}, "call_0")]))
    assert recovered.reward == pytest.approx(0.1) and decoys["1"]["key"] in recovered.observation[0].content
    assert env.step(Action("", [ToolCall("lookup", {"key": keys[2]}, "call_0")])).observation[0].content == \
        task.data["answer"]
    env.step(Action(f"<answer>{task.data['answer']}</answer>", []))
    judgement = env.judge()
    assert judgement.success and judgement.info["dead_ends"] == 1.0 and judgement.info["tool_errors"] == 0.0
    with pytest.raises(EnvError, match=r"env.kwargs.forks: expected <= hops - 1 \(2"):
        load_factory("chain", {"hops": 3, "forks": 3})


def test_the_chain_splits_are_disjoint_and_seeded():
    factory = load_factory("chain", {"num_tasks": 50, "eval_fraction": 0.2})
    train, held_out = factory.tasks("train"), factory.tasks("eval")
    assert len(held_out) == 10 and len(train) == 40
    assert not {t.id for t in train} & {t.id for t in held_out}
    assert [t.id for t in load_factory("chain", {"num_tasks": 50}).tasks("eval")] == [t.id for t in held_out]


# --- demonstrations ---------------------------------------------------------------------------------------------------


def test_demos_are_solved_train_episodes_played_through_the_env(tmp_path):
    config = chain_config(tmp_path, "env.kwargs.hops=2")
    out = tmp_path / "demos.jsonl"
    assert write_demonstrations(config, out, 50) == {"written": 50, "skipped": 0}  # 32 train tasks, cycled
    factory = load_factory("chain", config.env.kwargs)
    held_out = {t.data["keys"][0] for t in factory.tasks("eval")}
    conversations = [json.loads(line) for line in out.read_text().splitlines()]
    for conversation in conversations:
        messages = conversation["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
        assert conversation["tools"][0]["function"]["name"] == "lookup"
        start = json.loads(messages[1]["tool_calls"][0]["function"]["arguments"])["key"]
        assert start not in held_out  # never a held-out task
        assert messages[2]["content"] == json.loads(messages[3]["tool_calls"][0]["function"]["arguments"])["key"]
        assert messages[5]["content"] == f"<answer>{messages[4]['content']}</answer>"
    assert len({c["messages"][0]["content"] for c in conversations}) == 32  # every train task once before twice


def test_the_tasks_env_demonstrates_its_calculator_and_an_env_without_the_member_is_refused(tmp_path):
    config = load_config("smollm2", [f"run.dir={tmp_path}"])
    out = tmp_path / "tasks.jsonl"
    counts = write_demonstrations(config, out, 5)
    assert counts["written"] == 5
    first = json.loads(out.read_text().splitlines()[0])["messages"]
    assert first[1]["tool_calls"][0]["function"]["name"] == "calculator"
    assert first[3]["content"] == f"<answer>{first[2]['content']}</answer>"
    with pytest.raises(EnvError, match="env 'trap' has no demonstration"):
        write_demonstrations(load_config(None, [f"run.dir={tmp_path}"]), tmp_path / "trap.jsonl", 5)


def test_the_demos_command_writes_the_file_and_says_what_it_wrote(tmp_path):
    out = tmp_path / "demos.jsonl"
    done = subprocess.run([ASYNC_RL, "demos", "--out", str(out), "--n", "3", "env.name=chain"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"out": str(out.resolve()), "written": 3, "skipped": 0}
    assert len(read_demonstrations(out)) == 3


# --- malformed files ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("line, why", [
    ("{not json", "line 2: not valid JSON"),
    ('{"messages": []}', 'line 2: expected {"messages"'),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "line 2: messages[0].role: expected one of"),
    ('{"messages": [{"role": "user", "content": 3}]}', "line 2: messages[0].content: expected a string"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "line 2: messages: no assistant message"),
    ('{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": ""}}]}]}',
     "line 2: messages[0].tool_calls[0].function.name: expected a non-empty string"),
    ('{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]}',
     "line 2: messages[0].tool_calls[0].function.arguments: not valid JSON"),
    ('{"messages": [{"role": "user", "content": "x", "tool_calls": []}]}',
     "line 2: messages[0].tool_calls: only an assistant message calls tools"),
    ('{"messages": [{"role": "assistant", "content": "x"}], "tools": [1]}', "line 2: tools: expected a list"),
])
def test_a_malformed_demonstrations_file_is_refused_naming_the_line_and_field(tmp_path, line, why):
    path = tmp_path / "demos.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps(good) + "\n" + line + "\n")
    with pytest.raises(DemonstrationError, match=re.escape(why)):
        read_demonstrations(path)


def test_the_sft_command_refuses_a_bad_file_by_line_before_loading_a_model(tmp_path, smollm2):
    path = tmp_path / "demos.jsonl"
    path.write_text('{"messages": [{"role": "assistant", "content": "x"}]}\n\n{"messages": 5}\n')
    done = subprocess.run([ASYNC_RL, "sft", "--model", str(smollm2), "--data", str(path), "--out",
                           str(tmp_path / "out"), f"run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"{path} line 3" in done.stderr and "engine ready" not in done.stderr
    assert not (tmp_path / "out").exists()


# --- rendering and the loss --------------------------------------------------------------------------------------


def chain_demonstration(tmp_path: Path) -> dict:
    out = tmp_path / "one.jsonl"
    write_demonstrations(chain_config(tmp_path, "env.kwargs.hops=2"), out, 1)
    return json.loads(out.read_text())


def test_the_loss_mask_is_on_exactly_the_assistant_tokens_and_the_end_of_turn(tmp_path, smollm2):
    tokenizer = load_tokenizer(smollm2)
    conversation = chain_demonstration(tmp_path)
    demonstration = parse_line(json.dumps(conversation), 1, "demos.jsonl")
    rendered = render(tokenizer, demonstration)
    spans, current = [], None  # the trained runs of tokens, decoded
    for token, trained in zip(rendered.tokens.tolist(), rendered.mask.tolist(), strict=True):
        if trained and current is None:
            current = []
        if trained:
            current.append(token)
        elif current is not None:
            spans.append(tokenizer.decode(current))
            current = None
    spans.append(tokenizer.decode(current))
    messages = conversation["messages"]
    keys = [json.loads(m["tool_calls"][0]["function"]["arguments"])["key"] for m in messages if m.get("tool_calls")]
    assert spans == [f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{keys[0]}"}}}}\n</tool_call><|im_end|>',
                     f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{keys[1]}"}}}}\n</tool_call><|im_end|>',
                     f"{messages[-1]['content']}<|im_end|>"]
    context = tokenizer.decode([t for t, m in zip(rendered.tokens, rendered.mask, strict=True) if not m])
    assert "# Tools" in context and messages[0]["content"] in context and "<tool_response>" in context
    assert "<|im_start|>assistant" not in "".join(spans)  # the generation prompt is context


def test_the_rendered_conversation_is_token_for_token_the_context_a_rollout_builds(tmp_path, smollm2):
    tokenizer = load_tokenizer(smollm2)
    conversation = chain_demonstration(tmp_path)
    rendered = render(tokenizer, parse_line(json.dumps(conversation), 1, "demos.jsonl"))
    prompter, messages = Prompter(tokenizer), conversation["messages"]
    context = prompter.first(messages[0]["content"], conversation["tools"])
    for message in messages[1:]:
        if message["role"] == "tool":
            context += prompter.next([ToolResult(message["content"], message["name"], message["tool_call_id"])])
            continue
        text = "".join('<tool_call>\n{"name": "lookup", "arguments": ' + c["function"]["arguments"] + "}\n</tool_call>"
                       for c in message.get("tool_calls") or []) or message["content"]
        context += tokenizer(text + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    assert rendered.tokens.tolist() == context


def test_a_conversation_longer_than_the_context_is_skipped_and_counted(tmp_path, smollm2):
    path = tmp_path / "demos.jsonl"
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    long = {"messages": [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "ok"}]}
    path.write_text("\n".join(json.dumps(c) for c in (short, long, short)) + "\n")
    config = load_config(None, [f"model.path={smollm2}", "model.max_seq_len=128"])
    items, skipped = demonstration_items(config.model.max_seq_len, smollm2, path)
    assert len(items) == 2 and skipped == 1
    assert [len(b) for _, b in batches(items, 10_000, 2, seed=0)] == [2, 2]


def test_the_sft_loss_is_the_mean_nll_of_the_masked_tokens_and_no_other_token_gets_a_gradient():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11, requires_grad=True)
    tokens = torch.randint(0, 11, (2, 6))
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 1, 0]], dtype=torch.float32)
    logp = token_logprobs(logits, tokens)
    loss = sft_loss(logp, mask)
    assert math.isclose(float(loss.detach()), float(-(logp * mask).sum().detach() / 3), rel_tol=1e-6)
    loss.backward()
    predicts = torch.zeros(2, 6, dtype=torch.bool)  # the logits at t-1 predict token t
    predicts[:, :-1] = mask.bool()
    assert logits.grad[~predicts].abs().max() == 0 and logits.grad[predicts].abs().max() > 0


# --- sft, then RL, then export: real processes -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, smollm2) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer, chat template (tools included) and generation config."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-chat") / "model"
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    shutil.copy(smollm2 / "generation_config.json", out / "generation_config.json")
    return out


def run_command(*args: str, timeout: float = 600) -> str:
    done = subprocess.run([ASYNC_RL, *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


SMALL = ["learner.pack_row_tokens=null", "learner.micro_batch_tokens=2048", "learner.batch_tokens=2048",
         "model.max_seq_len=1024"]


@pytest.mark.slow
def test_sft_then_rl_resumes_and_exports_like_any_run(tmp_path, tiny_chat_model):
    # three train tasks, each demonstrated once and learned by heart by the tiny model: it then calls its tool and
    # sometimes succeeds, so its groups carry credit for RL
    env = ["env.name=chain", "env.kwargs.hops=2", "env.kwargs.num_tasks=4", "env.kwargs.eval_fraction=0.25"]
    demos = tmp_path / "demos.jsonl"
    run_command("demos", "--out", str(demos), "--n", "3", *env, f"run.dir={tmp_path}")
    warm = tmp_path / "warm"
    summary = json.loads(run_command("sft", "--model", str(tiny_chat_model), "--data", str(demos), "--out", str(warm),
                                     "--epochs", "60", "learner.lr=0.01", "wandb.mode=disabled", f"run.dir={tmp_path}",
                                     *SMALL).splitlines()[-1])
    assert summary["conversations"] == 3 and summary["skipped_too_long"] == 0 and summary["out_dir"] == str(warm)
    losses = [line["sft_loss"] for line in map(json.loads, (tmp_path / "sft-warm" / "metrics.jsonl").open())]
    assert len(losses) == summary["steps"] == 60 and losses[-1] < 0.5 < 5 < losses[0]  # the demonstrations are learned
    again = subprocess.run([ASYNC_RL, "sft", "--model", str(tiny_chat_model), "--data", str(demos), "--out",
                            str(warm), f"run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "exists and is not empty (pass --force" in again.stderr  # before any training
    assert not (tmp_path / "sft-warm-2").exists()
    # RL from the warm start, as any run: train, resume, export
    train = ["train", f"model.path={warm}", *env, "rollout.max_new_tokens=40", "rollout.group_size=4",
             "learner.min_batch_items=4", "run.target_success=null", "run.eval_samples_per_task=0",
             "wandb.mode=disabled", f"run.dir={tmp_path}", "run.name=rl", "run.max_versions=2",
             "algo.entropy_coef=0.0", *SMALL]
    first = json.loads(run_command(*train).splitlines()[-1])
    assert first["versions"] == 2
    rollout = [json.loads(line) for line in (Path(first["run_dir"]) / "metrics" / "rollout-0.jsonl").open()]
    assert sum(line["tool_calls"] for line in rollout) > 0  # the warmed-up tiny model calls its tool
    resumed = json.loads(run_command("train", "--resume", first["run_dir"], "run.max_versions=3").splitlines()[-1])
    assert resumed["versions"] == 3
    exported = tmp_path / "exported"
    assert run_command("export", first["run_dir"], str(exported)).strip() == str(exported)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(exported).config.vocab_size == len(load_tokenizer(warm))


@pytest.mark.slow
def test_a_lora_warm_start_writes_merged_weights_that_differ_from_the_base(tmp_path, tiny_chat_model):
    from safetensors.torch import load_file

    demos = tmp_path / "demos.jsonl"
    run_command("demos", "--out", str(demos), "--n", "4", "env.name=chain", f"run.dir={tmp_path}")
    warm = tmp_path / "warm"
    run_command("sft", "--model", str(tiny_chat_model), "--data", str(demos), "--out", str(warm), "--lora-rank", "4",
                "--max-steps", "1", "learner.lr=0.01", "wandb.mode=disabled", f"run.dir={tmp_path}", *SMALL)
    base, merged = load_file(tiny_chat_model / "model.safetensors"), load_file(warm / "model.safetensors")
    assert set(merged) == set(base)  # plain weights, no adapter tensors
    changed = [k for k in base if not torch.equal(base[k], merged[k])]
    assert changed and all("proj" in k for k in changed)  # only the adapted projections moved
