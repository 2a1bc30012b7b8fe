"""Self-Extend attention in query chunks: equal to the dense implementation it replaced, on every input
form it accepts, and never holding a [B, H, q, kv] tensor unless attention weights are returned.

The reference below is the dense implementation as it was before chunking (commit 6321647), copied verbatim.
Tolerance: fp32, atol 1e-5 / rtol 1e-4 on outputs and weights (the chunked form sums the same terms, in another
order, and skips keys whose weight is exactly 0).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import MAX_POSITIONS, make_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.integrations.sdpa_attention import repeat_kv

import hf_posswap as ps
import hf_posswap.core.attention as attention
from hf_posswap.core import self_extend
from hf_posswap.core.context import PositionContext
from hf_posswap.core.self_extend import chunk_size, chunked_self_extend, self_extend_attention
from hf_posswap.schemes.rope import apply_rotary
from hf_posswap.schemes.two_pass import TwoPassSettings

TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}
GROUP, WINDOW, ORIGINAL = 3, 5, 16
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def reference_self_extend(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    context: PositionContext,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense Self-Extend attention before chunking (two [B, H, q, kv] logit tensors), verbatim."""
    group, window, original = context.two_pass
    rotary = context.positions
    query_pos, key_pos = self_extend._positions(context, query.shape[2], key.shape[2], query.device)
    query_rows = query_pos if query_pos.dim() == 2 else query_pos[None]  # [1 or B, q]
    key_rows = key_pos if key_pos.dim() == 2 else key_pos[None]  # [1 or B, kv]
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # [B, Hkv, kv, D] -> [B, H, kv, D]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5

    def logits(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        q = apply_rotary(query, *rotary(q_pos))  # type: ignore[misc]
        k = apply_rotary(key, *rotary(k_pos))  # type: ignore[misc]
        return torch.matmul(q, k.transpose(2, 3)) * scaling  # [B, H, q, kv]

    neighbour = logits(query_pos, key_pos)
    grouped = logits(query_pos // group + (window - window // group), key_pos // group)
    distance = (query_rows[:, :, None] - key_rows[:, None, :])[:, None]  # [1 or B, 1, q, kv]
    causal = bool(getattr(module, "is_causal", True))
    if causal:
        use_grouped = (distance >= window) & (query_rows >= original)[:, None, :, None]
    else:  # a row no longer than the original (a short row padded in a batch with a long one) is not grouped
        longer = (key_rows.amax(-1) >= original)[:, None, None, None]  # [1 or B, 1, 1, 1]
        use_grouped = (distance.abs() >= window) & longer
    scores = torch.where(use_grouped, grouped, neighbour)
    lowest = torch.finfo(scores.dtype).min
    if attention_mask is None:
        if causal:
            scores = scores.masked_fill(distance < 0, lowest)
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[..., : scores.shape[-1]], lowest)
    else:
        scores = (scores + attention_mask[..., : scores.shape[-1]]).clamp(min=lowest)
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()  # [B, H, q, D] -> [B, q, H, D]
    return output, weights


def attention_module(causal: bool = True, implementation: str | None = None) -> nn.Module:
    module = nn.Module()
    module.is_causal = causal
    module.num_key_value_groups = HEADS // KV_HEADS
    if implementation is not None:
        module.config = type("Config", (), {"_attn_implementation": implementation})()
    return module.eval()


def make_context(offset: int = 0, start: int = WINDOW) -> PositionContext:
    """Settings (G, W, start): start = W is Self-Extend as its authors define it, start = the original length its
    ``exact_within_original`` option."""
    spec = ps.schemes.ModelSpec(
        model_type="test", hidden_size=HEADS * HEAD_DIM, num_layers=1, num_heads=HEADS, num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, is_causal=True, max_positions=ORIGINAL, initializer_range=0.02, native_rope_theta=None,
        dtype=torch.float32, device=torch.device("cpu"),
    )
    rotary = ps.RopeConfig(rope_theta=100.0).build(spec)
    return PositionContext(rotary, "rotary", offset, lambda module: True, True, TwoPassSettings(GROUP, WINDOW, start))


def tensors(batch: int, q_len: int, kv_len: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, HEADS, q_len, HEAD_DIM, generator=generator)
    key = torch.randn(batch, KV_HEADS, kv_len, HEAD_DIM, generator=generator)
    value = torch.randn(batch, KV_HEADS, kv_len, HEAD_DIM, generator=generator)
    return query, key, value


def left_padding(lengths: list[int], total: int) -> torch.Tensor:
    """2D mask [B, total]: each row's tokens at the end."""
    return torch.stack([torch.arange(total) >= total - length for length in lengths]).long()


def bool_mask(mask_2d: torch.Tensor, causal: bool, q_len: int) -> torch.Tensor:
    """[B, 1, q, kv] bool: padding keys hidden, and future keys in a causal model (queries are the last q_len)."""
    kv_len = mask_2d.shape[-1]
    allowed = mask_2d.bool()[:, None, None, :].expand(-1, 1, q_len, -1)
    if causal:
        query_index = torch.arange(kv_len - q_len, kv_len)[:, None]
        allowed = allowed & (torch.arange(kv_len)[None, :] <= query_index)
    return allowed


def float_mask(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


def case(
    name: str, start: int = WINDOW
) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor | None, PositionContext]:
    """(module, (q, k, v), mask, context) of one input form; lengths cross the original length (16)."""
    context = make_context(start=start)
    if name in ("causal", "bidirectional"):
        return attention_module(name == "causal"), tensors(2, 40, 40), None, context
    if name in ("causal-padded-bool", "causal-padded-float", "bidirectional-padded-bool", "bidirectional-padded-float"):
        causal = name.startswith("causal")
        mask_2d = left_padding([40, 12], 40)  # a long row and a short one (bidirectional, start 16: not grouped)
        context.padded_positions = (mask_2d.cumsum(-1) - 1).clamp(min=0)
        mask = bool_mask(mask_2d, causal, 40)
        return attention_module(causal), tensors(2, 40, 40), float_mask(mask) if "float" in name else mask, context
    if name == "row-positions":  # explicit position ids (PoSE): skipped positions, different per row
        context.row_positions = torch.stack([torch.arange(36) * 2, torch.arange(36) + 5])
        return attention_module(), tensors(2, 36, 36), None, context
    if name == "decode":  # one step after 39 cached tokens
        return attention_module(), tensors(2, 1, 40), None, make_context(39, start)
    if name == "cached-chunk":  # 6 queries after 34 cached tokens
        return attention_module(), tensors(2, 6, 40), None, make_context(34, start)
    if name == "static-cache":  # a 48-slot buffer holding 30 tokens, 4 new queries: later slots are empty
        return attention_module(), tensors(1, 4, 48), None, make_context(26, start)
    if name == "decode-padded":  # a padded batch decoding: dynamic cache, the mask covers the keys
        mask_2d = left_padding([40, 25], 40)
        context = make_context(39, start)
        context.padded_positions = (mask_2d.cumsum(-1) - 1).clamp(min=0)
        return attention_module(), tensors(2, 1, 40), bool_mask(mask_2d, True, 1), context
    raise ValueError(name)


CASES = ["causal", "bidirectional", "causal-padded-bool", "causal-padded-float", "bidirectional-padded-bool",
         "bidirectional-padded-float", "row-positions", "decode", "cached-chunk", "static-cache", "decode-padded"]


@pytest.mark.parametrize("start", [WINDOW, ORIGINAL], ids=["authors", "exact-within-original"])
@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
@pytest.mark.parametrize("name", CASES)
def test_chunked_equals_the_dense_reference(name: str, chunk: int, start: int) -> None:
    module, (query, key, value), mask, context = case(name, start)
    expected, expected_weights = reference_self_extend(module, query, key, value, mask, context, scaling=0.3)
    output, weights = chunked_self_extend(module, query, key, value, mask, context, 0.3, chunk=chunk,
                                          keep_weights=True)
    torch.testing.assert_close(output, expected, **TOLERANCE)
    torch.testing.assert_close(weights, expected_weights, **TOLERANCE)
    alone, none = chunked_self_extend(module, query, key, value, mask, context, 0.3, chunk=chunk)
    assert none is None
    torch.testing.assert_close(alone, output, atol=0, rtol=0)


@pytest.mark.parametrize("start", [WINDOW, ORIGINAL], ids=["authors", "exact-within-original"])
def test_the_cases_exercise_both_logits_and_every_shortcut(start: int) -> None:
    """The shapes above are long enough that chunks group all, some and none of their keys; queries before
    ``start`` group nothing."""
    module, (query, key, value), _mask, context = case("causal", start)
    grouped = chunked_self_extend(module, query, key, value, None, context, 0.3)[0]
    context.two_pass = TwoPassSettings(1, 10_000, 10_000)  # nothing grouped
    plain = chunked_self_extend(module, query, key, value, None, context, 0.3)[0]
    assert not torch.allclose(grouped[:, start:], plain[:, start:], atol=1e-3)
    torch.testing.assert_close(grouped[:, :start], plain[:, :start], atol=0, rtol=0)


def test_dropout_draws_as_the_reference_when_one_chunk_holds_every_query() -> None:
    module, (query, key, value), mask, context = case("bidirectional")
    module.train()
    torch.manual_seed(3)
    expected, expected_weights = reference_self_extend(module, query, key, value, mask, context, dropout=0.4)
    torch.manual_seed(3)
    output, weights = chunked_self_extend(module, query, key, value, mask, context, dropout=0.4, chunk=40,
                                          keep_weights=True)
    torch.testing.assert_close(weights, expected_weights, **TOLERANCE)
    torch.testing.assert_close(output, expected, **TOLERANCE)
    assert bool((weights == 0).any())
    module.eval()
    assert torch.equal(chunked_self_extend(module, query, key, value, mask, context, dropout=0.4)[0],
                       chunked_self_extend(module, query, key, value, mask, context)[0])


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operation produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        result = func(*args, **(kwargs or {}))
        for item in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(item, torch.Tensor):
                self.largest = max(self.largest, item.numel())
        return result


@pytest.mark.parametrize("name", ["causal", "bidirectional", "causal-padded-float", "row-positions"])
def test_no_intermediate_exceeds_one_chunk_of_logits(name: str) -> None:
    """The largest tensor is one chunk's logits [B, H, chunk, kv] or the output [B, q, H, D], never
    [B, H, q, kv] (the dense reference's, measured here too, so the probe is known to see it)."""
    module, (query, key, value), mask, context = case(name)
    batch, heads, q_len, dim = query.shape
    kv_len, chunk = key.shape[2], 4
    bound = max(batch * heads * chunk * kv_len, batch * q_len * heads * dim, mask.numel() if mask is not None else 0)
    with LargestTensor() as probe:
        chunked_self_extend(module, query, key, value, mask, context, chunk=chunk)
    assert probe.largest <= bound < batch * heads * q_len * kv_len
    with LargestTensor() as dense:
        reference_self_extend(module, query, key, value, mask, context)
    assert dense.largest == batch * heads * q_len * kv_len


def test_the_sdpa_carrier_holds_one_chunk_and_returns_no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the attention function: the chunk follows CHUNK_ELEMENTS; weights only when the caller can read
    them (eager, or output_attentions=True), as before."""
    _module, (query, key, value), _mask, context = case("causal")
    batch, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    monkeypatch.setattr(self_extend, "CHUNK_ELEMENTS", batch * heads * 5 * kv_len)
    assert chunk_size(batch, heads, kv_len) == 5
    sdpa = attention_module(implementation=attention.SDPA)
    expected, expected_weights = reference_self_extend(sdpa, query, key, value, None, context)
    with LargestTensor() as probe:
        output, weights = self_extend_attention(sdpa, query, key, value, None, context)
    assert weights is None
    assert probe.largest <= max(batch * heads * 5 * kv_len, output.numel()) < batch * heads * q_len * kv_len
    torch.testing.assert_close(output, expected, **TOLERANCE)
    for module, options in ((sdpa, {"output_attentions": True}), (attention_module(implementation=attention.EAGER), {}),
                            (attention_module(), {})):
        output, weights = self_extend_attention(module, query, key, value, None, context, **options)
        torch.testing.assert_close(weights, expected_weights, **TOLERANCE)
        torch.testing.assert_close(output, expected, **TOLERANCE)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_models_equal_the_dense_reference(monkeypatch: pytest.MonkeyPatch, family: str, attn: str) -> None:
    """Whole models past the original length, one long row and a left-padded short one, tiny chunks; with the
    dense reference swapped in as the attention function for comparison. Eager returns the same weights."""
    model = make_model(family, attn)
    if family != "llama":
        ps.swap(model, "rope")
    ps.extend_context(model, 4 * MAX_POSITIONS, "self_extend", neighbor_window=16)
    length = 3 * MAX_POSITIONS
    input_ids = torch.randint(3, 90, (2, length), generator=torch.Generator().manual_seed(0))
    attention_mask = left_padding([length, length - 50], length)
    monkeypatch.setattr(self_extend, "CHUNK_ELEMENTS", 2 * 4 * 7 * length)  # 7 queries per chunk
    with torch.no_grad():
        chunked = model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=attn == "eager")
        monkeypatch.setattr(attention, "self_extend_attention", reference_self_extend)
        dense = model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=attn == "eager")
    rows = attention_mask.bool()
    torch.testing.assert_close(chunked.logits[rows], dense.logits[rows], **TOLERANCE)
    if attn == "eager":
        for ours, theirs in zip(chunked.attentions, dense.attentions, strict=True):
            torch.testing.assert_close(ours[0], theirs[0], **TOLERANCE)
