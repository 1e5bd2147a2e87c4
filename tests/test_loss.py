"""The token loss (docs/algorithm.md, "Loss") on a real tiny model, with autograd."""

import copy
import math

import pytest
import torch

from async_rl.config import AlgoConfig
from async_rl.config_load import load_config
from async_rl.loss import (
    aggregate,
    importance_weights,
    k3_kl,
    policy_loss,
    token_logprobs,
    token_logprobs_and_entropy,
)
from async_rl.model import build_tiny_model


@pytest.fixture(scope="module")
def model():
    config = load_config(None, ["model.hidden_size=32", "model.num_layers=1", "run.seed=3"])
    return build_tiny_model(config.model, config.run.seed, vocab_size=17, pad_id=0, eos_id=1)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, 17, (3, 9), generator=g)
    mask = torch.zeros(3, 8)
    mask[:, 4:] = 1
    mask[2, 6:] = 0
    advantages = torch.randn(3, 8, generator=g)
    staleness = torch.randint(0, 4, (3, 8), generator=g)
    return tokens, mask, advantages, staleness


def gradient(model, algo, behaviour_shift, ppo):
    model.zero_grad()
    tokens, mask, advantages, staleness = batch()
    logp = token_logprobs(model(tokens).logits, tokens)
    behaviour = logp.detach() + behaviour_shift  # a behaviour policy a little off the learner's
    prox = logp.detach() if ppo else None  # one epoch: π_prox is the current policy
    loss, _ = policy_loss(logp, behaviour, advantages, staleness, mask, algo, prox_logp=prox)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("decay", [1.0, 0.8])
def test_one_epoch_tis_and_decoupled_ppo_give_the_same_gradient(model, decay):
    algo = AlgoConfig(staleness_decay=decay)
    shift = torch.linspace(-0.9, 0.9, 24).reshape(3, 8)  # ratios both under and over is_cap
    tis = gradient(model, algo, shift, ppo=False)
    ppo = gradient(model, algo, shift, ppo=True)
    assert any(g.abs().sum() > 0 for g in tis)
    for a, b in zip(tis, ppo, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_importance_weight_is_capped_and_carries_no_gradient():
    algo = AlgoConfig(is_cap=2.0)
    logp = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    behaviour = torch.tensor([-1.0, -3.0, -0.5])  # ρ = 1, e², e^-0.5
    weight, rho = importance_weights(logp, behaviour, torch.zeros(3), algo)
    assert not weight.requires_grad
    torch.testing.assert_close(rho, torch.exp(torch.tensor([0.0, 2.0, -0.5])))
    torch.testing.assert_close(weight, torch.tensor([1.0, 2.0, float(torch.exp(torch.tensor(-0.5)))]))


def test_staleness_decay_multiplies_the_weight_per_version():
    algo = AlgoConfig(staleness_decay=0.5)
    logp = torch.zeros(4)
    weight, _ = importance_weights(logp, logp.clone(), torch.tensor([0, 1, 2, 3]), algo)
    torch.testing.assert_close(weight, torch.tensor([1.0, 0.5, 0.25, 0.125]))


def test_tis_gradient_is_weight_times_advantage_times_score():
    algo = AlgoConfig(is_cap=2.0)
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.5, -0.5]])
    advantages = torch.tensor([[2.0, -1.0]])
    loss, stats = policy_loss(logp, behaviour, advantages, torch.zeros(1, 2), torch.ones(1, 2), algo)
    loss.backward()
    w = torch.clamp(torch.exp(logp.detach() - behaviour), max=2.0)
    torch.testing.assert_close(logp.grad, -(w * advantages) / 2)
    assert stats.is_capped_frac == 0.0 and stats.is_ratio_max == pytest.approx(float(torch.exp(torch.tensor(0.5))))


def test_capped_fraction_is_reported():
    algo = AlgoConfig(is_cap=1.5)
    logp = torch.zeros(1, 4, requires_grad=True)
    behaviour = torch.tensor([[0.0, -1.0, -2.0, 0.5]])
    _, stats = policy_loss(logp, behaviour, torch.ones(1, 4), torch.zeros(1, 4), torch.ones(1, 4), algo)
    assert stats.is_capped_frac == pytest.approx(0.5)


def test_decoupled_ppo_clips_a_policy_that_moved_too_far():
    algo = AlgoConfig(clip_low=0.2, clip_high=0.28)
    prox = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5]])).requires_grad_()  # u = 1.5 and 0.5, both outside the clip
    loss, _ = policy_loss(logp, prox, torch.tensor([[1.0, -1.0]]), torch.zeros(1, 2), torch.ones(1, 2), algo,
                          prox_logp=prox)
    loss.backward()
    assert torch.all(logp.grad == 0)  # both tokens are clipped on the side that stops the gradient


def test_token_mean_and_seq_mean_token_sum():
    token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(aggregate(token_loss, mask, AlgoConfig())) == pytest.approx(10.0 / 4)
    dr_grpo = AlgoConfig(aggregation="seq-mean-token-sum", seq_norm=5.0)
    assert float(aggregate(token_loss, mask, dr_grpo)) == pytest.approx((6.0 + 4.0) / (2 * 5.0))


def test_k3_kl_is_zero_at_the_reference_and_positive_elsewhere():
    logp = torch.log(torch.tensor([0.2, 0.5]))
    assert torch.allclose(k3_kl(logp, logp), torch.zeros(2))
    assert torch.all(k3_kl(logp, torch.log(torch.tensor([0.4, 0.1]))) > 0)


def test_kl_term_pulls_towards_the_reference(model):
    algo = AlgoConfig(kl_beta=0.5)
    tokens, mask, _, staleness = batch(1)
    logp = token_logprobs(model(tokens).logits, tokens)
    ref = logp.detach() - 0.3
    zero_adv = torch.zeros_like(mask)
    loss, stats = policy_loss(logp, logp.detach(), zero_adv, staleness, mask, algo, ref_logp=ref)
    assert stats.kl > 0 and float(loss.detach()) == pytest.approx(0.5 * stats.kl, rel=1e-5)


def test_entropy_of_uniform_logits_is_log_vocab_and_matches_the_chosen_logprobs():
    tokens = torch.tensor([[1, 2, 3]])
    logp, entropy = token_logprobs_and_entropy(torch.zeros(1, 3, 7), tokens)
    assert torch.allclose(entropy, torch.full((1, 2), math.log(7)))
    assert torch.allclose(logp, token_logprobs(torch.zeros(1, 3, 7), tokens))


def test_entropy_bonus_raises_the_policy_entropy_and_is_off_at_zero(model):
    model = copy.deepcopy(model)  # trained below; the fixture is shared
    tokens, mask, _, staleness = batch(1)
    zero_adv = torch.zeros_like(mask)
    logp, entropy = token_logprobs_and_entropy(model(tokens).logits, tokens)
    off = AlgoConfig(entropy_coef=0.0)  # the design's loss (configs/cluster.yaml); the default run's is 0.2
    loss, stats = policy_loss(logp, logp.detach(), zero_adv, staleness, mask, off, entropy=entropy)
    assert float(loss.detach()) == 0.0 and stats.entropy > 0  # reported, not trained, at 0
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    for _ in range(3):
        logp, entropy = token_logprobs_and_entropy(model(tokens).logits, tokens)
        loss, stats = policy_loss(
            logp, logp.detach(), zero_adv, staleness, mask, AlgoConfig(entropy_coef=0.5), entropy=entropy
        )
        assert float(loss.detach()) == pytest.approx(-0.5 * stats.entropy, rel=1e-5)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    _, after = token_logprobs_and_entropy(model(tokens).logits, tokens)
    assert float(aggregate(after.detach(), mask, AlgoConfig())) > stats.entropy


def test_entropy_and_kl_are_reported_per_action_token_whatever_the_aggregation():
    """Under token-sum the loss grows with the batch's tokens; `entropy_mean` and `kl` must not (they were, until
    2026-11-24, aggregated as the loss was: a token-sum run's entropy_mean rose as its episodes lengthened)."""
    logits = torch.zeros(2, 4, 7)  # uniform: every position's entropy is log 7
    tokens = torch.tensor([[1, 2, 3, 4], [1, 2, 0, 0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    logp, entropy = token_logprobs_and_entropy(logits, tokens)
    ref = logp.detach() - 0.3
    k3 = math.exp(-0.3) - 1 + 0.3  # k3 KL of a log-ratio 0.3 at every token
    for aggregation in ("token-mean", "token-sum", "seq-mean-token-sum"):
        algo = AlgoConfig(aggregation=aggregation, token_norm=1.0, kl_beta=0.1)
        _, stats = policy_loss(logp, logp.detach(), torch.zeros_like(mask), torch.zeros_like(mask), mask, algo,
                               ref_logp=ref, entropy=entropy)
        assert stats.entropy == pytest.approx(math.log(7), rel=1e-6), aggregation
        assert stats.kl == pytest.approx(k3, rel=1e-5), aggregation


def test_token_sum_weighs_a_token_the_same_whatever_else_the_batch_holds():
    """token-sum: the loss of a batch is the sum of its items' losses (a fixed weight per token); token-mean gives
    a one-token item the weight of a whole sequence when it shares a batch with fewer tokens."""
    token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    token_sum = AlgoConfig(aggregation="token-sum", token_norm=4.0)
    whole = float(aggregate(token_loss, mask, token_sum))
    assert whole == pytest.approx(10.0 / 4.0)
    parts = [float(aggregate(token_loss[r : r + 1], mask[r : r + 1], token_sum)) for r in range(2)]
    assert sum(parts) == pytest.approx(whole)
    mean = AlgoConfig()  # token-mean: the one-token item alone weighs 4.0, in the batch a quarter of it
    assert float(aggregate(token_loss[1:], mask[1:], mean)) == pytest.approx(4.0)


def test_entropy_per_credit_weights_each_tokens_bonus_by_its_advantage(model):
    """entropy_per=credit: the bonus on every trained token (as step), times |its advantage in the item|, so a token
    whose immediate push (A_imm) and correction (C) disagree gets |A_imm| + |C| > |A_final|, and one of a group
    without variance (advantage 0) gets none."""
    tokens, mask, _, staleness = batch(3)
    logp, entropy = token_logprobs_and_entropy(model(tokens).logits, tokens)
    advantages = torch.zeros_like(mask)
    advantages[0], advantages[1] = 1.5, -0.5  # row 2: advantage 0
    algo = AlgoConfig(entropy_coef=0.5, entropy_per="credit", aggregation="token-sum")
    # the entropy term alone: the loss less the same loss without the entropy
    loss, _ = policy_loss(logp.detach(), logp.detach(), advantages, staleness, mask, algo, entropy=entropy)
    pg, _ = policy_loss(logp.detach(), logp.detach(), advantages, staleness, mask, algo)
    weight = advantages.abs() * mask
    expected = -0.5 * float((entropy.detach() * weight).sum()) / algo.token_norm
    assert float(loss.detach() - pg.detach()) == pytest.approx(expected, rel=1e-5)
    # no advantage, no bonus: the row without credit alone moves no weight through its entropy
    row2, _ = policy_loss(logp[2:].detach(), logp[2:].detach(), advantages[2:], staleness[2:], mask[2:], algo,
                          entropy=entropy[2:])
    model.zero_grad()
    row2.backward(retain_graph=True)
    assert all(p.grad is None or float(p.grad.abs().sum()) == 0.0 for p in model.parameters())
    model.zero_grad()
    loss.backward()  # it trains: the bonus reaches the model through the entropy
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in model.parameters())
