"""Decoders that share LLaMA's layout work through the LLaMA adapter with no code of their own."""

from __future__ import annotations

import pytest
import torch
from conftest import SCHEMES, VOCAB, scheme_config
from transformers import AutoConfig, AutoModelForCausalLM

import hf_posswap as ps

LLAMA_LIKE = ["mistral", "qwen2", "qwen3"]


def tiny(model_type: str, attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    config._attn_implementation = attn
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("model_type", LLAMA_LIKE)
def test_llama_like_families(model_type: str, scheme: str) -> None:
    model = tiny(model_type)
    input_ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=input_ids).logits
        ps.swap(model, scheme_config(scheme))
        after = model(input_ids=input_ids).logits
        cached = model.generate(input_ids[:, :6], max_new_tokens=6, do_sample=False, pad_token_id=0)
        full = model.generate(input_ids[:, :6], max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=False)
        assert torch.equal(cached, full)
        eager = tiny(model_type, "eager")
        ps.swap(eager, scheme_config(scheme))
        if scheme == "learned":  # fresh random tables: copy them so both models match
            eager.load_state_dict(model.state_dict())
        torch.testing.assert_close(eager(input_ids=input_ids).logits, after, atol=1e-5, rtol=1e-4)
        if scheme == "rope":
            assert torch.equal(after, before)
        ps.unswap(model)
        assert torch.equal(model(input_ids=input_ids).logits, before)
