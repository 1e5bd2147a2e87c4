"""The built-in engine's cache between turns: a turn that extends an earlier call feeds only its new tokens, and its
log-probs equal one full forward pass over the whole context; eviction and weight updates never change a result."""

from __future__ import annotations

import random

import pytest
import torch
from rollout_helpers import model_dir_for

from async_rl.config_load import load_config
from async_rl.loss import token_logprobs
from async_rl.model import load_model
from async_rl.weights.file import save_weights
from rollout.engines import SamplingParams
from rollout.engines.prefix_cache import PrefixCache
from rollout.engines.torch_engine import TorchEngine

TOL = 1e-5


@pytest.fixture(scope="module", params=["trap", "hunt"])
def model_dir(request, tmp_path_factory):
    config = load_config(None, [f"run.dir={tmp_path_factory.mktemp('runs')}", "run.seed=1", f"env.name={request.param}",
                                "env.kwargs={}"])
    return model_dir_for(config)


def full_pass_logprobs(model, context: list[int], generated: list[int], temperature: float) -> list[float]:
    tokens = torch.tensor([context + generated])
    with torch.no_grad():
        return token_logprobs(model(tokens).logits, tokens, temperature)[0, len(context) - 1 :].tolist()


def play(engine: TorchEngine, starts: list[list[int]], turns: int, params: SamplingParams, vocab: int,
         seed: int = 0) -> list[tuple[list[int], list[int], list[float]]]:
    """Multi-turn episodes in one batch: each turn's prompt is the previous context, the action and an observation
    of 1-4 random tokens (rows of different lengths). Returns every (context, action, log-probs)."""
    rng = random.Random(seed)
    contexts, calls = [list(s) for s in starts], []
    for _ in range(turns):
        generations = engine.generate(contexts, params)
        for row, generation in enumerate(generations):
            calls.append((list(contexts[row]), generation.token_ids, generation.logprobs))
            observation = [rng.randrange(4, vocab) for _ in range(rng.randint(1, 4))]
            contexts[row] = contexts[row] + generation.token_ids + observation
    return calls


def assert_exact(model_dir, calls, temperature: float) -> None:
    model = load_model(model_dir).eval()
    for context, action, logprobs in calls:
        expected = full_pass_logprobs(model, context, action, temperature)
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected), atol=TOL, rtol=0)


@pytest.mark.parametrize("temperature, stop", [(1.0, False), (0.7, True)])
def test_later_turns_reuse_the_cache_and_their_logprobs_equal_a_full_pass(model_dir, temperature, stop):
    engine = TorchEngine(model_dir, seed=0, cache_mib=64)
    vocab = engine.model.config.vocab_size
    # with stop tokens, rows end at different steps and keep decoding in lockstep: only their real tokens are cached
    params = SamplingParams(temperature=temperature, max_new_tokens=5,
                            stop_token_ids=list(range(4, vocab, 3)) if stop else [])
    calls = play(engine, [[5, 9, 3, 11], [7], [4, 12, 6], [8, 8]], turns=5, params=params, vocab=vocab)
    stats = engine.cache.stats
    assert stats.reused_tokens > 2 * stats.prefilled_tokens  # turns 2-5 fed only their observations
    assert len(engine.cache.entries) == 4  # one entry per trajectory: each turn replaced the one it extended
    assert_exact(model_dir, calls, temperature)


def test_rows_that_hit_and_rows_that_miss_share_a_batch(model_dir):
    engine = TorchEngine(model_dir, seed=1, cache_mib=64)
    params = SamplingParams(max_new_tokens=4)
    first = engine.generate([[5, 9, 3], [7, 7]], params)
    extended = [[5, 9, 3] + first[0].token_ids + [6, 6, 6], [10, 11, 12, 13, 14], [7, 7] + first[1].token_ids[:2]]
    second = engine.generate(extended, params)
    # row 0: its prompt and 3 of its 4 tokens (the last sampled token was never fed); row 1: a miss; row 2 shares 4
    # tokens with its entry but feeds its last one (its logits sample the first new token)
    assert engine.cache.stats.reused_tokens == (3 + 3) + 3
    calls = [(p, g.token_ids, g.logprobs) for p, g in zip(extended, second, strict=True)]
    assert_exact(model_dir, calls, 1.0)


def test_a_small_budget_evicts_and_results_stay_exact(model_dir):
    engine = TorchEngine(model_dir, seed=2, cache_mib=0.02)  # room for a few short sequences of the tiny model
    vocab = engine.model.config.vocab_size
    calls = play(engine, [[5 + i, 9, 3] for i in range(8)], turns=4, params=SamplingParams(max_new_tokens=3),
                 vocab=vocab)
    assert engine.cache.stats.evicted > 0 and engine.cache.stats.held_bytes <= engine.cache.budget_bytes
    assert engine.cache.stats.reused_tokens > 0
    assert_exact(model_dir, calls, 1.0)


def test_a_weight_update_clears_the_cache_and_the_next_turn_is_computed_by_the_new_weights(model_dir, tmp_path):
    engine = TorchEngine(model_dir, seed=3, cache_mib=64)
    params = SamplingParams(max_new_tokens=3)
    first = engine.generate([[5, 9, 3]], params)[0]
    model = load_model(model_dir)
    torch.manual_seed(0)
    new_weights = {name: value + 0.05 * torch.randn_like(value) for name, value in model.state_dict().items()}
    save_weights(new_weights, tmp_path / "v1.safetensors")
    model.load_state_dict(new_weights)
    engine.update_weights(1, str(tmp_path / "v1.safetensors"))
    assert engine.cache.entries == [] and engine.cache.stats.cleared == 1
    context = [5, 9, 3] + first.token_ids + [6]
    second = engine.generate([context], params)[0]
    assert second.versions == [1, 1, 1] and engine.cache.stats.reused_tokens == 0
    expected = full_pass_logprobs(model.eval(), context, second.token_ids, 1.0)
    torch.testing.assert_close(torch.tensor(second.logprobs), torch.tensor(expected), atol=TOL, rtol=0)


def test_the_cache_off_keeps_nothing(model_dir):
    engine = TorchEngine(model_dir, seed=4)
    engine.generate([[5, 9, 3]], SamplingParams(max_new_tokens=3))
    assert engine.cache.entries == [] and engine.cache.stats.reused_tokens == 0


def test_a_lookup_takes_the_longest_shared_prefix_and_never_the_whole_prompt():
    cache = PrefixCache(budget_bytes=1 << 20)
    kv = [(torch.zeros(1, 6, 2), torch.zeros(1, 6, 2))]
    cache.put([1, 2, 3, 4, 5, 6], kv)
    cache.put([1, 2, 9, 9, 9, 9], kv)
    entry, n = cache.match([1, 2, 3, 4, 7])
    assert n == 4 and list(entry.tokens[:4]) == [1, 2, 3, 4]
    assert cache.match([1, 2, 3, 4, 5, 6])[1] == 5  # the last prompt token is always fed: its logits sample
    assert cache.match([2, 3])[0] is None and cache.match([1])[0] is None


@pytest.mark.slow
def test_the_real_model_reuses_its_cache_exactly(smollm2):
    """SmolLM2-135M (30 layers, grouped-query attention) over three turns with a chat-like context."""
    engine = TorchEngine(smollm2, seed=0, cache_mib=256)
    tokens = engine.tokenizer("<|im_start|>user\nWhat is 3 + 10?<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    calls = play(engine, [tokens, tokens[:-3]], turns=3, params=SamplingParams(max_new_tokens=4),
                 vocab=engine.model.config.vocab_size)
    assert engine.cache.stats.reused_tokens > engine.cache.stats.prefilled_tokens
    model = engine.model  # the same weights; the full pass runs without any cache
    for context, action, logprobs in calls:
        expected = full_pass_logprobs(model, context, action, 1.0)
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected), atol=1e-4, rtol=0)


def test_only_the_sampled_position_goes_through_the_lm_head(model_dir):
    """A prompt's earlier positions skip the LM head (`logits_to_keep=1`): each forward of a generate, prefill or
    decode, feeds the head one position per row; the log-probs are still a full pass's (the tests above)."""
    engine = TorchEngine(model_dir, seed=0)
    widths: list[int] = []
    engine.model.lm_head.register_forward_hook(lambda module, args, out: widths.append(args[0].shape[1]))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7]]
    engine.generate(prompts, SamplingParams(max_new_tokens=3, temperature=1.0))
    assert widths and set(widths) == {1}, widths
