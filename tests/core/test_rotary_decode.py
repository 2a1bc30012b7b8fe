"""RoPE inside attention (GPT-2, BERT as a decoder, LLaMA with partial RoPE) rotates each cached key once, where it
enters the cache, and decodes exactly as a full recompute: greedy, beams, sampling in a padded batch, static cache,
assisted decoding (crop), scalings; length-dependent scalings and Self-Extend keep unrotated keys. Caches that move
between models stay right or are refused."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import MAX_POSITIONS, VOCAB, make_model, tiny_config
from transformers import BertConfig, BertLMHeadModel, DynamicCache, GPT2LMHeadModel

import hf_posswap as ps
from hf_posswap.core import rotary_cache, rotation
from hf_posswap.errors import InvalidConfigError


def tokens(batch: int, length: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def bert_decoder() -> torch.nn.Module:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=MAX_POSITIONS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=0, is_decoder=True,
    )
    model = BertLMHeadModel(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def rope_model(family: str, scaling: str | None = None, seed: int = 0) -> torch.nn.Module:
    """A tiny model with RoPE inside attention: GPT-2 and BERT always, LLaMA with partial RoPE."""
    model = bert_decoder() if family == "bert" else make_model(family, seed=seed)
    ps.swap(model, ps.RopeConfig(partial_rotary_factor=0.5 if family == "llama" else 1.0), replace=family == "llama")
    if scaling is not None:
        ps.extend_context(model, 4 * MAX_POSITIONS, scaling)
    return model


def generation(model, input_ids, mask, use_cache: bool, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0,
                         use_cache=use_cache, return_dict_in_generate=True, output_scores=True, **kwargs)
    return out.sequences, torch.stack(out.scores, 1)


def assert_same_generation(cached, full) -> None:
    assert torch.equal(cached[0], full[0])
    finite = torch.isfinite(full[1])  # beam search marks impossible continuations with -inf
    assert torch.equal(finite, torch.isfinite(cached[1]))
    torch.testing.assert_close(cached[1][finite], full[1][finite], atol=1e-4, rtol=1e-4)


def padded_batch(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = tokens(2, length)
    mask = torch.ones_like(input_ids)
    input_ids[1, :5], mask[1, :5] = 0, 0
    return input_ids, mask


DECODING = {
    "greedy": {"do_sample": False},
    "beams": {"num_beams": 3, "do_sample": False},
    "sampling": {"do_sample": True, "top_k": 0, "temperature": 1.0},
    "static": {"do_sample": False, "cache_implementation": "static"},
}
FAMILIES = ["gpt2", "bert", "llama"]


@pytest.mark.parametrize("decoding", list(DECODING))
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_generation_equals_full_recompute(family: str, decoding: str) -> None:
    model = rope_model(family)
    input_ids, mask = padded_batch(20)
    with torch.no_grad():
        assert_same_generation(generation(model, input_ids, mask, True, **DECODING[decoding]),
                               generation(model, input_ids, mask, False, **DECODING[decoding]))


@pytest.mark.parametrize("scaling", ["linear", "yarn", "dynamic", "longrope", "self_extend"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_cached_generation_with_scalings_crosses_the_original_length(family: str, scaling: str) -> None:
    """Generation runs from below the original length to past it: dynamic NTK and LongRoPE change every key's
    rotation there, Self-Extend regroups them, so those keep unrotated keys (the full path); the others do not."""
    model = make_model(family) if family == "gpt2" else rope_model("llama")
    if family == "gpt2":
        ps.swap(model, "rope")
    options = {"neighbor_window": 16} if scaling == "self_extend" else {}
    if scaling == "longrope":
        options = {"short_factor": [1.0 + 0.1 * i for i in range(4 if family == "llama" else 8)],
                   "long_factor": [1.0 + 0.5 * i for i in range(4 if family == "llama" else 8)]}
    ps.extend_context(model, 4 * MAX_POSITIONS, scaling, **options)
    input_ids, mask = padded_batch(MAX_POSITIONS - 4)
    with torch.no_grad():
        assert_same_generation(generation(model, input_ids, mask, True), generation(model, input_ids, mask, False))
        cache = DynamicCache()
        model(input_ids=input_ids, attention_mask=mask, past_key_values=cache)
    stored = getattr(cache.layers[0], rotary_cache.MARKER, None)
    assert (stored is None) == (scaling in ("dynamic", "longrope", "self_extend"))


def test_assisted_decoding_crops_the_cache_and_stays_exact() -> None:
    """An assistant with other weights proposes tokens the model rejects: the model's cache is cropped, then grows.
    Every score of the assisted run equals the plain run's."""
    model, assistant = rope_model("gpt2"), rope_model("gpt2", seed=1)
    input_ids = tokens(1, 12)
    options = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True,
               "output_scores": True}
    with torch.no_grad():
        plain = model.generate(input_ids, **options)
        assisted = model.generate(input_ids, assistant_model=assistant, **options)
        recomputed = model.generate(input_ids, use_cache=False, **options)
    assert torch.equal(assisted.sequences, plain.sequences) and torch.equal(plain.sequences, recomputed.sequences)
    torch.testing.assert_close(torch.stack(assisted.scores), torch.stack(plain.scores), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.stack(plain.scores), torch.stack(recomputed.scores), atol=1e-4, rtol=1e-4)


def count_rotated_rows(monkeypatch) -> list[int]:
    """Rows (positions) rotated by each rotation in rotary_cache, counted at its primitives: the pair-wise block
    rotation (in place or not), the one-matrix product of a few tokens, and the formula of a trainable rotation."""
    rows: list[int] = []
    for name in ("rotate_pairs", "rotate_pairs_", "_turn", "apply_rotary"):
        primitive = getattr(rotary_cache, name)

        def counting(x: torch.Tensor, *args, primitive=primitive) -> torch.Tensor:
            rows.append(x.shape[-2])
            return primitive(x, *args)

        monkeypatch.setattr(rotary_cache, name, counting)
    return rows


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_rotate_only_the_new_token(family: str, monkeypatch) -> None:
    model = rope_model(family)
    layers = model.config.num_hidden_layers
    rows = count_rotated_rows(monkeypatch)
    cache = DynamicCache()
    with torch.no_grad():
        token = tokens(1, 30)
        for _ in range(10):
            token = model(input_ids=token, past_key_values=cache).logits[:, -1:].argmax(-1)
    # prefill: 30 query rows + 30 key rows per layer; each of the 9 decode steps: 1 + 1 per layer
    assert sum(rows) == layers * (2 * 30 + 9 * 2)
    assert max(rows[2 * layers:]) == 1  # no step rotates the 30+ cached keys again


def test_cos_sin_are_computed_once_per_forward_not_per_layer() -> None:
    config = tiny_config("gpt2")
    config.n_layer = 4
    model = GPT2LMHeadModel(config).eval()
    ps.swap(model, "rope")
    calls = []
    model.transformer.posswap_positions.register_forward_hook(lambda *args: calls.append(1))
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=tokens(1, 16))
        assert len(calls) == 1  # no cache: queries and keys share one cos/sin, and so do the 4 layers
        model(input_ids=tokens(1, 16), past_key_values=cache)  # (also names the rotation: cos/sin at position 1)
        calls.clear()
        for _ in range(3):
            model(input_ids=tokens(1, 1), past_key_values=cache)
        assert len(calls) == 1  # decode steps: one cos/sin for the next STEP_BLOCK positions, for every layer
        for _ in range(rotary_cache.STEP_BLOCK):
            model(input_ids=tokens(1, 1), past_key_values=cache)
    assert len(calls) == 2  # the steps past the first block made the next one


def decode_logits(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decode with a DynamicCache: the logits of every step [steps, vocab]."""
    cache, logits = DynamicCache(), []
    with torch.no_grad():
        token = prompt
        for _ in range(steps):
            step_logits = model(input_ids=token, past_key_values=cache).logits[:, -1]
            logits.append(step_logits)
            token = step_logits.argmax(-1, keepdim=True)
    return torch.cat(logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_decode_fast_path_is_taken_and_equals_the_general_path(family: str, monkeypatch) -> None:
    """Decode steps take the one-matrix fast path across two blocks of step matrices (LLaMA: partial RoPE), with
    the values of the general path (matrix made from this step's cos/sin), which the full recompute tests pin."""
    model = rope_model(family)
    steps = rotary_cache.STEP_BLOCK + 10
    general = rotary_cache._decode_step
    taken = []

    def counting(*args):
        found = general(*args)
        taken.append(found is not None)
        return found

    monkeypatch.setattr(rotary_cache, "_decode_step", counting)
    fast = decode_logits(model, tokens(1, 12), steps)
    assert sum(taken) == (steps - 1) * model.config.num_hidden_layers  # every layer of every step after prefill
    monkeypatch.setattr(rotary_cache, "_decode_step", lambda *args: None)
    torch.testing.assert_close(fast, decode_logits(model, tokens(1, 12), steps), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("how", ["in-place", "data"])
def test_step_matrices_follow_a_changed_rotation(how: str) -> None:
    """The step matrices are kept per scheme module between forwards: changing its frequencies (in place, or
    through ``.data``, which leaves the version counter alone) must make new ones, or decoding would keep the old
    rotation."""
    model = rope_model("gpt2")
    before = decode_logits(model, tokens(1, 12), 4)
    inv_freq = model.transformer.posswap_positions.inv_freq
    if how == "in-place":
        with torch.no_grad():
            inv_freq.mul_(0.5)
    else:  # writes that leave the version counter alone (as fused optimiser steps do)
        inv_freq.data.mul_(0.5)
    after = decode_logits(model, tokens(1, 12), 4)
    reference = make_model("gpt2")
    ps.swap(reference, "rope")
    with torch.no_grad():
        reference.transformer.posswap_positions.inv_freq.copy_(model.transformer.posswap_positions.inv_freq)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, decode_logits(reference, tokens(1, 12), 4), atol=1e-5, rtol=1e-5)


def test_the_rotation_check_sees_tensors_of_submodules() -> None:
    """The per-step value check reads a scheme module's own buffer and parameter dicts, which hold none of its
    submodules' tensors: a registered rotary scheme whose frequencies live in a submodule must still be compared
    (else a change there would go unseen by the kept step matrices)."""
    scheme = torch.nn.Module()
    scheme.register_buffer("own", torch.ones(2))
    scheme.inner = torch.nn.Linear(2, 2, bias=False)
    scheme.inner.register_buffer("frequencies", torch.arange(3.0))
    found = rotary_cache._scheme_tensors(scheme)
    assert any(t is scheme.inner.frequencies for t in found) and any(t is scheme.inner.weight for t in found)
    leaf = torch.nn.Module()
    leaf.register_buffer("inv_freq", torch.ones(4))
    leaf.register_buffer("unset", None)
    assert rotary_cache._scheme_tensors(leaf) == [leaf.inv_freq]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rotary_dim", [16, 8], ids=["full", "partial"])
def test_rotation_matrices_equal_the_formula(rotary_dim: int, dtype: torch.dtype) -> None:
    """x @ R(p) equals transformers' rotate-half formula on the first r dims and x on the others."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2) / rotary_dim)
    freqs = torch.arange(5.0)[:, None] * inv_freq
    cos, sin = torch.cat((freqs, freqs), -1).cos().to(dtype), torch.cat((freqs, freqs), -1).sin().to(dtype)
    x = torch.randn(2, 3, 5, 16).to(dtype)  # [B, H, positions, D]
    matrices = rotation.rotation_matrices(cos, sin, 16)  # [5, 16, 16]
    rotated = torch.einsum("bhpd,pde->bhpe", x, matrices)
    expected, _ = apply_rotary_pos_emb(x[..., :rotary_dim], x[..., :rotary_dim], cos[None], sin[None])
    tolerance = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(rotated[..., :rotary_dim], expected, **tolerance)
    assert torch.equal(rotated[..., rotary_dim:], x[..., rotary_dim:])


def unrotated_keys(model, input_ids: torch.Tensor) -> DynamicCache:
    """A cache filled with grad enabled: keys that require grad are never written, so they stay unrotated."""
    cache = DynamicCache()
    with torch.enable_grad():
        model(input_ids=input_ids, past_key_values=cache)
    assert getattr(cache.layers[0], rotary_cache.MARKER, None) is None
    return cache


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cache_holds_each_key_rotated_exactly_once(family: str) -> None:
    model = rope_model(family)
    input_ids = tokens(2, 24)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=input_ids[:, :20], past_key_values=cache)
        model(input_ids=input_ids[:, 20:], past_key_values=cache)
    reference = unrotated_keys(model, input_ids)
    positions = model.base_model.posswap_positions
    for layer, plain in zip(cache.layers, reference.layers, strict=True):
        assert layer.keys.shape == plain.keys.shape
        expected = rotary_cache.apply_rotary(plain.keys.detach(), *positions(torch.arange(24)))
        torch.testing.assert_close(layer.keys, expected, atol=1e-5, rtol=1e-5)
        assert getattr(layer, rotary_cache.MARKER).count == 24


def continue_logits(model, cache, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids, past_key_values=cache).logits


def filled(model, input_ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=input_ids, past_key_values=cache)
    return cache


def test_a_cache_filled_without_rotation_is_rotated_once_and_continues_as_before() -> None:
    """A cache the native model (or a forward that made its own cache) filled holds unrotated keys: the swapped
    model rotates them all on first use, as the full path of every step does."""
    native, model = make_model("gpt2"), rope_model("gpt2")
    prompt, step = tokens(1, 20), tokens(1, 3, seed=5)
    native_cache = filled(native, prompt)
    full_path = model(input_ids=step, past_key_values=copy.deepcopy(native_cache)).logits  # grad on: out of place
    once = continue_logits(model, native_cache, step)
    torch.testing.assert_close(once, full_path.detach())
    assert getattr(native_cache.layers[0], rotary_cache.MARKER).count == 23
    with torch.no_grad():  # the model makes its own cache: attention never sees it, its keys stay unrotated
        own = model(input_ids=prompt, use_cache=True).past_key_values
    assert getattr(own.layers[0], rotary_cache.MARKER, None) is None
    torch.testing.assert_close(continue_logits(model, own, step), continue_logits(model, filled(model, prompt), step))


def test_a_copied_cropped_or_reset_cache_stays_exact() -> None:
    model = rope_model("gpt2")
    prompt, step = tokens(1, 24), tokens(1, 2, seed=5)
    cache = filled(model, prompt)
    copied = copy.deepcopy(cache)
    torch.testing.assert_close(continue_logits(model, copied, step), continue_logits(model, cache, step))
    cropped = filled(model, prompt)
    cropped.crop(-6)
    shorter = filled(model, prompt[:, :18])
    torch.testing.assert_close(continue_logits(model, cropped, step), continue_logits(model, shorter, step))
    cropped.reset()
    expected = continue_logits(model, like_reset(cropped), prompt)
    torch.testing.assert_close(continue_logits(model, cropped, prompt), expected)


def like_reset(cache: DynamicCache) -> DynamicCache:
    """A cache in the state ``reset()`` left ``cache`` in, built without hf_posswap's record of rotated keys: empty
    (newer transformers), or as many zero keys and values as before (transformers before 5.20 zeroes them in place)."""
    fresh = DynamicCache()
    for index, layer in enumerate(cache.layers):
        if layer.get_seq_length():
            fresh.update(torch.zeros_like(layer.keys), torch.zeros_like(layer.values), index)
    return fresh


def test_a_cache_reused_after_unswap_and_swap_back_stays_exact() -> None:
    model = rope_model("gpt2")
    prompt, step = tokens(1, 20), tokens(1, 3, seed=5)
    cache = filled(model, prompt)
    expected = continue_logits(model, copy.deepcopy(cache), step)
    ps.unswap(model)
    ps.swap(model, "rope")
    torch.testing.assert_close(continue_logits(model, cache, step), expected)


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda m: ps.swap(m, ps.RopeConfig(rope_theta=500.0), replace=True), id="rope-other-theta"),
        pytest.param(lambda m: ps.swap(m, "alibi", replace=True), id="alibi"),
        pytest.param(lambda m: ps.swap(m, "learned", replace=True), id="learned"),
        pytest.param(lambda m: ps.extend_context(m, 4 * MAX_POSITIONS, "dynamic"), id="rope-dynamic"),
        pytest.param(lambda m: ps.extend_context(m, 4 * MAX_POSITIONS, "self_extend", neighbor_window=16),
                     id="self-extend"),
    ],
)
def test_a_rotated_cache_reaching_another_scheme_is_refused(other) -> None:
    model = rope_model("gpt2")
    cache = filled(model, tokens(1, 20))
    second = rope_model("gpt2")
    other(second)
    with pytest.raises(InvalidConfigError, match="KV cache holds keys"):
        continue_logits(second, cache, tokens(1, 2, seed=5))


def test_a_second_model_with_the_same_rotation_continues_the_cache() -> None:
    model = rope_model("gpt2")
    prompt, step = tokens(1, 20), tokens(1, 2, seed=5)
    cache = filled(model, prompt)
    torch.testing.assert_close(continue_logits(copy.deepcopy(model), cache, step),
                               continue_logits(model, filled(model, prompt), step))


def test_keys_that_require_grad_or_are_inference_tensors_are_never_written() -> None:
    model = rope_model("gpt2")
    prompt, step = tokens(1, 20), tokens(1, 3, seed=5)
    cache = unrotated_keys(model, prompt)  # keys require grad: rotated out of place, gradients flow
    logits = model(input_ids=step, past_key_values=cache).logits
    logits.sum().backward()
    assert model.transformer.h[0].attn.c_attn.weight.grad is not None
    expected = continue_logits(model, filled(model, prompt), step)
    torch.testing.assert_close(logits.detach(), expected)
    with torch.inference_mode():
        inference_cache = filled(model, prompt)
    with torch.no_grad():  # continued outside inference mode
        torch.testing.assert_close(continue_logits(model, inference_cache, step), expected)
