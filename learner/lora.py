"""LoRA in the learner (learner.lora): the model wrapped with peft adapters, the KL reference with the adapter off,
and what the rollout engines load: the merged full weights, or the adapters alone for vLLM servers that load them
(`rollout.vllm.lora: adapter`, `adapter_state_dict` and `adapter_config`).

Only the adapters are trainable (and so in the optimizer: learner/engine.py builds it over trainable parameters);
the base weights stay frozen and are never copied. The merged weights are a plain state dict under the base
model's own key names with each adapted weight W replaced by W + (alpha / rank) · B · A, computed in fp32 from the
live tensors without touching the trained model: the built-in engine, SGLang and an export load it as they load a
full fine-tune's, with no peft.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import torch

from async_rl.errors import ConfigError
from learner.settings import LoraSettings

ADAPTER = "default"  # peft's name for the one adapter we train


def lora_on(lora: LoraSettings) -> bool:
    return lora.rank > 0


def is_adapted(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft model (without importing peft: a full fine-tune never pays for it)."""
    return getattr(model, "peft_config", None) is not None and hasattr(model, "disable_adapter")


def _matches(name: str, target: str) -> bool:
    """peft's rule for a target given as a plain name: the module's dotted name is it or ends with `.target`."""
    return name == target or name.endswith("." + target)


def check_targets(model: torch.nn.Module, targets: Iterable[str]) -> None:
    """Every learner.lora.target_modules entry names at least one module of `model`, and only linear layers."""
    modules = dict(model.named_modules())
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in modules.items() if isinstance(m, torch.nn.Linear)})
    for target in targets:
        hits = [name for name in modules if _matches(name, target)]
        if not hits:
            raise ConfigError(f"learner.lora.target_modules: {target!r} matches no module of the model (its linear "
                              f"layers are named {', '.join(linear)})")
        other = sorted({type(modules[name]).__name__ for name in hits} - {"Linear"})
        if other:
            raise ConfigError(f"learner.lora.target_modules: {target!r} names {', '.join(other)} modules; LoRA here "
                              f"adapts linear layers only ({', '.join(linear)})")


def wrap(model: torch.nn.Module, lora: LoraSettings) -> torch.nn.Module:
    """`model` with LoRA adapters on learner.lora.target_modules (peft): B starts at zero, so the wrapped model
    computes exactly what the base did; A is drawn from torch's RNG (seeded by the caller). Everything but the
    adapters is frozen."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError:
        raise ConfigError("learner.lora.rank > 0 needs peft, which is not installed: pip install -e '.[models]' "
                          "(or pip install peft)") from None
    check_targets(model, lora.target_modules)
    return get_peft_model(model, PeftLoraConfig(**_peft_fields(lora)), adapter_name=ADAPTER)


def _peft_fields(lora: LoraSettings) -> dict[str, Any]:
    """PEFT's LoraConfig for learner.lora, the one the learner trains and the one a published adapter names."""
    return {"r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": list(lora.target_modules), "bias": "none", "task_type": "CAUSAL_LM"}


def adapter_config(lora: LoraSettings, base_model: str) -> dict[str, Any]:
    """The `adapter_config.json` of the adapters the learner publishes (`rollout.vllm.lora: adapter`): PEFT's own
    serialization of the trained LoraConfig, naming `base_model`."""
    from peft import LoraConfig as PeftLoraConfig

    config = PeftLoraConfig(**_peft_fields(lora), base_model_name_or_path=base_model).to_dict()
    return json.loads(json.dumps(config, default=lambda value: sorted(value) if isinstance(value, set) else str(value)))


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors alone, under PEFT's key names (`base_model.model.<module>.lora_A.weight`): what a PEFT
    adapter directory holds. At ZeRO-3 the caller holds the parameters gathered."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=ADAPTER)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


class AdapterOff:
    """The KL reference (algo.kl_beta > 0) under LoRA: the trained model itself, run in eval mode with its adapter
    disabled (peft's `disable_adapter`), i.e. the frozen base model, with no second copy of its weights. Called like
    a model; only ever under torch.no_grad (learner/step.py)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, **inputs: Any) -> Any:
        training = self.model.training
        self.model.eval()
        try:
            with self.model.disable_adapter():
                return self.model(**inputs)
        finally:
            self.model.train(training)


def _adapted_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The peft LoRA layers of `model`'s base model, by the dotted name of the linear layer each wraps."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer) and ADAPTER in m.lora_A}


def delta_weight(layer: torch.nn.Module) -> torch.Tensor:
    """(alpha / rank) · B · A of one adapted linear layer, in fp32."""
    a = layer.lora_A[ADAPTER].weight.detach().float()
    b = layer.lora_B[ADAPTER].weight.detach().float()
    delta = b @ a
    return (delta.T if layer.fan_in_fan_out else delta) * layer.scaling[ADAPTER]


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict under its own key names with every adapter merged into its weight (computed in
    fp32, stored in the weight's dtype; on the weights' device), the adapters' own tensors left out. The trained
    model is not modified. At ZeRO-3 the caller holds the parameters gathered."""
    layers = _adapted_layers(model)
    merged: dict[str, torch.Tensor] = {}
    for key, value in model.get_base_model().state_dict().items():
        if ".lora_" in key:
            continue
        name = key.replace(".base_layer.", ".")
        layer = layers.get(name.rsplit(".", 1)[0]) if name.endswith(".weight") else None
        if layer is not None:
            value = (value.detach().float() + delta_weight(layer).to(value.device)).to(value.dtype)
        merged[name] = value
    return merged


def signature(model: torch.nn.Module) -> dict[str, Any] | None:
    """What a checkpoint must agree on to be resumed into `model`: its adapters' rank, alpha and targets (None: not
    adapted, a full fine-tune)."""
    if not is_adapted(model):
        return None
    peft_config = model.peft_config[ADAPTER]
    return {"rank": peft_config.r, "alpha": float(peft_config.lora_alpha),
            "target_modules": sorted(peft_config.target_modules)}
