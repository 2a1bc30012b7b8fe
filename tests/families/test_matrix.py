"""Every family x scheme: forward/backward, eager == sdpa, cache == no cache, padding, static cache, long inputs,
output_attentions. Ids read ``gpt2-alibi`` so ``pytest -k alibi`` selects one scheme."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    CAUSAL_FAMILIES,
    FAMILIES,
    MAX_POSITIONS,
    SCHEMES,
    VOCAB,
    make_model,
    padding_position_ids,
    swapped,
)
from test_checkpoints import logits

import hf_posswap as ps
from hf_posswap.core.input_positions import reads_query_positions
from hf_posswap.schemes import BiasPositions

MATRIX = [pytest.param(f, s, id=f"{f}-{s}") for f in FAMILIES for s in SCHEMES]
CAUSAL_MATRIX = [pytest.param(f, s, id=f"{f}-{s}") for f in CAUSAL_FAMILIES for s in SCHEMES]


def generate_logits(model: torch.nn.Module, input_ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy generation; returns (sequences, per-step logits [B, steps, vocab]) so tests compare numbers, not
    just argmax tokens."""
    out = model.generate(
        input_ids, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True, **kwargs
    )
    return out.sequences, torch.stack(out.logits, dim=1)


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


@pytest.mark.parametrize(("family", "scheme"), MATRIX)
def test_forward_backward(family: str, scheme: str) -> None:
    model = swapped(family, scheme).train()
    input_ids = tokens(2, 24)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    for name, _shape, trainable in ps.describe(model).new_parameters:
        param = model.get_parameter(name)
        if trainable:
            assert param.grad is not None and torch.isfinite(param.grad).all(), name
            assert param.grad.abs().sum() > 0, f"{name} gets no gradient"


@pytest.mark.parametrize(("family", "scheme"), MATRIX)
def test_eager_matches_sdpa(family: str, scheme: str) -> None:
    eager, sdpa = swapped(family, scheme, "eager"), swapped(family, scheme, "sdpa")
    input_ids = tokens(2, 20)
    mask = torch.ones_like(input_ids)
    mask[1, :5] = 0
    kwargs = {"input_ids": input_ids, "attention_mask": mask, "position_ids": padding_position_ids(mask)}
    with torch.no_grad():
        out_eager, out_sdpa = eager(**kwargs).logits, sdpa(**kwargs).logits
    torch.testing.assert_close(out_eager[mask.bool()], out_sdpa[mask.bool()], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("family", "scheme"), CAUSAL_MATRIX)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_cached_generation_equals_recompute(family: str, scheme: str, attn: str) -> None:
    model = swapped(family, scheme, attn)
    input_ids = tokens(1, 8)
    cached, cached_logits = generate_logits(model, input_ids, max_new_tokens=12, use_cache=True)
    recomputed, recomputed_logits = generate_logits(model, input_ids, max_new_tokens=12, use_cache=False)
    assert torch.equal(cached, recomputed)
    torch.testing.assert_close(cached_logits, recomputed_logits, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("family", "scheme"), CAUSAL_MATRIX)
def test_static_cache_equals_dynamic(family: str, scheme: str) -> None:
    model = swapped(family, scheme)
    input_ids = tokens(1, 8)
    dynamic, dynamic_logits = generate_logits(model, input_ids, max_new_tokens=10)
    static, static_logits = generate_logits(model, input_ids, max_new_tokens=10, cache_implementation="static")
    assert torch.equal(dynamic, static)
    torch.testing.assert_close(dynamic_logits, static_logits, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("family", "scheme"), CAUSAL_MATRIX)
def test_left_padded_generation_equals_rows_alone(family: str, scheme: str) -> None:
    model = swapped(family, scheme)
    rows = [tokens(1, 10, seed=2)[0], tokens(1, 6, seed=3)[0]]
    width = max(len(r) for r in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, row in enumerate(rows):
        batch[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    together, together_logits = generate_logits(model, batch, attention_mask=mask, max_new_tokens=8)
    for i, row in enumerate(rows):
        alone, alone_logits = generate_logits(model, row[None], max_new_tokens=8)
        assert torch.equal(together[i, width:], alone[0, len(row):]), f"row {i}"
        torch.testing.assert_close(together_logits[i], alone_logits[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("family", "scheme"), MATRIX)
def test_left_padded_forward_equals_rows_alone(family: str, scheme: str) -> None:
    model = swapped(family, scheme)
    rows = [tokens(1, 12, seed=4)[0], tokens(1, 7, seed=5)[0]]
    width = max(len(r) for r in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, row in enumerate(rows):
        batch[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    position_ids = padding_position_ids(mask)
    if family == "roberta":  # RoBERTa numbers positions from padding_idx + 1
        position_ids = position_ids + model.config.pad_token_id + 1
    with torch.no_grad():
        together = model(input_ids=batch, attention_mask=mask, position_ids=position_ids).logits
        for i, row in enumerate(rows):
            alone = model(input_ids=row[None]).logits[0]
            torch.testing.assert_close(together[i, width - len(row):], alone, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("family", "scheme"), MATRIX)
def test_inputs_longer_than_trained_length(family: str, scheme: str) -> None:
    model = swapped(family, scheme)
    input_ids = tokens(1, MAX_POSITIONS + 36)
    if scheme == "learned":  # a table that was not grown has a hard limit, with an error that says what to do
        last = MAX_POSITIONS + 35 + (model.config.pad_token_id + 1 if family == "roberta" else 0)  # RoBERTa: from 2
        with pytest.raises(IndexError, match=rf"Position {last} is past the end of the learned position table"):
            model(input_ids=input_ids)
        ps.swap(model, ps.LearnedConfig(max_positions=2 * MAX_POSITIONS), replace=True)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert logits.shape[1] == MAX_POSITIONS + 36 and torch.isfinite(logits).all()


@pytest.mark.parametrize(("family", "scheme"), MATRIX)
def test_output_attentions_include_the_scheme(family: str, scheme: str) -> None:
    """With q = 0 the logits are the position bias alone, so the weights must be softmax(bias + mask)."""
    model = swapped(family, scheme, "eager")
    base = model.base_model
    for module in base.modules():  # zero the query projections
        for name in ("q_proj", "query"):
            if isinstance(getattr(module, name, None), torch.nn.Linear):
                torch.nn.init.zeros_(getattr(module, name).weight)
                torch.nn.init.zeros_(getattr(module, name).bias) if getattr(module, name).bias is not None else None
    if family == "gpt2":
        for block in base.h:  # c_attn packs q, k, v: zero the q third
            with torch.no_grad():
                block.attn.c_attn.weight[:, :64] = 0
                block.attn.c_attn.bias[:64] = 0
    if family == "phi3":
        for layer in base.layers:  # qkv_proj packs [q | k | v] along its output: zero the q rows
            with torch.no_grad():
                layer.self_attn.qkv_proj.weight[:64] = 0
    if family == "gpt_neox":
        for layer in base.layers:  # query_key_value packs (q, k, v) per head: [H * 3 * D] outputs
            with torch.no_grad():
                layer.attention.query_key_value.weight.view(4, 3, 16, 64)[:, 0] = 0
                layer.attention.query_key_value.bias.view(4, 3, 16)[:, 0] = 0
    input_ids = tokens(1, 10)
    with torch.no_grad():
        attentions = model(input_ids=input_ids, output_attentions=True).attentions
    assert attentions is not None and len(attentions) == 2
    weights = attentions[0][0]  # [H, q, kv]
    causal = family in CAUSAL_FAMILIES
    positions = torch.arange(10)
    scheme_module = getattr(base, "posswap_positions", None)
    if isinstance(scheme_module, BiasPositions):
        bias = scheme_module(positions, positions, 0, causal)[0]
    else:
        bias = torch.zeros(4, 10, 10)  # absolute and rotary schemes cannot act on a zero query
    if causal:
        bias = bias.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(weights, bias.softmax(-1), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_t5_tables_per_layer(family: str) -> None:
    """shared_across_layers=False: each layer reads its own table (the per-forward memo must not mix them)."""
    models = {}
    for attn in ("eager", "sdpa"):
        model = make_model(family, attn)
        ps.swap(model, ps.T5BiasConfig(num_buckets=16, max_distance=32, shared_across_layers=False))
        tables = model.base_model.posswap_positions.tables
        assert len(tables) == 2
        torch.manual_seed(3)
        with torch.no_grad():
            for table in tables:
                table.weight.copy_(3 * torch.randn_like(table.weight))
        models[attn] = model
    input_ids = tokens(1, 12)
    with torch.no_grad():
        eager = models["eager"](input_ids=input_ids, output_attentions=True)
        sdpa = models["sdpa"](input_ids=input_ids)
        # layer 1 with layer 0's table must give different logits
        tables = models["sdpa"].base_model.posswap_positions.tables
        tables[1].weight.copy_(tables[0].weight)
        mixed = models["sdpa"](input_ids=input_ids)
    torch.testing.assert_close(eager.logits, sdpa.logits, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(sdpa.logits, mixed.logits, atol=1e-4)


IN_ATTENTION = [pytest.param(f, s, id=f"{f}-{s}") for f in FAMILIES for s in ("rope", "alibi", "t5")
                if not (f == "llama" and s == "rope")]


@pytest.mark.parametrize(("family", "scheme"), IN_ATTENTION)
def test_explicit_position_ids_reach_attention(family: str, scheme: str) -> None:
    """Position ids passed for unpadded, uncached input (PoSE training) are the positions attention uses:
    arange equals the default, a constant shift changes nothing for relative schemes (and changes FIRE, whose
    normaliser reads the query's position), a skip changes the
    logits, and rows with different ids in one batch equal each row alone."""
    model = swapped(family, scheme)
    input_ids = tokens(2, 16)
    first = model.config.pad_token_id + 1 if family == "roberta" else 0  # RoBERTa numbers from padding_idx + 1
    arange = torch.arange(16)[None].expand(2, -1) + first
    skipped = torch.cat([torch.arange(8), torch.arange(8) + 40])[None] + first
    with torch.no_grad():
        default = model(input_ids=input_ids).logits
        torch.testing.assert_close(model(input_ids=input_ids, position_ids=arange).logits, default)
        shifted = model(input_ids=input_ids, position_ids=arange + 5).logits
        if reads_query_positions(getattr(model.base_model, "posswap_positions", None)):  # FIRE reads i itself
            assert not torch.allclose(shifted, default, atol=1e-4)
        else:
            torch.testing.assert_close(shifted, default, atol=1e-5, rtol=1e-4)
        mixed = torch.cat([arange[:1], skipped])
        together = model(input_ids=input_ids, position_ids=mixed).logits
        alone = model(input_ids=input_ids[1:], position_ids=skipped).logits
    torch.testing.assert_close(together[1:], alone, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(together[:1], default[:1], atol=1e-5, rtol=1e-4)
    assert (alone - default[1:]).abs().max() > 1e-6  # the skip is seen (tiny random BERT: small effect)


def packed_logits(
    model: torch.nn.Module, lengths: tuple[int, ...] = (9, 15)
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences packed into one row, as training packs them: a block-diagonal causal 4-D mask and position ids
    counting from 0 in each sequence. Returns (packed logits, the sequence's logits alone) per sequence."""
    sequences = [tokens(1, length, seed=index + 1) for index, length in enumerate(lengths)]
    segment = torch.cat([torch.full((length,), index) for index, length in enumerate(lengths)])  # [T]
    causal = torch.ones(len(segment), len(segment), dtype=torch.bool).tril()
    mask = ((segment[:, None] == segment[None, :]) & causal)[None, None]  # [1, 1, T, T]
    position_ids = torch.cat([torch.arange(length) for length in lengths])[None]
    with torch.no_grad():
        packed = model(input_ids=torch.cat(sequences, 1), attention_mask=mask, position_ids=position_ids).logits
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        return [(packed[:, starts[i]:starts[i + 1]], model(input_ids=sequence).logits)
                for i, sequence in enumerate(sequences)]


@pytest.mark.parametrize(("family", "scheme"), CAUSAL_MATRIX)
def test_packed_sequences_equal_each_sequence_alone(family: str, scheme: str) -> None:
    """Packed sequences beside a block-diagonal 4-D mask are placed by their position ids: each one's logits equal
    the sequence alone. Distances within a sequence are the same by index, but FIRE's normaliser psi(max(i, L))
    reads the query's own position, which the index would count from the first sequence (0.04 in its logits)."""
    for packed, alone in packed_logits(swapped(family, scheme)):
        torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama4-temperature", "self-extend"])
def test_packed_sequences_equal_each_alone_with_absolute_position_parts(name: str) -> None:
    """Llama 4's query temperature and Self-Extend's groups floor(pos / G) read absolute positions too (3e-4 and
    1e-3 in the second sequence's logits when read by index); the first sequence has an odd length so that Self-Extend's
    groups would split differently."""
    model = make_model("llama")
    if name == "self-extend":
        ps.swap(model, ps.RopeConfig(scaling=ps.SelfExtend(group_size=2, neighbor_window=4)))
    else:
        ps.swap(model, ps.llama4_irope(model, no_rope_layer_interval=2, floor_scale=4))
    for packed, alone in packed_logits(model):
        torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-4)


def test_roberta_position_ids_in_its_own_numbering_place_the_sequence_as_without_ids() -> None:
    """RoBERTa numbers positions from padding_idx + 1 (its table's rows); FIRE's normaliser reads the query's own
    position, so attention counts those ids from 0 (read as they were, they moved FIRE's logits by 4.4e-4)."""
    model = swapped("roberta", "fire")
    input_ids = tokens(2, 12)
    numbered = torch.arange(12)[None].expand(2, -1) + model.config.pad_token_id + 1
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=input_ids, position_ids=numbered).logits,
                                   model(input_ids=input_ids).logits, atol=1e-6, rtol=1e-5)
    # 0-based ids are not RoBERTa's: its table would read them as other rows, and clamped they put three tokens at 0
    with pytest.raises(ps.InvalidConfigError, match=r"position_ids start at 0, and roberta numbers .* \+ 2"):
        model(input_ids=input_ids, position_ids=torch.arange(12)[None])


@pytest.mark.parametrize("scheme", ["t5", "alibi", "learned"])
def test_an_integer_four_d_mask_is_refused_with_the_fix(scheme: str) -> None:
    """A 4-D mask is used as given: an integer one of 1s and 0s was added to the logits as it is by the dense bias
    path and eager attention, hiding nothing (1.9e-2 in T5's logits of packed sequences)."""
    model = swapped("gpt2", scheme)
    causal = torch.ones(1, 1, 8, 8, dtype=torch.long).tril()
    with pytest.raises(ps.InvalidConfigError, match=r"4-D torch.int64 .*attention_mask.bool\(\)"):
        model(input_ids=tokens(1, 8), attention_mask=causal)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens(1, 8), attention_mask=causal.bool()).logits,
                                   model(input_ids=tokens(1, 8)).logits)


def future_leak(model: torch.nn.Module) -> float:
    """How much the first of two packed sequences' logits move when the second one's tokens change, with ids that
    restart and no mask between the sequences (transformers gives sdpa none while it makes a KV cache): nonzero
    means a query saw later tokens, which a causal model must never do."""
    first, second, other = tokens(1, 9, seed=1), tokens(1, 15, seed=2), tokens(1, 15, seed=3)
    position_ids = torch.cat([torch.arange(9), torch.arange(15)])[None]
    with torch.no_grad():
        seen = [model(input_ids=torch.cat([first, later], 1), position_ids=position_ids, use_cache=True).logits[:, :9]
                for later in (second, other)]
    return float((seen[0] - seen[1]).abs().max())


@pytest.mark.parametrize(("family", "scheme"), CAUSAL_MATRIX)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_position_ids_that_restart_never_show_a_query_later_tokens(family: str, scheme: str, attn: str) -> None:
    """Causality follows token order, whatever the positions: bias schemes built it from the positions, so a query
    saw the later tokens whose restarted ids are smaller (0.34 in ALiBi's logits with sdpa)."""
    assert future_leak(swapped(family, scheme, attn=attn)) == 0


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_restarting_position_ids_never_show_self_extend_later_tokens(attn: str) -> None:
    model = make_model("llama", attn=attn)
    ps.swap(model, ps.RopeConfig(scaling=ps.SelfExtend(group_size=2, neighbor_window=4)))
    assert future_leak(model) == 0


#: swaps placed by hf_posswap's attention (natively carried RoPE honours any position ids through transformers)
PLACED_BY_HOOK = [pytest.param(f, s, id=f"{f}-{s}") for f in FAMILIES for s in ("alibi", "t5")] + [
    pytest.param(f, s, id=f"{f}-{s}") for f, s in (("gpt2", "rope"), ("bert", "rope"), ("llama", "xpos"))]


@pytest.mark.parametrize(("family", "scheme"), PLACED_BY_HOOK)
def test_padded_rows_with_position_ids_that_skip_are_refused(family: str, scheme: str) -> None:
    """A padded batch is placed by distances between its real tokens: ids that count them (as ``generate`` makes
    for left padding) give the same logits as no ids; ids that skip (PoSE's) cannot be honoured there and raise
    instead of being silently replaced."""
    model = swapped(family, scheme)
    input_ids = tokens(2, 16)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :4] = 0  # row 1 left-padded by 4
    counting = (mask.cumsum(-1) - 1).clamp(min=0)
    skipped = torch.cat([torch.arange(8), torch.arange(8) + 40])[None].expand(2, -1)
    with torch.no_grad():
        plain = model(input_ids=input_ids, attention_mask=mask).logits
        counted = model(input_ids=input_ids, attention_mask=mask, position_ids=counting).logits
        torch.testing.assert_close(counted[mask.bool()], plain[mask.bool()], atol=1e-5, rtol=1e-4)
        with pytest.raises(ps.InvalidConfigError, match=r"position_ids of the padded rows \[0, 1\] skip"):
            model(input_ids=input_ids, attention_mask=mask, position_ids=skipped)


@pytest.mark.parametrize("family", ["gpt2", "bert", "llama"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_sinusoidal_in_half_precision(family: str, dtype: torch.dtype) -> None:
    reference = logits(swapped(family, "sinusoidal"))
    model = make_model(family).to(dtype)
    ps.swap(model, "sinusoidal")
    out = logits(model)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert torch.allclose(out.float(), reference, atol=0.1)  # the same model, rounded
