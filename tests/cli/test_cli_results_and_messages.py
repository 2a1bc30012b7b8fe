"""Results that are never lost or unreadable (a failed final write prints them; non-finite numbers are JSON null;
the text's sha256 is whole), and messages whose fix the user can apply (a decoder is a config.json setting, a
pickled weights file names itself, a repeated option is refused, ``--version`` answers)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_checkpoint

import hf_posswap.persistence.saving
from hf_posswap.cli import main
from hf_posswap.evaluation.corpora import text_digest
from hf_posswap.evaluation.results_files import load_runs
from hf_posswap.version import __version__


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("results_and_messages")
    for family in ("llama", "bert"):
        save_tiny_checkpoint(family, root / family)
    return root


def test_version_is_printed(capsys) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hf-posswap {__version__}"


def test_a_failed_final_write_prints_the_results_first(ws, tmp_path, capsys, monkeypatch) -> None:
    """The disk fills during a long evaluation: what was measured still reaches stdout, as JSON, before the
    one-line error."""
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_posswap.persistence.saving, "write_file_atomic", full_disk)
    code = main(["eval", "--model", str(ws / "llama"), "--lengths", "16", "--corpus", "pydoc", "--max-windows", "1",
                 "--no-progress", "--output", str(tmp_path / "r.json")])
    captured = capsys.readouterr()
    assert code == 1 and "Traceback" not in captured.out + captured.err
    printed = json.loads(captured.out[captured.out.index("{"):])
    assert printed["perplexity"][0]["length"] == 16
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "could not write the results (No space left on device)" in lines[0], captured.err
    assert "printed above as JSON" in lines[0]


def test_non_finite_numbers_are_written_as_null_and_plotted_as_missing(tmp_path) -> None:
    results = {"text": {}, "perplexity": [{"length": 8, "mode": "windows", "perplexity": math.nan, "nll": math.inf},
                                          {"length": 16, "mode": "windows", "perplexity": 3.0, "nll": 1.1}],
               "passkey": []}
    from hf_posswap.evaluation.measure import results_json

    text = results_json(results)

    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    written = json.loads(text, parse_constant=no_constants)
    assert written["perplexity"][0]["perplexity"] is None and written["perplexity"][0]["nll"] is None
    (tmp_path / "r.json").write_text(text)
    read = load_runs([str(tmp_path / "r.json")], "windows")["r"]
    assert math.isnan(read["perplexity"][0]["perplexity"]) and read["perplexity"][1]["perplexity"] == 3.0


def test_the_text_digest_is_the_whole_sha256() -> None:
    assert text_digest("some text") == hashlib.sha256(b"some text").hexdigest()


def test_a_decoder_is_suggested_as_a_config_setting_not_an_option(ws, tmp_path, capsys) -> None:
    """`--option` sets scheme options, so `--option is_decoder=True` would be refused: the fix is config.json."""
    assert main(["swap", "--model", str(ws / "bert"), "--scheme", "xpos", "--output", str(tmp_path / "o")]) == 1
    error = capsys.readouterr().err
    assert 'set "is_decoder": true in its config.json' in error and "--option is_decoder" not in error, error


def test_the_scheme_config_names_rewritten_are_the_registered_ones() -> None:
    from hf_posswap.cli.wording import SCHEME_CONFIGS
    from hf_posswap.schemes.base import SCHEME_REGISTRY

    names = {SCHEME_REGISTRY.get(name).__name__ for name in SCHEME_REGISTRY.names()} - {"LayerMix"}
    assert set(SCHEME_CONFIGS) == names


class Payload:
    """Not a tensor: torch.load(weights_only=True) refuses to unpickle it."""


def test_a_weights_file_holding_pickled_objects_names_itself_and_the_fix(ws, tmp_path, capsys) -> None:
    model = tmp_path / "pickled"
    model.mkdir()
    (model / "config.json").write_text((ws / "llama" / "config.json").read_text())
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2), "extra": Payload()}, model / "pytorch_model.bin")
    assert main(["swap", "--model", str(model), "--scheme", "alibi", "--output", str(tmp_path / "o")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"'{model / 'pytorch_model.bin'}' holds objects other than tensors" in lines[0]
    assert "will not be unpickled" in lines[0] and "safetensors" in lines[0] and "torch.load" not in lines[0]


def test_a_repeated_finetune_option_is_refused(ws, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["finetune", "--model", str(ws / "llama"), "--data", "x.txt", "--output", str(tmp_path / "run"),
              "--steps", "3", "--steps", "4"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "argument --steps: given twice (--steps 3, then --steps 4)" in lines[0], lines


# --- early checks accept what the model can do ---------------------------------------------------------------------


def test_eval_takes_lengths_a_grown_learned_table_holds(ws, tmp_path, capsys) -> None:
    """A learned swap grown to 128 positions keeps config.json's 64: the early check reads the table's length from
    the swap's record, as the loaded model has it."""
    grown = tmp_path / "grown"
    assert main(["swap", "--model", str(ws / "llama"), "--scheme", "learned", "--option", "max_positions=128",
                 "--output", str(grown)]) == 0
    capsys.readouterr()
    argv = ["eval", "--model", str(grown), "--corpus", "pydoc", "--max-windows", "1", "--no-progress", "--lengths"]
    assert main([*argv, "100"]) == 0, capsys.readouterr().err
    assert main([*argv, "129"]) == 1
    assert "learned position table (128 positions" in capsys.readouterr().err


def test_extend_rescales_a_rope_scaled_checkpoint_at_its_own_length(ws, tmp_path, capsys) -> None:
    """A checkpoint trained at 32 and YaRN-scaled to 64: another method at 64 is a change (it rescales from 32), not
    the no-op --to 64 is on an unscaled model."""
    scaled = tmp_path / "yarn"
    save_tiny_checkpoint("llama", scaled, max_position_embeddings=64,
                         rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
                                          "rope_theta": 10000.0})
    assert main(["extend", "--model", str(scaled), "--to", "64", "--method", "linear", "--output",
                 str(tmp_path / "linear")]) == 0, capsys.readouterr().err
    written = json.loads((tmp_path / "linear" / "config.json").read_text())
    assert written["rope_parameters"]["rope_type"] == "linear" and written["rope_parameters"]["factor"] == 2.0
    assert main(["extend", "--model", str(ws / "llama"), "--to", str(json.loads(
        (ws / "llama" / "config.json").read_text())["max_position_embeddings"]), "--output", str(tmp_path / "x")]) == 1
    assert "nothing to extend" in capsys.readouterr().err
