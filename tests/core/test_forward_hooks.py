"""Forward hooks on the query and key projections keep what they saw. RoPE and xPos inside attention (GPT-2, BERT,
LLaMA with partial RoPE or xPos) rotate the query and key that attention receives, and in GPT-2 and BERT those are
views of the projections' outputs (``c_attn``; ``query`` and ``key``): they are rotated into new tensors, so a hook
that keeps a projection's output (activation capture, interpretability tools) still holds the values the projection
returned, bit for bit. Only keys in a KV cache layer's own tensor are rotated where they lie (decoding stays fast),
and a cache layer that keeps the projection's output as it was handed over is not written. The logits stay those
of transformers' rotate-half formula."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import make_model
from test_rotary_decode import assert_same_generation, bert_decoder, padded_batch, tokens
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.models.llama.modeling_llama import rotate_half

import hf_posswap as ps
from hf_posswap.core import rotary_cache

#: case id -> (model, scheme); "bert" is the encoder (no cache), "bert_decoder" BERT as a causal LM
CASES = {
    "gpt2-rope": ("gpt2", "rope"),
    "gpt2-rope-eager": ("gpt2", "rope"),
    "gpt2-xpos": ("gpt2", "xpos"),
    "bert-rope": ("bert", "rope"),
    "bert_decoder-rope": ("bert_decoder", "rope"),
    "bert_decoder-xpos": ("bert_decoder", "xpos"),
    "llama-partial_rope": ("llama", "rope"),
    "llama-xpos": ("llama", "xpos"),
}
CAUSAL_CASES = [case for case in CASES if not case.startswith("bert-")]
PROMPT, STEPS = 12, [1, 1, 1, 4]  # decoding: a prompt, three single tokens, then a chunk of four


def build(case: str) -> torch.nn.Module:
    """The case's tiny model swapped to its scheme, with the rotation inside attention."""
    family, scheme = CASES[case]
    model = bert_decoder() if family == "bert_decoder" else make_model(family, "eager" if "eager" in case else "sdpa")
    config = ps.RopeConfig(partial_rotary_factor=0.5) if case == "llama-partial_rope" else scheme
    ps.swap(model, config, replace=family == "llama")
    assert model.config._attn_implementation.startswith("posswap_")  # rotated in hf_posswap's attention
    return model


def projections(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose outputs attention's query and key come from, in every layer."""
    if hasattr(model, "transformer"):  # GPT-2: one fused qkv projection
        return [block.attn.c_attn for block in model.transformer.h]
    if hasattr(model, "bert"):
        return [m for layer in model.bert.encoder.layer for m in (layer.attention.self.query, layer.attention.self.key)]
    return [m for layer in model.model.layers for m in (layer.self_attn.q_proj, layer.self_attn.k_proj)]


class HeldOutputs:
    """Forward hooks that keep each projection output (the tensor itself, as a capturing tool would) and a copy."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.held: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.handles = [m.register_forward_hook(self.keep) for m in projections(model)]

    def keep(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.held.append((output, output.detach().clone()))

    def assert_untouched(self) -> None:
        for handle in self.handles:
            handle.remove()
        assert self.held
        changed = [(kept - copy).abs().max().item() for kept, copy in self.held if not torch.equal(kept, copy)]
        assert not changed, f"{len(changed)} of {len(self.held)} projection outputs changed (by up to {max(changed)})"


def formula_rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: object, in_place: bool = False
) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` on the first r dims, into a new tensor."""
    if cos.dim() == 3:  # per-row positions [B, L, r] -> [B, 1, L, r]
        cos, sin = cos[:, None], sin[:, None]
    rotary_dim = cos.shape[-1]
    part, cos, sin = x[..., :rotary_dim], cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((part * cos + rotate_half(part) * sin, x[..., rotary_dim:]), dim=-1)


def reference(run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``run``'s result with every rotation in attention done by :func:`formula_rotate`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rotary_cache, "rotate", formula_rotate)
        patch.setattr(rotary_cache, "_decode_step", lambda *args: None)
        return run()


def uncached_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    options = {"use_cache": False} if model.can_generate() else {}  # (BERT's encoder has no cache)
    with torch.no_grad():
        return model(input_ids=input_ids, **options).logits


def decoded_logits(model: torch.nn.Module, input_ids: torch.Tensor, cache) -> torch.Tensor:
    """Logits [B, L, V] of ``input_ids`` fed through ``cache`` as a prompt, then single tokens, then a chunk."""
    logits, start = [], 0
    for length in [PROMPT, *STEPS]:
        logits.append(model(input_ids=input_ids[:, start : start + length], past_key_values=cache).logits)
        start += length
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("case", list(CASES))
def test_a_forward_without_cache_leaves_the_projection_outputs_as_they_were(case: str) -> None:
    model = build(case)
    input_ids = tokens(2, 16)
    held = HeldOutputs(model)
    logits = uncached_logits(model, input_ids)
    held.assert_untouched()
    assert torch.equal(logits, reference(lambda: uncached_logits(model, input_ids)))  # the same values bit for bit


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("case", CAUSAL_CASES)
def test_prefill_and_decode_steps_leave_the_projection_outputs_as_they_were(case: str, mode: str) -> None:
    """The cache's own key tensor is still rotated in place (the layer records every slot as rotated)."""
    model = build(case)
    input_ids = tokens(2, PROMPT + sum(STEPS))
    cache = DynamicCache()
    held = HeldOutputs(model)
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        logits = decoded_logits(model, input_ids, cache)
    held.assert_untouched()
    torch.testing.assert_close(logits, reference(lambda: uncached_logits(model, input_ids)), atol=1e-5, rtol=1e-5)
    for layer in cache.layers:
        assert getattr(layer, rotary_cache.MARKER).count == input_ids.shape[1]


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
@pytest.mark.parametrize("case", CAUSAL_CASES)
def test_generate_leaves_the_projection_outputs_as_they_were(case: str, cache_implementation: str) -> None:
    model = build(case)
    input_ids, mask = padded_batch(PROMPT)
    options = {"max_new_tokens": 6, "pad_token_id": 0, "do_sample": False, "return_dict_in_generate": True,
               "output_scores": True, "cache_implementation": cache_implementation}

    def generation(use_cache: bool) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, use_cache=use_cache, **options)
        return out.sequences, torch.stack(out.scores, 1)

    held = HeldOutputs(model)
    cached = generation(True)
    held.assert_untouched()
    assert_same_generation(cached, reference(lambda: generation(False)))


class KeepsWhatItIsHanded(DynamicLayer):
    """A cache layer that stores the first keys and values it is handed as they are, not a copy: its key tensor is
    then the key projection's output (a view of it), which a forward hook may hold."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, ...]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
            return self.keys, self.values
        return super().update(key_states, value_states, *args, **kwargs)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("case", ["gpt2-rope", "gpt2-xpos", "bert_decoder-rope"])
def test_a_cache_layer_that_keeps_the_projection_output_is_not_written(case: str, mode: str) -> None:
    """Its keys are rotated out of place while they are the projection's output; once the layer has copied them
    into memory of its own (the next step's concatenation), they are rotated there, once."""
    model = build(case)
    input_ids = tokens(2, PROMPT + sum(STEPS))
    cache = DynamicCache()
    cache.layer_class_to_replicate = KeepsWhatItIsHanded
    held = HeldOutputs(model)
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        logits = decoded_logits(model, input_ids, cache)
    held.assert_untouched()
    assert all(isinstance(layer, KeepsWhatItIsHanded) for layer in cache.layers)
    torch.testing.assert_close(logits, reference(lambda: uncached_logits(model, input_ids)), atol=1e-5, rtol=1e-5)
    for layer in cache.layers:
        assert getattr(layer, rotary_cache.MARKER).count == input_ids.shape[1]
