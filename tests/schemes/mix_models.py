"""The tiny mixed models the test_mixes_*.py files share: a 4-layer model whose weights make positions matter,
the mixes of the matrix (every part kind, each family) and the calls that run them. Ids read ``llama-irope`` so
``pytest -k irope`` selects one mix."""

from __future__ import annotations

import pytest
import torch
from conftest import MODEL_CLASSES, VOCAB, tiny_config

import hf_posswap as ps

LAYERS = 4


def make_model(family: str, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    """A 4-layer tiny model whose weights make positions matter (sharper attention)."""
    torch.manual_seed(seed)
    config = tiny_config(family)
    config.num_hidden_layers = LAYERS
    config._attn_implementation = attn
    model = MODEL_CLASSES[family](config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
            if any(part in name for part in ("q_proj", "k_proj", "query", "key", "c_attn")) and param.dim() == 2:
                param.mul_(3.0)
    return model


#: (family, mix) for the matrix: every part kind, each family, the temperature with a visible floor_scale
MIXES = {
    "llama-irope": ("llama", lambda: ps.llama4_irope(LAYERS, no_rope_layer_interval=2, floor_scale=3, attn_scale=0.5)),
    "llama-rope-alibi-t5": ("llama", lambda: ps.LayerMix(default="rope", overrides={"alibi": [1], "t5": [2, 3]})),
    "gpt2-alibi-rope-none": ("gpt2", lambda: ps.LayerMix(default="alibi", overrides={"rope": [1], "none": [2]})),
    "bert-t5-rope": ("bert", lambda: ps.LayerMix(default=ps.T5BiasConfig(num_buckets=16, max_distance=32),
                                                 overrides={"rope": [0, 2]})),
    # per-head mixes: ALiBi on the second kv group of a grouped-query LLaMA; T5 on GPT-2's heads 1 and 3
    "llama-headmix-alibi-rope": ("llama", lambda: ps.LayerMix(
        default=ps.HeadMix(bias="alibi", rotary="rope", bias_heads=[2, 3]), overrides={"none": [1]})),
    "gpt2-headmix-t5-rope": ("gpt2", lambda: ps.LayerMix(default=ps.HeadMix(
        bias=ps.T5BiasConfig(num_buckets=16, max_distance=32), rotary="rope", bias_heads=[1, 3]),
        overrides={"alibi": [1]})),
}
CAUSAL = [key for key, (family, _) in MIXES.items() if family != "bert"]


def cases(keys: list[str], fast: set[str]) -> list:
    """``keys`` as parameters; those not in ``fast`` are marked slow (the default run keeps one or two)."""
    return [pytest.param(key, id=key, marks=() if key in fast else pytest.mark.slow) for key in keys]


def mixed(key: str, attn: str = "sdpa") -> torch.nn.Module:
    family, mix = MIXES[key]
    model = make_model(family, attn)
    ps.swap(model, mix())
    with torch.no_grad():  # zero-initialised T5 tables carry no signal: give them one
        for name, param in model.named_parameters():
            if "posswap_positions" in name and "tables" in name:
                param.copy_(torch.randn_like(param))
    return model


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model: torch.nn.Module, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids, **kwargs).logits


def generate(model: torch.nn.Module, input_ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    out = model.generate(input_ids, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                         output_logits=True, max_new_tokens=8, **kwargs)
    return out.sequences, torch.stack(out.logits, dim=1)
