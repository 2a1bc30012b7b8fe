"""Per-layer scheme mixes (``LayerMix``), their presets and Llama 4's NoPE temperature.

References nobody here wrote: transformers' ``SmolLM3ForCausalLM`` (NoPE layers by ``no_rope_layers``) holding the
LLaMA's weights, transformers' ``Llama4TextAttention`` (iRoPE NoPE layer with attention temperature) put into a
LLaMA, and transformers' config classes for the presets' layer conventions. Ids read ``llama-irope`` so
``pytest -k irope`` selects one mix."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import MODEL_CLASSES, VOCAB, padding_position_ids, save_tiny_checkpoint, tiny_config, write_corpus
from transformers import SmolLM3Config, SmolLM3ForCausalLM

import hf_posswap as ps
from hf_posswap.core.state import STATE_ATTR
from hf_posswap.schemes import scheme_config_from_dict
from hf_posswap.schemes.mix import llama4_attn_scales

LAYERS = 4
ROOT = Path(__file__).resolve().parents[2]


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


# --- references from transformers ------------------------------------------------------------------------------


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


# --- the matrix checks on mixed models ----------------------------------------------------------------------------


@pytest.mark.parametrize("key", cases(list(MIXES), {"llama-irope"}))
def test_forward_backward(key: str) -> None:
    model = mixed(key).train()
    input_ids = tokens(2, 24)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    for name, _shape, trainable in ps.describe(model).new_parameters:
        param = model.get_parameter(name)
        if trainable and "tables" in name and key != "bert-t5-rope":  # T5 tables in layers without t5 stay unused
            continue
        if trainable:
            assert param.grad is not None and param.grad.abs().sum() > 0, f"{name} gets no gradient"


@pytest.mark.parametrize("key", cases(list(MIXES), {"llama-rope-alibi-t5"}))
def test_eager_matches_sdpa_with_padding(key: str) -> None:
    input_ids = tokens(2, 20)
    mask = torch.ones_like(input_ids)
    mask[1, :5] = 0
    kwargs = {"attention_mask": mask, "position_ids": padding_position_ids(mask)}
    eager, sdpa = logits(mixed(key, "eager"), input_ids, **kwargs), logits(mixed(key, "sdpa"), input_ids, **kwargs)
    torch.testing.assert_close(eager[mask.bool()], sdpa[mask.bool()], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("key", cases(list(MIXES), {"llama-irope"}))
def test_left_padded_forward_equals_rows_alone(key: str) -> None:
    model = mixed(key)
    rows = [tokens(1, 12, seed=4)[0], tokens(1, 7, seed=5)[0]]
    batch = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, row in enumerate(rows):
        batch[i, 12 - len(row):], mask[i, 12 - len(row):] = row, 1
    together = logits(model, batch, attention_mask=mask, position_ids=padding_position_ids(mask))
    for i, row in enumerate(rows):
        torch.testing.assert_close(together[i, 12 - len(row):], logits(model, row[None])[0], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("key", CAUSAL)
def test_cached_generation_equals_recompute(key: str, attn: str) -> None:
    model = mixed(key, attn)
    input_ids = tokens(1, 8)
    cached, cached_logits = generate(model, input_ids, use_cache=True)
    recomputed, recomputed_logits = generate(model, input_ids, use_cache=False)
    static, static_logits = generate(model, input_ids, cache_implementation="static")
    assert torch.equal(cached, recomputed) and torch.equal(cached, static)
    torch.testing.assert_close(cached_logits, recomputed_logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(static_logits, recomputed_logits, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("key", CAUSAL)
def test_left_padded_generation_equals_rows_alone(key: str) -> None:
    model = mixed(key)
    rows = [tokens(1, 10, seed=2)[0], tokens(1, 6, seed=3)[0]]
    batch = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, row in enumerate(rows):
        batch[i, 10 - len(row):], mask[i, 10 - len(row):] = row, 1
    _, together = generate(model, batch, attention_mask=mask)
    for i, row in enumerate(rows):
        torch.testing.assert_close(together[i], generate(model, row[None])[1][0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("key", cases(list(MIXES), {"gpt2-alibi-rope-none"}))
def test_explicit_position_ids_reach_attention(key: str) -> None:
    model = mixed(key)
    input_ids = tokens(2, 16)
    default = logits(model, input_ids)
    torch.testing.assert_close(logits(model, input_ids, position_ids=torch.arange(16)[None]), default)
    skipped = torch.cat((torch.arange(8), torch.arange(20, 28)))[None]
    assert not torch.allclose(logits(model, input_ids, position_ids=skipped), default, atol=1e-4)


@pytest.mark.parametrize("key", cases(list(MIXES), {"bert-t5-rope"}))
def test_output_attentions_per_layer_follow_the_layers_scheme(key: str) -> None:
    """Layer 0 sees only the embeddings, so its weights equal those of a model swapped to layer 0's scheme alone."""
    family, mix = MIXES[key]
    model = mixed(key, "eager")
    alone = make_model(family, "eager")
    ps.swap(alone, mix().layer_schemes(LAYERS)[0])
    if "headmix-t5" in key:  # the same T5 table as the mixed model's (both random)
        table = alone.base_model.posswap_positions.parts["0"].bias.bias.tables[0]
        table.weight.data.copy_(model.base_model.posswap_positions.parts["0"].bias.bias.tables[0].weight)
    input_ids = tokens(1, 10)
    with torch.no_grad():
        ours = model(input_ids=input_ids, output_attentions=True).attentions
        theirs = alone(input_ids=input_ids, output_attentions=True).attentions
    assert len(ours) == LAYERS
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(ours[1], theirs[1], atol=1e-4)  # layer 1 has another part in every mix here


@pytest.mark.parametrize(("family", "bias", "bias_heads"), [
    pytest.param("llama", "alibi", [0, 1], id="llama-gqa-alibi"),
    pytest.param("gpt2", "t5", [0, 2], id="gpt2-t5", marks=pytest.mark.slow),
])
def test_head_mix_heads_equal_the_pure_schemes_per_head(family: str, bias: str, bias_heads: list[int]) -> None:
    """Layer 0 attention weights, head by head: a bias head's are the pure bias model's, a rotary head's the pure
    RoPE model's (transformers' own RoPE for LLaMA); models built from the same weights."""
    bias_config = ps.T5BiasConfig(num_buckets=16, max_distance=32) if bias == "t5" else ps.AlibiConfig()
    head_mix, pure_bias, pure_rope = (make_model(family, "eager") for _ in range(3))
    ps.swap(head_mix, ps.HeadMix(bias=bias_config, rotary="rope", bias_heads=bias_heads))
    ps.swap(pure_bias, bias_config)
    if family != "llama":
        ps.swap(pure_rope, "rope")
    if bias == "t5":
        table = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
        pure_bias.base_model.posswap_positions.tables[0].weight.data.copy_(table)
        head_mix.base_model.posswap_positions.parts["0"].bias.bias.tables[0].weight.data.copy_(table)
    input_ids = tokens(2, 14)
    weights = [m(input_ids=input_ids, output_attentions=True).attentions[0] for m in (head_mix, pure_bias, pure_rope)]
    rotary_heads = [h for h in range(4) if h not in bias_heads]
    torch.testing.assert_close(weights[0][:, bias_heads], weights[1][:, bias_heads], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weights[0][:, rotary_heads], weights[2][:, rotary_heads], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(weights[0][:, rotary_heads], weights[1][:, rotary_heads], atol=1e-3)


# --- bad values: a clear error, the model unchanged ------------------------------------------------------------------

BAD = {
    "out-of-range": (lambda: ps.LayerMix(default="rope", overrides={"none": [1, 4]}),
                     r"lists layers \[4\], but the model has 4 layers \(indices 0 to 3\)"),
    "overlap": (lambda: ps.LayerMix(default="rope", overrides=[("none", [1]), ("alibi", [2, 1])]),
                r"lists layer 1 twice \(in the overrides for 'none' and 'alibi'\)"),
    "nested": (lambda: ps.LayerMix(default=ps.LayerMix(), overrides={}), r"mixes do not nest"),
    "absolute-part": (lambda: ps.LayerMix(default="rope", overrides={"learned": [0]}),
                      r"'learned', an absolute scheme: absolute schemes add their vectors once"),
    "not-an-index": (lambda: ps.LayerMix(default="rope", overrides={"none": [1.5]}), r"not valid: \[1.5\]"),
    "negative-floor-scale": (lambda: ps.LayerMix(overrides={"none": [1]}, attn_temperature_tuning=True,
                                                 floor_scale=-1), r"LayerMix.floor_scale must be a finite number > 0"),
    "nan-attn-scale": (lambda: ps.LayerMix(overrides={"none": [1]}, attn_temperature_tuning=True,
                                           attn_scale=float("nan")), r"LayerMix.attn_scale must be a finite number"),
    "temperature-without-nope": (lambda: ps.LayerMix(default="rope", attn_temperature_tuning=True),
                                 r"this mix has no 'none' layer"),
    "head-split-across-kv-group": (lambda: ps.HeadMix(bias="alibi", rotary="rope", bias_heads=[1, 2]),
                                   r"splits key/value groups \[\[0, 1\], \[2, 3\]\].*e\.g\. bias_heads=\[0, 1, 2, 3\]"),
    "head-mix-every-head-bias": (lambda: ps.HeadMix(bias_heads=[0, 1, 2, 3]), r"covers every head, leaving none"),
    "head-mix-rotary-as-bias": (lambda: ps.HeadMix(bias="rope"), r"HeadMix.bias must be a bias scheme"),
    "head-out-of-range": (lambda: ps.LayerMix(overrides=[(ps.HeadMix(bias_heads=[4, 5]), [0])]),
                          r"lists heads \[4, 5\], but the model has 4 attention heads"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_mixes_are_refused_and_leave_the_model_unchanged(case: str) -> None:
    build, message = BAD[case]
    model = make_model("llama")
    ps.swap(model, "alibi")  # an earlier swap must survive a refused replacement
    before, keys = logits(model, tokens(1, 12)), list(model.state_dict())
    with pytest.raises(ps.InvalidConfigError, match=message):
        ps.swap(model, build(), replace=True)
    assert ps.describe(model).scheme == "alibi" and list(model.state_dict()) == keys
    assert torch.equal(logits(model, tokens(1, 12)), before)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_layers_shorthand_on_absolute_models_is_refused(family: str) -> None:
    model = make_model(family)
    with pytest.raises(ps.InvalidConfigError, match=r"not a per-layer mechanism.*LayerMix\(default='rope'"):
        ps.swap(model, "none", layers=[1])
    assert getattr(model, STATE_ATTR, None) is None


# --- JSON, describe, unswap, extension, checkpoints, export, peft, fine-tuning ---------------------------------------


def test_json_round_trip_and_layer_listing() -> None:
    mix = ps.LayerMix(default=ps.RopeConfig(rope_theta=500.0), overrides=[(ps.AlibiConfig(trainable_slopes=True), [0]),
                                                                          ("none", [2, 3])])
    assert scheme_config_from_dict(mix.to_dict()) == mix
    assert [s.name for s in mix.layer_schemes(LAYERS)] == ["alibi", "rope", "none", "none"]
    model = make_model("llama")
    ps.swap(model, mix)
    text = str(ps.describe(model))
    assert "rope(rope_theta=500.0" in text and "): 1\n" in text and "- none: 2, 3" in text
    assert "alibi(trainable_slopes=True): 0" in text


@pytest.mark.parametrize("key", cases(list(MIXES), {"llama-irope"}))
def test_unswap_restores_exactly(key: str) -> None:
    family, mix = MIXES[key]
    model = make_model(family)
    before, keys, config = logits(model, tokens(2, 20)), list(model.state_dict()), model.config.to_dict()
    modules = dict(model.named_modules())
    ps.swap(model, mix())
    ps.unswap(model)
    assert torch.equal(logits(model, tokens(2, 20)), before)
    assert list(model.state_dict()) == keys and model.config.to_dict() == config
    assert dict(model.named_modules()) == modules and "forward" not in vars(model.base_model)


def test_extend_context_scales_only_the_rope_layers() -> None:
    model = make_model("llama")
    ps.swap(model, ps.llama4_irope(model, no_rope_layer_interval=2))
    ps.extend_context(model, 256)
    mix = ps.describe(model)
    parts = model._posswap_state.config.parts(LAYERS)
    assert parts[0][0].scaling is not None and parts[0][0].scaling.factor == 4.0 and parts[0][1] == [0, 2]
    assert parts[1][0] == ps.NoPEConfig() and parts[1][1] == [1, 3]
    assert mix.context["max_position_embeddings"] == 256 and model.config.max_position_embeddings == 256
    rope = model.base_model.posswap_positions(0)
    assert rope.rope_type == "yarn"
    long = tokens(1, 200)
    assert torch.isfinite(logits(model, long)).all()
    nope_only = make_model("llama")
    ps.swap(nope_only, ps.LayerMix(default="none", overrides={"alibi": [0]}))
    with pytest.raises(ps.InvalidConfigError, match=r"needs a model with RoPE"):
        ps.extend_context(nope_only, 256, "yarn")
    ps.extend_context(nope_only, 256)  # no RoPE layer: 'lift' only records the length
    assert ps.describe(nope_only).context["method"] == "lift"
    head_mix = make_model("llama")
    ps.swap(head_mix, ps.HeadMix(bias="alibi", rotary="rope", bias_heads=[0, 1]))  # alone: on every layer
    ps.extend_context(head_mix, 256)  # the rotary heads' RoPE is scaled, the ALiBi heads need nothing
    scaled = head_mix._posswap_state.config.default
    assert scaled.rotary.scaling.factor == 4.0 and scaled.bias == ps.AlibiConfig()
    assert torch.isfinite(logits(head_mix, long)).all()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*holds no weights for this native position module")
@pytest.mark.parametrize("key", MIXES)
def test_checkpoint_round_trip_gives_identical_logits(tmp_path: Path, key: str) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    model = mixed(key)
    if key == "llama-irope":
        ps.extend_context(model, 256)
    model.save_pretrained(tmp_path)
    auto = AutoModelForMaskedLM if key.startswith("bert") else AutoModelForCausalLM
    loaded = auto.from_pretrained(tmp_path).eval()
    input_ids = tokens(2, 100 if key == "llama-irope" else 30)
    assert torch.equal(logits(loaded, input_ids), logits(model, input_ids))
    assert ps.describe(loaded).layers == ps.describe(model).layers
    ps.unswap(loaded)
    assert ps.describe(loaded).scheme == "native"


@pytest.mark.slow
@pytest.mark.parametrize("key", ["llama-irope", "llama-headmix-alibi-rope"])
def test_standalone_export_reloads_without_hf_posswap(tmp_path: Path, key: str) -> None:
    from test_export import load_without_hf_posswap

    model = mixed(key)
    ps.extend_context(model, 256)
    input_ids = tokens(1, 120)
    torch.save({"input_ids": input_ids, "expected": logits(model, input_ids)}, tmp_path / "io.pt")
    ps.export_standalone(model, tmp_path / "export")
    assert "EQUAL" in load_without_hf_posswap(tmp_path / "export", tmp_path / "io.pt", "AutoModelForCausalLM")


def test_peft_modules_to_save_copy_is_the_one_used() -> None:
    """LoRA with trainable ALiBi slopes in a mix: peft copies the mix's module; attention must read the copy."""
    from peft import get_peft_model

    model = make_model("llama")
    ps.swap(model, ps.LayerMix(default="rope", overrides=[(ps.AlibiConfig(trainable_slopes=True), [1, 2])]))
    peft_model = get_peft_model(model, ps.lora_config(model))
    input_ids = tokens(1, 16)
    before = logits(peft_model, input_ids)
    wrapper = peft_model.base_model.model.model.posswap_positions
    copy_slopes = wrapper.modules_to_save["default"].parts["1"].slopes
    with torch.no_grad():
        copy_slopes.mul_(4.0)
    assert not torch.allclose(logits(peft_model, input_ids), before, atol=1e-4)


FINETUNES = {"full": {}, "lora": {"lora": True}}


@pytest.mark.slow
@pytest.mark.parametrize("how", FINETUNES)
def test_finetune_trains_a_mixed_model_and_saves_its_position_parameters(tmp_path: Path, how: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_posswap.training import FinetuneConfig, finetune

    save_tiny_checkpoint("llama", tmp_path / "plain")
    start = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    mix = ps.LayerMix(default="rope", overrides=[(ps.AlibiConfig(trainable_slopes=True), [1])])
    ps.swap(start, mix)
    slopes = start.base_model.posswap_positions.parts["1"].slopes.detach().clone()
    start.save_pretrained(tmp_path / "start")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "start" / name).write_bytes((tmp_path / "plain" / name).read_bytes())
    (tmp_path / "corpus").mkdir()
    write_corpus(tmp_path / "corpus", documents=10)
    finetune(FinetuneConfig(model=str(tmp_path / "start"), data=[str(tmp_path / "corpus" / "*.txt")],
                            output=str(tmp_path / "run"), seq_len=64, batch_size=2, steps=3, lr=1e-2, eval_every=0,
                            save_every=3, progress=False, **FINETUNES[how]))
    if how == "lora":
        keys = load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors").keys()
        assert any("posswap_positions" in key and "slopes" in key for key in keys), sorted(keys)
        return
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert ps.describe(trained).layers == ps.describe(start).layers
    assert not torch.equal(trained.base_model.posswap_positions.parts["1"].slopes, slopes)


@pytest.mark.slow
def test_irope_example_runs(tmp_path: Path) -> None:
    """examples/irope_extend.py: iRoPE, 4x extension, fine-tuning, save and reload, on a tiny LLaMA."""
    script = ROOT / "examples" / "irope_extend.py"
    library_lines = [line for line in script.read_text().split("# --- the library part")[1].split("# ---")[0]
                     .splitlines()[1:] if line.strip() and not line.lstrip().startswith(("#", "seq_len"))]
    assert len(library_lines) <= 5, library_lines
    result = subprocess.run([sys.executable, str(script), "--tiny", "--steps", "2", "--seq-len", "64", "--output",
                             str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "layer_mix" in result.stdout and "none + attention temperature" in result.stdout
    assert "extended from 64 to 256 tokens with 'yarn'" in result.stdout


@pytest.mark.slow
def test_finetune_command_swaps_to_a_mix(tmp_path: Path) -> None:
    """``hf-posswap finetune --scheme layer_mix --scheme-option overrides=...`` (options are JSON)."""
    from transformers import AutoModelForCausalLM

    save_tiny_checkpoint("llama", tmp_path / "plain")
    (tmp_path / "corpus").mkdir()
    write_corpus(tmp_path / "corpus", documents=5)
    command = [sys.executable, "-m", "hf_posswap", "finetune", "--model", str(tmp_path / "plain"), "--data",
               str(tmp_path / "corpus" / "*.txt"), "--output", str(tmp_path / "run"), "--scheme", "layer_mix",
               "--scheme-option", 'overrides={"none": [1]}', "--scheme-option", "attn_temperature_tuning=true",
               "--steps", "2", "--seq-len", "32", "--batch-size", "2", "--no-progress"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    layers = ps.describe(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")).layers
    assert list(layers.values()) == [[0], [1]] and "attention temperature" in list(layers)[1]


BAD_TEMPERATURE = {
    "floor_scale-none": {"floor_scale": None},
    "floor_scale-list": {"floor_scale": [8192]},
    "attn_scale-str": {"attn_scale": "0.1"},
}


@pytest.mark.parametrize("options", list(BAD_TEMPERATURE.values()), ids=list(BAD_TEMPERATURE))
def test_layer_mix_temperature_setting_of_wrong_type_is_refused(options: dict) -> None:
    (name, value), = options.items()
    with pytest.raises(ps.errors.InvalidConfigError, match=rf"LayerMix\.{name} must be a finite number") as caught:
        ps.LayerMix(default="rope", overrides={"none": [1]}, attn_temperature_tuning=True, **options)
    assert repr(value) in str(caught.value)


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
