"""Reloading swapped checkpoints: nothing loads as the wrong model (position weights are never dropped or
invented, edited records are caught), a reloaded model supports every operation an in-memory one does (unswap,
swap again, extend, save), and swapped configs and models pickle."""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from conftest import CAUSAL_FAMILIES, FAMILIES, MAX_POSITIONS, NATIVE_PAIRS, VOCAB, edit_config, make_model, swapped
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, GPT2LMHeadModel

import hf_posswap as ps
from hf_posswap.core.native import check_loaded
from hf_posswap.core.state import swap_state
from hf_posswap.persistence.restore import NativeWeightsMissingWarning, check_checkpoint_keys

AUTO = {family: AutoModelForCausalLM if family in CAUSAL_FAMILIES else AutoModelForMaskedLM
        for family in FAMILIES}
INPUT = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
NON_NATIVE = [(f, s) for f in FAMILIES for s in ps.available_schemes() if (f, s) not in NATIVE_PAIRS]
TABLE_FAMILIES = ("gpt2", "bert", "roberta")  # families whose native table a swapped checkpoint does not hold


def logits(model: torch.nn.Module, input_ids: torch.Tensor = INPUT) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def _save(path: Path, family: str = "gpt2", scheme: str = "t5") -> Path:
    swapped(family, scheme).save_pretrained(path)
    return path


def _structure(model: torch.nn.Module) -> dict[str, str]:
    return {name: type(module).__name__ for name, module in model.named_modules()}


# --- never drop, never invent position weights ---------------------------------------------------------


@pytest.mark.parametrize("record", [None, {}], ids=["record-removed", "record-emptied"])
def test_swapped_model_type_without_record_is_refused(tmp_path: Path, record) -> None:
    path = _save(tmp_path)
    edit_config(path, lambda config: config.pop("posswap") if record is None else config.update(posswap=record))
    with pytest.raises(ps.InvalidConfigError, match=r"model_type 'hf_posswap_gpt2'.*no 'posswap' record \(got "
                       + (r"None" if record is None else r"\{\}") + r"\).*Restore the 'posswap' entry"):
        AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize(("family", "scheme", "key"), [
    ("gpt2", "t5", "transformer.posswap_positions.tables.0.weight"),
    ("gpt2", "alibi", "transformer.posswap_positions.slopes"),
    ("gpt2", "learned", "transformer.wpe.weight"),
    ("bert", "rope", "bert.posswap_positions.inv_freq"),
])
def test_missing_position_weights_are_refused(tmp_path: Path, family: str, scheme: str, key: str) -> None:
    path = _save(tmp_path, family, scheme)
    weights = load_file(path / "model.safetensors")
    assert key in weights
    del weights[key]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ps.InvalidConfigError, match=rf"lacks the position weights \['{key}'\].*scheme '{scheme}'"):
        AUTO[family].from_pretrained(path)


def test_leftover_position_weights_are_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, "gpt2", "t5")
    edit_config(path, lambda config: config.update(posswap={"version": 1, "family": "gpt2", "scheme": "none"}))
    with pytest.raises(ps.InvalidConfigError, match=r"holds position weights "
                       r"\['transformer.posswap_positions.tables.0.weight'\].*scheme 'none'.*would drop them"):
        AutoModelForCausalLM.from_pretrained(path)


def test_loading_info_is_still_returned_when_asked(tmp_path: Path) -> None:
    path = _save(tmp_path, "gpt2", "alibi")
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert swap_state(model).config.name == "alibi" and not info["missing_keys"] and not info["unexpected_keys"]


def test_model_type_edited_back_to_the_family_is_detected(tmp_path: Path) -> None:
    path = _save(tmp_path, "gpt2", "t5")
    edit_config(path, lambda config: config.update(model_type="gpt2"))
    plain = AutoModelForCausalLM.from_pretrained(path)  # plain transformers: nothing hf_posswap can hook into
    message = (
        r"carries config.posswap \(scheme 't5'\) but was loaded as plain 'gpt2'.*"
        r"\"model_type\": \"hf_posswap_gpt2\""
    )
    for call in (check_loaded, ps.describe, lambda model: ps.extend_context(model, 128)):
        with pytest.raises(ps.InvalidConfigError, match=message):
            call(plain)


def test_a_swapped_checkpoint_loaded_by_the_plain_class_names_the_auto_class(tmp_path: Path) -> None:
    """GPT2LMHeadModel.from_pretrained on a swapped checkpoint (config.json as saved) does not rebuild the swap; the
    fix is the Auto class, not an edit of a model_type that is already right."""
    path = _save(tmp_path, "gpt2", "t5")
    plain = GPT2LMHeadModel.from_pretrained(path)
    with pytest.raises(ps.InvalidConfigError, match=(
            r"loaded from a checkpoint that hf_posswap swapped to 't5' \(model_type 'hf_posswap_gpt2'\) by the plain "
            r"class's GPT2LMHeadModel.from_pretrained.*Load it with an Auto class")) as refused:
        ps.describe(plain)
    assert "hf_posswap_hf_posswap" not in str(refused.value)


@pytest.mark.parametrize("scaling", [ps.SelfExtend(factor=4.0), ps.ReRoPE(factor=4.0, window=16)],
                         ids=["self_extend", "rerope"])
def test_rope_in_attention_edited_back_to_the_family_is_detected(tmp_path: Path, scaling) -> None:
    """A LLaMA whose RoPE runs inside attention (two-pass scalings, partial RoPE) is not native: a plain reload
    of it is refused, whichever way the record says so."""
    model = make_model("llama")
    ps.swap(model, ps.RopeConfig(scaling=scaling))
    model.save_pretrained(tmp_path)
    edit_config(tmp_path, lambda config: config.update(model_type="llama"))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ps.InvalidConfigError, match="but was loaded as plain 'llama'"):
        check_loaded(plain)
    edit_config(tmp_path, lambda config: config["posswap"].pop("native"))  # a record from before "native" existed
    with pytest.raises(ps.InvalidConfigError, match="but was loaded as plain 'llama'"):
        check_loaded(AutoModelForCausalLM.from_pretrained(tmp_path))


def test_native_swaps_are_not_mistaken_for_misloaded_ones(tmp_path: Path) -> None:
    model = make_model("llama")
    ps.swap(model, "rope", rope_theta=500.0)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    check_loaded(loaded)
    assert ps.describe(loaded).scheme == "native"
    assert json.loads((tmp_path / "config.json").read_text())["posswap"]["native"] is True


def test_checkpoint_keys_check_before_loading(tmp_path: Path) -> None:
    path = _save(tmp_path, "gpt2", "t5")
    config = json.loads((path / "config.json").read_text())
    keys = list(load_file(path / "model.safetensors"))
    check_checkpoint_keys(config, keys)  # as saved: fine
    config["model_type"] = "gpt2"
    with pytest.raises(ps.InvalidConfigError, match=r"holds hf_posswap position weights "
                       r"\['transformer.posswap_positions.tables.0.weight'\].*model_type 'gpt2'"):
        check_checkpoint_keys(config, keys, str(path))


# --- a reloaded model supports what an in-memory one does ---------------------------------------------


def _meta_tensors(model: torch.nn.Module) -> list[str]:
    return [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]


@pytest.mark.parametrize(("family", "scheme"), NON_NATIVE, ids=lambda value: str(value))
def test_reloaded_model_unswaps_to_the_native_structure(tmp_path: Path, family: str, scheme: str) -> None:
    swapped(family, scheme).save_pretrained(tmp_path)
    loaded = AUTO[family].from_pretrained(tmp_path).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ps.unswap(loaded)
    native = make_model(family)
    assert _structure(loaded) == _structure(native)
    assert set(loaded.state_dict()) == set(native.state_dict())
    assert not _meta_tensors(loaded)
    assert type(loaded.config) is type(native.config) and loaded.config.model_type == family
    assert torch.isfinite(logits(loaded)).all()
    fresh = [w for w in caught if issubclass(w.category, NativeWeightsMissingWarning)]
    if family in TABLE_FAMILIES:  # the learned table was not in the checkpoint: re-created, and said so
        table = "transformer.wpe" if family == "gpt2" else f"{family}.embeddings.position_embeddings"
        assert len(fresh) == 1 and str(fresh[0].message).startswith(f"{table}: the checkpoint")
    else:  # a rotary module is deterministic: rebuilt exactly, no warning
        assert not fresh
        native_buffers = dict(native.base_model.rotary_emb.named_buffers())  # Gemma 3: one inv_freq per layer type
        for name, buffer in loaded.base_model.rotary_emb.named_buffers():
            assert torch.equal(buffer, native_buffers[name]), name
        assert torch.equal(logits(loaded), logits(native))  # same seed: same weights, same native RoPE


@pytest.mark.parametrize(("family", "scheme"), [("gpt2", "alibi"), ("bert", "t5"), ("llama", "learned")])
def test_reloaded_model_swaps_again_extends_and_saves(tmp_path: Path, family: str, scheme: str) -> None:
    swapped(family, scheme).save_pretrained(tmp_path / "a")
    loaded = AUTO[family].from_pretrained(tmp_path / "a").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NativeWeightsMissingWarning)
        ps.swap(loaded, "rope", replace=True)
    ps.extend_context(loaded, 4 * MAX_POSITIONS, "yarn")
    assert ps.describe(loaded).context["max_position_embeddings"] == 4 * MAX_POSITIONS
    loaded.save_pretrained(tmp_path / "b")
    again = AUTO[family].from_pretrained(tmp_path / "b").eval()
    long_input = torch.randint(3, VOCAB, (1, 3 * MAX_POSITIONS), generator=torch.Generator().manual_seed(2))
    assert torch.equal(logits(again, long_input), logits(loaded, long_input))
    assert not _meta_tensors(again)


FIRST_EXTENSIONS = ("linear", "ntk", "yarn", "dynamic", "llama3")


@pytest.mark.parametrize("second", ["yarn", "linear", "ntk"])
@pytest.mark.parametrize("first", FIRST_EXTENSIONS)
def test_extending_a_reloaded_native_extension_again_starts_from_the_original(tmp_path: Path, first: str,
                                                                              second: str) -> None:
    """A LLaMA extended natively, saved and loaded by plain transformers, then extended again, equals the same two
    extensions in memory: ``linear`` keeps no original length in rope_parameters and NTK only a raised base, so the
    second extension reads both from the config.posswap record."""
    in_memory = make_model("llama")
    ps.extend_context(in_memory, 2 * MAX_POSITIONS, first)
    in_memory.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert swap_state(reloaded) is None  # loaded natively: only the record remembers the original
    for model in (in_memory, reloaded):
        ps.extend_context(model, 4 * MAX_POSITIONS, second)
    assert reloaded.config.rope_parameters == in_memory.config.rope_parameters
    assert ps.describe(reloaded).context == ps.describe(in_memory).context
    long_input = torch.randint(3, VOCAB, (1, 3 * MAX_POSITIONS), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(logits(reloaded, long_input), logits(in_memory, long_input), atol=0, rtol=0)


def test_a_record_that_no_longer_describes_the_config_is_not_read(tmp_path: Path) -> None:
    """rope_parameters edited after saving: the config as it stands is the model, its length the original."""
    model = make_model("llama")
    ps.extend_context(model, 2 * MAX_POSITIONS, "linear")
    model.save_pretrained(tmp_path)
    edit_config(tmp_path, lambda config: config["rope_parameters"].update(factor=3.0))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ps.extend_context(reloaded, 4 * MAX_POSITIONS, "yarn")
    assert reloaded.config.rope_parameters["original_max_position_embeddings"] == 2 * MAX_POSITIONS


def test_extending_a_reloaded_table_warns_only_when_the_user_unswaps(tmp_path: Path) -> None:
    swapped("gpt2", "learned").save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NativeWeightsMissingWarning)
        ps.extend_context(loaded, 2 * MAX_POSITIONS, "interpolate")
    with pytest.warns(NativeWeightsMissingWarning, match=r"^transformer.wpe: the checkpoint"):
        ps.unswap(loaded)
    assert loaded.transformer.wpe.weight.shape == (MAX_POSITIONS, 64)


def test_reloaded_extended_bert_unswaps_its_position_buffers(tmp_path: Path) -> None:
    model = swapped("bert", "alibi")
    ps.extend_context(model, 200, "lift")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path)
    with pytest.warns(NativeWeightsMissingWarning):
        ps.unswap(loaded)
    embeddings = loaded.bert.embeddings
    assert torch.equal(embeddings.position_ids, torch.arange(MAX_POSITIONS)[None])
    assert torch.equal(embeddings.token_type_ids, torch.zeros(1, MAX_POSITIONS, dtype=torch.long))
    assert loaded.config.max_position_embeddings == MAX_POSITIONS


# --- pickling and torch.save ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_swapped_config_pickles(family: str) -> None:
    config = swapped(family, "alibi").config
    copy = pickle.loads(pickle.dumps(config))
    assert type(copy) is type(config) and copy.model_type == f"hf_posswap_{family}"
    assert copy.posswap == config.posswap


@pytest.mark.slow
def test_swapped_config_unpickles_in_a_fresh_process(tmp_path: Path) -> None:
    (tmp_path / "config.pkl").write_bytes(pickle.dumps(swapped("gpt2", "t5").config))
    script = textwrap.dedent(f"""
        import pickle
        config = pickle.loads(open({str(tmp_path / "config.pkl")!r}, "rb").read())
        print(type(config).__name__, config.model_type, config.posswap["scheme"])
        """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "PosSwapGPT2Config hf_posswap_gpt2 t5", result.stderr[-2000:]


def test_torch_save_of_a_swapped_model() -> None:
    model = swapped("gpt2", "alibi")
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(logits(loaded), logits(model))


# --- records and tables edited or missing after a reload -----------------------------------------------------------


def test_keeping_a_recreated_native_table_warns(tmp_path: Path) -> None:
    swapped("gpt2", "alibi").save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.warns(NativeWeightsMissingWarning, match=r"keep_weights=True\) starts from the model's native "
                      r"position table, which this reloaded swapped checkpoint did not hold"):
        ps.swap(loaded, "learned", replace=True)


@pytest.mark.parametrize("extension", [
    {"method": "lift", "original_max_position_embeddings": 0, "max_position_embeddings": 128},
    {"method": "lift", "original_max_position_embeddings": 128, "max_position_embeddings": 64},
    {"method": "nope", "original_max_position_embeddings": 64, "max_position_embeddings": 128},
    {"method": "lift", "original_max_position_embeddings": 64.0, "max_position_embeddings": 128},
], ids=["zero", "shrinks", "unknown-method", "float"])
def test_malformed_extension_records_are_refused(tmp_path: Path, extension: dict) -> None:
    path = _save(tmp_path, "gpt2", "alibi")
    edit_config(path, lambda config: config["posswap"].update(extension=extension))
    with pytest.raises(ps.InvalidConfigError, match=r"config.posswap.extension record is malformed.*1 <= "
                       r"original_max_position_embeddings <= max_position_embeddings"):
        AutoModelForCausalLM.from_pretrained(path)


def test_record_of_another_family_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, "gpt2", "alibi")
    edit_config(path, lambda config: config["posswap"].update(family="bert"))
    with pytest.raises(ps.InvalidConfigError, match=r"record says family 'bert' but the model is 'gpt2'"):
        AutoModelForCausalLM.from_pretrained(path)


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
