"""Per-layer scheme mixes (``LayerMix``) and their presets equal models nobody here wrote: transformers'
``SmolLM3ForCausalLM`` (NoPE layers by ``no_rope_layers``) holding the LLaMA's weights, transformers'
``Llama4TextAttention`` (iRoPE NoPE layer with attention temperature) put into a LLaMA, transformers' config
classes for the presets' layer conventions, and transformers' own layers where a swap keeps the model's RoPE."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import VOCAB
from mix_models import LAYERS, generate, logits, make_model, tokens
from transformers import SmolLM3Config, SmolLM3ForCausalLM

import hf_posswap as ps
from hf_posswap.schemes.mix import llama4_attn_scales


def test_native_rope_on_every_layer_equals_the_unswapped_model() -> None:
    model = make_model("llama")
    before = logits(model, tokens(2, 30))
    ps.swap(model, ps.LayerMix(default="rope"))  # the model's own theta, rotated inside attention
    assert model.base_model.rotary_emb.__class__.__name__ == "IdentityRotary"
    torch.testing.assert_close(logits(model, tokens(2, 30)), before, atol=1e-6, rtol=1e-6)


def smollm3_copy(llama: torch.nn.Module, no_rope_layers: list[int]) -> SmolLM3ForCausalLM:
    """transformers' SmolLM3 with the LLaMA's sizes and weights (its layout is LLaMA's: same parameter names)."""
    fields = {k: v for k, v in llama.config.to_dict().items() if k in SmolLM3Config.__dataclass_fields__}
    config = SmolLM3Config(**{**fields, "no_rope_layers": no_rope_layers}, head_dim=llama.config.head_dim)
    config._attn_implementation = "sdpa"
    model = SmolLM3ForCausalLM(config).eval()
    model.load_state_dict(llama.state_dict(), strict=True)
    return model


@pytest.mark.parametrize("how", ["layers-sugar", pytest.param("smollm3-preset", marks=pytest.mark.slow)])
def test_none_on_some_layers_equals_transformers_smollm3(how: str) -> None:
    model = make_model("llama")
    reference = smollm3_copy(model, [1, 0, 1, 0])  # SmolLM3: 1 = RoPE, so layers 1 and 3 are NoPE
    if how == "layers-sugar":
        ps.swap(model, "none", layers=[1, 3])
    else:
        ps.swap(model, ps.smollm3_nope(model, no_rope_layer_interval=2))
    input_ids = tokens(2, 40)
    torch.testing.assert_close(logits(model, input_ids), logits(reference, input_ids), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits(model, input_ids), logits(make_model("llama"), input_ids), atol=1e-3)


SCALED_ROPE = {
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("rope_type", ["llama3", pytest.param("yarn", marks=pytest.mark.slow)])
def test_layers_shorthand_keeps_a_scaled_native_rope(rope_type: str) -> None:
    """The other layers keep the model's own RoPE, scaling included (Llama 3.x checkpoints carry llama3 scaling)."""
    model = make_model("llama")
    model.config.rope_parameters = dict(SCALED_ROPE[rope_type])
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    reference = smollm3_copy(model, [1, 0, 1, 1])
    ps.swap(model, "none", layers=[1])
    assert model._posswap_state.config.default.scaling.method == rope_type
    input_ids = tokens(2, 40)
    torch.testing.assert_close(logits(model, input_ids), logits(reference, input_ids), atol=1e-5, rtol=1e-5)


def llama4_reference(llama: torch.nn.Module, nope: list[int], floor_scale: int, attn_scale: float) -> torch.nn.Module:
    """The LLaMA with transformers' own ``Llama4TextAttention`` (NoPE layer, temperature on) in the NoPE layers."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention

    reference = copy.deepcopy(llama)
    config = Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, no_rope_layers=[int(i not in nope) for i in range(LAYERS)], use_qk_norm=False,
        attn_temperature_tuning=True, floor_scale=floor_scale, attn_scale=attn_scale, attention_bias=False,
    )
    config._attn_implementation = "sdpa"
    for index in nope:
        attention = Llama4TextAttention(config, index)
        attention.load_state_dict(reference.model.layers[index].self_attn.state_dict(), strict=True)
        assert not attention.use_rope and attention.attn_temperature_tuning
        reference.model.layers[index].self_attn = attention.eval()
    return reference


@pytest.mark.parametrize("use_cache", [pytest.param(False, id="forward"),
                                       pytest.param(True, id="generate-cached", marks=pytest.mark.slow)])
def test_irope_equals_transformers_llama4_attention(use_cache: bool) -> None:
    model = make_model("llama")
    reference = llama4_reference(model, nope=[1, 3], floor_scale=4, attn_scale=0.5)
    ps.swap(model, ps.llama4_irope(model, no_rope_layer_interval=2, floor_scale=4, attn_scale=0.5))
    input_ids = tokens(2, 30)
    if not use_cache:
        torch.testing.assert_close(logits(model, input_ids), logits(reference, input_ids), atol=1e-5, rtol=1e-5)
        without = make_model("llama")
        ps.swap(without, "none", layers=[1, 3])  # the temperature is visible: NoPE alone differs
        assert not torch.allclose(logits(model, input_ids), logits(without, input_ids), atol=1e-4)
        return
    ours, our_logits = generate(model, input_ids[:1], use_cache=True)
    theirs, their_logits = generate(reference, input_ids[:1], use_cache=True)
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(our_logits, their_logits, atol=1e-5, rtol=1e-5)


def test_temperature_formula_is_llama4s() -> None:
    """transformers/models/llama4/modeling_llama4.py, Llama4TextAttention.forward (lines 359-364 in 5.23):
    attn_scales = log1p(floor((positions + 1) / floor_scale)) * attn_scale + 1."""
    positions = torch.tensor([0, 1, 6, 7, 8, 8190, 8191, 100_000])
    expected = [1 + 0.1 * math.log(1 + ((p + 1) // 8192)) for p in positions.tolist()]
    torch.testing.assert_close(llama4_attn_scales(positions, 8192, 0.1), torch.tensor(expected), atol=1e-6, rtol=0)
    assert llama4_attn_scales(torch.tensor([8190]), 8192, 0.1).item() == 1.0  # floor: no change before 8191


def test_presets_follow_transformers_conventions() -> None:
    from transformers import Cohere2Config, Llama4TextConfig

    smol = SmolLM3Config(num_hidden_layers=12)  # no_rope_layers default: 1 = RoPE
    expected_nope = [i for i, flag in enumerate(smol.no_rope_layers) if not flag]
    assert expected_nope == [3, 7, 11]
    assert ps.smollm3_nope(12).parts(12)[1] == (ps.NoPEConfig(), expected_nope)
    llama4 = Llama4TextConfig(num_hidden_layers=12)
    irope = ps.llama4_irope(12)
    assert irope.parts(12)[1][1] == [i for i, flag in enumerate(llama4.no_rope_layers) if not flag]
    assert (irope.attn_temperature_tuning, irope.floor_scale, irope.attn_scale) == (
        llama4.attn_temperature_tuning, llama4.floor_scale, llama4.attn_scale)
    cohere = Cohere2Config(num_hidden_layers=8)  # RoPE only where layer_types says sliding_attention
    mix = ps.cohere2_sliding_rope(cohere)
    assert [s.name for s in mix.layer_schemes(8)] == [
        "rope" if kind == "sliding_attention" else "none" for kind in cohere.layer_types]
    assert ps.cohere2_sliding_rope(8).parts(8) == mix.parts(8)  # no layer_types: Cohere2's default pattern


KEPT = {  # id: (family, swapped layers, the layer kept whose output is compared with transformers' own model)
    "gemma3_text-sliding-layer-kept": ("gemma3_text", [1], 0),
    "llama-layer-kept": ("llama", [1], 0),
}


@pytest.mark.parametrize("case", list(KEPT), ids=list(KEPT))
def test_layers_swap_keeps_the_own_rope_of_the_other_layers(case: str) -> None:
    from conftest import make_model

    family, layers, kept = KEPT[case]
    ids = torch.randint(3, 90, (2, 24), generator=torch.Generator().manual_seed(0))  # past Gemma's window of 16
    own, model = make_model(family), make_model(family)
    ps.swap(model, "none", layers=layers)
    with torch.no_grad():
        expected = own(ids, output_hidden_states=True).hidden_states[kept + 1]  # transformers' own layer
        got = model(ids, output_hidden_states=True).hidden_states[kept + 1]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    if family == "gemma3_text":  # both layer types' thetas (local 1e4, global 1e6) are in the swapped model's record
        assert "rope_theta=10000.0" in str(ps.describe(model))


@pytest.mark.parametrize("preset", ["smollm3_nope", "cohere2_sliding_rope"])
def test_preset_keeps_gemma3_sliding_layers_rope(preset: str) -> None:
    from conftest import make_model

    ids = torch.randint(3, 90, (2, 24), generator=torch.Generator().manual_seed(0))
    own, model = make_model("gemma3_text"), make_model("gemma3_text")
    ps.swap(model, getattr(ps, preset)(model, 2))  # layer 0 (sliding) keeps RoPE, layer 1 (global) NoPE
    with torch.no_grad():
        expected = own(ids, output_hidden_states=True).hidden_states[1]
        got = model(ids, output_hidden_states=True).hidden_states[1]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
