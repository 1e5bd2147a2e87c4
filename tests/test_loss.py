"""The token loss (docs/algorithm.md, "Loss") on a real tiny model, with autograd."""

import copy
import math

import pytest
import torch

from async_rl.config import AlgoConfig, load_config
from async_rl.loss import (
    aggregate,
    bonus_rows,
    credit_bonus_weights,
    entropy_floor_boost,
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
    return build_tiny_model(config, vocab_size=17, pad_id=0, eos_id=1)


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


@pytest.mark.parametrize("updates", ["immediate+correction", "outcome-only", "immediate-only"])
def test_entropy_per_new_token_gives_each_token_of_data_the_bonus_once(model, updates):
    """entropy_per=new-token: with immediate+correction only the correction rows get the bonus (their tokens were
    also trained as immediates); with one item kind, every row; entropy_per=step: every row."""
    tokens, mask, _, staleness = batch(2)
    is_correction = torch.tensor([False, True, True]) if updates == "immediate+correction" else (
        torch.full((3,), updates == "outcome-only"))
    logp, entropy = token_logprobs_and_entropy(model(tokens).logits, tokens)
    zero_adv = torch.zeros_like(mask)
    per_token = AlgoConfig(updates=updates, entropy_coef=0.5, entropy_per="new-token", aggregation="token-sum")
    rows = bonus_rows(is_correction, mask, per_token)
    loss, _ = policy_loss(logp, logp.detach(), zero_adv, staleness, mask, per_token, entropy=entropy,
                          entropy_rows=rows)
    bonus_mask = mask.clone()
    if updates == "immediate+correction":
        bonus_mask[0] = 0  # the immediate row
    expected = -0.5 * float((entropy.detach() * bonus_mask).sum()) / per_token.token_norm
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    assert bonus_rows(is_correction, mask, AlgoConfig(entropy_per="step")) is None


def test_entropy_per_first_train_gives_each_token_the_bonus_on_the_first_item_that_trains_it(model):
    """entropy_per=first-train: an immediate item's tokens get the bonus (its push is the token's first); a
    correction's only on the stages no immediate item trained (its first-trained flags), so each token of data
    gets it once, and on the immediate item where there was one (not on the correction, as new-token does)."""
    tokens, mask, _, staleness = batch(3)
    is_correction = torch.tensor([False, True, True])
    first = mask.clone()
    first[1] = 0  # a correction whose stages were all trained by immediate items first
    first[2, 4] = 0  # a correction whose first stage (position 4) had an immediate item, the rest none
    logp, entropy = token_logprobs_and_entropy(model(tokens).logits, tokens)
    algo = AlgoConfig(entropy_coef=0.5, entropy_per="first-train", aggregation="token-sum")
    loss, _ = policy_loss(logp, logp.detach(), torch.zeros_like(mask), staleness, mask, algo, entropy=entropy,
                          entropy_rows=bonus_rows(is_correction, first, algo))
    expected = -0.5 * float((entropy.detach() * first * mask).sum()) / algo.token_norm
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    assert float((first * mask).sum()) < float(mask.sum()), "some trained tokens get no bonus"
    new_token = AlgoConfig(entropy_coef=0.5, entropy_per="new-token", aggregation="token-sum")
    assert torch.equal(bonus_rows(is_correction, first, new_token), is_correction)
    only_immediate = AlgoConfig(updates="immediate-only", entropy_per="first-train")
    assert bonus_rows(is_correction, first, only_immediate) is None


def test_entropy_per_credit_weights_each_tokens_bonus_by_its_advantage(model):
    """entropy_per=credit: the bonus on every trained token (as step), times |its advantage in the item|, so a token
    whose immediate push (A_imm) and correction (C) disagree gets |A_imm| + |C| > |A_final|, and one of a group
    without variance (advantage 0) gets none."""
    tokens, mask, _, staleness = batch(3)
    logp, entropy = token_logprobs_and_entropy(model(tokens).logits, tokens)
    advantages = torch.zeros_like(mask)
    advantages[0], advantages[1] = 1.5, -0.5  # row 2: advantage 0
    algo = AlgoConfig(entropy_coef=0.5, entropy_per="credit", aggregation="token-sum")
    assert bonus_rows(torch.tensor([False, True, True]), mask, algo) is None
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


@pytest.mark.parametrize("updates,paid", [("immediate+correction", 6.0), ("outcome-only", 10.0)])
def test_entropy_per_credit_norm_pays_new_tokens_bonus_in_proportion_to_credit(model, updates, paid):
    """entropy_per=credit-norm: the weights of credit (|A| on every trained token) scaled so that the batch's
    bonus sums to new-token's (one per token of data: here the 6 correction tokens of immediate+correction, or all
    10 trained tokens of outcome-only); a row without credit gets none."""
    tokens, mask, _, staleness = batch(3)  # 4, 4 and 2 trained tokens
    logp, entropy = token_logprobs_and_entropy(model(tokens).logits, tokens)
    advantages = torch.zeros_like(mask)
    advantages[0], advantages[1] = 1.5, -0.5  # Σ|A| over the trained tokens: 8; row 2: advantage 0
    is_correction = torch.tensor([[0.0], [1.0], [1.0]]).expand_as(mask)
    algo = AlgoConfig(updates=updates, entropy_coef=0.5, entropy_per="credit-norm", aggregation="token-sum")
    assert bonus_rows(is_correction, mask, algo) is None
    scale, clip = credit_bonus_weights(advantages, mask, is_correction, algo)
    assert scale == pytest.approx(paid / 8) and clip == pytest.approx(4 * 0.8)
    loss, _ = policy_loss(logp.detach(), logp.detach(), advantages, staleness, mask, algo, entropy=entropy,
                          credit_weights=(scale, clip))
    pg, _ = policy_loss(logp.detach(), logp.detach(), advantages, staleness, mask, algo)
    weight = advantages.abs() * scale * mask
    assert float(weight.sum()) == pytest.approx(paid)  # new-token's bonus, all of it
    assert float(weight[2].sum()) == 0.0
    expected = -0.5 * float((entropy.detach() * weight).sum()) / algo.token_norm
    assert float(loss.detach() - pg.detach()) == pytest.approx(expected, rel=1e-5)
    # any other rule leaves the weights as they are (credit: |A| itself)
    assert credit_bonus_weights(advantages, mask, is_correction, AlgoConfig(entropy_per="credit")) == (1.0, math.inf)


def test_entropy_per_credit_norm_caps_a_lone_credited_token_and_pays_nothing_without_credit():
    """One token with credit among ten: it would take all ten tokens' bonus; the clip holds it to 4× the batch's
    mean weight (4, not 10). A batch with no credit at all pays no bonus (scale 0)."""
    mask = torch.zeros(2, 8)
    mask[:, 3:] = 1  # 10 trained tokens
    advantages = torch.zeros_like(mask)
    advantages[0, 3] = 2.0
    algo = AlgoConfig(updates="outcome-only", entropy_per="credit-norm")
    scale, clip = credit_bonus_weights(advantages, mask, torch.ones_like(mask), algo)
    assert float((advantages.abs().clamp(max=clip) * scale).max()) == pytest.approx(4.0)
    assert credit_bonus_weights(torch.zeros_like(mask), mask, torch.ones_like(mask), algo) == (0.0, 0.0)


def test_the_entropy_floor_raises_the_bonus_below_it_lowers_it_above_within_its_bounds():
    """algo.entropy_floor: +step per optimizer step while the trained tokens' entropy is under the floor, -step
    above it, never below 0 (the bonus is then entropy_coef alone) nor above entropy_floor_max; off, always 0; a
    step with no entropy measured (NaN) changes nothing."""
    algo = AlgoConfig(entropy_floor=0.2, entropy_floor_step=0.05, entropy_floor_max=0.12)
    assert entropy_floor_boost(0.0, 0.1, algo) == pytest.approx(0.05)
    assert entropy_floor_boost(0.05, 0.1, algo) == pytest.approx(0.10)
    assert entropy_floor_boost(0.10, 0.1, algo) == pytest.approx(0.12)  # capped
    assert entropy_floor_boost(0.12, 0.3, algo) == pytest.approx(0.07)
    assert entropy_floor_boost(0.02, 0.3, algo) == 0.0  # not below the plain coefficient
    assert entropy_floor_boost(0.0, 0.2, algo) == 0.0  # at the floor is not below it
    assert entropy_floor_boost(0.07, float("nan"), algo) == 0.07
    assert entropy_floor_boost(0.07, 0.0, AlgoConfig()) == 0.0  # off by default


def test_the_entropy_floor_pulls_a_collapsed_policy_back_up_to_it(model):
    """The controller on a real tiny model: a constant positive advantage on the sampled tokens collapses the policy
    without the floor (entropy ~0); with a floor of 1 nat the coefficient rises while the entropy is under it, and
    the policy comes back and stays near the floor (the last 20 of 80 steps)."""
    tokens, mask, _, staleness = batch(4)
    advantages = mask.clone() * 2.0

    def train(floor: float) -> tuple[list[float], float]:
        net = copy.deepcopy(model)
        optimizer = torch.optim.Adam(net.parameters(), lr=3e-2)
        algo = AlgoConfig(entropy_floor=floor, entropy_floor_step=0.05, entropy_floor_max=10.0)
        boost, seen = 0.0, []
        for _ in range(80):
            logp, entropy = token_logprobs_and_entropy(net(tokens).logits, tokens)
            step_algo = AlgoConfig(entropy_coef=boost, entropy_floor=floor)
            loss, stats = policy_loss(logp, logp.detach(), advantages, staleness, mask, step_algo, entropy=entropy)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen.append(stats.entropy)
            boost = entropy_floor_boost(boost, stats.entropy, algo)
        return seen, boost

    collapsed, no_boost = train(0.0)
    held, boost = train(1.0)
    assert no_boost == 0.0 and max(collapsed[-20:]) < 0.05
    assert min(held[:40]) < 0.2, "it collapsed first"
    assert boost > 0 and 0.6 < sum(held[-20:]) / 20 < 1.8
