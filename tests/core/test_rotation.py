"""RoPE inside attention rotates q and k pair-wise in blocks of positions (hf_posswap.core.rotation): the values of
transformers' own ``apply_rotary_pos_emb`` bit for bit (whole and partial heads, strided views, per-row positions,
in place or not), the gradient autograd computes through that formula, no full-size temporaries, and a training
step whose backward has one node per rotation (no zero-filled slice gradients)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model
from torch.profiler import ProfilerActivity, profile
from transformers import BertConfig, BertForMaskedLM
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_rotary
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, rotate_half

import hf_posswap as ps
from hf_posswap.core import rotation

BATCH, HEADS, LENGTH, HEAD_DIM = 2, 4, 37, 16


def layouts(length: int = LENGTH, head_dim: int = HEAD_DIM) -> dict[str, torch.Tensor]:
    """q [B, H, L, D] as models hand it to attention: contiguous, a transposed projection (BERT, LLaMA) and a
    slice of a fused qkv projection (GPT-2: strided, not dense)."""
    torch.manual_seed(0)
    fused = torch.randn(BATCH, length, 3 * HEADS * head_dim)
    return {
        "contiguous": torch.randn(BATCH, HEADS, length, head_dim),
        "transposed": torch.randn(BATCH, length, HEADS * head_dim).view(BATCH, length, HEADS, head_dim).transpose(1, 2),
        "fused-qkv": fused[..., : HEADS * head_dim].view(BATCH, length, HEADS, head_dim).transpose(1, 2),
    }


def cos_sin(length: int, rotary_dim: int, rows: int | None = None, tied: bool = True) -> tuple[torch.Tensor, ...]:
    """cos, sin [L, r] (or [B, L, r]) in the rotate-half layout, from random positions and frequencies; ``tied``
    False: the two halves of each differ (the formula is defined for any values, and a transposition that swapped
    them would go unseen with equal halves)."""
    shape = (length, rotary_dim // 2) if rows is None else (rows, length, rotary_dim // 2)
    generator = torch.Generator().manual_seed(1)
    freqs = 40 * torch.rand(shape, generator=generator)
    other = freqs if tied else 40 * torch.rand(shape, generator=generator)
    return torch.cat((freqs, other), dim=-1).cos(), torch.cat((freqs, other), dim=-1).sin()


@pytest.fixture(params=["one block", "many blocks"])
def blocks(request, monkeypatch) -> None:
    if request.param == "many blocks":  # blocks of 3 positions: 12 full blocks and a remainder of 1
        monkeypatch.setattr(rotation, "BLOCK_ELEMENTS", BATCH * HEADS * HEAD_DIM // 2 * 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "fused-qkv"])
def test_rotation_equals_transformers_bit_for_bit(layout: str, dtype: torch.dtype, blocks: None) -> None:
    x = layouts()[layout].to(dtype)
    cos, sin = (t.to(dtype) for t in cos_sin(LENGTH, HEAD_DIM, tied=False))
    expected, _ = apply_rotary_pos_emb(x, x, cos, sin, unsqueeze_dim=0)
    assert torch.equal(rotation.rotate_pairs(x, cos, sin), expected)
    in_place = x.clone() if layout == "contiguous" else x  # (the others are fresh views)
    assert rotation.rotate_pairs_(in_place, cos, sin) is in_place and torch.equal(in_place, expected)


def test_partial_rotation_and_per_row_positions_equal_transformers(blocks: None) -> None:
    x = layouts()["transposed"]
    cos, sin = cos_sin(LENGTH, HEAD_DIM // 2)  # GPT-NeoX's partial rotary: the first 8 of 16 dims rotate
    expected, _ = neox_rotary(x, x, cos, sin, unsqueeze_dim=0)
    assert torch.equal(rotation.rotate_pairs(x, cos, sin), expected)
    rows_cos, rows_sin = cos_sin(LENGTH, HEAD_DIM, rows=BATCH)  # explicit position ids per row (PoSE)
    expected, _ = apply_rotary_pos_emb(x, x, rows_cos, rows_sin)  # unsqueeze_dim=1: [B, 1, L, r]
    assert torch.equal(rotation.rotate_pairs(x, rows_cos[:, None], rows_sin[:, None]), expected)
    assert torch.equal(rotation.rotate_pairs_(x.clone(), rows_cos[:, None], rows_sin[:, None]), expected)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "fused-qkv"])
def test_the_rotated_copy_lies_in_memory_as_its_input(layout: str) -> None:
    """Attention (sdpa and its backward) then sees the strides it sees natively: [B, L, H, D] order for a
    projection's view, dense even where the input is a strided slice."""
    x = layouts()[layout]
    out = rotation.rotate_pairs(x, *cos_sin(LENGTH, HEAD_DIM))
    order = sorted(range(4), key=lambda dim: -x.stride(dim))
    assert sorted(range(4), key=lambda dim: -out.stride(dim)) == order
    assert out.is_contiguous() or out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, HEAD_DIM // 2])
def test_gradient_equals_autograd_through_the_formula(rotary_dim: int, blocks: None) -> None:
    cos, sin = cos_sin(LENGTH, rotary_dim, tied=False)
    x = layouts()["transposed"].requires_grad_()
    weight = torch.randn(BATCH, HEADS, LENGTH, HEAD_DIM)
    (rotation.rotate_pairs(x, cos, sin) * weight).sum().backward()
    ours, x.grad = x.grad, None
    part, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    plain = torch.cat((part * cos + rotate_half(part) * sin, rest), dim=-1)
    (plain * weight).sum().backward()
    assert torch.equal(ours, x.grad)


def test_second_derivatives() -> None:
    cos, sin = (t.double() for t in cos_sin(5, 8, tied=False))
    x = torch.randn(2, 3, 5, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: rotation.rotate_pairs(t, cos, sin), (x,))
    assert torch.autograd.gradgradcheck(lambda t: rotation.rotate_pairs(t, cos, sin).pow(2), (x,))


def peak_new_bytes(step) -> int:
    """The most bytes ``step`` holds allocated at once beyond what existed before it (CPU allocator events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def test_no_full_size_temporaries() -> None:
    """transformers' formula holds three x-sized tensors at once; here: the result and one block's two products."""
    x = torch.randn(1, 8, 4096, 64)  # 8 MiB
    cos, sin = cos_sin(4096, 64)
    size, block = x.numel() * 4, rotation.BLOCK_ELEMENTS * 4
    assert peak_new_bytes(lambda: apply_rotary_pos_emb(x, x[:, :1], cos, sin, unsqueeze_dim=0)) >= 3 * size
    assert peak_new_bytes(lambda: rotation.rotate_pairs(x, cos, sin)) <= size + 2 * block + 65536
    assert peak_new_bytes(lambda: rotation.rotate_pairs_(x, cos, sin)) <= 2 * block + 65536


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_no_grad_gives_the_logits_of_a_forward_with_grad(family: str) -> None:
    """Under no_grad the carriers rotate q and k into new tensors, as with grad (they may be views of a projection's
    output, see tests/core/test_forward_hooks.py): both give the same logits, and a model-made cache keeps unrotated
    keys."""
    model = make_model(family)
    ps.swap(model, "rope")
    input_ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        no_grad = model(input_ids=input_ids, use_cache=family == "gpt2")
    with torch.enable_grad():
        with_grad = model(input_ids=input_ids, use_cache=family == "gpt2")
    torch.testing.assert_close(no_grad.logits, with_grad.logits.detach(), atol=1e-6, rtol=1e-6)
    if family == "gpt2":  # the cache GPT-2 made itself holds the keys unrotated, as under grad
        for ours, theirs in zip(no_grad.past_key_values.layers, with_grad.past_key_values.layers, strict=True):
            torch.testing.assert_close(ours.keys, theirs.keys.detach(), atol=1e-6, rtol=1e-6)


def test_a_bert_training_step_has_one_backward_node_per_rotation() -> None:
    """The backward of a rotation is one inverse rotation: no slice gradients filled with zeros, no cat backward."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, attn_implementation="sdpa")
    model = BertForMaskedLM(config).train()
    ps.swap(model, "rope")
    input_ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(0))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("_RotationBackward", 0) == 2 * config.num_hidden_layers  # q and k of every layer
    assert counts.get("aten::slice_backward", 0) == 0 and counts.get("CatBackward0", 0) == 0
    assert all(param.grad is not None for name, param in model.named_parameters() if "query" in name or "key" in name)
