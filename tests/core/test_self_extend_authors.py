"""Self-Extend (Jin et al. 2024, arXiv:2401.01325) against its authors' formula, on a tiny LLaMA with grouped-query
attention (4 heads, 2 key/value heads).

The reference below is written from the authors' code, github.com/datamllab/LongLM at commit cdbbb06,
``self_extend_patch/Llama_4_40.py``, ``self_extend_forward`` (the eager/sdpa patch): query positions are the
``position_ids``, key positions the same in prefill and ``arange(kv_len)`` when ``q_len == 1`` (l. 121-122);
"neighbour" logits with RoPE at those positions; "group" logits with keys at ``key_position // G`` and queries at
``query_position // G + W - W // G``, the shift set to 0 while every query position is below W (l. 130-132);
neighbour logits where the key is less than W before the query (prefill: ``tril`` minus a ``tril`` shifted by W,
l. 167-172; decoding: the last W keys, l. 164-166), group logits elsewhere; then the causal mask, a float32 softmax
and the values. Nothing depends on the model's original length. Left out: the optional log-n query scaling
(``scale_base``, off by default). The reference runs as the attention function of the unswapped model whose
rotary is made the identity, with cos/sin from transformers' LlamaRotaryEmbedding; it sees no padding (the authors'
code handles one row), so padded batches are checked row by row against it.
Tolerance: fp32, atol 1e-5 / rtol 1e-4 on logits and attention weights.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import MAX_POSITIONS, make_model, padding_position_ids
from torch import nn
from transformers import AttentionInterface, DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, repeat_kv, rotate_half

import hf_posswap as ps

TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}
WINDOW, TARGET = 16, 4 * MAX_POSITIONS
GROUP = 5  # the default for 4 x 64 with W = 16: (64 - 16) * 5 + 16 = 256; W // G = 3, so the floor matters
REFERENCE = "self_extend_authors_reference"
HEADS, HEAD_DIM = 4, 16
SHARPEN = 8  # query and key weights x 8, so that grouping moves the logits clearly (as in tests/schemes/test_rerope.py)


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 90, (batch, length), generator=torch.Generator().manual_seed(seed))


def make(attn: str = "sdpa") -> nn.Module:
    model = make_model("llama", attn)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(SHARPEN)
    return model


def extended(attn: str = "sdpa", **options: Any) -> nn.Module:
    model = ps.extend_context(make(attn), TARGET, "self_extend", neighbor_window=WINDOW, **options)
    assert ps.describe(model).settings["scaling"]["group_size"] == GROUP
    return model


# ---- the reference (datamllab/LongLM, self_extend_patch/Llama_4_40.py) ----------------------------------------


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on one tensor, cos/sin [B, L, D] broadcast over heads."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def reference_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    scaling: float | None = None, dropout: float = 0.0, position_ids: torch.Tensor | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-Extend as in the authors' self_extend_forward, on unrotated query [1, H, q, D], key/value [1, Hkv, kv, D]
    (the cache's keys included) and the forward's position_ids [1, q]."""
    group, window = GROUP, WINDOW
    q_len, kv_len = query.shape[2], key.shape[2]
    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                                              head_dim=HEAD_DIM, rope_theta=10_000.0))
    query_position = position_ids
    key_position = position_ids if q_len != 1 else torch.arange(kv_len)[None]
    shift = 0 if query_position.max() < window else window
    group_query_position = query_position // group + shift - shift // group
    group_key_position = key_position // group
    neighbour_query = rotate(query, *rotary(value, query_position))
    neighbour_key = repeat_kv(rotate(key, *rotary(value, key_position)), HEADS // key.shape[1])
    group_query = rotate(query, *rotary(value, group_query_position))
    group_key = repeat_kv(rotate(key, *rotary(value, group_key_position)), HEADS // key.shape[1])
    value = repeat_kv(value, HEADS // value.shape[1])
    neighbour_scores = torch.matmul(neighbour_query, neighbour_key.transpose(2, 3)) / HEAD_DIM**0.5  # [1, H, q, kv]
    group_scores = torch.matmul(group_query, group_key.transpose(2, 3)) / HEAD_DIM**0.5
    if q_len == 1:
        neighbour_mask = torch.zeros(q_len, kv_len)
        neighbour_mask[:, -window:] = 1
    elif q_len == kv_len:
        neighbour_mask = torch.tril(torch.ones(q_len, kv_len))
        if q_len - window > 0:
            neighbour_mask[window:, :-window] -= torch.tril(torch.ones(q_len - window, kv_len - window))
    else:
        raise ValueError("the authors' code takes q_len == 1 or q_len == kv_len")
    scores = torch.where(neighbour_mask.bool(), neighbour_scores, group_scores)
    future = torch.ones(q_len, kv_len, dtype=torch.bool).triu(kv_len - q_len + 1)
    scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights  # [1, q, H, D]


AttentionInterface.register(REFERENCE, reference_attention)


class Unrotated(nn.Module):
    """cos = 1, sin = 0: LLaMA passes q and k to attention (and to its cache) as they are."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*position_ids.shape, HEAD_DIM)
        return torch.ones(shape, dtype=x.dtype), torch.zeros(shape, dtype=x.dtype)


def reference_model() -> nn.Module:
    model = make()
    model.model.rotary_emb = Unrotated()
    model.set_attn_implementation(REFERENCE)
    return model


@torch.no_grad()
def stepwise(model: nn.Module, prompt: torch.Tensor, continuation: torch.Tensor, mask: torch.Tensor | None = None):
    """Logits [B, 1 + n, vocab]: the prompt's last prediction, then one cached forward per continuation token."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompt, attention_mask=mask, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    for step in range(continuation.shape[1]):
        if mask is not None:
            mask = torch.cat((mask, torch.ones_like(mask[:, :1])), 1)
        out = model(input_ids=continuation[:, step:step + 1], attention_mask=mask, past_key_values=out.past_key_values,
                    use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


# ---- tests ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("length", [40, 150], ids=["below-the-original", "past-the-original"])
def test_prefill_equals_the_authors_formula(length: int, attn: str) -> None:
    """Every position of one row: 40 tokens (past the window, within the original 64: the authors group there
    too) and 150; eager also returns the authors' attention weights. Both differ from plain RoPE past the window."""
    input_ids = tokens(1, length)
    with torch.no_grad():
        ours = extended(attn)(input_ids=input_ids, output_attentions=attn == "eager")
        expected = reference_model()(input_ids=input_ids, output_attentions=attn == "eager")
        plain = make()(input_ids=input_ids).logits
    torch.testing.assert_close(ours.logits, expected.logits, **TOLERANCE)
    if attn == "eager":
        for mine, theirs in zip(ours.attentions, expected.attentions, strict=True):
            torch.testing.assert_close(mine, theirs, **TOLERANCE)
    torch.testing.assert_close(ours.logits[:, :WINDOW], plain[:, :WINDOW], **TOLERANCE)
    assert (ours.logits - plain)[:, WINDOW + GROUP:].abs().max() > 1e-2  # 1000 x the tolerance


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_cached_decode_equals_the_authors_decode_and_a_recompute(attn: str) -> None:
    """A 10-token prompt (within the window) decoded one token at a time to 80 tokens, crossing the window and the
    original length: ours with the KV cache = the authors' q_len == 1 branch = our forward over the whole row."""
    sequence = tokens(1, 80, seed=2)
    prompt, continuation = sequence[:, :10], sequence[:, 10:]
    model = extended(attn)
    cached = stepwise(model, prompt, continuation)
    expected = stepwise(reference_model(), prompt, continuation)
    with torch.no_grad():
        recomputed = model(input_ids=sequence).logits[:, 9:]
    torch.testing.assert_close(cached, expected, **TOLERANCE)
    torch.testing.assert_close(cached, recomputed, **TOLERANCE)


@pytest.mark.parametrize("explicit_positions", [False, True], ids=["mask-only", "position-ids"])
def test_left_padded_rows_equal_the_authors_formula_row_by_row(explicit_positions: bool) -> None:
    """A batch of a 100-token row and a 40-token row left-padded to 100, prefill then 6 cached steps: each row
    equals the authors' formula on the row alone (their code takes no padding), with the padding-aware positions
    found from the attention mask or passed as generate() builds them."""
    lengths, steps = (100, 40), 6
    rows = [tokens(1, n + steps, seed=4 + i)[0] for i, n in enumerate(lengths)]
    batch, mask = torch.zeros(2, lengths[0], dtype=torch.long), torch.zeros(2, lengths[0], dtype=torch.long)
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        batch[i, lengths[0] - n:], mask[i, lengths[0] - n:] = row[:n], 1
    continuation = torch.stack([row[-steps:] for row in rows])
    model = extended()
    with torch.no_grad():
        options = {"position_ids": padding_position_ids(mask)} if explicit_positions else {}
        together = model(input_ids=batch, attention_mask=mask, **options).logits
    decoded = stepwise(model, batch, continuation, mask)
    reference = reference_model()
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        with torch.no_grad():
            alone = reference(input_ids=row[None, :n]).logits[0]
        torch.testing.assert_close(together[i, lengths[0] - n:], alone, **TOLERANCE)
        torch.testing.assert_close(decoded[i], stepwise(reference, row[None, :n], row[None, n:])[0], **TOLERANCE)


def test_exact_within_original_is_the_unextended_model_below_the_original_length() -> None:
    """The option: an input within the original length runs the unextended model (bit for bit), and so do the first
    64 positions of a longer one; past it queries group as the authors do, but the earlier positions they attend
    to were computed without grouping, so the logits differ from the authors'."""
    model, plain = extended(exact_within_original=True), make()
    assert ps.describe(model).settings["scaling"]["exact_within_original"] is True
    short, long = tokens(1, MAX_POSITIONS), tokens(1, 150)
    with torch.no_grad():
        assert torch.equal(model(input_ids=short).logits, plain(input_ids=short).logits)
        ours = model(input_ids=long).logits
        unextended = plain(input_ids=long).logits
        authors = reference_model()(input_ids=long).logits
    torch.testing.assert_close(ours[:, :MAX_POSITIONS], unextended[:, :MAX_POSITIONS], **TOLERANCE)
    assert (ours - authors)[:, MAX_POSITIONS:].abs().max() > 1e-2


def test_the_option_is_validated_recorded_and_defaults_for_older_records(tmp_path) -> None:
    """A non-bool is refused naming the field; a record written before the option existed loads with the authors'
    rule; the option survives save and reload."""
    from transformers import AutoModelForCausalLM

    from hf_posswap.schemes.rope_scaling import scaling_from_dict

    with pytest.raises(ps.InvalidConfigError, match=r"SelfExtend.exact_within_original must be True or False, got 1"):
        ps.SelfExtend(exact_within_original=1)
    older = scaling_from_dict({"method": "self_extend", "factor": 4.0, "original_max_position_embeddings": 64,
                               "group_size": 5, "neighbor_window": 16})
    assert older.exact_within_original is False and tuple(older.attention_settings()) == (5, 16, 16)
    model = extended(exact_within_original=True)
    assert tuple(swap_settings(model)) == (GROUP, WINDOW, MAX_POSITIONS)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert ps.describe(loaded).settings["scaling"]["exact_within_original"] is True
    input_ids = tokens(1, 100)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=input_ids).logits, model(input_ids=input_ids).logits)


def swap_settings(model: nn.Module):
    """The two-pass settings (G, W, start) the swapped model's attention reads."""
    from hf_posswap.core.state import swap_state

    return swap_state(model).config.scaling.attention_settings()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.slow
def test_self_extend_left_padded_row_equals_the_row_alone(family: str) -> None:
    """Self-Extend groups positions as floor(pos / G): a left-padded row must group its own positions, not its
    padded token indices (grouping the indices would differ from the row run alone, in forward and in generate)."""
    model = make_model(family)
    if family == "gpt2":
        ps.swap(model, "rope")
    ps.extend_context(model, 256, "self_extend", neighbor_window=16)
    row, pad = tokens(1, 100), 5
    padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), row], 1)
    mask = torch.ones_like(padded)
    mask[:, :pad] = 0
    with torch.no_grad():
        alone = model(input_ids=row).logits
        batched = model(input_ids=padded, attention_mask=mask).logits[:, pad:]
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-4)
    greedy = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True,
              "output_scores": True}
    for use_cache in (True, False):
        out_alone = model.generate(input_ids=row, use_cache=use_cache, **greedy)
        out_padded = model.generate(input_ids=padded, attention_mask=mask, use_cache=use_cache, **greedy)
        assert torch.equal(out_padded.sequences[:, pad:], out_alone.sequences)
        torch.testing.assert_close(torch.stack(out_padded.scores), torch.stack(out_alone.scores), atol=1e-4,
                                   rtol=1e-4)


@pytest.mark.parametrize("exact_within_original", [False, True], ids=["authors", "exact-within-original"])
def test_self_extend_short_bert_row_batched_with_a_long_one_attends_as_alone(exact_within_original: bool) -> None:
    """Bidirectional Self-Extend: a row within the original length, right-padded next to a longer row, must attend
    as it does alone (grouped past the window, or, with ``exact_within_original``, not grouped: grouping follows
    the row, not the batch)."""
    model = make_model("bert")
    ps.swap(model, "rope")
    ps.extend_context(model, 256, "self_extend", neighbor_window=16, exact_within_original=exact_within_original)
    short, long = tokens(1, 40), tokens(1, 100, seed=2)
    batch = torch.cat([torch.cat([short, torch.zeros(1, 60, dtype=torch.long)], 1), long])
    mask = torch.ones_like(batch)
    mask[0, 40:] = 0
    with torch.no_grad():
        alone = model(input_ids=short).logits
        batched = model(input_ids=batch, attention_mask=mask).logits
        long_alone = model(input_ids=long).logits
    torch.testing.assert_close(batched[:1, :40], alone, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(batched[1:], long_alone, atol=2e-6, rtol=1e-5)
