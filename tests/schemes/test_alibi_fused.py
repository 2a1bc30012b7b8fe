"""ALiBi without the dense bias (``hf_posswap.schemes.fused_alibi``): the fused forms equal the dense path.

The reference is the project's dense path: ``AlibiBias.forward`` builds the bias, ``merge_bias_and_mask`` adds
causality or transformers' mask, then softmax(q.k s + bias) v in the call's dtype; whole models compare the sdpa
carrier with the eager one (always dense). Tolerances: float64 1e-10;
float32 2e-5 on these tiny shapes; at 2,048 / 8,192 tokens ``FP32_TOLERANCE`` (the separable form adds m (j - c) to
the logits in the working dtype, see the module docstring).
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_model

import hf_posswap as ps
from hf_posswap.core.attention import merge_bias_and_mask
from hf_posswap.schemes import denormals, fused_alibi
from hf_posswap.schemes.alibi import AlibiBias, alibi_slopes
from hf_posswap.schemes.base import FusedCall

TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}


def make_call(
    q_len: int,
    kv_len: int,
    *,
    heads: int = 4,
    kv_heads: int = 2,
    batch: int = 2,
    dim: int = 16,
    causal: bool = True,
    dtype: torch.dtype = torch.float32,
    query_pos: torch.Tensor | None = None,
    key_pos: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    seed: int = 0,
) -> FusedCall:
    """Random q [B, H, q, D], k/v [B, Hkv, kv, D]; positions default to a cache of kv - q tokens before the queries."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    if query_pos is None:
        query_pos = torch.arange(kv_len - q_len, kv_len)
    if key_pos is None:
        key_pos = torch.arange(kv_len)
    return FusedCall(
        query=randn(batch, heads, q_len, dim),
        key=randn(batch, kv_heads, kv_len, dim),
        value=randn(batch, kv_heads, kv_len, dim),
        attention_mask=mask,
        query_pos=query_pos,
        key_pos=key_pos,
        layer_idx=0,
        causal=causal,
        scaling=dim**-0.5,
        dropout=0.0,
        memo={},
    )


def dense(call: FusedCall, slopes: torch.Tensor) -> torch.Tensor:
    """The dense path: ``AlibiBias.forward``'s bias merged by ``merge_bias_and_mask`` (as ``scheme_inputs`` does),
    then softmax(q.k s + bias) v in the call's dtype (eager attention's softmax runs in float32, too coarse to check
    float64 with): output [B, q, H, D]."""
    bias = AlibiBias(slopes, trainable=False)
    bias.slopes = slopes  # keep the caller's tensor (it may require grad)
    full = bias(call.query_pos, call.key_pos, 0, call.causal)
    allowed = None
    if call.causal and call.attention_mask is None:
        allowed = call.key_pos[..., None, :] <= call.query_pos[..., :, None]
        allowed = allowed[:, None] if allowed.dim() == 3 else allowed
    merged = merge_bias_and_mask(full, call.attention_mask, allowed, call.query.dtype)
    groups = call.query.shape[1] // call.key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in (call.key, call.value))
    weights = torch.softmax(call.query @ key.transpose(2, 3) * call.scaling + merged, dim=-1)
    return (weights @ value).transpose(1, 2)


def fused(call: FusedCall, slopes: torch.Tensor) -> torch.Tensor:
    output = fused_alibi.alibi_attention(call, slopes)
    assert output is not None, "the fused path declined a call it should handle"
    return output


def assert_fused_equals_dense(call: FusedCall, heads: int = 4) -> None:
    slopes = alibi_slopes(heads).to(call.query.dtype)
    tolerance = TOLERANCE[call.query.dtype]
    torch.testing.assert_close(fused(call, slopes), dense(call, slopes), atol=tolerance, rtol=tolerance)


# --- causal: every layout the carrier hands over ------------------------------------------------------------------

CAUSAL_LAYOUTS = {
    "prefill": {"q_len": 24, "kv_len": 24},
    "decode": {"q_len": 1, "kv_len": 30},
    "small chunk after a cache": {"q_len": 5, "kv_len": 30},
    "long chunk after a cache": {"q_len": 20, "kv_len": 50},
    "static-cache prefill (buffer longer than the input)": {"q_len": 24, "kv_len": 40, "query_pos": torch.arange(24),
                                                           "key_pos": torch.arange(40)},
}


@pytest.mark.parametrize("layout", list(CAUSAL_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_causal_fused_equals_dense(layout: str, dtype: torch.dtype) -> None:
    assert_fused_equals_dense(make_call(dtype=dtype, **CAUSAL_LAYOUTS[layout]))


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
def test_causal_grouped_heads(heads: int, kv_heads: int) -> None:
    for q_len, kv_len in [(24, 24), (1, 24)]:
        assert_fused_equals_dense(make_call(q_len, kv_len, heads=heads, kv_heads=kv_heads), heads)


def test_causal_per_row_positions() -> None:
    """PoSE: explicit increasing positions with gaps, different per row (the centre is per row)."""
    positions = torch.stack([torch.arange(24) * 3 + 5, torch.cat([torch.arange(12), torch.arange(12) + 400])])
    for dtype in (torch.float32, torch.float64):
        assert_fused_equals_dense(make_call(24, 24, dtype=dtype, query_pos=positions, key_pos=positions))


def test_causal_padding_mask() -> None:
    """transformers' boolean mask (left padding + causality) decides which keys a query sees, as in the dense path."""
    allowed = torch.ones(2, 1, 24, 24, dtype=torch.bool).tril()
    allowed[1, :, :, :7] = False
    allowed[1, :, torch.arange(7), torch.arange(7)] = True  # padded queries see themselves (no empty rows)
    assert_fused_equals_dense(make_call(24, 24, mask=allowed))
    assert_fused_equals_dense(make_call(1, 24, mask=allowed[:, :, -1:]))


def test_trainable_slopes_get_the_dense_gradients() -> None:
    for q_len, kv_len in [(24, 24), (20, 50), (1, 30)]:
        call = make_call(q_len, kv_len, dtype=torch.float64)
        grads = []
        for path in (fused, dense):
            slopes = alibi_slopes(4).double().requires_grad_()
            inputs = [t.detach().requires_grad_() for t in (call.query, call.key, call.value)]
            call.query, call.key, call.value = inputs
            weights = torch.randn(call.query.shape[0], q_len, 4, 16, generator=torch.Generator().manual_seed(3))
            (path(call, slopes) * weights.double()).sum().backward()
            grads.append([slopes.grad] + [t.grad for t in inputs])
        for got, want in zip(*grads, strict=True):
            torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_dropout_reaches_the_kernel(causal: bool) -> None:
    """Dropout draws differ from the dense path's, so: the output changes with dropout on, and p = 1 drops all."""
    call = make_call(24, 24, causal=causal, kv_heads=2 if causal else 4)
    slopes = alibi_slopes(4)
    plain = fused(call, slopes)
    call.dropout = 0.5
    assert not torch.allclose(fused(call, slopes), plain)
    call.dropout = 1.0
    assert fused(call, slopes).abs().max() == 0


def test_declined_calls_return_none() -> None:
    """Positions that fall (index order is not position order), and float16 offsets past its range (half precision
    itself runs fused on CPU: tests/schemes/test_fused_bf16.py)."""
    slopes = alibi_slopes(4)
    backwards = torch.arange(24).flip(0).expand(2, -1)
    assert fused_alibi.alibi_attention(make_call(24, 24, query_pos=backwards, key_pos=backwards), slopes) is None
    far = torch.arange(24) + fused_alibi.HALF_OFFSET_LIMIT
    call = make_call(24, 24, dtype=torch.float16, query_pos=far, key_pos=torch.arange(24))
    assert fused_alibi.alibi_attention(call, slopes) is None
    call.query_pos = torch.arange(24)
    assert fused_alibi.alibi_attention(call, slopes) is not None


# --- bidirectional -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("q_len", "kv_len"), [(24, 24), (7, 24), (24, 9)])
def test_bidirectional_toeplitz_equals_dense(dtype: torch.dtype, q_len: int, kv_len: int) -> None:
    call = make_call(q_len, kv_len, causal=False, heads=4, kv_heads=4, dtype=dtype,
                     query_pos=torch.arange(q_len) + 3, key_pos=torch.arange(kv_len))
    assert_fused_equals_dense(call)


def test_bidirectional_encoder_position_ids() -> None:
    """BERT passes position ids for every row: the same consecutive run qualifies for the Toeplitz form; positions
    with gaps (PoSE) on a small input go to the dense path."""
    consecutive = torch.arange(24).expand(2, -1) + 2
    assert_fused_equals_dense(make_call(24, 24, causal=False, kv_heads=4, query_pos=consecutive, key_pos=consecutive))
    gaps = torch.arange(24).expand(2, -1) * 2
    call = make_call(24, 24, causal=False, kv_heads=4, query_pos=gaps, key_pos=gaps)
    assert fused_alibi.alibi_attention(call, alibi_slopes(4)) is None


def test_bidirectional_padding_mask_uses_blocks_when_large(monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = torch.ones(2, 1, 24, 24, dtype=torch.bool)
    allowed[1, :, :, :5] = False
    call = make_call(24, 24, causal=False, kv_heads=4, mask=allowed)
    assert fused_alibi.alibi_attention(call, alibi_slopes(4)) is None  # small: the dense path (shared by layers)
    monkeypatch.setattr(fused_alibi, "DENSE_BIAS_ELEMENTS", 0)
    monkeypatch.setattr(fused_alibi, "BIAS_BLOCK_ELEMENTS", 2 * 4 * 24 * 5)  # blocks of 5 queries
    assert_fused_equals_dense(call)
    float_mask = torch.zeros(2, 1, 24, 24).masked_fill(~allowed, torch.finfo(torch.float32).min)
    assert_fused_equals_dense(make_call(24, 24, causal=False, kv_heads=4, mask=float_mask))


# --- long inputs: the stated float32 tolerance ----------------------------------------------------------------------


@pytest.mark.parametrize("length", [2048, pytest.param(8192, marks=pytest.mark.slow)])
def test_float32_error_at_long_lengths_is_within_the_stated_tolerance(length: int) -> None:
    """8 heads of 64 (slopes 1/2 ... 1/256), 2 kv heads; the float64 dense reference on the first and last 128
    queries (the rows farthest from the reference position, where the error is largest)."""
    call = make_call(length, length, heads=8, kv_heads=2, batch=1, dim=64)
    slopes = alibi_slopes(8)
    output = fused(call, slopes)
    rows = torch.cat([torch.arange(128), torch.arange(length - 128, length)])
    reference = make_call(length, length, heads=8, kv_heads=2, batch=1, dim=64, dtype=torch.float64)
    reference.query, reference.query_pos = reference.query[:, :, rows], rows
    expected = dense(reference, slopes.double())
    error = (output[:, rows].double() - expected).abs().max().item()
    assert error <= fused_alibi.FP32_TOLERANCE[length], error


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_long_prefill_blocks_equal_dense(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The query-block form of a long prefill (here: blocks of 8 of 24 queries), with index and per-row positions,
    and the slopes' gradient through it."""
    monkeypatch.setattr(fused_alibi, "PRECISE_BLOCK", 8)
    monkeypatch.setattr(fused_alibi, "PRECISE_SPAN", 0.0)
    spy = []
    original = fused_alibi._blocked_separable
    monkeypatch.setattr(fused_alibi, "_blocked_separable", lambda *args: spy.append(1) or original(*args))
    assert_fused_equals_dense(make_call(24, 24, dtype=dtype))
    rows = torch.stack([torch.arange(24) * 2, torch.arange(24) + 100])
    assert_fused_equals_dense(make_call(24, 24, dtype=dtype, query_pos=rows, key_pos=rows))
    assert len(spy) == 2


def test_long_prefill_blocks_bound_the_float32_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 256 queries at 2,048 tokens: each block's reference position is near its queries, so the error is
    several times below the one-call form's (measured 2.2e-5 -> ~3e-6)."""
    call = make_call(2048, 2048, heads=8, kv_heads=2, batch=1, dim=64)
    rows = torch.cat([torch.arange(128), torch.arange(2048 - 128, 2048)])  # the largest errors (module docstring)
    reference = make_call(2048, 2048, heads=8, kv_heads=2, batch=1, dim=64, dtype=torch.float64)
    reference.query, reference.query_pos = reference.query[:, :, rows], rows
    expected = dense(reference, alibi_slopes(8).double())
    one_call = (fused(call, alibi_slopes(8))[:, rows].double() - expected).abs().max().item()
    monkeypatch.setattr(fused_alibi, "PRECISE_BLOCK", 256)
    monkeypatch.setattr(fused_alibi, "PRECISE_SPAN", 0.0)
    blocked = (fused(call, alibi_slopes(8))[:, rows].double() - expected).abs().max().item()
    assert blocked < one_call / 3, (blocked, one_call)


# --- denormals: flushed around the kernel, and the thread's setting restored ----------------------------------------


@pytest.mark.parametrize("before", [False, True])
@pytest.mark.parametrize(("q_len", "kv_len", "causal"), [(24, 24, True), (1, 24, True), (24, 24, False)])
def test_denormal_setting_is_restored_after_forward_and_backward(before: bool, q_len, kv_len, causal) -> None:
    """Separable, decoding and Toeplitz forms; trainable slopes with frozen q, k, v (the slopes' bias is then the
    kernel's only input with a gradient) and with q trainable too."""
    torch.set_flush_denormal(before)
    try:
        for train_query in (False, True):
            call = make_call(q_len, kv_len, causal=causal, kv_heads=2 if causal else 4)
            call.query.requires_grad_(train_query)
            slopes = alibi_slopes(4).requires_grad_()
            output = fused(call, slopes)
            assert denormals._flushing_now() is before
            output.sum().backward()
            assert denormals._flushing_now() is before
            assert slopes.grad is not None and (call.query.grad is not None) is train_query
    finally:
        torch.set_flush_denormal(False)


# --- whole models: the fused path runs on the test matrix's tiny shapes -------------------------------------------


def no_dense_bias(*args, **kwargs):
    raise AssertionError("the dense ALiBi bias was built")


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_models_run_the_fused_path_and_match_eager(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sdpa carrier never builds the dense bias (forward, and cached generation for causal models), and its
    logits equal the eager carrier's (which always takes the dense path)."""
    sdpa_model, eager_model = make_model(family, "sdpa"), make_model(family, "eager")
    ps.swap(sdpa_model, "alibi")
    ps.swap(eager_model, "alibi")
    input_ids = torch.randint(3, 90, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = eager_model(input_ids=input_ids).logits
        monkeypatch.setattr(AlibiBias, "forward", no_dense_bias)
        torch.testing.assert_close(sdpa_model(input_ids=input_ids).logits, expected, atol=1e-5, rtol=1e-4)
        if family != "bert":
            sdpa_model.generate(input_ids[:1, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)


def test_trainable_slopes_in_a_model_get_the_eager_gradients() -> None:
    grads = []
    for attn in ("sdpa", "eager"):
        model = make_model("llama", attn).double()
        ps.swap(model, "alibi", trainable_slopes=True)
        input_ids = torch.randint(3, 90, (2, 20), generator=torch.Generator().manual_seed(1))
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        grads.append(model.base_model.posswap_positions.slopes.grad)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-8, rtol=1e-5)  # eager: float32 softmax
