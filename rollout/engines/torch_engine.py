"""The built-in inference engine: batched sampling from a Hugging Face causal LM with a KV cache, in PyTorch.

Prompts of different lengths are left-padded so every row's next token sits in the last column; the attention
mask hides the padding and position ids restart at 0 on each row's first real token, so a row's tokens and
log-probs are the same as if it had been generated alone.

Between turns the engine keeps each sequence's keys and values (rollout/engines/prefix_cache.py, `rollout.
prefix_cache_mib`): a prompt that extends an earlier call's sequence feeds only its new tokens, the cached prefix
placed before them in the row (padding between the two is masked; position ids continue the prefix). Loading new
weights clears the cache, so the next turn's context is computed again by the weights that sample it.

Behaviour log-probs: log mu(a) = log_softmax(logits / temperature)[a] under the FULL distribution, even when
top-p truncates what may be sampled. That is the quantity the learner recomputes
(`async_rl.loss.token_logprobs(..., temperature)`), so the importance ratio of the loss (docs/algorithm.md) is exactly 1
for an on-policy token; top-p's truncation is treated as part of the sampler, not of the policy.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache

from async_rl.errors import WeightsError
from async_rl.model import load_model, load_state, load_tokenizer, resolve_device
from async_rl.weights.base import Loader, loader_for
from async_rl.weights.file import read_weights
from async_rl.weights.hf_dir import read_dir
from rollout.engines.base import EngineStopped, Generation, SamplingParams
from rollout.engines.prefix_cache import KV, Entry, PrefixCache

log = logging.getLogger("async_rl.rollout")


def configured_device(device: str) -> str:
    """`device` (rollout.device) resolved on this machine ("cpu" or "cuda"); ConfigError for cuda without a GPU."""
    return resolve_device(device, "rollout.device", torch.cuda.is_available())


class TorchEngine:
    def __init__(self, model_dir: Path, seed: int, device: str = "cpu", stop: threading.Event | None = None,
                 cache_mib: float = 0.0) -> None:
        self.stop = stop  # set: a generate under way ends at its next token with EngineStopped (a prompt exit)
        self.device = torch.device(device)
        self.model = load_model(model_dir).to(self.device).eval()
        self.tokenizer = load_tokenizer(model_dir)  # stop strings are matched on the decoded text
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.pad_id = self.model.config.pad_token_id or 0  # any id works: padding is masked out
        self.version = 0  # the model directory holds the version-0 weights
        self.weights_refused = 0  # published files that failed their checksum, never loaded
        # By `WeightsPublished.format`: what this engine can read into its own model (not "distributed": the
        # learner pushes those into SGLang servers, and there is no file to read).
        self.loaders: dict[str, Loader] = {
            "safetensors": lambda version, path: self._take(version, path, read_weights),
            "hf-dir": lambda version, path: self._take(version, path, read_dir),
        }
        self.cache = PrefixCache(int(cache_mib * 2**20))
        # transformers 5 names the forward's cache argument `cache`; 4.x `past_key_values`
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        # Only the last position's logits are sampled from: a prompt's other positions skip the LM head (with
        # SmolLM2's 49,152-token vocabulary, a 300-token prefill's full logits are 59 MB a row)
        self._last_logits = {"logits_to_keep": 1} if "logits_to_keep" in forward_args else {}
        log.info("built-in engine on %s (%s parameters, fp32)", self.device,
                 f"{sum(p.numel() for p in self.model.parameters()):,}")

    streams_tokens = True  # generate's `on_token` hears each row's token at the step that sampled it

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 on_token: Callable[[int, int], None] | None = None) -> list[Generation]:
        """Each prompt's continuation; `on_token(row, token)` (when given) hears every sampled token as it is
        sampled, before the next forward pass."""
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("TorchEngine.generate: every prompt needs at least one token")
        matches = [self.cache.match(prompt) for prompt in prompts]
        input_ids, attention_mask, position_ids, past = self._first_inputs(prompts, matches)
        batch = len(prompts)
        stop_ids = set(params.stop_token_ids)
        generations = [Generation(token_ids=[], logprobs=[], versions=[], finish_reason="length") for _ in prompts]
        running = [True] * batch
        out = self._forward(input_ids, attention_mask, position_ids, past)
        decoded = 0  # forward passes over sampled tokens: their keys and values are in the cache
        for step in range(params.max_new_tokens):
            tokens, logprobs = self._sample(out.logits[:, -1], params)
            for row, (token, logprob) in enumerate(zip(tokens.tolist(), logprobs.tolist(), strict=True)):
                if not running[row]:
                    continue
                generation = generations[row]
                generation.token_ids.append(token)
                generation.logprobs.append(logprob)
                generation.versions.append(self.version)
                if on_token is not None:
                    on_token(row, token)
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
            out = self._forward(tokens.unsqueeze(-1), attention_mask, position_ids, self._cache_of(out))
            decoded += 1
        self._keep(prompts, generations, matches, attention_mask, self._cache_of(out), decoded)
        return generations

    def _first_inputs(self, prompts: list[list[int]], matches: list[tuple[Entry | None, int]]) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache | None]:
        """The first forward's inputs: per row, the cached prefix right-aligned in the past columns, then the
        prompt's remaining tokens right-aligned in the new columns (so every row's next token is in the last one)."""
        batch = len(prompts)
        reused = [n for _, n in matches]
        past_len, new_len = max(reused), max(len(p) - n for p, n in zip(prompts, reused, strict=True))
        input_ids = torch.full((batch, new_len), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, past_len + new_len), dtype=torch.long)
        position_ids = torch.zeros((batch, new_len), dtype=torch.long)
        for row, (prompt, n) in enumerate(zip(prompts, reused, strict=True)):
            fresh = len(prompt) - n
            input_ids[row, new_len - fresh :] = torch.tensor(prompt[n:], dtype=torch.long)
            position_ids[row, new_len - fresh :] = torch.arange(n, len(prompt))
            attention_mask[row, past_len - n : past_len] = 1
            attention_mask[row, past_len + new_len - fresh :] = 1
        self.cache.stats.reused_tokens += sum(reused)
        self.cache.stats.prefilled_tokens += sum(len(p) for p in prompts) - sum(reused)
        past = self._past(matches, past_len) if past_len else None
        return input_ids.to(self.device), attention_mask.to(self.device), position_ids.to(self.device), past

    def _past(self, matches: list[tuple[Entry | None, int]], past_len: int) -> DynamicCache:
        """A batch cache of `past_len` columns holding each row's reused prefix right-aligned (zeros elsewhere,
        masked)."""
        template = next(entry.kv for entry, n in matches if entry is not None and n)
        cache = DynamicCache()
        for layer, (keys0, values0) in enumerate(template):
            keys = keys0.new_zeros((len(matches), keys0.shape[0], past_len, keys0.shape[2]))
            values = values0.new_zeros((len(matches), values0.shape[0], past_len, values0.shape[2]))
            for row, (entry, n) in enumerate(matches):
                if entry is not None and n:
                    keys[row, :, past_len - n :] = entry.kv[layer][0][:, :n]
                    values[row, :, past_len - n :] = entry.kv[layer][1][:, :n]
            cache.update(keys, values, layer)
        return cache

    def _keep(self, prompts: list[list[int]], generations: list[Generation], matches: list[tuple[Entry | None, int]],
              attention_mask: torch.Tensor, cache: DynamicCache, decoded: int) -> None:
        """Cache each row's prompt and the sampled tokens that went through the model, replacing the entries the
        rows extended (a trajectory's previous turn)."""
        if not self.cache.budget_bytes:
            return
        for entry in {id(e): e for e, _ in matches if e is not None}.values():
            if any(entry is held for held in self.cache.entries):
                self.cache.remove(entry)
        layers = _layers(cache)
        for row, (prompt, generation) in enumerate(zip(prompts, generations, strict=True)):
            kept = generation.token_ids[: min(len(generation.token_ids), decoded)]
            columns = attention_mask[row].nonzero().squeeze(-1)[: len(prompt) + len(kept)]
            kv: KV = [(keys[row].index_select(1, columns), values[row].index_select(1, columns))
                      for keys, values in layers]
            self.cache.put(prompt + kept, kv)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 past: DynamicCache | None) -> object:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=True, **self._last_logits, **({self._cache_arg: past} if past is not None else {}))

    def _cache_of(self, out: object) -> DynamicCache:
        return out.cache if self._cache_arg == "cache" else out.past_key_values

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

    def update_weights(self, version: int, path: str, format: str | None = None) -> None:
        """Load the weights the learner published as `version` at `path` in `format` (its notice's; None: a
        safetensors file), by this engine's loader for it: WeightsFormatError naming a format it cannot load.
        Tokens sampled from now on carry `version`."""
        loader_for(self.loaders, format or "safetensors", "the built-in engine")(version, path)

    def _take(self, version: int, path: str, read: Callable[[Path], dict[str, torch.Tensor]]) -> None:
        """The weights `read` returns from `path` (checked against their checksums: one that fails is not loaded,
        and counted in `weights_refused`) into the model."""
        try:
            state = read(Path(path))
        except WeightsError:
            if Path(path).exists():  # there, but torn or changed (a pruned file is no damage)
                self.weights_refused += 1
            raise
        load_state(self.model, state, Path(path))
        self.version = version
        self.cache.clear()  # cached keys and values were computed by the old weights
        log.info("policy version %d loaded from %s", version, path)

    def close(self) -> None:
        """Nothing to release: the model lives in this process and goes with it."""


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values), each (batch, heads, tokens, head_dim)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))  # transformers < 4.56's layout
