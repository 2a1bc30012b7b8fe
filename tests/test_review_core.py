"""Hostile review of issue 9 items 1-4 and 12-13 (call paths, Self-Extend, checkpointing, reloaded models):
faults found from the outside, each pinned by a test that failed before its fix."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, make_model, scheme_config, swapped

import hf_posswap as ps


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


# ---- item 1: the forward wrapper under accelerate's hooks -------------------------------------------------------

@pytest.mark.parametrize(("family", "scheme"), [("llama", "alibi"), ("llama", "sinusoidal"), ("gpt2", "t5")])
def test_removing_an_accelerate_hook_added_before_the_swap_keeps_the_scheme(family: str, scheme: str) -> None:
    """accelerate's remove_hook_from_module puts back the forward it saved when hooking: the swap must survive it
    (it used to run the model with no positions at all, native or swapped, without a word)."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    model, expected = make_model(family), swapped(family, scheme)
    input_ids = tokens(2, 16)
    add_hook_to_module(model.base_model, ModelHook())
    ps.swap(model, scheme_config(scheme))
    model.load_state_dict(expected.state_dict())  # the same (randomised) position weights
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=input_ids).logits, expected(input_ids=input_ids).logits)
        remove_hook_from_module(model.base_model)
        torch.testing.assert_close(model(input_ids=input_ids).logits, expected(input_ids=input_ids).logits)
    ps.unswap(model)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=input_ids).logits, make_model(family)(input_ids=input_ids).logits)


def test_unswap_under_an_accelerate_hook_then_removing_it_gives_the_native_model() -> None:
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    model = make_model("llama")
    add_hook_to_module(model.model, ModelHook())
    ps.swap(model, "alibi")
    ps.swap(model, "t5", replace=True)
    ps.unswap(model)
    input_ids = tokens(2, 16)
    native = make_model("llama")(input_ids=input_ids).logits.detach()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=input_ids).logits, native)
        remove_hook_from_module(model.model)
        torch.testing.assert_close(model(input_ids=input_ids).logits, native)


# ---- item 12: reloaded models ----------------------------------------------------------------------------------

def test_unswap_of_a_reloaded_native_rope_swap_says_why_it_cannot(tmp_path) -> None:
    """A LLaMA swapped to another RoPE saves in transformers' own format and reloads as a plain LlamaForCausalLM:
    unswap cannot restore the original base, and must not claim the model 'was not swapped by hf_posswap'."""
    from transformers import AutoModelForCausalLM

    model = make_model("llama")
    ps.swap(model, "rope", rope_theta=50_000.0)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ps.NotSwappedError, match=r"checkpoint that hf_posswap had swapped to 'rope'.*original "
                       r"position settings.*Load the original checkpoint"):
        ps.unswap(reloaded)
    with pytest.raises(ps.NotSwappedError, match="was not swapped by hf_posswap"):
        ps.unswap(make_model("llama"))


# ---- item 2: Self-Extend in padded batches ---------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.slow
def test_self_extend_left_padded_row_equals_the_row_alone(family: str) -> None:
    """Self-Extend groups positions as floor(pos / G): a left-padded row must group its own positions, not its
    padded token indices (it used to differ from the row run alone, in forward and in generate)."""
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
