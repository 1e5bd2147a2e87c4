"""The built-in torch engine: exact behaviour log-probs, seeded sampling, stop tokens, weight updates."""

import pytest
import torch
from rollout_helpers import model_dir_for

from async_rl.config_load import load_config
from async_rl.loss import token_logprobs
from async_rl.model import load_model
from async_rl.weights.file import save_weights
from rollout.engines import SamplingParams
from rollout.engines.torch_engine import TorchEngine

PROMPTS = [[5, 9, 3, 11], [7], [4, 12, 6], [8, 8]]  # different lengths: rows are left-padded


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = load_config(None, [f"run.dir={tmp_path_factory.mktemp('runs')}", "run.seed=1"])
    return model_dir_for(config)


def recomputed_logprobs(model, prompt, generated, temperature):
    """log pi(generated | prompt) from one full-sequence forward pass, without padding or cache."""
    tokens = torch.tensor([prompt + generated])
    with torch.no_grad():
        logp = token_logprobs(model(tokens).logits, tokens, temperature)
    return logp[0, len(prompt) - 1 :].tolist()


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_logprobs_equal_a_full_sequence_recomputation(model_dir, temperature, top_p):
    engine = TorchEngine(model_dir, seed=0)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=6)
    generations = engine.generate(PROMPTS, params)
    model = load_model(model_dir).eval()
    for prompt, generation in zip(PROMPTS, generations, strict=True):
        assert len(generation.token_ids) == len(generation.logprobs) == len(generation.versions) == 6
        assert generation.finish_reason == "length"
        expected = recomputed_logprobs(model, prompt, generation.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(generation.logprobs), torch.tensor(expected), atol=1e-5, rtol=0)


def test_same_seed_same_samples_and_different_seed_different_samples(model_dir):
    params = SamplingParams(max_new_tokens=8)
    first = TorchEngine(model_dir, seed=3).generate(PROMPTS, params)
    again = TorchEngine(model_dir, seed=3).generate(PROMPTS, params)
    other = TorchEngine(model_dir, seed=4).generate(PROMPTS, params)
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert [g.logprobs for g in first] == [g.logprobs for g in again]
    assert [g.token_ids for g in first] != [g.token_ids for g in other]


def test_top_p_restricts_sampling_to_the_nucleus(model_dir):
    engine = TorchEngine(model_dir, seed=0)
    generations = engine.generate([[5, 9]] * 16, SamplingParams(top_p=1e-6, max_new_tokens=1))
    assert len({g.token_ids[0] for g in generations}) == 1  # only the most likely token survives


def test_a_stop_token_ends_its_row_and_is_kept(model_dir):
    engine = TorchEngine(model_dir, seed=0)
    free = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8))
    stop_id = free[0].token_ids[2]  # a token row 0 samples at step 3 under this seed
    engine = TorchEngine(model_dir, seed=0)
    stopped = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, stop_token_ids=[stop_id]))
    for before, after in zip(free, stopped, strict=True):
        if stop_id in before.token_ids:
            cut = before.token_ids.index(stop_id) + 1
            assert after.token_ids == before.token_ids[:cut]
            assert after.finish_reason == "stop"
            assert len(after.logprobs) == len(after.versions) == cut
        else:
            assert after.token_ids == before.token_ids and after.finish_reason == "length"
    assert stopped[0].token_ids[-1] == stop_id


def test_update_weights_changes_outputs_and_version(model_dir, tmp_path):
    engine = TorchEngine(model_dir, seed=0)
    params = SamplingParams(max_new_tokens=4)
    before = engine.generate(PROMPTS, params)
    assert all(g.versions == [0] * 4 for g in before)

    model = load_model(model_dir)
    torch.manual_seed(0)
    new_weights = {name: value + 0.5 * torch.randn_like(value) for name, value in model.state_dict().items()}
    save_weights(new_weights, tmp_path / "v7.safetensors")
    engine.update_weights(7, str(tmp_path / "v7.safetensors"))
    assert engine.version == 7

    fresh = TorchEngine(model_dir, seed=0)
    fresh.update_weights(7, str(tmp_path / "v7.safetensors"))
    after = fresh.generate(PROMPTS, params)
    assert all(g.versions == [7] * 4 for g in after)
    assert [g.logprobs for g in after] != [g.logprobs for g in before]
    model.load_state_dict(new_weights)
    for prompt, generation in zip(PROMPTS, after, strict=True):
        expected = recomputed_logprobs(model.eval(), prompt, generation.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(generation.logprobs), torch.tensor(expected), atol=1e-5, rtol=0)


def test_empty_batch_and_empty_prompt(model_dir):
    engine = TorchEngine(model_dir, seed=0)
    assert engine.generate([], SamplingParams()) == []
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[3], []], SamplingParams())


def test_a_stop_string_ends_the_row_at_the_token_that_completes_it(tmp_path):
    """Byte-level tiny model (no env vocabulary): stop strings are matched on the decoded text."""
    from async_rl.model import ensure_model_dir, load_tokenizer

    config = load_config(None, [f"run.dir={tmp_path}", "run.seed=3"])
    model_dir = ensure_model_dir(config.model, config.run_dir, config.run.seed)  # no words: byte-level
    tokenizer = load_tokenizer(model_dir)
    engine = TorchEngine(model_dir, seed=0)
    prompts = [tokenizer("def f(x):\n")["input_ids"], tokenizer("hello")["input_ids"]]
    free = engine.generate(prompts, SamplingParams(max_new_tokens=40))
    texts = [tokenizer.decode(g.token_ids) for g in free]
    # Stop at a character the unconstrained samples produced (a random byte model: pick one that occurs early).
    stop = texts[0][5]
    stopped = TorchEngine(model_dir, seed=0).generate(prompts, SamplingParams(max_new_tokens=40, stop=[stop]))
    for before, after in zip(free, stopped, strict=True):
        text = tokenizer.decode(after.token_ids)
        assert after.token_ids == before.token_ids[: len(after.token_ids)]  # same seed: the same samples, cut short
        if stop in tokenizer.decode(before.token_ids):
            assert after.finish_reason == "stop" and text.endswith(stop) and stop not in text[: -len(stop)]
        else:
            assert after.finish_reason == "length" and len(after.token_ids) == 40
    assert stopped[0].finish_reason == "stop" and len(stopped[0].token_ids) <= 6
