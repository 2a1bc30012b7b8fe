"""Whole models through ``flex_attention`` (``hf_posswap.core.flex_bias``) equal the dense path, and the calls flex
declines keep the paths they ran before.

On CPU the uncompiled flex runs (forward only, exact; it evaluates the mask function everywhere and ignores the
block structure), with ``FLEX_DEVICES`` patched to include ``"cpu"``. The reference is the eager carrier (always
the dense bias). Each swapped model checks a left-padded batch, Gemma 3's sliding-window layers, chunked prefill
after a cache, explicit position ids, bf16 and autocast; the declined calls are decode steps and short chunks,
devices outside ``FLEX_DEVICES``, CPU calls that need a gradient, the eager carrier, float masks and float64.
"""

from __future__ import annotations

import flex_cases
import pytest
import torch
from flex_cases import ATOL, FAMILIES, LENGTH, RTOL, SCHEMES, build, dense, matrix, run, tokens
from transformers import DynamicCache

from hf_posswap.core import flex_bias
from hf_posswap.core.paths import DENSE, FLEX, record_paths

flex_on_cpu = flex_cases.flex_on_cpu  # the shared fixture (assigned: ruff reads an imported one as unused)


# ---------------------------------------------------------------------------------------------------------------
# Whole models: flex = dense.


FAST_MODELS = {"llama-kerple-power", "llama-head-mix", "llama-layer-mix", "gpt2-sandwich", "bert-t5", "bert-fire"}


@pytest.mark.parametrize(("family", "scheme"), matrix(FAMILIES, list(SCHEMES), FAST_MODELS))
def test_flex_equals_dense(family: str, scheme: str, flex_on_cpu: None) -> None:
    model = build(family, scheme)
    input_ids = tokens(2, LENGTH)
    logits, paths = run(model, input_ids=input_ids)
    assert paths == {FLEX}
    torch.testing.assert_close(logits, dense(model, input_ids=input_ids), atol=ATOL, rtol=RTOL)


PADDED = matrix(FAMILIES, ["t5", "kerple-power", "fire", "head-mix"], {"llama-t5", "bert-fire"})


@pytest.mark.parametrize(("family", "scheme"), PADDED)
def test_left_padded_batch(family: str, scheme: str, flex_on_cpu: None) -> None:
    """A bool padding mask from transformers: the mask function reads it, and the padded row equals the row alone.
    Padded query rows are not compared (flex gives fully masked rows 0, the dense path a uniform average)."""
    model = build(family, scheme)
    input_ids = tokens(2, LENGTH)
    mask = torch.ones_like(input_ids)
    mask[1, :7] = 0
    logits, paths = run(model, input_ids=input_ids, attention_mask=mask)
    assert paths == {FLEX}
    real = mask.bool()
    torch.testing.assert_close(logits[real], dense(model, input_ids=input_ids, attention_mask=mask)[real],
                               atol=ATOL, rtol=RTOL)
    alone, _ = run(model, input_ids=input_ids[1:, 7:])  # the padded row's real tokens, unpadded (FIRE reads i)
    torch.testing.assert_close(logits[1, 7:], alone[0], atol=ATOL, rtol=RTOL)


def test_sliding_window_layers_read_transformers_mask(flex_on_cpu: None) -> None:
    """Gemma 3's local layer (window 16) gets a sliding bool mask, its global layer a causal one."""
    model = build("gemma3_text", "kerple-log")
    input_ids = tokens(2, LENGTH)
    logits, paths = run(model, input_ids=input_ids)
    assert paths == {FLEX}
    torch.testing.assert_close(logits, dense(model, input_ids=input_ids), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("scheme", ["fire", *(pytest.param(name, marks=pytest.mark.slow)
                                             for name in ("alibi", "t5", "sandwich"))])
def test_chunked_prefill_after_a_cache(scheme: str, flex_on_cpu: None) -> None:
    """Two chunks of 20 after a DynamicCache (the second sees 40 keys, its queries start at 20) = one pass of 40."""
    model = build("llama", scheme)
    input_ids = tokens(2, LENGTH)
    cache = DynamicCache()
    first, first_paths = run(model, input_ids=input_ids[:, :20], past_key_values=cache)
    second, second_paths = run(model, input_ids=input_ids[:, 20:], past_key_values=cache)
    assert first_paths == second_paths == {FLEX}
    whole = dense(model, input_ids=input_ids)
    torch.testing.assert_close(torch.cat((first, second), dim=1), whole, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("family", "scheme"), matrix(["llama", "bert"], ["alibi", "t5", "fire"],
                                                     {"llama-t5", "bert-alibi"}))
def test_explicit_position_ids(family: str, scheme: str, flex_on_cpu: None) -> None:
    """Per-row position ids with a gap (position skipping, PoSE): the score and mask functions gather by row."""
    model = build(family, scheme)
    input_ids = tokens(2, LENGTH)
    position_ids = torch.cat((torch.arange(20), torch.arange(50, 70)))[None].expand(2, -1)
    position_ids = position_ids + torch.tensor([[0], [5]])  # two rows, two offsets
    logits, paths = run(model, input_ids=input_ids, position_ids=position_ids)
    assert paths == {FLEX}
    torch.testing.assert_close(logits, dense(model, input_ids=input_ids, position_ids=position_ids),
                               atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("scheme", ["alibi", "fire"])
def test_restarting_position_ids_keep_causality_by_token_order(scheme: str, flex_on_cpu: None) -> None:
    """Ids that restart (two sequences packed in a row, no mask between them): the block mask follows token order,
    as the dense path does; built from the positions, a query saw the later tokens whose ids are smaller."""
    model = build("llama", scheme)
    input_ids = tokens(1, LENGTH)
    position_ids = torch.cat((torch.arange(17), torch.arange(LENGTH - 17)))[None]
    logits, paths = run(model, input_ids=input_ids, position_ids=position_ids)
    assert paths == {FLEX}
    torch.testing.assert_close(logits, dense(model, input_ids=input_ids, position_ids=position_ids),
                               atol=ATOL, rtol=RTOL)
    changed = input_ids.clone()
    changed[:, 17:] = tokens(1, LENGTH - 17, seed=5)
    earlier, _ = run(model, input_ids=changed, position_ids=position_ids)
    torch.testing.assert_close(earlier[:, :17], logits[:, :17], atol=0, rtol=0)


def test_shifted_rows_prefilling_a_static_cache_keep_causality(flex_on_cpu: None) -> None:
    """FIRE's per-row positions (ids shifted by 3) prefilling a static cache without a mask (transformers then
    gives none): the keys are the whole buffer, so causality must come from the cache offset, not from the keys
    ending at the last query (that let every query see 44 slots ahead: 0.54 off the dense path)."""
    from transformers import StaticCache

    model = build("llama", "fire")
    input_ids = tokens(2, 20)
    position_ids = (torch.arange(20) + 3)[None]

    def prefill(ids: torch.Tensor, attn: str = "posswap_sdpa") -> tuple[torch.Tensor, set[str]]:
        cache = StaticCache(config=model.config, max_cache_len=64)
        return run(model, attn, input_ids=ids, past_key_values=cache, position_ids=position_ids)

    logits, paths = prefill(input_ids)
    assert paths == {FLEX}
    torch.testing.assert_close(logits, prefill(input_ids, "posswap_eager")[0], atol=ATOL, rtol=RTOL)
    changed = input_ids.clone()
    changed[:, 10:] = tokens(2, 10, seed=5)
    torch.testing.assert_close(prefill(changed)[0][:, :10], logits[:, :10], atol=0, rtol=0)


@pytest.mark.parametrize(("family", "scheme"), matrix(["llama", "bert"], ["alibi", "fire"], {"llama-fire"}))
def test_bfloat16_forward(family: str, scheme: str, flex_on_cpu: None) -> None:
    """A bf16 model through flex against the fp32 dense path: within what the dense path itself loses in bf16."""
    model = build(family, scheme)
    input_ids = tokens(2, LENGTH)
    reference = dense(model, input_ids=input_ids)
    dense_error = (dense(model.to(torch.bfloat16), input_ids=input_ids).float() - reference).abs().max()
    logits, paths = run(model, input_ids=input_ids)
    assert paths == {FLEX} and logits.dtype == torch.bfloat16
    error = (logits.float() - reference).abs().max()
    assert error <= 2 * dense_error + 1e-2, (float(error), float(dense_error))


def test_autocast_casts_to_one_dtype(flex_on_cpu: None) -> None:
    model = build("llama", "kerple-log")
    input_ids = tokens(2, LENGTH)
    reference = dense(model, input_ids=input_ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, paths = run(model, input_ids=input_ids)
    assert paths == {FLEX}
    assert (logits.float() - reference).abs().max() < 0.1


# ---------------------------------------------------------------------------------------------------------------
# Calls flex declines run the paths they ran before.


def test_decode_steps_and_short_chunks_keep_the_dense_bias(flex_on_cpu: None) -> None:
    model = build("llama", "kerple-log")
    input_ids = tokens(1, LENGTH)
    cache = DynamicCache()
    _, prefill = run(model, input_ids=input_ids[:, :30], past_key_values=cache)
    _, chunk = run(model, input_ids=input_ids[:, 30:30 + flex_bias.FLEX_MIN_QUERIES - 1], past_key_values=cache)
    assert prefill == {FLEX} and chunk == {DENSE}


def test_devices_outside_flex_devices_keep_their_paths() -> None:
    assert "cpu" not in flex_bias.FLEX_DEVICES
    for scheme, path in (("alibi", "fused-alibi"), ("kerple-log", DENSE)):
        _, paths = run(build("llama", scheme), input_ids=tokens(1, LENGTH))
        assert paths == {path}


def test_cpu_calls_that_need_a_gradient_keep_their_paths(flex_on_cpu: None) -> None:
    model = build("llama", "fire")
    with record_paths() as paths:
        model(input_ids=tokens(1, LENGTH)).logits.sum().backward()
    assert set(paths) == {DENSE}
    assert model.base_model.posswap_positions.functions[0].c.grad is not None


def test_eager_attention_keeps_the_dense_path(flex_on_cpu: None) -> None:
    _, paths = run(build("gpt2", "t5"), "posswap_eager", input_ids=tokens(1, LENGTH))
    assert paths == {DENSE}


@torch.no_grad()
def test_float_masks_and_float64_are_declined(flex_on_cpu: None) -> None:
    query, key = torch.randn(1, 4, 20, 8), torch.randn(1, 2, 20, 8)
    assert flex_bias.flex_applies(query, key, key, None, 0.0)
    assert not flex_bias.flex_applies(query, key, key, torch.zeros(1, 1, 20, 20), 0.0)
    assert not flex_bias.flex_applies(query, key, key, None, 0.1)
    assert not flex_bias.flex_applies(query.double(), key.double(), key.double(), None, 0.0)
    assert not flex_bias.flex_applies(query[:, :, :15], key, key, None, 0.0)
