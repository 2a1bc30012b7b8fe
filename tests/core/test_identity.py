"""Identity swaps leave logits unchanged; unswap restores the original model exactly."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, SCHEMES, VOCAB, make_model, scheme_config

import hf_posswap as ps


def logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


INPUT = torch.randint(3, VOCAB, (2, 30), generator=torch.Generator().manual_seed(0))


def test_llama_swapped_to_its_own_rope_is_bit_identical() -> None:
    model = make_model("llama")
    before = logits(model, INPUT)
    ps.swap(model, ps.RopeConfig(rope_theta=model.config.rope_parameters["rope_theta"]))
    assert torch.equal(logits(model, INPUT), before)
    assert ps.describe(model).native


#: rope_parameters of checkpoints that ship scaled RoPE (Llama 3.1's llama3, YaRN and linear fine-tunes, ...);
#: original length 16 of the tiny model's 64, so every scaling changes the logits of a 150-token input
OWN_SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 4.0, "original_max_position_embeddings": 16, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
}


@pytest.mark.parametrize("rope", OWN_SCALINGS.values(), ids=OWN_SCALINGS.keys())
def test_llama_swapped_to_rope_keeps_its_own_scaling(rope: dict) -> None:
    """``swap(model, "rope")`` is the model's own RoPE, scaling included (as rope_theta=None keeps its base); the
    scaling dropped would change every logit with no warning."""
    from conftest import tiny_config
    from transformers import LlamaForCausalLM

    config = tiny_config("llama")
    config.rope_parameters = {**rope, "rope_theta": 10_000.0}
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    long_input = torch.randint(3, VOCAB, (1, 150), generator=torch.Generator().manual_seed(1))
    before = logits(model, long_input)
    plain = logits(make_unscaled(model), long_input)
    assert not torch.allclose(plain, before, atol=1e-4)  # the scaling matters at this length
    ps.swap(model, "rope")
    assert torch.equal(logits(model, long_input), before)
    assert model.config.rope_parameters["rope_type"] == rope["rope_type"]
    ps.unswap(model)
    assert torch.equal(logits(model, long_input), before)


def make_unscaled(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with plain RoPE of the same base (what the swap gave before it kept the scaling)."""
    import copy

    from transformers import LlamaForCausalLM

    config = copy.deepcopy(model.config)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10_000.0}
    plain = LlamaForCausalLM(config).eval()
    plain.load_state_dict(model.state_dict())
    return plain


def test_rope_defaults_to_the_models_own_theta() -> None:
    model = make_model("llama")
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 500.0}
    ps.swap(model, "rope", replace=False)
    assert ps.describe(model).settings["rope_theta"] == 500.0


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_learned_swap_keeping_the_table_is_bit_identical(family: str) -> None:
    model = make_model(family)
    before = logits(model, INPUT)
    ps.swap(model, "learned")
    assert torch.equal(logits(model, INPUT), before)
    assert [name for name, _, _ in ps.describe(model).new_parameters], "the kept table is a new parameter copy"


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_growing_the_learned_table_keeps_the_old_rows(family: str) -> None:
    model = make_model(family)
    before = logits(model, INPUT)
    ps.swap(model, ps.LearnedConfig(max_positions=200))
    assert torch.equal(logits(model, INPUT), before)
    table = [p for n, p in model.named_parameters() if "wpe" in n or "position_embeddings" in n][0]
    assert table.shape[0] == 200


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_unswap_restores_exactly(family: str, scheme: str) -> None:
    model = make_model(family)
    before = logits(model, INPUT)
    keys, attn = list(model.state_dict()), model.config._attn_implementation
    modules = {name: module for name, module in model.named_modules()}
    config_before = model.config.to_dict()
    ps.swap(model, scheme_config(scheme))
    ps.unswap(model)
    assert torch.equal(logits(model, INPUT), before)
    assert list(model.state_dict()) == keys
    assert model.config._attn_implementation == attn
    assert model.config.to_dict() == config_before
    assert {name: module for name, module in model.named_modules()} == modules
    assert "forward" not in vars(model.base_model)  # the class's own forward again


def test_replace_swaps_cleanly_without_stacking() -> None:
    model = make_model("llama")
    ps.swap(model, "alibi")
    ps.swap(model, "t5", replace=True)
    assert ps.describe(model).scheme == "t5"
    wrapper = vars(model.base_model)["forward"]
    assert wrapper.previous is None  # not stacked on the earlier swap's wrapper
    reference = make_model("llama")
    ps.swap(reference, "t5")
    torch.testing.assert_close(logits(model, INPUT), logits(reference, INPUT))
    ps.unswap(model)
    torch.testing.assert_close(logits(model, INPUT), logits(make_model("llama"), INPUT))


def test_describe_names_scheme_settings_places_and_new_parameters() -> None:
    model = make_model("gpt2")
    text = str(ps.describe(model))
    assert "native" in text and "transformer.wpe" in text
    ps.swap(model, ps.T5BiasConfig(num_buckets=16, max_distance=64))
    description = ps.describe(model)
    text = str(description)
    assert description.scheme == "t5" and description.settings["num_buckets"] == 16
    assert "posswap_positions" in text and "posswap_sdpa" in text
    assert ("transformer.posswap_positions.tables.0.weight", (16, 4), True) in description.new_parameters
