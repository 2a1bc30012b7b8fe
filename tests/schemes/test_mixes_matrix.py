"""The matrix checks on mixed models (``LayerMix`` and ``HeadMix``): training, eager against SDPA, padding,
cached generation, explicit position ids, attention weights per layer and per head. Ids read ``llama-irope`` so
``pytest -k irope`` selects one mix."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded, padding_position_ids
from mix_models import CAUSAL, LAYERS, MIXES, cases, generate, logits, make_model, mixed, tokens

import hf_posswap as ps


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
    batch, mask = left_padded(rows, 12)
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
    batch, mask = left_padded(rows, 10)
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
