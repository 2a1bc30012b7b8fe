"""transformers models built from one config object share it; a swap changes only the swapped model's config.

Otherwise the other model would carry the swap's record and config class without its modules: saved, it reloads
as a swapped checkpoint it never was (silently, for schemes without weights such as ``none``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import MODEL_CLASSES, tiny_config
from transformers import AutoModelForCausalLM

import hf_posswap as ps


def ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("scheme", ["none", "sinusoidal", "alibi"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_model_sharing_the_swapped_models_config_stays_plain(tmp_path: Path, family: str, scheme: str) -> None:
    config = tiny_config(family)
    plain_json = config.to_json_string()
    torch.manual_seed(0)
    plain = MODEL_CLASSES[family](config).eval()
    swapped = MODEL_CLASSES[family](config).eval()
    ps.swap(swapped, scheme)
    assert type(plain.config) is type(config) and plain.config is config
    assert config.to_json_string() == plain_json and config._attn_implementation == "sdpa"
    plain.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert ps.describe(reloaded).scheme == "native", "the plain model must not reload as a swapped one"
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids()).logits, plain(ids()).logits)
    ps.swap(plain, "t5")  # the other model swaps on its own
    assert ps.describe(plain).scheme == "t5" and ps.describe(swapped).scheme == scheme


def test_unswap_gives_back_the_original_config_object_with_the_users_changes() -> None:
    config = tiny_config("llama")
    model = MODEL_CLASSES["llama"](config)
    ps.swap(model, "alibi")
    assert model.config is not config and model.model.config is model.config
    assert all(layer.self_attn.config is model.config for layer in model.model.layers)
    model.config.use_cache = False  # as the Trainer does for gradient checkpointing
    ps.unswap(model)
    assert model.config is config and model.model.config is config and config.use_cache is False
    assert type(config).__name__ == "LlamaConfig" and not hasattr(config, "posswap")
    assert config._attn_implementation == "sdpa"
