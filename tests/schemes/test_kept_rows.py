"""Decoding steps read ALiBi's and T5's bias from a row kept across steps (``hf_posswap.schemes.kept_rows``).

What could go wrong: a stale row after the slopes or the table change (an optimiser step between two generations,
a replaced parameter), a row too short for a longer cache, or a caller writing into the kept row. The reference is
the bias computed from scratch (transformers' T5 buckets for T5) and, for whole models, a forward without cache.
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, make_model, swapped
from transformers.models.t5.modeling_t5 import T5Attention

import hf_posswap as ps
from hf_posswap.schemes import fused_alibi
from hf_posswap.schemes.base import ModelSpec
from hf_posswap.schemes.kept_rows import MIN_SPAN


def _spec(num_heads: int = 4) -> ModelSpec:
    return ModelSpec(
        model_type="test", hidden_size=num_heads * 16, num_layers=1, num_heads=num_heads, num_kv_heads=num_heads,
        head_dim=16, is_causal=True, max_positions=64, initializer_range=0.02, native_rope_theta=None,
        dtype=torch.float32, device=torch.device("cpu"),
    )


def _t5_expected(module: ps.T5RelativeBias, query: int, kv_len: int) -> torch.Tensor:
    relative = torch.arange(kv_len)[None, :] - query
    buckets = T5Attention._relative_position_bucket(relative, False, module.num_buckets, module.max_distance)
    return module.tables[0].weight.t()[:, buckets].unsqueeze(0)  # [1, H, 1, kv]


def _t5_step(module: ps.T5RelativeBias, query: int) -> torch.Tensor:
    with torch.no_grad():
        return module(torch.tensor([query]), torch.arange(query + 1), 0, True, {})


@pytest.mark.parametrize("query", [0, 7, MIN_SPAN + 5, 3 * MIN_SPAN], ids=["first", "near", "grown", "grown-twice"])
def test_t5_decode_step_equals_transformers_buckets(query: int) -> None:
    module = ps.T5BiasConfig(num_buckets=16, max_distance=40).build(_spec())
    torch.nn.init.normal_(module.tables[0].weight)
    _t5_step(module, 3)  # a short row first: the longer steps must grow it
    assert torch.equal(_t5_step(module, query), _t5_expected(module, query, query + 1))


def _change(module: torch.nn.Module, name: str, how: str) -> None:
    """Change the parameter ``name`` (dotted) of ``module`` as a user or library might: in place (a plain optimiser
    step), through ``.data`` or numpy (no version bump), or by replacing it."""
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    tensor = getattr(owner, attr)
    if how == "in-place":
        with torch.no_grad():
            tensor.mul_(-2.0)
    elif how == "data":
        tensor.data.mul_(-2.0)
    elif how == "numpy":
        tensor.detach().numpy()[...] *= -2.0
    else:
        setattr(owner, attr, torch.nn.Parameter(torch.randn_like(tensor)))


CHANGES = ["in-place", "data", "numpy", "replaced"]


@pytest.mark.parametrize("change", CHANGES)
def test_t5_kept_row_follows_the_table(change: str) -> None:
    module = ps.T5BiasConfig(num_buckets=16, max_distance=40).build(_spec())
    torch.nn.init.normal_(module.tables[0].weight)
    _t5_step(module, 50)
    _change(module, "tables.0.weight", change)
    assert torch.equal(_t5_step(module, 50), _t5_expected(module, 50, 51))


def test_t5_decode_bias_is_a_copy_callers_may_write_to() -> None:
    module = ps.T5BiasConfig(num_buckets=16, max_distance=40).build(_spec())
    torch.nn.init.normal_(module.tables[0].weight)
    _t5_step(module, 20).fill_(123.0)  # the dense path merges masks into the bias in place
    assert torch.equal(_t5_step(module, 20), _t5_expected(module, 20, 21))


def _alibi_decode_bias(slopes: torch.Tensor, owner: torch.nn.Module | None, query: int, dtype: torch.dtype):
    call = fused_alibi.FusedCall(
        query=torch.zeros(1, 4, 1, 16, dtype=dtype), key=torch.zeros(1, 4, query + 1, 16, dtype=dtype),
        value=torch.zeros(1, 4, query + 1, 16, dtype=dtype), attention_mask=None, query_pos=torch.tensor([query]),
        key_pos=torch.arange(query + 1), layer_idx=0, causal=True, scaling=0.25, dropout=0.0, memo={},
    )
    plan = fused_alibi.causal_plan(call)
    with torch.no_grad():
        return fused_alibi._small_query_bias(call, slopes, plan, owner)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("query", [1, 9, MIN_SPAN + 5], ids=["first", "near", "grown"])
def test_alibi_decode_step_equals_the_computed_bias(query: int, dtype: torch.dtype) -> None:
    module = ps.AlibiConfig().build(_spec())
    kept = _alibi_decode_bias(module.slopes, module, query, dtype)
    assert torch.equal(kept, _alibi_decode_bias(module.slopes, None, query, dtype))  # None: computed, nothing kept
    assert "_kept_rows" in module.__dict__, "the decoding step did not take the kept row"


@pytest.mark.parametrize("change", CHANGES)
def test_alibi_kept_row_follows_trainable_slopes(change: str) -> None:
    module = ps.AlibiConfig(trainable_slopes=True).build(_spec())
    _alibi_decode_bias(module.slopes, module, 30, torch.float32)
    _change(module, "slopes", change)
    kept = _alibi_decode_bias(module.slopes, module, 30, torch.float32)
    assert torch.equal(kept, _alibi_decode_bias(module.slopes, None, 30, torch.float32))


@pytest.mark.parametrize("scheme", ["alibi", "t5"])
def test_generation_after_a_training_step_uses_the_new_positions(scheme: str) -> None:
    """Decode, change the position parameters as an optimiser would, decode again: every cached step equals the
    forward without cache of the same tokens (a stale kept row would give the old parameters' logits)."""
    model = swapped("gpt2", scheme)
    positions = model.base_model.posswap_positions
    parameter = positions.tables[0].weight if scheme == "t5" else positions.slopes
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    for round_ in range(2):
        with torch.no_grad():
            cache = model(input_ids=ids[:, :8], use_cache=True).past_key_values
            for step in range(8, 12):
                cached = model(input_ids=ids[:, step : step + 1], past_key_values=cache, use_cache=True).logits
                full = model(input_ids=ids[:, : step + 1]).logits[:, -1:]
                torch.testing.assert_close(cached, full, atol=2e-5, rtol=2e-5)
            parameter.mul_(1.7 if round_ == 0 else 1.0)


@pytest.mark.parametrize("scheme", ["alibi", "t5"])
def test_a_model_swapped_under_inference_mode_decodes(scheme: str) -> None:
    """Position tensors made under ``torch.inference_mode`` have no version counter: their rows are not kept, and
    cached decoding still equals the forward without cache."""
    with torch.inference_mode():
        model = swapped("gpt2", scheme)
        ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))
        cache = model(input_ids=ids[:, :8], use_cache=True).past_key_values
        for step in (8, 9):
            cached = model(input_ids=ids[:, step : step + 1], past_key_values=cache, use_cache=True).logits
            torch.testing.assert_close(cached, model(input_ids=ids[:, : step + 1]).logits[:, -1:], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("scheme", ["alibi", "t5"])
def test_generation_between_fused_adamw_steps_uses_the_new_positions(scheme: str) -> None:
    """Fused AdamW (``Trainer``'s default optimiser on recent torch) updates parameters without bumping their
    version counters: generating between training steps (an evaluation callback) must still see the new values."""
    model = swapped("gpt2", scheme)
    if scheme == "alibi":
        model = make_model("gpt2")
        ps.swap(model, ps.AlibiConfig(trainable_slopes=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        model.eval()
        with torch.no_grad():
            cache = model(input_ids=ids[:, :10], use_cache=True).past_key_values
            cached = model(input_ids=ids[:, 10:11], past_key_values=cache, use_cache=True).logits
            torch.testing.assert_close(cached, model(input_ids=ids[:, :11]).logits[:, -1:], atol=2e-5, rtol=2e-5)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_t5_rows_built_under_inference_mode_serve_a_later_step_with_gradient() -> None:
    """Rows are normal tensors even when first built under ``inference_mode``: a later one-query step with the
    table trainable saves its bucket ids for backward."""
    model = swapped("gpt2", "t5")
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        cache = model(input_ids=ids[:, :8], use_cache=True).past_key_values
        model(input_ids=ids[:, 8:9], past_key_values=cache, use_cache=True)
    cache = model(input_ids=ids[:, :8], use_cache=True).past_key_values
    model(input_ids=ids[:, 8:9], past_key_values=cache, use_cache=True).logits.sum().backward()
    assert model.base_model.posswap_positions.tables[0].weight.grad is not None


def test_t5_direct_call_without_memo_takes_any_positions() -> None:
    """Direct calls without a memo may pass 1-D positions that are not ranges: no range shortcut is taken."""
    module = ps.T5BiasConfig(num_buckets=16, max_distance=40).build(_spec())
    torch.nn.init.normal_(module.tables[0].weight)
    for query_pos, key_pos in ((torch.tensor([0, 10, 20, 30]), torch.tensor([0, 10, 20, 30])),
                               (torch.tensor([30]), torch.tensor([0, 7, 29, 30]))):
        relative = key_pos[None, :] - query_pos[:, None]
        buckets = T5Attention._relative_position_bucket(relative, False, 16, 40)
        expected = module.tables[0].weight.t()[:, buckets].unsqueeze(0)
        assert torch.equal(module(query_pos, key_pos, 0, True), expected)
