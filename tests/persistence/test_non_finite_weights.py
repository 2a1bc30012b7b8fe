"""A NaN or inf in a weight never becomes a saved checkpoint: every save path of the library and of the command line
refuses it before writing, names the tensors, and leaves the output as it was. (transformers' own
``save_pretrained`` writes such weights without a word, and the checkpoint loads and computes NaN.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import make_model, save_tiny_checkpoint
from transformers import AutoModelForCausalLM

import hf_posswap as ps
from hf_posswap.cli import main
from hf_posswap.persistence.saving import NonFiniteWeightsError

BAD_VALUES = {"nan": math.nan, "inf": math.inf}


def poisoned(model: torch.nn.Module, value: float) -> str:
    """Put ``value`` in one MLP weight of ``model``; the weight's state-dict name."""
    name, parameter = next((n, p) for n, p in model.named_parameters() if "mlp" in n and n.endswith("weight"))
    with torch.no_grad():
        parameter.view(-1)[3] = value
    return name


@pytest.mark.parametrize("value", BAD_VALUES.values(), ids=BAD_VALUES.keys())
@pytest.mark.parametrize("save", ["export_standalone", "save_native"])
def test_the_library_refuses_to_save_non_finite_weights(tmp_path: Path, save: str, value: float) -> None:
    model = make_model("llama")
    ps.swap(model, "alibi" if save == "export_standalone" else "rope")
    name = poisoned(model, value)
    with pytest.raises(NonFiniteWeightsError, match=rf"Refusing to save the model: 1 of its tensors hold NaN or inf "
                                                    rf"\({name}\).*Nothing was written"):
        getattr(ps, save)(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_nan_in_a_position_parameter_is_refused_too(tmp_path: Path) -> None:
    model = make_model("llama")
    ps.swap(model, "alibi", trainable_slopes=True)
    slopes = next(p for n, p in model.named_parameters() if "slopes" in n)
    with torch.no_grad():
        slopes[0] = math.nan
    with pytest.raises(NonFiniteWeightsError, match="slopes"):
        ps.export_standalone(model, tmp_path / "out")


def test_an_adapter_over_non_finite_weights_is_refused(tmp_path: Path) -> None:
    from peft import get_peft_model

    model = make_model("llama")
    ps.swap(model, "t5")
    peft_model = get_peft_model(model, ps.lora_config(model, r=2))
    poisoned(peft_model, math.nan)
    with pytest.raises(NonFiniteWeightsError, match="the adapter's model"):
        ps.save_adapter(peft_model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


@pytest.fixture(scope="module")
def nan_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain checkpoint holding one NaN, written by transformers itself (which does not check)."""
    directory = tmp_path_factory.mktemp("nan") / "llama"
    save_tiny_checkpoint("llama", directory)
    model = AutoModelForCausalLM.from_pretrained(directory)
    poisoned(model, math.nan)
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("command", [
    ["swap", "--model", "{m}", "--scheme", "alibi", "--output", "{out}"],
    ["extend", "--model", "{m}", "--to", "128", "--output", "{out}"],
], ids=["swap", "extend"])
def test_the_command_line_refuses_on_one_line_and_keeps_the_output(nan_checkpoint, tmp_path, capsys,
                                                                    command) -> None:
    output = tmp_path / "out"
    output.mkdir()
    (output / "notes.txt").write_text("mine")
    code = main([a.format(m=nan_checkpoint, out=output) for a in command] + ["--overwrite"])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("hf-posswap")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in captured.err, captured.err[-2000:]
    assert "NaN or inf" in lines[0] and "mlp" in lines[0]
    assert sorted(p.name for p in output.iterdir()) == ["notes.txt"]
