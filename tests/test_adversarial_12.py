"""Issue 12's adversarial pass: what a hostile user found in the layer/head mixes, the new schemes and
``extend --train`` (each test failed before its fix)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import save_tiny_checkpoint, tiny_config, write_corpus

import hf_posswap as ps
from hf_posswap.cli.main import main as cli
from hf_posswap.cli.recipe import check_run_output

# --- LayerMix temperature settings of the wrong type: an error naming the value, not a TypeError ----------------

BAD_TEMPERATURE = {
    "floor_scale-none": {"floor_scale": None},
    "floor_scale-list": {"floor_scale": [8192]},
    "attn_scale-str": {"attn_scale": "0.1"},
}


@pytest.mark.parametrize("options", list(BAD_TEMPERATURE.values()), ids=list(BAD_TEMPERATURE))
def test_layer_mix_temperature_setting_of_wrong_type_is_refused(options: dict) -> None:
    (name, value), = options.items()
    with pytest.raises(ps.errors.InvalidConfigError, match=rf"LayerMix\.{name} must be a finite number") as caught:
        ps.LayerMix(default="rope", overrides={"none": [1]}, attn_temperature_tuning=True, **options)
    assert repr(value) in str(caught.value)


# --- extend --train refused at the extension leaves nothing behind, so the corrected command runs as typed ------

TO = 4 * tiny_config("llama").max_position_embeddings
BAD_EXTENSION = {  # id: extension arguments that only the extension itself (after the output was locked) refuses
    "default-method-factor-0": (["--option", "factor=0"], "factor must be"),
    "rerope-window-past-length": (["--method", "rerope", "--option", "window=100"], "window=100"),
}


@pytest.mark.parametrize("case", list(BAD_EXTENSION), ids=list(BAD_EXTENSION))
def test_extend_train_refused_extension_writes_nothing(case: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    base = save_tiny_checkpoint("llama", tmp_path / "llama")
    data = write_corpus(tmp_path, documents=2)
    extra, fragment = BAD_EXTENSION[case]
    output = tmp_path / "out"
    argv = ["extend", "--model", str(base), "--to", str(TO), "--train", "--data", *data, "--steps", "1",
            "--seq-len", "32", "--no-progress", "--output", str(output), *extra]
    assert cli(argv) == 1
    err = capsys.readouterr().err
    error = err.strip().splitlines()[-1]  # before it: the run's plan line (and the tiny checkpoint's save bar)
    assert fragment in error and error.startswith("hf-posswap extend: ") and "Traceback" not in err, err
    assert not output.exists(), sorted(str(p.relative_to(output)) for p in output.rglob("*"))
    check_run_output(str(output), resume=False, overwrite=False)  # the corrected rerun needs no --overwrite


def test_extend_train_refused_extension_keeps_an_existing_empty_output(tmp_path: Path) -> None:
    base = save_tiny_checkpoint("llama", tmp_path / "llama")
    data = write_corpus(tmp_path, documents=2)
    output = tmp_path / "out"
    output.mkdir()
    argv = ["extend", "--model", str(base), "--to", str(TO), "--train", "--data", *data, "--steps", "1",
            "--seq-len", "32", "--no-progress", "--output", str(output), "--option", "factor=0"]
    assert cli(argv) == 1
    assert output.is_dir() and not any(output.iterdir())


# --- swap(model, s, layers=[...]) on Gemma 3 keeps each other layer's own RoPE (one per layer type) ---------------

KEPT = {  # id: (family, swapped layers, the layer kept whose output is compared with transformers' own model)
    "gemma3_text-sliding-layer-kept": ("gemma3_text", [1], 0),
    "llama-layer-kept": ("llama", [1], 0),
}


@pytest.mark.parametrize("case", list(KEPT), ids=list(KEPT))
def test_layers_swap_keeps_the_own_rope_of_the_other_layers(case: str) -> None:
    import torch
    from conftest import make_model

    family, layers, kept = KEPT[case]
    ids = torch.randint(3, 90, (2, 24), generator=torch.Generator().manual_seed(0))  # past Gemma's window of 16
    own, model = make_model(family), make_model(family)
    ps.swap(model, "none", layers=layers)
    with torch.no_grad():
        expected = own(ids, output_hidden_states=True).hidden_states[kept + 1]  # transformers' own layer
        got = model(ids, output_hidden_states=True).hidden_states[kept + 1]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    if family == "gemma3_text":  # both layer types' thetas (local 1e4, global 1e6) are in the swapped model's record
        assert "rope_theta=10000.0" in str(ps.describe(model))


@pytest.mark.parametrize("preset", ["smollm3_nope", "cohere2_sliding_rope"])
def test_preset_keeps_gemma3_sliding_layers_rope(preset: str) -> None:
    import torch
    from conftest import make_model

    ids = torch.randint(3, 90, (2, 24), generator=torch.Generator().manual_seed(0))
    own, model = make_model("gemma3_text"), make_model("gemma3_text")
    ps.swap(model, getattr(ps, preset)(model, 2))  # layer 0 (sliding) keeps RoPE, layer 1 (global) NoPE
    with torch.no_grad():
        expected = own(ids, output_hidden_states=True).hidden_states[1]
        got = model(ids, output_hidden_states=True).hidden_states[1]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
