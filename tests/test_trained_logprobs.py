"""learner/logits.py: the log-probs computed at the trained positions only equal the full logits' (values, entropy
and every gradient), padded and packed, with and without LoRA, and a batch with nothing to train costs nothing."""

import copy

import peft
import pytest
import torch

from async_rl.config_load import load_config
from async_rl.loss import token_logprobs_and_entropy
from async_rl.model import build_tiny_model
from learner.batch import TrainBatch
from learner.logits import trained_logprobs


def tiny_model():
    config = load_config(None, ["model.hidden_size=32", "model.num_layers=2", "run.seed=5"])
    return build_tiny_model(config.model, config.run.seed, vocab_size=50, pad_id=0, eos_id=1)


def make_batch(packed: bool, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    rows, width = 3, 12
    tokens = torch.randint(2, 50, (rows, width), generator=g)
    mask = (torch.rand(rows, width - 1, generator=g) < 0.4).float()
    mask[1] = 0  # a row with nothing trained
    attention = torch.ones(rows, width, dtype=torch.int64)
    attention[2, 9:] = 0
    mask[2, 8:] = 0
    positions = None
    if packed:  # two items end to end in each row, position ids restarting at 0
        positions = torch.cat([torch.arange(5), torch.arange(width - 5)]).repeat(rows, 1)
        mask[:, 4] = 0  # the logit at an item's last token predicts the next item's first: never trained
    zeros = torch.zeros(rows, width - 1)
    return TrainBatch(tokens=tokens, attention_mask=attention, loss_mask=mask, advantages=zeros,
                      behaviour_logp=zeros, versions=zeros.long(), is_correction=torch.zeros(rows, dtype=torch.bool),
                      position_ids=positions)


def full_logprobs(model, batch, temperature, entropy):
    logits = model(**batch.model_inputs()).logits
    return token_logprobs_and_entropy(logits, batch.tokens, temperature, entropy=entropy)


def loss_and_grads(model, batch, compute):
    model.zero_grad()
    logp, spread = compute(model, batch, 0.7, True)
    on = batch.loss_mask.bool()
    loss = -(logp * batch.loss_mask).sum() - 0.1 * (spread * batch.loss_mask).sum()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logp[on].detach(), spread[on].detach(), grads, logp.detach(), on


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("lora", [False, True])
def test_trained_positions_only_equal_the_full_logits_in_value_entropy_and_gradient(packed, lora):
    torch.manual_seed(0)
    model = tiny_model()
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    batch = make_batch(packed)
    full = loss_and_grads(model, batch, full_logprobs)
    mine = loss_and_grads(copy.deepcopy(model), batch, trained_logprobs)
    torch.testing.assert_close(mine[0], full[0])
    torch.testing.assert_close(mine[1], full[1])
    assert full[2].keys() == mine[2].keys() and full[2]
    for name in full[2]:
        torch.testing.assert_close(mine[2][name], full[2][name], msg=name)
    assert (mine[3][~mine[4]] == 0).all()  # off the mask: 0, which the loss masks out


def test_the_hook_is_gone_after_the_call_and_a_batch_with_nothing_to_train_gives_zeros():
    model = tiny_model()
    batch = make_batch(packed=True)
    batch.loss_mask.zero_()
    logp, spread = trained_logprobs(model, batch, 1.0, entropy=True)
    assert logp.shape == spread.shape == batch.loss_mask.shape and not logp.any() and not spread.any()
    assert model(**batch.model_inputs()).logits.shape == (*batch.tokens.shape, 50)  # the full forward again
