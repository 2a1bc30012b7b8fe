"""T5 bias without the dense bias: the fused far-parts + near-band attention equals the dense path, in
output and in every gradient (q, k, v and the tables), wherever it runs; calls it cannot take fall back to the dense
path. Small num_buckets / max_distance put the saturation distance within a few tokens, so tiny shapes cross it."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, make_model, swapped

import hf_posswap as ps
from hf_posswap.core.paths import FUSED_ALIBI, FUSED_T5, record_paths
from hf_posswap.schemes import fused_t5
from hf_posswap.schemes import t5 as t5_module
from hf_posswap.schemes.base import FusedCall
from hf_posswap.schemes.fused_t5 import fused_t5_attention
from hf_posswap.schemes.fused_t5_plan import saturation_distance
from hf_posswap.schemes.t5 import T5RelativeBias, relative_position_bucket

# fp32: the fused path sums in another order than the dense softmax; gradients of the tables sum over every entry
ATOL, RTOL = 2e-5, 1e-4


def buckets(causal: bool, num_buckets: int, max_distance: int):
    def bucket_of(relative: torch.Tensor) -> torch.Tensor:
        return relative_position_bucket(relative, not causal, num_buckets, max_distance)

    return bucket_of


def test_saturation_distance_is_the_first_distance_of_the_last_bucket() -> None:
    bucket_of = buckets(True, 32, 128)
    distance = saturation_distance(bucket_of, 128, -1)
    assert distance == 113  # T5's defaults, causal (the distance past which every query shares one bucket)
    far = bucket_of(-torch.arange(distance, 2000))
    assert bool((far == 31).all()) and int(bucket_of(torch.tensor(-(distance - 1)))) != 31
    both = buckets(False, 32, 128)
    before, after = saturation_distance(both, 128, -1), saturation_distance(both, 128, 1)
    assert int(both(torch.tensor(-before))) == 15 and int(both(torch.tensor(after))) == 31
    assert int(both(torch.tensor(-(before - 1)))) != 15 and int(both(torch.tensor(after - 1))) != 31


def dense_attention(module, query, key, value, query_pos, key_pos, causal, scale, layer):
    """The reference: the scheme's dense bias [1, H, q, kv] added to the logits, causality by position."""
    bias = module(query_pos, key_pos, layer, causal)[0].to(query.dtype)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2) * scale + bias
    if causal:
        scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2)


# (batch, heads, kv heads, q_len, kv_len, query offset, causal)
CASES = {
    "prefill-shorter-than-saturation": (2, 4, 2, 9, 9, 0, True),
    "prefill-longer": (2, 4, 2, 40, 40, 0, True),
    "prefill-mha": (1, 4, 4, 33, 33, 0, True),
    "decode": (2, 4, 2, 1, 30, 29, True),
    "decode-near-only": (1, 4, 2, 1, 6, 5, True),
    "chunk-after-cache": (1, 4, 2, 7, 45, 38, True),
    "static-prefill": (1, 4, 2, 30, 48, 0, True),  # a static cache hands the whole buffer
    "static-chunk": (1, 4, 2, 10, 48, 20, True),
    "bidirectional": (2, 4, 4, 40, 40, 0, False),
    "bidirectional-short": (1, 4, 4, 7, 7, 0, False),
    "bidirectional-gqa": (1, 4, 2, 29, 29, 0, False),
}


def fused_and_dense(case, dtype=torch.float32, shared=True, num_buckets=8, max_distance=16):
    """(fused, dense) results for one case: [output, dq, dk, dv, dtable]."""
    batch, heads, kv_heads, q_len, kv_len, offset, causal = case
    torch.manual_seed(0)
    module = T5RelativeBias(heads, 2, num_buckets, max_distance, shared).to(dtype)
    for table in module.tables:
        torch.nn.init.normal_(table.weight, std=2.0)
    layer = 0 if shared else 1
    query = torch.randn(batch, heads, q_len, 8, dtype=dtype, requires_grad=True)
    key = torch.randn(batch, kv_heads, kv_len, 8, dtype=dtype, requires_grad=True)
    value = torch.randn(batch, kv_heads, kv_len, 8, dtype=dtype, requires_grad=True)
    query_pos = torch.arange(q_len) + offset
    key_pos = torch.arange(kv_len) + max(offset + q_len - kv_len, 0)
    call = FusedCall(query, key, value, None, query_pos, key_pos, layer, causal, 8**-0.5, 0.0, {})
    if q_len > 1:
        fused = module.fused_attention(call)
        assert fused is not None, "the fused path declined a call it handles"
    else:  # a decoding step takes the dense path in models (one bias row): the fused kernel still handles it
        assert module.fused_attention(call) is None
        plan = module._fused_plan(call)
        weight = module.tables[layer].weight.to(torch.float32).t().to(dtype)
        fused = fused_t5_attention(query, key, value, weight, plan).transpose(1, 2)
    dense = dense_attention(module, query, key, value, query_pos, key_pos, causal, 8**-0.5, layer)
    grad = torch.randn_like(dense)
    inputs = [query, key, value, module.tables[layer].weight]
    return (
        [fused, *torch.autograd.grad(fused, inputs, grad)],
        [dense, *torch.autograd.grad(dense, inputs, grad)],
    )


def assert_all_close(got, want, atol=ATOL, rtol=RTOL) -> None:
    for name, a, b in zip(["output", "dq", "dk", "dv", "dtable"][: len(got)], got, want, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fused_equals_dense(case: str) -> None:
    assert_all_close(*fused_and_dense(CASES[case]))


@pytest.mark.parametrize("case", ["prefill-longer", "decode", "bidirectional"])
def test_fused_equals_dense_float64(case: str) -> None:
    # the tables go through float32 on both paths (as the dense path always did): their gradient is fp32-exact
    fused, dense = fused_and_dense(CASES[case], torch.float64)
    assert_all_close(fused[:4], dense[:4], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(fused[4], dense[4], atol=ATOL, rtol=RTOL)


# cases with several band blocks of 64 queries (a block per chunk at chunk 1)
CHUNK_CASES = {
    **{name: case for name, case in CASES.items() if case[3] > 1},
    "prefill-three-blocks": (1, 4, 2, 150, 150, 0, True),
    "static-three-blocks": (1, 4, 2, 140, 170, 0, True),
    "bidirectional-three-blocks": (2, 4, 2, 150, 150, 0, False),
}


@pytest.mark.parametrize("chunk", [1, 1 << 22], ids=["block-by-block", "default-chunks"])
@pytest.mark.parametrize("case", list(CHUNK_CASES), ids=list(CHUNK_CASES))
def test_fused_without_grad_runs_the_band_in_chunks_and_equals_dense(case: str, chunk: int, monkeypatch) -> None:
    """Under no_grad the band runs in chunks of blocks (bounded logits); it must equal the dense path as the
    all-at-once band of training does (chunk 1: every block alone, so edge blocks land in their own chunks)."""
    monkeypatch.setattr(fused_t5, "BAND_CHUNK_ELEMENTS", chunk)
    batch, heads, kv_heads, q_len, kv_len, offset, causal = CHUNK_CASES[case]
    torch.manual_seed(0)
    module = T5RelativeBias(heads, 2, 8, 16, True)
    for table in module.tables:
        torch.nn.init.normal_(table.weight, std=2.0)
    query = torch.randn(batch, heads, q_len, 8)
    key, value = torch.randn(batch, kv_heads, kv_len, 8), torch.randn(batch, kv_heads, kv_len, 8)
    query_pos, key_pos = torch.arange(q_len) + offset, torch.arange(kv_len) + max(offset + q_len - kv_len, 0)
    call = FusedCall(query, key, value, None, query_pos, key_pos, 0, causal, 8**-0.5, 0.0, {})
    with torch.no_grad():
        fused = module.fused_attention(call)
        dense = dense_attention(module, query, key, value, query_pos, key_pos, causal, 8**-0.5, 0)
    torch.testing.assert_close(fused, dense, atol=ATOL, rtol=RTOL)


def test_fused_per_layer_tables() -> None:
    assert_all_close(*fused_and_dense(CASES["prefill-longer"], shared=False))


def test_fused_default_buckets_past_saturation() -> None:
    """T5's own 32 buckets / 128: a sequence past the saturation distance of 113."""
    assert_all_close(*fused_and_dense((1, 4, 2, 150, 150, 0, True), num_buckets=32, max_distance=128))


# -- whole models ------------------------------------------------------------------------------------------------


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls that took the fused path."""
    calls: list[int] = []
    inner = t5_module.fused_t5_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(t5_module, "fused_t5_attention", spy)
    return calls


def t5_model(family: str, attn: str, shared: bool = True) -> torch.nn.Module:
    model = make_model(family, attn)
    ps.swap(model, ps.T5BiasConfig(num_buckets=8, max_distance=16, shared_across_layers=shared))
    torch.manual_seed(5)
    with torch.no_grad():
        for table in model.base_model.posswap_positions.tables:
            table.weight.copy_(2 * torch.randn_like(table.weight))
    return model


def table_grads(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    output = model(input_ids=input_ids)
    (output.logits.square().mean()).backward()
    return output.logits.detach(), [t.weight.grad.clone() for t in model.base_model.posswap_positions.tables]


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-layer"])
def test_model_fused_equals_eager(family: str, shared: bool, fused_calls: list[int]) -> None:
    """sdpa (fused) and eager (dense) give the same logits and table gradients across the saturation distance."""
    input_ids = torch.randint(3, VOCAB, (2, 37), generator=torch.Generator().manual_seed(1))
    eager_logits, eager_grads = table_grads(t5_model(family, "eager", shared), input_ids)
    assert not fused_calls
    sdpa_logits, sdpa_grads = table_grads(t5_model(family, "sdpa", shared), input_ids)
    assert len(fused_calls) == 2  # both layers took the fused path
    torch.testing.assert_close(sdpa_logits, eager_logits, atol=ATOL, rtol=RTOL)
    for got, want in zip(sdpa_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_model_cached_generation_fused(family: str, fused_calls: list[int]) -> None:
    """The prefill takes the fused path, decoding steps the dense one (one bias row each); cached generation
    equals the dense path without a cache."""
    input_ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    kwargs = {"max_new_tokens": 14, "do_sample": False, "pad_token_id": 0, "output_logits": True}
    fused = t5_model(family, "sdpa").generate(input_ids, use_cache=True, return_dict_in_generate=True, **kwargs)
    assert len(fused_calls) == 2  # the prefill, two layers
    dense = t5_model(family, "eager").generate(input_ids, use_cache=False, return_dict_in_generate=True, **kwargs)
    assert torch.equal(fused.sequences, dense.sequences)
    torch.testing.assert_close(torch.stack(fused.logits), torch.stack(dense.logits), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_model_chunk_after_cache_fused(family: str, fused_calls: list[int]) -> None:
    """Several queries after a cache (chunked prefill) take the fused path and equal one dense forward."""
    input_ids = torch.randint(3, VOCAB, (1, 45), generator=torch.Generator().manual_seed(6))
    model = t5_model(family, "sdpa")
    with torch.no_grad():
        first = model(input_ids=input_ids[:, :21], use_cache=True)
        second = model(input_ids=input_ids[:, 21:], past_key_values=first.past_key_values, use_cache=True)
        whole = t5_model(family, "eager")(input_ids=input_ids).logits
    assert len(fused_calls) == 4
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), whole, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_matrix_shapes_take_the_fused_path(family: str, fused_calls: list[int]) -> None:
    """tests/families/test_matrix.py's tiny models and lengths (conftest's t5 settings) run the fused form."""
    model = swapped(family, "t5")
    with torch.no_grad():
        model(input_ids=torch.randint(3, VOCAB, (2, 24)))
    assert len(fused_calls) == 2


def test_declined_calls_fall_back_to_dense(fused_calls: list[int]) -> None:
    """Padding, different per-row positions and dropout in training run the dense path, correctly (half precision
    runs fused: tests/schemes/test_fused_bf16.py)."""
    eager, sdpa = t5_model("llama", "eager"), t5_model("llama", "sdpa")
    input_ids = torch.randint(3, VOCAB, (2, 30), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(input_ids)
    mask[1, :6] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        padded = [m(input_ids=input_ids, attention_mask=mask, position_ids=position_ids).logits for m in (eager, sdpa)]
    assert not fused_calls
    torch.testing.assert_close(padded[1][mask.bool()], padded[0][mask.bool()], atol=ATOL, rtol=RTOL)

    rows = torch.stack([torch.arange(30), torch.arange(30) * 2])  # PoSE-style skips, different per row
    with torch.no_grad():
        skipped = [m(input_ids=input_ids, position_ids=rows).logits for m in (eager, sdpa)]
    assert not fused_calls
    torch.testing.assert_close(skipped[1], skipped[0], atol=ATOL, rtol=RTOL)

    sdpa.config.attention_dropout = 0.5
    for layer in sdpa.model.layers:
        layer.self_attn.attention_dropout = 0.5
    sdpa.train()(input_ids=input_ids)
    assert not fused_calls


def test_fused_path_is_exact_in_a_training_step(fused_calls: list[int]) -> None:
    """One optimiser step through the fused path moves every parameter as the dense path does."""
    models = {attn: t5_model("llama", attn) for attn in ("eager", "sdpa")}
    input_ids = torch.randint(3, VOCAB, (2, 33), generator=torch.Generator().manual_seed(4))
    for model in models.values():
        model.train()
        optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimiser.step()
    assert len(fused_calls) == 2
    for (name, got), want in zip(models["sdpa"].named_parameters(), models["eager"].parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("scheme", ["t5", "alibi"])
def test_mixed_precision_training_takes_the_fused_path(scheme: str) -> None:
    """Under CPU autocast the fused forms get q, k, v cast as sdpa would get them and run with autocast off, forward
    and backward (CI once saw the T5 backward fail with a bf16 gradient, when autocast reached inside it); the loss
    and every gradient are finite. Accuracy against the dense path: tests/schemes/test_fused_bf16.py."""
    model = swapped("llama", scheme)
    model.train()
    input_ids = torch.randint(0, 50, (2, 40))
    with torch.autocast("cpu", dtype=torch.bfloat16), record_paths() as paths:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
    assert set(paths) == {FUSED_T5 if scheme == "t5" else FUSED_ALIBI}
    assert torch.isfinite(loss)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
