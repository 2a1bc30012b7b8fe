"""``save_native``: write a swapped model in transformers' own format where transformers can express it, so that
vanilla transformers (no hf_posswap installed) reloads it to the same logits.

A LLaMA whose layers use either its own RoPE or no positions at all (NoPE, Kazemnejad et al. 2023,
arXiv:2305.19466) is exactly transformers' ``smollm3`` architecture (SmolLM3, Hugging Face 2025): the same
modules and weight names, plus ``config.no_rope_layers`` (one entry per layer, ``1`` = that layer applies RoPE,
``0`` = it skips it; ``SmolLM3Attention.use_rope``). Such a model is written as ``SmolLM3For*``. Everything
else that SmolLM3 shares with LLaMA (``attention_bias`` on q/k/v/o, ``mlp_bias``, ``head_dim``, tied embeddings,
grouped-query heads, any native ``rope_type``) is carried over as is; the modelling code is LLaMA's line for line
apart from ``use_rope`` and sliding windows, which stay off.

Before anything is written the converted model's logits are compared with the swapped model's on a probe
sequence, so a checkpoint that would reload as a different model is refused, never written.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.native import check_loaded, unwrap_peft
from ..core.state import swap_state
from ..errors import InvalidConfigError
from ..schemes.base import SchemeConfig
from ..schemes.nope import NoPEConfig
from ..schemes.rope import RopeConfig
from ..schemes.two_pass import TwoPassScaling
from ..transformers_internals import attention_implementation, config_rope_parameters, set_config_attention

TARGET = "smollm3"
#: keys of a LLaMA config that a SmolLM3 config does not take (``pretraining_tp`` is unused by 5.x's LLaMA)
_DROPPED = ("model_type", "architectures", "auto_map", "transformers_version", "posswap", "pretraining_tp",
            "_name_or_path", "layer_types", "no_rope_layers", "no_rope_layer_interval", "use_sliding_window",
            "sliding_window")
#: what to do instead, appended to every refusal
_INSTEAD = ("model.save_pretrained(directory) keeps the hf_posswap format (reloads with hf_posswap imported), and "
            "hf_posswap.export_standalone(model, directory) writes a checkpoint that loads with "
            "trust_remote_code=True where hf_posswap is not installed.")
#: the probe's length and the logit tolerance (per dtype, scaled by the logits' size) of the converted model
PROBE_LENGTH = 24
_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}


class NotNativeError(InvalidConfigError):
    """A swapped model that transformers' own architectures cannot express."""


def save_native(
    model: nn.Module, directory: str | os.PathLike[str], *, tokenizer: Any = None, overwrite: bool = False
) -> Path:
    """Save ``model`` in transformers' own format, so ``AutoModel*.from_pretrained(directory)`` rebuilds it in
    vanilla transformers, without hf_posswap, with the same logits.

    - a model whose ``save_pretrained`` already writes a native checkpoint (not swapped, or swapped to a RoPE
      that ``config.rope_parameters`` expresses) is saved with it;
    - a LLaMA whose layers mix its own RoPE and NoPE (``swap(model, "none")``, or a layer mix of ``rope`` and
      ``none``) is saved as ``smollm3`` with ``no_rope_layers``;
    - anything else raises :class:`NotNativeError` naming what blocks it, before anything is written.

    Written atomically (a staging directory moved into place). A non-empty ``directory`` is refused unless
    ``overwrite``; then only checkpoint files are replaced. ``tokenizer`` (optional) is saved with the model.
    """
    from .saving import check_finite_weights, check_output_dir, staged_directory

    model = _plain_model(model)
    check_output_dir(directory, overwrite, flag="directory")
    check_finite_weights(model)
    native = not getattr(type(model.config), "posswap_base_model_type", None)
    converted = model if native else to_smollm3(model)
    with staged_directory(directory, overwrite) as staging:
        converted.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return Path(directory)


def _plain_model(model: nn.Module) -> nn.Module:
    """The transformers model to save; a peft model (adapters still separate), a quantised one or one with
    offloaded weights is refused."""
    if callable(getattr(model, "get_base_model", None)) or getattr(model, "peft_config", None):
        raise NotNativeError(
            f"{type(model).__name__} holds peft adapters; merge them first (model = model.merge_and_unload()), "
            "then save_native the merged model, or save the adapter alone with hf_posswap.save_adapter."
        )
    model = unwrap_peft(model)
    check_loaded(model)
    if getattr(model.config, "quantization_config", None) is not None:
        raise NotNativeError(
            f"{type(model).__name__} is quantised (config.quantization_config); save_native writes full weights "
            f"only. Load the model unquantised to convert it. {_INSTEAD}"
        )
    if any(param.is_meta for param in model.parameters()):
        raise NotNativeError(
            f"{type(model).__name__} has weights offloaded to the meta device (device_map offloading); load it "
            f"fully to convert it. {_INSTEAD}"
        )
    return model


def no_rope_layers(model: nn.Module) -> tuple[list[int], dict[str, Any]]:
    """SmolLM3's ``no_rope_layers`` for a swapped LLaMA (``1``: layer i applies RoPE, ``0``: NoPE) and the
    ``rope_parameters`` of its RoPE layers; raises :class:`NotNativeError` naming the layers it cannot express."""
    state = swap_state(model)
    if state is None:
        raise NotNativeError(f"{type(model).__name__} is not swapped: model.save_pretrained writes it natively.")
    from ..families.base import get_family

    spec = get_family(model).spec(model)
    parts = _layer_parts(state.config, spec.num_layers)
    rope_parts = {i: part for i, part in enumerate(parts) if isinstance(part, RopeConfig)}
    tuned = bool(getattr(state.config, "attn_temperature_tuning", False))  # Llama 4 iRoPE: NoPE layers scale queries
    blocked: dict[str, list[int]] = {}
    for i, part in enumerate(parts):
        if not _expressible(part) or (tuned and type(part) is NoPEConfig):
            label = "NoPE with Llama 4's attention temperature" if _expressible(part) else _describe(part)
            blocked.setdefault(label, []).append(i)
    if blocked:
        found = "; ".join(f"{label} on layers {layers}" for label, layers in blocked.items())
        raise NotNativeError(
            f"transformers' {TARGET} expresses layers with the model's own RoPE (any native rope_type, whole heads) "
            f"or with no positions (NoPE without temperature); this model has {found}. {_INSTEAD}"
        )
    settings = {_json_key(part.rope_parameters(spec.head_dim)) for part in rope_parts.values()}
    if len(settings) > 1:
        raise NotNativeError(
            f"{TARGET} has one rope_parameters for all RoPE layers; this model's RoPE layers use {len(settings)} "
            f"different ones ({sorted(settings)}). {_INSTEAD}"
        )
    rope_parameters = (
        next(iter(rope_parts.values())).rope_parameters(spec.head_dim) if rope_parts
        else dict(config_rope_parameters(model.config))  # all NoPE: the native settings, used by no layer
    )
    return [int(i in rope_parts) for i in range(spec.num_layers)], rope_parameters


def _json_key(data: dict[str, Any]) -> str:
    """A hashable, order-free form of a JSON-like dict."""
    return json.dumps(data, sort_keys=True, default=str)


def _layer_parts(config: SchemeConfig, num_layers: int) -> list[SchemeConfig]:
    """The scheme each layer gets: a layer mix lists them, a single scheme applies to every layer."""
    from ..schemes.mix import LayerMix

    return config.layer_schemes(num_layers) if isinstance(config, LayerMix) else [config] * num_layers


def _expressible(part: SchemeConfig) -> bool:
    """Plain NoPE, or a RoPE that LLaMA's own rotary module computes (``LlamaAdapter.native_rope_edits``'s rule)."""
    if type(part) is NoPEConfig:
        return part.to_dict() == {"scheme": "none"}
    if type(part) is RopeConfig:
        return part.partial_rotary_factor == 1.0 and not isinstance(part.scaling, TwoPassScaling)
    return False


def _describe(part: SchemeConfig) -> str:
    if type(part) is RopeConfig and part.partial_rotary_factor != 1.0:
        return f"partial RoPE (partial_rotary_factor={part.partial_rotary_factor})"
    if type(part) is RopeConfig:
        return "RoPE with Self-Extend's grouped positions"
    return f"'{part.name}'"


def smollm3_config(model: nn.Module) -> Any:
    """The ``SmolLM3Config`` of a swapped LLaMA: its own config with ``no_rope_layers`` and the RoPE layers'
    ``rope_parameters``, sliding windows off; other families are refused."""
    from transformers import SmolLM3Config

    from ..core.state import base_model_type

    family = base_model_type(model.config)
    if family != "llama":
        raise NotNativeError(
            f"Only LLaMA ('llama') models convert to {TARGET}, which shares LLaMA's layout exactly; this model is "
            f"'{family}' ({_FAMILY_GAPS.get(str(family), 'a different layout')}). {_INSTEAD}"
        )
    flags, rope_parameters = no_rope_layers(model)
    data = {key: value for key, value in model.config.to_dict().items()
            if key not in _DROPPED and not key.startswith("posswap")}
    data.update(no_rope_layers=flags, rope_parameters=rope_parameters, use_sliding_window=False)
    return SmolLM3Config.from_dict(data)


_FAMILY_GAPS = {
    "mistral": "sliding-window attention on every layer",
    "qwen2": "biases on q/k/v but not on the output projection",
    "qwen3": "RMSNorm on queries and keys",
}


def to_smollm3(model: nn.Module) -> nn.Module:
    """``SmolLM3For*`` sharing ``model``'s weight tensors (no copy), checked to give the same logits."""
    import transformers

    config = smollm3_config(model)
    class_name = type(model).__name__.removeprefix("PosSwap").replace("Llama", "SmolLM3", 1)
    target = getattr(transformers, class_name, None)
    if target is None or not class_name.startswith("SmolLM3"):
        raise NotNativeError(f"transformers has no {TARGET} counterpart of {type(model).__name__}. {_INSTEAD}")
    converted = _share_weights(model, target, config)
    _check_same_logits(model, converted)
    return converted


def _share_weights(model: nn.Module, target: type, config: Any) -> nn.Module:
    """Build ``target`` on the meta device and hand it ``model``'s tensors; the rotary module is built for real."""
    set_config_attention(config, _plain_attention(attention_implementation(model.config)))
    with torch.device("meta"):
        converted = target(config)
    weights = model.state_dict()
    expected = converted.state_dict()
    missing = sorted(set(expected) - set(weights))
    extra = sorted(key for key in set(weights) - set(expected) if "posswap" not in key and "rotary_emb" not in key)
    if missing or extra:
        raise NotNativeError(
            f"{type(model).__name__}'s weights do not match {target.__name__}'s layout (missing {missing[:5]}, "
            f"unexpected {extra[:5]}). {_INSTEAD}"
        )
    converted.load_state_dict({key: weights[key] for key in expected}, strict=True, assign=True)
    base = converted.base_model
    rotary = type(base.rotary_emb)(config=config)
    base.rotary_emb = rotary.to(next(model.parameters()).device)
    if config.tie_word_embeddings:
        converted.tie_weights()
    left = [name for name, tensor in (*converted.named_parameters(), *converted.named_buffers()) if tensor.is_meta]
    if left:
        raise NotNativeError(f"{left[:5]} of {target.__name__} have no values in the swapped model. {_INSTEAD}")
    if getattr(model, "generation_config", None) is not None:
        converted.generation_config = copy.deepcopy(model.generation_config)
    converted.train(model.training)
    return converted


def _plain_attention(name: str) -> str:
    """The transformers attention implementation behind hf_posswap's carrier (``posswap_sdpa`` -> ``sdpa``)."""
    from ..core.attention import CARRIERS

    return next((plain for plain, carrier in CARRIERS.items() if carrier == name), name)


def _check_same_logits(model: nn.Module, converted: nn.Module) -> None:
    """Refuse the conversion when the two models' logits differ on a probe sequence (a conversion bug)."""
    device = next(model.parameters()).device
    length = min(PROBE_LENGTH, int(getattr(model.config, "max_position_embeddings", PROBE_LENGTH)))
    vocab = int(model.config.vocab_size)
    input_ids = (torch.arange(length, device=device) * 7919 % vocab)[None]  # [1, L], a fixed spread of tokens
    training = model.training
    model.eval()
    converted.eval()
    try:
        with torch.no_grad():
            expected = _output(model(input_ids=input_ids)).float()
            actual = _output(converted(input_ids=input_ids)).float()
    finally:
        model.train(training)
        converted.train(training)
    dtype = next(model.parameters()).dtype
    bound = _TOLERANCE.get(dtype, 2e-2) * max(1.0, float(expected.abs().max()))
    gap = float((expected - actual).abs().max())
    if not gap <= bound:
        raise NotNativeError(
            f"The {TARGET} conversion of {type(model).__name__} gives logits that differ from the swapped model's "
            f"by {gap:.3g} (allowed {bound:.3g}) on a {length}-token probe, so it is not written. Please report "
            f"this as an hf_posswap bug. {_INSTEAD}"
        )


def _output(output: Any) -> torch.Tensor:
    """The first tensor of a model output (logits, or the last hidden state of a bare model)."""
    for value in (output.values() if hasattr(output, "values") else output):
        if isinstance(value, torch.Tensor):
            return value
    raise NotNativeError("The model returned no tensor to compare.")
