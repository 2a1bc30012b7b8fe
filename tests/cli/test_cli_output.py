"""What the command line prints and refuses around a run: fine-tuning progress in a log, ``eval --no-progress``,
one-line warnings, a tokenizer larger than the model, a closed stdout, a corrupt tokenizer, and a user script named
``hf-posswap.py`` that still registers the swapped classes."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from conftest import byte_tokenizer, save_tiny_checkpoint, write_corpus

from hf_posswap.training import FinetuneConfig, finetune

ROOT = Path(__file__).resolve().parents[2]
cli = importlib.import_module("hf_posswap.cli.main")  # the module (hf_posswap.cli.main is also its function)


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli_output")
    save_tiny_checkpoint("gpt2", root / "gpt2")
    save_tiny_checkpoint("gpt2", root / "big-tokenizer")
    tokenizer = byte_tokenizer()
    tokenizer.add_tokens(["<extra-1>", "<extra-2>", "<extra-3>"])  # 262 ids for a model of 259 rows
    tokenizer.save_pretrained(root / "big-tokenizer")
    (root / "corpus").mkdir()
    write_corpus(root / "corpus", documents=12)
    (root / "corpus" / "extra.txt").write_text("words <extra-3> more words " * 40, encoding="utf-8")
    return root


# --- fine-tuning progress in a log ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_finetune_progress_in_a_log_is_plain_lines_with_the_loss(ws, tmp_path, capsys) -> None:
    settings = {"model": str(ws / "gpt2"), "data": [str(ws / "corpus" / "doc*.txt")], "seq_len": 32, "batch_size": 2,
                "steps": 2, "eval_every": 0, "save_every": 0, "eval_fraction": 0.0}
    finetune(FinetuneConfig(output=str(tmp_path / "a"), **settings))
    err = capsys.readouterr().err
    assert "\r" not in err
    assert "finetune: step 1/2 done (loss " in err and "finetune: step 2/2 done (loss " in err
    finetune(FinetuneConfig(output=str(tmp_path / "b"), progress=False, **settings))
    assert "finetune:" not in capsys.readouterr().err


# --- eval --no-progress, one-line warnings ----------------------------------------------------------------------------


def test_eval_no_progress_and_no_carriage_returns_in_a_log(ws, capsys) -> None:
    argv = ["eval", "--model", str(ws / "gpt2"), "--lengths", "32", "--max-windows", "1", "--corpus", "pydoc"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "perplexity at 32 tokens (windows): window 1/1 done" in err
    assert "\r" not in err  # transformers' "Loading weights" bar is off when stderr is not a terminal
    assert cli.main([*argv, "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "perplexity at" not in captured.err and "perplexity  length     32" in captured.out


def test_the_program_prints_warnings_on_one_line_and_restores_the_machinery(monkeypatch, capsys) -> None:
    def warn(argv: list[str]) -> int:
        warnings.warn("a run has\n  nothing to draw", UserWarning, stacklevel=1)
        return 0

    monkeypatch.setitem(cli.COMMANDS, "schemes", warn)
    monkeypatch.setattr(sys, "argv", ["hf-posswap", "schemes"])
    before = warnings.showwarning
    assert cli.main() == 0
    assert capsys.readouterr().err == "hf-posswap schemes: warning: a run has nothing to draw\n"
    assert warnings.showwarning is before
    with pytest.warns(UserWarning, match="nothing to draw"):  # a caller passing argv keeps its own display
        assert cli.main(["schemes"]) == 0


# --- a tokenizer larger than the model --------------------------------------------------------------------------------


@pytest.mark.slow
def test_finetune_refuses_a_tokenizer_larger_than_the_model(ws, tmp_path, capsys) -> None:
    from hf_posswap.cli.finetune import main

    code = main(["--model", str(ws / "big-tokenizer"), "--data", str(ws / "corpus" / "extra.txt"), "--output",
                 str(tmp_path / "run"), "--seq-len", "32", "--batch-size", "2", "--steps", "2", "--eval-fraction", "0"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and "IndexError" not in err, err[-2000:]
    assert "tokenizer has 262 tokens but the model's input embeddings have 259 rows" in err
    assert "model.resize_token_embeddings(len(tokenizer))" in err


def test_eval_refuses_a_tokenizer_larger_than_the_model(ws, capsys) -> None:
    assert cli.main(["eval", "--model", str(ws / "big-tokenizer"), "--text", str(ws / "corpus" / "extra.txt"),
                     "--lengths", "32", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokenizer has 262 tokens but the model's input embeddings have 259 rows" in err


# --- odd inputs and environments --------------------------------------------------------------------------------------


def test_a_huge_passkey_length_is_one_line_not_an_overflow(ws, capsys) -> None:
    assert cli.main(["eval", "--model", str(ws / "gpt2"), "--passkey-lengths", "99999999999999999999"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "past the longest prompt built, 16777216 tokens" in err


def test_eval_with_stdout_closed_and_no_output_is_refused(ws, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "stdout", None)  # what Python gives a process started with `>&-`
    assert cli.main(["eval", "--model", str(ws / "gpt2"), "--lengths", "32"]) == 1
    assert "stdout is closed and no --output was given" in capsys.readouterr().err


def test_eval_on_a_corrupt_tokenizer_is_one_line(ws, tmp_path, capsys) -> None:
    import shutil

    shutil.copytree(ws / "gpt2", tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text('{"version": "1.0", "trunc', encoding="utf-8")
    assert cli.main(["eval", "--model", str(tmp_path / "m"), "--lengths", "32"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Could not load the tokenizer" in err


@pytest.mark.slow
def test_a_user_script_named_hf_posswap_py_still_registers(ws, tmp_path) -> None:
    swapped = tmp_path / "swapped"
    assert cli.main(["swap", "--model", str(ws / "gpt2"), "--scheme", "alibi", "--output", str(swapped)]) == 0
    script = tmp_path / "hf-posswap.py"
    script.write_text("import hf_posswap\nfrom transformers import AutoConfig\n"
                      f"print(type(AutoConfig.from_pretrained({str(swapped)!r})).__name__)\n", encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-1000:]


