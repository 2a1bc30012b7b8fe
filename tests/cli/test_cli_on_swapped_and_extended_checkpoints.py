"""The CLI on checkpoints that carry an earlier swap or extension: `eval --mode tail` reads the length the model was
trained at (not the extended one), `swap` warns what it replaces, `inspect` says when a scheme has nothing to draw;
and the option spellings the README uses (Python's True / False / None) are accepted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MAX_POSITIONS, save_tiny_checkpoint, swapped

import hf_posswap as ps
from hf_posswap.cli import main
from hf_posswap.evaluation.perplexity import trained_length
from hf_posswap.training.config import parse_options


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("checkpoints")
    for family in ("gpt2", "llama"):
        save_tiny_checkpoint(family, root / family)
    return root


def test_tail_mode_defaults_to_the_trained_length_of_an_extended_checkpoint(ws, tmp_path, capsys) -> None:
    extended = tmp_path / "llama-ext"
    assert main(["extend", "--model", str(ws / "llama"), "--to", str(8 * MAX_POSITIONS), "--method", "yarn",
                 "--output", str(extended)]) == 0
    capsys.readouterr()
    assert main(["eval", "--model", str(extended), "--lengths", str(2 * MAX_POSITIONS), "--mode", "tail",
                 "--no-progress", "--output", str(tmp_path / "r.json")]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(("family", "scheme", "method"), [("gpt2", "alibi", None), ("llama", "rope", "yarn"),
                                                          ("gpt2", "rope", "linear")],
                         ids=["gpt2-alibi-lift", "llama-yarn-native", "gpt2-rope-linear"])
def test_trained_length_is_the_length_before_extension(family, scheme, method) -> None:
    model = swapped(family, scheme)
    assert trained_length(model) == MAX_POSITIONS
    ps.extend_context(model, 4 * MAX_POSITIONS, method)
    assert model.config.max_position_embeddings == 4 * MAX_POSITIONS
    assert trained_length(model) == MAX_POSITIONS


def test_inspect_of_a_scheme_without_position_signal_says_so(ws, tmp_path, capsys) -> None:
    for family in ("gpt2", "llama"):
        out = tmp_path / family
        assert main(["inspect", "--model", str(ws / family), "--scheme", "none", "--output", str(out)]) == 1
        assert "--scheme 'none' (NoPE): it carries no position signal" in capsys.readouterr().err
        assert not list(out.glob("*.png"))  # not RoPE's curve for a LLaMA swapped to none


def test_swapping_a_swapped_checkpoint_warns_what_is_replaced(ws, tmp_path, capsys) -> None:
    assert main(["swap", "--model", str(ws / "gpt2"), "--scheme", "t5", "--output", str(tmp_path / "t5")]) == 0
    capsys.readouterr()
    assert main(["swap", "--model", str(tmp_path / "t5"), "--scheme", "alibi", "--output", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "warning: the checkpoint already carries 't5'; replacing it with 'alibi'" in err
    assert "posswap_positions" in err and "are dropped" in err


def test_python_spellings_of_booleans_are_accepted_in_options(ws, tmp_path) -> None:
    assert parse_options(["a=True", "b=False", "c=None", "d=true", "e=yes"]) == {
        "a": True, "b": False, "c": None, "d": True, "e": "yes"}
    with pytest.raises(ps.InvalidConfigError, match="Option 'num_buckets' is given twice"):  # not the last one silently
        parse_options(["num_buckets=16", "num_buckets=32"])
    assert main(["swap", "--model", str(ws / "gpt2"), "--scheme", "alibi", "--option", "trainable_slopes=True",
                 "--output", str(tmp_path / "out")]) == 0


@pytest.mark.slow
def test_eval_of_a_swapped_checkpoint_prints_no_model_type_warning(ws, tmp_path) -> None:
    assert main(["swap", "--model", str(ws / "llama"), "--scheme", "t5", "--output", str(tmp_path / "t5")]) == 0
    script = Path(sys.executable).with_name("hf-posswap")
    result = subprocess.run([str(script), "eval", "--model", str(tmp_path / "t5"), "--lengths", "32",
                             "--no-progress"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "to instantiate a model of type" not in result.stderr, result.stderr
