"""ReRoPE and Leaky ReRoPE (Su 2023, "Rectified Rotary Position Embeddings") as a context-extension method.

The reference below is written from the authors' code, github.com/bojone/rerope at commit acfe788:
``rerope_patch.py`` and ``leaky_rerope_patch.py``, ``forward_*`` prefill branch (``q_len > 1``): full [q, kv] score
matrices with RoPE at the real positions (s1) and with queries at position w against unrotated keys (s2; leaky:
queries at (i + w (k - 1)) / k, keys at j / k, i.e. the linearly scaled rotary), merged as
``where(|i - j| < w, s1, s2)``, then the causal mask and a float32 softmax. Two parts of the patches are left out:
their log-n query scaling (a separate trick, kexue.fm/archives/8823) and the q_len == 1 branch (a decoding
shortcut that gives the same logits; here cached decoding is checked against a full recompute instead). The
reference runs as the attention function of an unswapped model whose own positions are switched off (LLaMA's
rotary made the identity, GPT-2's and BERT's tables zeroed), with cos/sin from transformers' LlamaRotaryEmbedding.
Tolerance: fp32, atol 1e-5 / rtol 1e-4 on logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import MAX_POSITIONS, left_padded, make_model, padding_position_ids
from test_self_extend_memory import LargestTensor
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, repeat_kv, rotate_half

import hf_posswap as ps
from hf_posswap.core import self_extend
from hf_posswap.core.state import swap_state
from hf_posswap.schemes.two_pass import ReRoPE

TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}
WINDOW, LEAK, TARGET = 16, 8.0, 4 * MAX_POSITIONS
VARIANTS = {"rerope": {"window": WINDOW}, "leaky": {"window": WINDOW, "leaky_factor": LEAK}}
REFERENCE = "rerope_reference"
HEADS, HEAD_DIM = 4, 16
SHARPEN = 8  # query and key weights are multiplied by this (see make)


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 90, (batch, length), generator=torch.Generator().manual_seed(seed))


def make(family: str, attn: str = "sdpa") -> nn.Module:
    """conftest's tiny model with query and key weights x SHARPEN, so that ReRoPE moves the logits clearly away from
    plain RoPE (by 2e-3 for BERT to 0.4 for LLaMA; with the random initialisation alone, 3e-5 to 4e-3)."""
    model = make_model(family, attn)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "query.weight", "key.weight")):
                parameter.mul_(SHARPEN)
            elif name.endswith("c_attn.weight"):  # GPT-2: [hidden, q | k | v]
                parameter[:, : 2 * HEADS * HEAD_DIM].mul_(SHARPEN)
    return model


def extended(family: str, variant: str, attn: str = "sdpa") -> nn.Module:
    model = make(family, attn)
    if family != "llama":
        ps.swap(model, "rope")
    return ps.extend_context(model, TARGET, "rerope", **VARIANTS[variant])


# ---- the reference (bojone/rerope) --------------------------------------------------------------------------


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on one tensor, cos/sin [B, L, D] broadcast over heads."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def reference_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReRoPE as in bojone/rerope's prefill branch, on unrotated query [B, H, q, D] and key/value [B, Hkv, kv, D]."""
    window, leak, positions = module.config.rerope_reference
    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                                              head_dim=HEAD_DIM, rope_theta=10_000.0))
    kv_len = key.shape[2]
    position_ids = positions if positions is not None else torch.arange(kv_len)[None]  # [1 or B, kv]
    key = repeat_kv(key, query.shape[1] // key.shape[1])
    value = repeat_kv(value, query.shape[1] // value.shape[1])
    cos, sin = rotary(value, position_ids)
    query1, key1 = rotate(query, cos, sin), rotate(key, cos, sin)
    if leak is None:  # rerope_patch.py: query_states2 at position_ids * 0 + window, key_states2 = key_states
        query2, key2 = rotate(query, *rotary(value, position_ids * 0 + window)), key
    else:  # leaky_rerope_patch.py: rotary_emb2 is linear scaling by k; queries at position_ids + window * (k - 1)
        query2 = rotate(query, *rotary(value, (position_ids + window * (leak - 1)) / leak))
        key2 = rotate(key, *rotary(value, position_ids / leak))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores1 = torch.matmul(query1, key1.transpose(2, 3)) * scale  # [B, H, q, kv]
    scores2 = torch.matmul(query2, key2.transpose(2, 3)) * scale
    rectified = (position_ids[:, :, None] - position_ids[:, None]).abs() < window  # [1 or B, q, kv]
    scores = torch.where(rectified[:, None], scores1, scores2)
    if getattr(module, "is_causal", True):
        future = torch.ones(kv_len, kv_len, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights  # [B, q, H, D]


AttentionInterface.register(REFERENCE, reference_attention)


class Unrotated(nn.Module):
    """cos = 1, sin = 0: LLaMA passes q and k to attention as they are."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*position_ids.shape, HEAD_DIM)
        return torch.ones(shape, dtype=x.dtype), torch.zeros(shape, dtype=x.dtype)


def reference_model(family: str, variant: str, positions: torch.Tensor | None = None) -> nn.Module:
    """The unswapped model, its own positions off, attention = :func:`reference_attention`."""
    model = make(family)
    with torch.no_grad():
        if family == "llama":
            model.model.rotary_emb = Unrotated()
        elif family == "gpt2":  # a zero table long enough for every test length
            model.transformer.wpe = nn.Embedding(TARGET, HEADS * HEAD_DIM)
            model.transformer.wpe.weight.zero_()
        else:
            model.bert.embeddings.position_embeddings.weight.zero_()
    model.config.rerope_reference = (WINDOW, VARIANTS[variant].get("leaky_factor"), positions)
    model.set_attn_implementation(REFERENCE)
    return model


def cases(families: tuple[str, ...], fast: set[str]) -> list:
    """(family, variant) params with ids like ``gpt2-leaky``; those not in ``fast`` are marked slow."""
    return [pytest.param(family, variant, id=f"{family}-{variant}",
                         marks=() if f"{family}-{variant}" in fast else pytest.mark.slow)
            for family in families for variant in VARIANTS]


ALL_FAMILIES, CAUSAL = ("llama", "gpt2", "bert"), ("llama", "gpt2")


@pytest.mark.parametrize(("family", "variant"), cases(ALL_FAMILIES, {"llama-rerope", "gpt2-leaky"}))
def test_logits_equal_the_authors_formula(family: str, variant: str) -> None:
    """Past the original length (causal: 150 tokens; BERT, whose reference table stops at 64: 60 tokens, still
    past the window): every position, both variants; and they differ from plain RoPE, so the check can fail."""
    length = 150 if family != "bert" else 60
    input_ids = tokens(1, length)
    model, plain = extended(family, variant), make(family)
    if family != "llama":
        ps.swap(plain, "rope")
    with torch.no_grad():
        ours = model(input_ids=input_ids).logits
        expected = reference_model(family, variant)(input_ids=input_ids).logits
        unextended = plain(input_ids=input_ids).logits
    torch.testing.assert_close(ours, expected, **TOLERANCE)
    assert (ours - unextended)[:, 2 * WINDOW:].abs().max() > 1e-3  # 100 x the tolerance


@pytest.mark.parametrize(("family", "variant"), cases(CAUSAL, set()))
def test_within_the_window_it_is_plain_rope(family: str, variant: str) -> None:
    """Inputs no longer than the window, and each causal row's first w positions, are plain RoPE (for LLaMA,
    transformers' own)."""
    model, plain = extended(family, variant), make(family)
    if family != "llama":
        ps.swap(plain, "rope")
    with torch.no_grad():
        short = tokens(2, WINDOW)
        torch.testing.assert_close(model(input_ids=short).logits, plain(input_ids=short).logits, **TOLERANCE)
        long = tokens(1, 100)
        torch.testing.assert_close(model(input_ids=long).logits[:, :WINDOW], plain(input_ids=long).logits[:, :WINDOW],
                                   **TOLERANCE)


@pytest.mark.parametrize(("family", "variant"), cases(CAUSAL, set()))
def test_explicit_position_ids_follow_the_formula(family: str, variant: str) -> None:
    """PoSE-style skipped positions per row (past the original length): the distances are position differences."""
    first = torch.cat((torch.arange(30), torch.arange(100, 130)))
    positions = torch.stack((first, torch.arange(60) * 2))
    input_ids = tokens(2, 60)
    with torch.no_grad():
        ours = extended(family, variant)(input_ids=input_ids, position_ids=positions).logits
        for row in range(2):
            expected = reference_model(family, variant, positions[row:row + 1])(input_ids=input_ids[row:row + 1])
            torch.testing.assert_close(ours[row], expected.logits[0], **TOLERANCE)


def generation(model: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor, use_cache: bool, **options: Any):
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0,
                         use_cache=use_cache, return_dict_in_generate=True, output_scores=True, **options)
    return out.sequences, torch.stack(out.scores, 1)


DECODING = {"greedy": {"do_sample": False}, "beams": {"num_beams": 3, "do_sample": False}}


GENERATION = [pytest.param(family, variant, length, decoding, id=f"{family}-{variant}-{where}-{decoding}",
                           marks=() if (family, where, decoding) == ("llama", "crossing-the-window", "greedy")
                           else pytest.mark.slow)
              for family, variant in (("llama", "rerope"), ("gpt2", "leaky"))
              for where, length in (("crossing-the-window", WINDOW - 4), ("past-the-original", MAX_POSITIONS + 6))
              for decoding in DECODING]


@pytest.mark.parametrize(("family", "variant", "length", "decoding"), GENERATION)
def test_cached_generation_equals_a_full_recompute(family: str, variant: str, length: int, decoding: str) -> None:
    """A left-padded batch, 8 new tokens, with and without the KV cache."""
    model = extended(family, variant)
    input_ids, mask = tokens(2, length, seed=3), torch.ones(2, length, dtype=torch.long)
    input_ids[1, :5], mask[1, :5] = 0, 0
    cached = generation(model, input_ids, mask, True, **DECODING[decoding])
    full = generation(model, input_ids, mask, False, **DECODING[decoding])
    assert torch.equal(cached[0], full[0])
    finite = torch.isfinite(full[1])  # beam search marks impossible continuations with -inf
    assert torch.equal(finite, torch.isfinite(cached[1]))
    torch.testing.assert_close(cached[1][finite], full[1][finite], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("family", "variant"), cases(ALL_FAMILIES, {"gpt2-rerope"}))
def test_left_padded_batch_equals_rows_alone(family: str, variant: str) -> None:
    lengths = (100, 40) if family != "bert" else (90, 30)
    rows = [tokens(1, n, seed=4 + i)[0] for i, n in enumerate(lengths)]
    batch, mask = left_padded(rows, lengths[0])
    model = extended(family, variant)
    with torch.no_grad():
        together = model(input_ids=batch, attention_mask=mask, position_ids=padding_position_ids(mask)).logits
        for i, row in enumerate(rows):
            torch.testing.assert_close(together[i, lengths[0] - len(row):], model(input_ids=row[None]).logits[0],
                                       **TOLERANCE)


@pytest.mark.parametrize(("family", "variant"), cases(ALL_FAMILIES, set()))
def test_eager_equals_sdpa_and_returns_the_weights(family: str, variant: str) -> None:
    input_ids = tokens(1, 120 if family != "bert" else 60)
    with torch.no_grad():
        eager = extended(family, variant, "eager")(input_ids=input_ids, output_attentions=True)
        sdpa = extended(family, variant)(input_ids=input_ids).logits
        expected = reference_model(family, variant)(input_ids=input_ids, output_attentions=True)
    torch.testing.assert_close(eager.logits, sdpa, **TOLERANCE)
    for ours, theirs in zip(eager.attentions, expected.attentions, strict=True):
        torch.testing.assert_close(ours, theirs, **TOLERANCE)


@pytest.mark.slow
def test_a_swap_with_the_config_equals_extend_context() -> None:
    """``swap(model, RopeConfig(scaling=ReRoPE(...)))`` runs the same attention (only the recorded lengths differ)."""
    input_ids = tokens(1, 150)
    swapped = make("llama")
    ps.swap(swapped, ps.RopeConfig(scaling=ReRoPE(window=WINDOW, leaky_factor=LEAK)))
    with torch.no_grad():
        assert torch.equal(swapped(input_ids=input_ids).logits, extended("llama", "leaky")(input_ids=input_ids).logits)
    assert swapped.config.posswap["scaling"] == {"method": "rerope", "factor": 1.0, "original_max_position_embeddings":
                                                 MAX_POSITIONS, "window": WINDOW, "leaky_factor": LEAK}


@pytest.mark.slow
@pytest.mark.parametrize(("family", "variant"), [("llama", "leaky"), ("gpt2", "rerope")], ids=["llama-leaky", "gpt2"])
def test_save_and_reload_round_trip(tmp_path: Path, family: str, variant: str) -> None:
    model = extended(family, variant)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == f"hf_posswap_{family}"  # never plain transformers: ReRoPE is not native anywhere
    assert saved["posswap"]["extension"]["scaling"] == {"method": "rerope", "factor": 4.0, "window": WINDOW,
                                                        "original_max_position_embeddings": MAX_POSITIONS,
                                                        "leaky_factor": VARIANTS[variant].get("leaky_factor")}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert ps.describe(loaded).context == ps.describe(model).context
    input_ids = tokens(1, 150)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=input_ids).logits, model(input_ids=input_ids).logits)
    if family == "llama":  # the native rotary comes back (GPT-2's table is not in the swapped checkpoint)
        ps.unswap(loaded)
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=input_ids[:, :MAX_POSITIONS]).logits,
                                       make(family)(input_ids=input_ids[:, :MAX_POSITIONS]).logits, **TOLERANCE)


@pytest.mark.slow
def test_standalone_export_loads_without_hf_posswap(tmp_path: Path) -> None:
    from test_export import load_without_hf_posswap

    model = extended("llama", "leaky")
    input_ids = tokens(1, 150)
    with torch.no_grad():
        torch.save({"input_ids": input_ids, "expected": model(input_ids=input_ids).logits}, tmp_path / "io.pt")
    ps.export_standalone(model, tmp_path / "export")
    assert "EQUAL" in load_without_hf_posswap(tmp_path / "export", tmp_path / "io.pt", "AutoModelForCausalLM")


def test_attention_holds_one_query_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Self-Extend's query-chunked path runs ReRoPE too: with 25 queries per chunk no intermediate reaches
    [B, H, q, kv] (which the probe sees when one chunk holds every query); nor does the merged path's."""
    length = 100
    input_ids = tokens(1, length)
    model = extended("llama", "rerope")
    with torch.no_grad(), LargestTensor() as merged:
        fused = model(input_ids=input_ids).logits
    assert merged.largest < HEADS * length * length
    monkeypatch.setattr(self_extend, "MERGED_MIN_QUERIES", {"cpu": length + 1})  # every call chunked
    with torch.no_grad(), LargestTensor() as whole:
        expected = model(input_ids=input_ids).logits
    assert whole.largest >= HEADS * length * length
    monkeypatch.setattr(self_extend, "CHUNK_ELEMENTS", HEADS * 25 * length)
    with torch.no_grad(), LargestTensor() as chunked:
        logits = model(input_ids=input_ids).logits
    assert chunked.largest < HEADS * length * length
    torch.testing.assert_close(logits, expected, **TOLERANCE)
    torch.testing.assert_close(fused, expected, **TOLERANCE)


BAD_OPTIONS = {
    "window-too-long": ({"window": MAX_POSITIONS}, ps.InvalidConfigError,
                        r"ReRoPE.window=64 must be shorter than the original length 64"),
    "window-not-int": ({"window": 8.5}, ps.InvalidConfigError, r"ReRoPE.window must be an integer >= 1, got 8.5"),
    "leak-one": ({"leaky_factor": 1}, ps.InvalidConfigError, r"leaky_factor must exceed 1 \(1 is plain RoPE\)"),
    "leak-short": ({"leaky_factor": 2.0}, ps.InvalidConfigError,
                   r"Leaky ReRoPE with leaky_factor=2.0 and window=16 reaches 112 tokens, short of 256; use "
                   r"leaky_factor >= 5"),
    "self-extend-option": ({"group_size": 4}, ps.InvalidOptionError,
                           r"'rerope' \(ReRoPE\) has no option 'group_size'. Its options are: factor, "
                           r"original_max_position_embeddings, window, leaky_factor"),
    "typo": ({"windw": 8}, ps.InvalidOptionError, r"no option 'windw'.*Did you mean 'window'\?"),
}


@pytest.mark.parametrize("name", BAD_OPTIONS)
def test_bad_options_are_refused_before_any_edit(name: str) -> None:
    options, error, message = BAD_OPTIONS[name]
    model = make_model("llama")
    before = model.config.to_dict()
    with pytest.raises(error, match=message):
        ps.extend_context(model, TARGET, "rerope", **({"window": WINDOW} | options))
    assert swap_state(model) is None and model.config.to_dict() == before


def test_configs_refuse_self_extend_fields_and_list_their_own() -> None:
    for field, value in (("neighbor_window", 8), ("exact_within_original", True)):
        with pytest.raises(ps.InvalidOptionError, match=rf"'rerope' \(ReRoPE\) has no option '{field}'. Its options "
                           r"are: factor, original_max_position_embeddings, window, leaky_factor"):
            ReRoPE.from_options(**{field: value})
        assert not hasattr(ReRoPE(), field)
    assert ReRoPE.option_names() == ["factor", "original_max_position_embeddings", "window", "leaky_factor"]
    assert "rerope" in ps.available_extension_methods()
    settings = ReRoPE(leaky_factor=3.0).with_original(64).attention_settings()
    assert (settings.group, settings.window, settings.start, settings.floor) == (3.0, 16, 16, False)
    assert math.isinf(ReRoPE().with_original(64).attention_settings().group)


@pytest.mark.slow
def test_the_cli_extends_with_rerope(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from conftest import save_tiny_checkpoint

    from hf_posswap.cli import main

    save_tiny_checkpoint("llama", tmp_path / "llama")
    assert main(["extend", "--model", str(tmp_path / "llama"), "--to", "256", "--method", "rerope", "--option",
                 "window=16", "--option", "leaky_factor=8", "--output", str(tmp_path / "long")]) == 0
    saved = json.loads((tmp_path / "long" / "config.json").read_text())
    assert saved["posswap"]["scaling"]["window"] == 16 and saved["posswap"]["scaling"]["leaky_factor"] == 8
