"""The built-in inference engine: batched sampling from a Hugging Face causal LM with a KV cache, in PyTorch.

Prompts of different lengths are left-padded so every row's next token sits in the last column; the attention
mask hides the padding and position ids restart at 0 on each row's first real token, so a row's tokens and
log-probs are the same as if it had been generated alone.

Behaviour log-probs: log mu(a) = log_softmax(logits / temperature)[a] under the FULL distribution, even when
top-p truncates what may be sampled. That is the quantity the learner recomputes
(`async_rl.loss.token_logprobs(..., temperature)`), so the importance ratio of the loss (docs/algorithm.md) is exactly 1
for an on-policy token; top-p's truncation is treated as part of the sampler, not of the policy.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from async_rl.config import RolloutConfig
from async_rl.model import load_model, load_tokenizer, load_weights, resolve_device
from rollout.engines.base import EngineStopped, Generation, SamplingParams

log = logging.getLogger("async_rl.rollout")


def configured_device(rollout: RolloutConfig) -> str:
    """rollout.device resolved on this machine ("cpu" or "cuda"); ConfigError for cuda without a GPU."""
    return resolve_device(rollout.device, "rollout.device", torch.cuda.is_available())


class TorchEngine:
    def __init__(self, model_dir: Path, seed: int, device: str = "cpu", stop: threading.Event | None = None) -> None:
        self.stop = stop  # set: a generate under way ends at its next token with EngineStopped (a prompt exit)
        self.device = torch.device(device)
        self.model = load_model(model_dir).to(self.device).eval()
        self.tokenizer = load_tokenizer(model_dir)  # stop strings are matched on the decoded text
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.pad_id = self.model.config.pad_token_id or 0  # any id works: padding is masked out
        self.version = 0  # the model directory holds the version-0 weights
        log.info("built-in engine on %s (%s parameters, fp32)", self.device,
                 f"{sum(p.numel() for p in self.model.parameters()):,}")

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("TorchEngine.generate: every prompt needs at least one token")
        batch, longest = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((batch, longest), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, longest), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, longest - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, longest - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

        stop_ids = set(params.stop_token_ids)
        generations = [Generation(token_ids=[], logprobs=[], versions=[], finish_reason="length") for _ in prompts]
        running = [True] * batch
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True)
        for step in range(params.max_new_tokens):
            tokens, logprobs = self._sample(out.logits[:, -1], params)
            for row, (token, logprob) in enumerate(zip(tokens.tolist(), logprobs.tolist(), strict=True)):
                if not running[row]:
                    continue
                generation = generations[row]
                generation.token_ids.append(token)
                generation.logprobs.append(logprob)
                generation.versions.append(self.version)
                if token in stop_ids or (params.stop and self._ends_at_stop_string(generation.token_ids, params.stop)):
                    generation.finish_reason = "stop"
                    running[row] = False
            if not any(running) or step == params.max_new_tokens - 1:
                break
            if self.stop is not None and self.stop.is_set():
                raise EngineStopped("the worker is stopping")
            # Stopped rows keep decoding in lockstep (their tokens are discarded); rows never see each other.
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch, 1))], dim=-1)
            position_ids = position_ids[:, -1:] + 1
            out = self.model(
                input_ids=tokens.unsqueeze(-1),
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        return generations

    def _ends_at_stop_string(self, token_ids: list[int], stops: list[str]) -> bool:
        """Whether the text so far contains a stop string; only the tail can hold a new one, so only the tail of
        the tokens is decoded (a token is at least one byte, so this many tokens cover the longest stop string)."""
        tail = token_ids[-(max(len(s.encode()) for s in stops) + 8) :]
        text = self.tokenizer.decode(tail, skip_special_tokens=True)
        return any(stop in text for stop in stops)

    def _sample(self, logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per row with temperature and top-p; return it and its full-distribution log-prob."""
        logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
        probs = logp.exp()
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)  # the top token always stays
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    def update_weights(self, version: int, path: str) -> None:
        """Load a safetensors file written by the learner; tokens sampled from now on carry `version`."""
        load_weights(self.model, Path(path))
        self.version = version
        log.info("policy version %d loaded from %s", version, path)

    def close(self) -> None:
        """Nothing to release: the model lives in this process and goes with it."""
