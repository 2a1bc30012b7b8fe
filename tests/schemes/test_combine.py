"""``combine="concat"`` for the absolute schemes: the token embedding and the position vector are
concatenated and projected back to the hidden size by a map that starts as plain addition, ``[I | I]``.

The reference for "starts where the additive model does" is the unswapped model itself (transformers' own GPT-2 and
BERT add their learned table) and the ``combine="add"`` swap (LLaMA, sinusoidal)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import FAMILIES, VOCAB, make_model, padding_position_ids
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

import hf_posswap as ps
from hf_posswap.errors import InvalidConfigError

ABSOLUTE = ["learned", "sinusoidal"]
CORE = ["gpt2", "bert", "llama"]
#: RoBERTa's table slot numbers positions from padding_idx + 1 (its embeddings build the ids), while the hook that
#: concatenates numbers them from 0: the concatenated model reads other rows (change requested in core/context.py)
MATRIX = [pytest.param(f, s, id=f"{f}-{s}") for f in CORE for s in ABSOLUTE]
FAST = {"gpt2-learned", "bert-learned", "llama-sinusoidal"}  # the default run; the rest is marked slow
ALL_FAMILIES = [
    pytest.param(f, s, id=f"{f}-{s}", marks=[pytest.mark.slow][: f"{f}-{s}" not in FAST])
    for f in FAMILIES for s in ABSOLUTE
]
AUTO = {"gpt2": AutoModelForCausalLM, "llama": AutoModelForCausalLM, "bert": AutoModelForMaskedLM}
INPUT = torch.randint(3, VOCAB, (2, 30), generator=torch.Generator().manual_seed(0))


def logits(model: torch.nn.Module, input_ids: torch.Tensor = INPUT, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids, **kwargs).logits


def concat_model(family: str, scheme: str, attn: str = "sdpa", trained: bool = True) -> torch.nn.Module:
    """A model swapped to ``scheme`` with concatenation; ``trained`` moves the projection off [I | I] (as training
    would), so a check that loses or re-initialises it sees a different model."""
    model = make_model(family, attn)
    ps.swap(model, scheme, combine="concat")
    if trained:
        projection = model.base_model.posswap_positions.projection.weight
        with torch.no_grad():
            projection.add_(0.05 * torch.randn(projection.shape, generator=torch.Generator().manual_seed(3)))
    return model


@pytest.mark.parametrize(("family", "scheme"), ALL_FAMILIES)
def test_concat_starts_where_add_does(family: str, scheme: str) -> None:
    added = make_model(family)
    ps.swap(added, scheme)
    joined = concat_model(family, scheme, trained=False)
    expected = logits(added)
    if family in ("bert", "roberta"):
        # BERT's and RoBERTa's embeddings add token types first, (e + t) + p; concatenation enters as (e + p), then + t:
        # the same sum in another order, one float32 rounding apart (seen: 2.4e-7)
        torch.testing.assert_close(logits(joined), expected, rtol=0, atol=1e-5)
    else:
        assert torch.equal(logits(joined), expected)
    if scheme == "learned" and family in ("gpt2", "bert", "roberta"):  # the kept table: transformers' model, unswapped
        native = logits(make_model(family))
        torch.testing.assert_close(logits(joined), native, rtol=0, atol=0 if family == "gpt2" else 1e-5)


def test_the_projection_is_identity_pairs_and_the_position_half_is_the_table() -> None:
    model = make_model("gpt2")
    table = model.transformer.wpe.weight.detach().clone()
    ps.swap(model, "learned", combine="concat")
    module = model.transformer.posswap_positions
    eye = torch.eye(64)
    assert torch.equal(module.projection.weight, torch.cat((eye, eye), dim=1))
    assert torch.equal(module(torch.arange(10)[None])[0], table[:10])  # ids alone: what the positions add
    assert [name for name, _, _ in ps.describe(model).new_parameters] == [
        "transformer.posswap_positions.positions.weight", "transformer.posswap_positions.projection.weight"]
    assert ps.describe(model).settings["combine"] == "concat"


@pytest.mark.parametrize("scheme", ["learned", pytest.param("sinusoidal", marks=pytest.mark.slow)])
def test_concat_trains_both_halves_of_the_projection(scheme: str) -> None:
    model = concat_model("llama", scheme, trained=False).train()
    module = model.model.posswap_positions
    loss = model(input_ids=INPUT, labels=INPUT).loss
    loss.backward()
    grad = module.projection.weight.grad
    assert grad is not None and grad[:, :64].abs().sum() > 0 and grad[:, 64:].abs().sum() > 0
    if scheme == "learned":
        assert module.positions.weight.grad.abs().sum() > 0
    before = logits(model)
    with torch.no_grad():
        module.projection.weight.sub_(1.0 * grad)
    assert not torch.allclose(logits(model), before)  # the projection is on the forward path


def test_peft_trains_the_saved_copy_of_the_projection() -> None:
    from peft import get_peft_model

    model = concat_model("gpt2", "learned", trained=False)
    config = ps.lora_config(model, r=2)
    assert config.modules_to_save == ["posswap_positions"]
    peft_model = get_peft_model(model, config)
    expected = logits(peft_model)
    copy_ = peft_model.base_model.model.transformer.posswap_positions.modules_to_save["default"]
    with torch.no_grad():
        copy_.projection.weight.mul_(0.5)
    assert not torch.allclose(logits(peft_model), expected)  # the copy peft trains is the one called


@pytest.mark.parametrize(("family", "scheme"), [
    pytest.param("gpt2", "learned", id="gpt2-learned"),
    pytest.param("bert", "sinusoidal", id="bert-sinusoidal", marks=pytest.mark.slow),
    pytest.param("llama", "learned", id="llama-learned", marks=pytest.mark.slow)])
def test_concat_round_trips_through_auto_classes(tmp_path: Path, family: str, scheme: str) -> None:
    model = concat_model(family, scheme)
    model.save_pretrained(tmp_path)
    loaded = AUTO[family].from_pretrained(tmp_path).eval()
    assert ps.describe(loaded).settings["combine"] == "concat"
    assert torch.equal(logits(loaded), logits(model))


@pytest.mark.slow
@pytest.mark.parametrize(("family", "scheme"), [("gpt2", "learned"), ("llama", "sinusoidal")],
                         ids=lambda value: str(value))
def test_concat_exports_standalone(tmp_path: Path, family: str, scheme: str) -> None:
    from test_export import load_without_hf_posswap

    model = concat_model(family, scheme)
    input_ids = torch.randint(3, VOCAB, (1, 40))
    torch.save({"input_ids": input_ids, "expected": logits(model, input_ids)}, tmp_path / "io.pt")
    ps.export_standalone(model, tmp_path / "export")
    assert "EQUAL" in load_without_hf_posswap(tmp_path / "export", tmp_path / "io.pt", "AutoModelForCausalLM")


@pytest.mark.parametrize(("family", "scheme"), [
    pytest.param(f, s, id=f"{f}-{s}", marks=[pytest.mark.slow][: s == "sinusoidal"]) for f in CORE for s in ABSOLUTE])
def test_unswap_after_concat_restores_exactly(family: str, scheme: str) -> None:
    model = make_model(family)
    before, keys = logits(model), list(model.state_dict())
    modules = dict(model.named_modules())
    config_before = model.config.to_dict()
    ps.swap(model, scheme, combine="concat")
    ps.unswap(model)
    assert torch.equal(logits(model), before)
    assert list(model.state_dict()) == keys
    assert dict(model.named_modules()) == modules
    assert model.config.to_dict() == config_before


@pytest.mark.parametrize("family", [pytest.param(f, marks=[pytest.mark.slow][: f != "bert"]) for f in CORE])
def test_concat_eager_matches_sdpa(family: str) -> None:
    mask = torch.ones_like(INPUT)
    mask[1, :5] = 0
    kwargs = {"attention_mask": mask, "position_ids": padding_position_ids(mask)}
    eager = logits(concat_model(family, "learned", "eager"), **kwargs)
    sdpa = logits(concat_model(family, "learned", "sdpa"), **kwargs)
    # padding rows attend to nothing: eager and sdpa fill them differently, so only real tokens are compared
    torch.testing.assert_close(sdpa[mask.bool()], eager[mask.bool()], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", [pytest.param("gpt2", marks=pytest.mark.slow), "llama"])
def test_concat_cached_steps_equal_the_full_forward(family: str) -> None:
    model = concat_model(family, "sinusoidal" if family == "gpt2" else "learned")
    full = logits(model)
    with torch.no_grad():
        first = model(input_ids=INPUT[:, :20], use_cache=True)
        cache = first.past_key_values
        steps = [model(input_ids=INPUT[:, t:t + 1], past_key_values=cache, use_cache=True).logits
                 for t in range(20, INPUT.shape[1])]
    torch.testing.assert_close(torch.cat([first.logits, *steps], dim=1), full, rtol=1e-4, atol=1e-5)
    generated = model.generate(INPUT[:1, :10], max_new_tokens=8, do_sample=False)
    uncached = model.generate(INPUT[:1, :10], max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(generated, uncached)


def test_concat_copies_are_independent() -> None:
    model = concat_model("llama", "learned")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.model.posswap_positions.projection.weight.zero_()
    assert not torch.allclose(logits(twin), logits(model))


@pytest.mark.parametrize("value", ["cat", pytest.param("ADD", marks=pytest.mark.slow), None,
                                   pytest.param(1, marks=pytest.mark.slow)])
def test_unknown_combine_is_refused_before_any_edit(value) -> None:
    model = make_model("gpt2")
    before = logits(model)
    with pytest.raises(InvalidConfigError, match=r"combine must be 'add' .* or 'concat'"):
        ps.swap(model, "learned", combine=value)
    with pytest.raises(InvalidConfigError, match=repr(value).replace("(", r"\(")):
        ps.SinusoidalConfig(combine=value)
    assert ps.describe(model).scheme == "native" and torch.equal(logits(model), before)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_extending_a_concatenated_table_is_refused_and_leaves_the_model(family: str) -> None:
    """Growing a concatenated table would lose the trained projection: refused clearly, before any edit."""
    model = concat_model(family, "learned")
    before = logits(model)
    with pytest.raises(InvalidConfigError, match=r"combine='concat'.*does not support yet.*Extend before swapping"):
        ps.extend_context(model, 128, "copy")
    assert torch.equal(logits(model), before) and model.config.max_position_embeddings == 64
