"""Two-pass attention (Self-Extend, ReRoPE) as two fused calls merged by log-sum-exp: equal to the query-chunked
path (itself checked against the authors' formulas in tests/core/test_self_extend_authors.py and
tests/schemes/test_rerope.py) on every layout it takes, on the CPU kernel and on the flex_attention form (run
uncompiled on CPU here; compiled on CUDA in the last test), and the dispatch takes it only where it is exact.
Tolerance: fp32, atol 1e-5 / rtol 1e-4 (the same sums in another order).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from conftest import MAX_POSITIONS, make_model
from test_self_extend_memory import attention_module, bool_mask, left_padding, tensors
from torch import nn
from transformers import DynamicCache

import hf_posswap as ps
from hf_posswap.core import self_extend, two_pass_fused
from hf_posswap.core.context import PositionContext
from hf_posswap.core.paths import SELF_EXTEND_CHUNKED, SELF_EXTEND_MERGED, record_paths
from hf_posswap.core.self_extend import chunked_self_extend, merged_self_extend
from hf_posswap.schemes.two_pass import TwoPassSettings

TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
SCALE = 0.3

#: (group, window, start) as the scalings' attention_settings() give them
SETTINGS = {
    "self-extend": (3, 5, 5),  # the authors' rule: from length W on
    "self-extend-exact-within-original": (3, 5, 16),  # start = the original length
    "self-extend-window-1": (2, 1, 1),
    "rerope": (math.inf, 6, 6),
    "leaky-rerope": (4.0, 6, 6),
}
#: (batch, queries, keys, cached tokens before the queries); static: a 48-slot buffer, later slots empty (masked)
LAYOUTS = {
    "prefill": (2, 40, 40, 0),
    "decode": (1, 1, 40, 39),
    "chunk-after-cache": (2, 6, 40, 34),
    "chunk-after-short-cache": (1, 9, 13, 4),  # the cache is shorter than the window: some queries are below it
    "static-cache": (1, 4, 48, 26),
}


def make_context(settings: tuple, offset: int, head_dim: int = HEAD_DIM) -> PositionContext:
    spec = ps.schemes.ModelSpec(
        model_type="test", hidden_size=HEADS * head_dim, num_layers=1, num_heads=HEADS, num_kv_heads=KV_HEADS,
        head_dim=head_dim, is_causal=True, max_positions=MAX_POSITIONS, initializer_range=0.02,
        native_rope_theta=None, dtype=torch.float32, device=torch.device("cpu"),
    )
    rotary = ps.RopeConfig(rope_theta=100.0).build(spec)
    return PositionContext(rotary, "rotary", offset, lambda module: True, True, TwoPassSettings(*settings))


def layout_case(name: str, settings: tuple, dtype: torch.dtype = torch.float32, head_dim: int = HEAD_DIM) -> tuple:
    """(q, k, v, causal bool mask or None, context) of one layout."""
    batch, q_len, kv_len, offset = LAYOUTS[name]
    query, key, value = (t.to(dtype) for t in tensors(batch, q_len, kv_len))
    if head_dim != HEAD_DIM:  # flex_attention on CUDA takes head dims of 16 and more
        query, key, value = (t.repeat_interleave(head_dim // HEAD_DIM, -1) for t in (query, key, value))
    mask = None
    if kv_len > offset + q_len:  # a static cache: keys past the last query are empty slots
        mask = bool_mask(torch.ones(batch, offset + q_len, dtype=torch.long), True, q_len)
        mask = torch.nn.functional.pad(mask, (0, kv_len - offset - q_len))
    return query, key, value, mask, make_context(settings, offset, head_dim)


def flex_uncompiled(near: tuple, far: tuple, value: torch.Tensor, layout: Any, scale: float) -> torch.Tensor:
    """The CUDA form's logic with the eager flex_attention (its CPU reference implementation)."""
    from torch.nn.attention.flex_attention import flex_attention

    return two_pass_fused.flex_two_pass(near, far, value, layout, scale, attend=flex_attention)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kernel", ["cpu", "cpu-blocks-of-3", "flex"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("settings", SETTINGS)
def test_merged_equals_chunked(monkeypatch: pytest.MonkeyPatch, settings: str, layout: str, kernel: str) -> None:
    """Every layout the merged path takes: prefill, a decoding step, chunks after a cache (longer and shorter than
    the window), a static cache's buffer; with blocks of 3 the band has several blocks and a tail."""
    query, key, value, mask, context = layout_case(layout, SETTINGS[settings])
    expected, _ = chunked_self_extend(attention_module(), query, key, value, mask, context, SCALE)
    if kernel == "cpu-blocks-of-3":
        monkeypatch.setattr(two_pass_fused, "BAND_ROWS", 3)
    if kernel == "flex":
        monkeypatch.setattr(self_extend, "fused_two_pass", flex_uncompiled)
    with torch.no_grad():
        output = merged_self_extend(query, key, value, context, SCALE)
    torch.testing.assert_close(output, expected, **TOLERANCE)


def test_the_layouts_group_some_pairs_and_not_others() -> None:
    """The cases above can fail: merged Self-Extend differs from plain RoPE attention (nothing grouped) past the
    window and equals it before."""
    query, key, value, mask, context = layout_case("prefill", SETTINGS["self-extend"])
    grouped = merged_self_extend(query, key, value, context, SCALE)
    context.two_pass = TwoPassSettings(1, 10_000, 10_000)
    plain = merged_self_extend(query, key, value, context, SCALE)
    assert (grouped - plain)[:, 5:].abs().max() > 1e-2
    torch.testing.assert_close(grouped[:, :5], plain[:, :5], atol=1e-6, rtol=0)


def test_bfloat16_is_close_to_chunked() -> None:
    query, key, value, mask, context = layout_case("prefill", SETTINGS["self-extend"], torch.bfloat16)
    expected, _ = chunked_self_extend(attention_module(), query, key, value, mask, context, SCALE)
    output = merged_self_extend(query, key, value, context, SCALE)
    assert output.dtype == torch.bfloat16
    torch.testing.assert_close(output.float(), expected.float(), atol=3e-2, rtol=3e-2)


# ---- whole models -----------------------------------------------------------------------------------------------

WINDOW = 16
METHODS = {
    "self-extend": ("self_extend", {"neighbor_window": WINDOW}),
    "self-extend-exact-within-original": ("self_extend", {"neighbor_window": WINDOW, "exact_within_original": True}),
    "rerope": ("rerope", {"window": WINDOW}),
    "leaky-rerope": ("rerope", {"window": WINDOW, "leaky_factor": 8.0}),
}


def extended(family: str, method: str, attn: str = "sdpa") -> nn.Module:
    model = make_model(family, attn)
    with torch.no_grad():  # sharper queries and keys, so that grouping moves the logits clearly
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "c_attn.weight", "query_key_value.weight")):
                parameter.mul_(4)
    if family == "gpt2":
        ps.swap(model, "rope")
    name, options = METHODS[method]
    return ps.extend_context(model, 4 * MAX_POSITIONS, name, **options)


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 90, (batch, length), generator=torch.Generator().manual_seed(seed))


def chunked_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(self_extend, "MERGED_MIN_QUERIES", dict.fromkeys(("cpu", "cuda"), 1 << 30))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_models_take_the_merged_path_and_equal_chunked(monkeypatch: pytest.MonkeyPatch, family: str,
                                                       method: str) -> None:
    """Within the window (no two-pass call), past it within the original length, and past the original length:
    LLaMA with grouped-query heads, GPT-2 swapped to RoPE, GPT-NeoX rotating a quarter of each head."""
    model = extended(family, method)
    batch = tokens(2, 150)
    with torch.no_grad():
        merged = {}
        for length in (WINDOW, 40, 150):
            with record_paths() as paths:
                merged[length] = model(input_ids=batch[:, :length]).logits
            assert set(paths) == (set() if length == WINDOW or (length == 40 and "original" in method)
                                  else {SELF_EXTEND_MERGED})
        chunked_only(monkeypatch)
        for length in (WINDOW, 40, 150):
            with record_paths() as paths:
                expected = model(input_ids=batch[:, :length]).logits
            assert SELF_EXTEND_MERGED not in paths
            torch.testing.assert_close(merged[length], expected, **TOLERANCE)


@pytest.mark.parametrize("method", ["self-extend", "leaky-rerope"])
def test_cached_prefill_and_decoding_equal_one_forward(method: str) -> None:
    """A 10-token prompt (within the window), a 90-token chunk with the cache (crossing the window and the original
    length), then 6 decoding steps: every call merged, the logits those of one forward over the whole row."""
    model = extended("llama", method)
    sequence = tokens(1, 106, seed=3)
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), record_paths() as paths:
        logits = [model(input_ids=sequence[:, :10], past_key_values=cache, use_cache=True).logits]
        logits.append(model(input_ids=sequence[:, 10:100], past_key_values=cache, use_cache=True).logits)
        for step in range(100, 106):
            logits.append(model(input_ids=sequence[:, step:step + 1], past_key_values=cache, use_cache=True).logits)
    assert paths == [SELF_EXTEND_MERGED] * 2 * 7  # 2 layers; the 10-token prompt makes no two-pass call
    with torch.no_grad():
        whole = model(input_ids=sequence).logits
    torch.testing.assert_close(torch.cat(logits, 1), whole, **TOLERANCE)


def test_a_decoding_step_past_the_original_length_is_merged_and_equals_chunked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = extended("llama", "self-extend")
    sequence = tokens(1, 151, seed=4)
    with torch.no_grad():
        steps = []
        for merged in (True, False):
            if not merged:
                chunked_only(monkeypatch)
            cache = DynamicCache(config=model.config)
            model(input_ids=sequence[:, :150], past_key_values=cache, use_cache=True)
            with record_paths() as paths:
                steps.append(model(input_ids=sequence[:, 150:], past_key_values=cache, use_cache=True).logits)
            assert set(paths) == {SELF_EXTEND_MERGED if merged else SELF_EXTEND_CHUNKED}
    torch.testing.assert_close(steps[0], steps[1], **TOLERANCE)


# ---- the chunked path where the merged one does not apply ----------------------------------------------------


def fallback_call(case: str) -> tuple[nn.Module, dict[str, Any], bool]:
    """(model, forward arguments, under no_grad) of a call the merged path declines."""
    if case == "bidirectional":
        model = make_model("bert")
        ps.swap(model, "rope")
        return ps.extend_context(model, 4 * MAX_POSITIONS, "self_extend", neighbor_window=WINDOW), {
            "input_ids": tokens(1, 100)}, True
    model = extended("llama", "self-extend", attn="eager" if case == "output-attentions" else "sdpa")
    arguments: dict[str, Any] = {"input_ids": tokens(2, 100)}
    if case == "padding":
        arguments["attention_mask"] = left_padding([100, 70], 100)
    if case == "per-row-positions":
        arguments["position_ids"] = torch.stack((torch.arange(100), torch.arange(100) * 2))
    if case == "output-attentions":
        arguments["output_attentions"] = True
    return model, arguments, case != "gradient-on-cpu"


@pytest.mark.parametrize("case", ["padding", "per-row-positions", "output-attentions", "gradient-on-cpu",
                                  "bidirectional"])
def test_other_calls_stay_chunked(case: str) -> None:
    model, arguments, no_grad = fallback_call(case)
    with torch.set_grad_enabled(not no_grad), record_paths() as paths:
        model(**arguments)
    assert set(paths) == {SELF_EXTEND_CHUNKED}


def test_a_float_mask_or_one_hiding_more_than_the_future_stays_chunked() -> None:
    """The dispatch reads the mask: only None or the exact causal pattern of the positions is plain."""
    query, key, value, _, context = layout_case("prefill", SETTINGS["self-extend"])
    sdpa = attention_module(implementation="posswap_sdpa")
    causal = bool_mask(torch.ones(2, 40, dtype=torch.long), True, 40)
    hidden = causal.clone()
    hidden[1, :, :, 0] = False  # a padding-like hole
    for mask, path in ((None, SELF_EXTEND_MERGED), (causal, SELF_EXTEND_MERGED), (hidden, SELF_EXTEND_CHUNKED),
                       (torch.zeros(causal.shape).masked_fill(~causal, -1e30), SELF_EXTEND_CHUNKED)):
        with torch.no_grad(), record_paths() as paths:
            output, weights = self_extend.self_extend_attention(sdpa, query, key, value, mask, context, SCALE)
        assert paths == [path] and weights is None
        expected, _ = chunked_self_extend(sdpa, query, key, value, mask, context, SCALE)
        torch.testing.assert_close(output, expected, **TOLERANCE)


# ---- CUDA: the compiled flex_attention form ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("settings", ["self-extend", "self-extend-exact-within-original", "leaky-rerope"])
def test_cuda_flex_equals_chunked_forward_and_backward(settings: str, layout: str) -> None:
    """Prefill layouts through the dispatch; a decoding step (chunked there by default) called directly."""
    query, key, value, mask, context = layout_case(layout, SETTINGS[settings], torch.float64, head_dim=16)
    device = torch.device("cuda")
    inputs = [t.to(device, torch.float32).requires_grad_() for t in (query, key, value)]
    context.positions = context.positions.to(device)
    mask = mask.to(device) if mask is not None else None
    expected, _ = chunked_self_extend(attention_module(), *inputs, mask, context, SCALE)
    expected_grads = torch.autograd.grad(expected.square().sum(), inputs)
    if layout == "decode":
        output = merged_self_extend(*inputs, context, SCALE)
    else:
        with record_paths() as paths:
            output, _ = self_extend.self_extend_attention(
                attention_module(implementation="posswap_sdpa"), *inputs, mask, context, SCALE)
        assert paths == [SELF_EXTEND_MERGED]
    grads = torch.autograd.grad(output.square().sum(), inputs)
    torch.testing.assert_close(output, expected, atol=1e-4, rtol=1e-3)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, atol=1e-3, rtol=1e-3)
