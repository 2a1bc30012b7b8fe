"""The math checked against code nobody here wrote: transformers' T5, BLOOM and LLaMA implementations."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import VOCAB, make_model
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.t5.modeling_t5 import T5Attention

import hf_posswap as ps
from hf_posswap.families.llama import LlamaAdapter
from hf_posswap.schemes import alibi_slopes, apply_rotary, relative_position_bucket, sinusoidal_table


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (16, 64), (8, 20), (64, 256)])
def test_t5_buckets_match_transformers(bidirectional: bool, num_buckets: int, max_distance: int) -> None:
    relative = torch.arange(-400, 401)[None, :] + torch.zeros(3, 1, dtype=torch.long)
    expected = T5Attention._relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
    assert torch.equal(relative_position_bucket(relative, bidirectional, num_buckets, max_distance), expected)


@pytest.mark.parametrize("num_heads", [1, 2, 3, 4, 5, 6, 8, 12, 16, 24])
def test_alibi_slopes_match_bloom(num_heads: int) -> None:
    alibi = build_alibi_tensor(torch.ones(1, 4, dtype=torch.long), num_heads, torch.float32)  # [H, 1, L] = m*j
    torch.testing.assert_close(alibi_slopes(num_heads), alibi[:, 0, 1], rtol=1e-6, atol=0)


def test_alibi_slopes_follow_the_papers_rule_for_non_powers_of_two() -> None:
    # Press et al. 2022: 8 heads -> 1/2 ... 1/256; for n not a power of two, take the 2^k slopes and every other
    # slope of the 2^(k+1) sequence.
    assert alibi_slopes(8).tolist() == [2.0 ** -(i + 1) for i in range(8)]
    eight, sixteen = [2.0 ** -(i + 1) for i in range(8)], [2.0 ** (-(i + 1) / 2) for i in range(16)]
    assert alibi_slopes(12).tolist() == pytest.approx(eight + sixteen[0::2][:4])
    four, eight_half = [2.0 ** (-2 * (i + 1)) for i in range(4)], [2.0 ** -(i + 1) for i in range(8)]
    assert alibi_slopes(6).tolist() == pytest.approx(four + eight_half[0::2][:2])
    assert alibi_slopes(3).tolist() == pytest.approx([2.0**-4, 2.0**-8, 2.0**-2])
    assert alibi_slopes(5).tolist() == pytest.approx([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_alibi_keeps_the_papers_slopes_whenever_the_model_is_cast(dtype: torch.dtype) -> None:
    """A cast after the swap (``model.to(torch.bfloat16)``) rounded the slopes buffer: with 24 heads the bias was
    2.15 logits off at a distance of 2,047, while the same cast before the swap kept float32 slopes. Both orders now
    use the paper's slopes in float32 (BLOOM's, to its float32 rounding), or float64 in a float64 model, and give
    the same logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=16 * 24, num_hidden_layers=1, num_attention_heads=24,
                             num_key_value_heads=8, head_dim=16, intermediate_size=64)
        return LlamaForCausalLM(config).eval()

    reference = build_alibi_tensor(torch.ones(1, 4, dtype=torch.long), 24, torch.float64)[:, 0, 1]  # [H] m_h
    swapped_then_cast = ps.swap(model(), "alibi").to(dtype)
    cast_then_swapped = ps.swap(model().to(dtype), "alibi")
    for swapped in (swapped_then_cast, cast_then_swapped):
        slopes = swapped.model.posswap_positions.exact_slopes()
        assert slopes.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        # BLOOM builds its base in float32: agreement to float32's rounding (bf16's was 1.4e-3)
        torch.testing.assert_close(slopes.double(), reference, rtol=1e-6, atol=0)
        if dtype == torch.float64:  # the paper's rule evaluated in float64, not float32 values widened
            assert torch.equal(slopes, alibi_slopes(24, torch.float64))
    ids = torch.randint(3, VOCAB, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(swapped_then_cast(ids).logits, cast_then_swapped(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("num_heads", [3, 5, 6, 12])
def test_causal_alibi_bias_equals_bloom_up_to_a_row_constant(num_heads: int) -> None:
    length = 9
    module = ps.AlibiConfig().build(_spec(num_heads))
    positions = torch.arange(length)
    ours = module(positions, positions, 0, causal=True)[0]  # [H, q, kv]
    bloom = build_alibi_tensor(torch.ones(1, length, dtype=torch.long), num_heads, torch.float32)  # [H, 1, kv]
    difference = ours - bloom  # softmax is invariant to a constant per row: the difference must be one
    torch.testing.assert_close(difference, difference[..., :1].expand_as(difference))
    bidirectional = module(positions, positions, 0, causal=False)[0]
    torch.testing.assert_close(bidirectional, -(alibi_slopes(num_heads)[:, None, None]
                                                * (positions[:, None] - positions[None, :]).abs()))


def test_rotary_matches_llama() -> None:
    model = make_model("llama")
    rotary = LlamaRotaryEmbedding(model.config)
    ours = ps.RopeConfig(rope_theta=model.config.rope_parameters["rope_theta"]).build(_spec(4, head_dim=16))
    positions = torch.arange(50)
    q, k = torch.randn(2, 4, 50, 16), torch.randn(2, 2, 50, 16)
    cos, sin = rotary(q, positions[None])
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    our_cos, our_sin = ours(positions)
    torch.testing.assert_close(our_cos, cos[0])
    torch.testing.assert_close(apply_rotary(q, our_cos, our_sin), expected_q)
    torch.testing.assert_close(apply_rotary(k, our_cos, our_sin), expected_k)


def test_rope_inside_attention_matches_llamas_native_rope(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path GPT-2 and BERT use (rotate inside attention, cached keys rotated by index) equals LLaMA's own."""
    input_ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    native = make_model("llama")
    with torch.no_grad():
        expected = native(input_ids=input_ids).logits
    monkeypatch.setattr(LlamaAdapter, "native_rope_edits", lambda self, model, config: None)
    patched = make_model("llama")
    ps.swap(patched, "rope")
    assert not ps.describe(patched).native
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=input_ids).logits, expected, atol=1e-5, rtol=1e-4)
    sequences = native.generate(input_ids[:1, :8], max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(input_ids[:1, :8], max_new_tokens=10, do_sample=False, pad_token_id=0),
                       sequences)


def test_rope_keeps_hf_rotate_half_layout() -> None:
    """Dimension i pairs with i + d/2 (not 2i with 2i+1): pinned on a unit vector rotated by one position."""
    ours = ps.RopeConfig(rope_theta=10_000.0).build(_spec(1, head_dim=8))
    x = torch.zeros(1, 1, 2, 8)
    x[..., 0] = 1.0  # e_0
    cos, sin = ours(torch.tensor([0, 1]))
    rotated = apply_rotary(x, cos, sin)[0, 0, 1]
    assert rotated[0] == pytest.approx(math.cos(1.0)) and rotated[4] == pytest.approx(math.sin(1.0))
    assert rotated[1].abs() < 1e-7


def test_sinusoidal_table_matches_the_paper() -> None:
    table = sinusoidal_table(torch.arange(20), 16, 10_000.0)
    for pos in (0, 1, 7, 19):
        for i in range(8):
            angle = pos / 10_000.0 ** (2 * i / 16)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def _spec(num_heads: int, head_dim: int = 16) -> ps.schemes.ModelSpec:
    return ps.schemes.ModelSpec(
        model_type="test", hidden_size=num_heads * head_dim, num_layers=1, num_heads=num_heads,
        num_kv_heads=num_heads, head_dim=head_dim, is_causal=True, max_positions=64, initializer_range=0.02,
        native_rope_theta=None, dtype=torch.float32, device=torch.device("cpu"),
    )


def test_t5_bias_gradient_equals_plain_indexing() -> None:
    module = ps.T5BiasConfig(num_buckets=16, max_distance=40).build(_spec(4))
    torch.nn.init.normal_(module.tables[0].weight)
    positions = torch.arange(30)
    upstream = torch.randn(1, 4, 30, 30)
    (module(positions, positions, 0, True) * upstream).sum().backward()
    ours = module.tables[0].weight.grad.clone()
    weight = module.tables[0].weight.detach().clone().requires_grad_()
    buckets = relative_position_bucket(positions[None, :] - positions[:, None], False, 16, 40)
    (weight.t()[:, buckets].unsqueeze(0) * upstream).sum().backward()
    torch.testing.assert_close(ours, weight.grad)


# (first query, queries, first key, keys): a prefill, a chunk after a cache, decoding steps (one near the start,
# one past the kept row's first 1,024 relative positions, so it grows), a static cache's keys after the query
_T5_INDEX_CASES = {
    "prefill": (0, 40, 0, 40),
    "chunk-after-cache": (30, 7, 0, 37),
    "decode-step": (5, 1, 0, 6),
    "decode-past-the-kept-row": (3000, 1, 0, 3001),
    "static-cache-buffer": (4, 2, 0, 12),
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("case", list(_T5_INDEX_CASES), ids=list(_T5_INDEX_CASES))
def test_t5_bias_at_index_positions_equals_transformers_buckets(case: str, causal: bool) -> None:
    """Index positions read their bucket ids from a kept row of every relative position (views and one flip): the
    bias equals T5's own buckets gathered from the table, whatever the offsets, and after the row grows."""
    first_query, q_len, first_key, kv_len = _T5_INDEX_CASES[case]
    module = ps.T5BiasConfig(num_buckets=16, max_distance=40).build(_spec(4))
    torch.nn.init.normal_(module.tables[0].weight)
    query_pos = torch.arange(first_query, first_query + q_len)
    key_pos = torch.arange(first_key, first_key + kv_len)
    relative = key_pos[None, :] - query_pos[:, None]
    buckets = T5Attention._relative_position_bucket(relative, not causal, 16, 40)
    expected = module.tables[0].weight.t()[:, buckets].unsqueeze(0)  # [1, H, q, kv]
    assert torch.equal(module(query_pos, key_pos, 0, causal), expected)
    assert torch.equal(module(query_pos, key_pos, 0, causal, {}), expected)  # with a memo, as attention calls it
