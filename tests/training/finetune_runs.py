"""What the fine-tuning guard tests (test_finetune_refusals.py, test_finetune_divergence_and_resume.py,
test_finetune_output_directory.py) share: a module-scoped workspace (tiny GPT-2 and BERT checkpoints and a small
corpus), short runs through the Python API and the CLI's arguments for them, the check that an error is one line
without a traceback, the steps a run logged, and a fixture that fails a test if the model gets loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import save_tiny_checkpoint, write_corpus

from hf_posswap.training import FinetuneConfig, finetune


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("finetune_guards")
    for family in ("gpt2", "bert"):
        save_tiny_checkpoint(family, root / family)
    (root / "corpus").mkdir()
    write_corpus(root / "corpus", documents=12)
    return root


def settings(workspace: Path, output: Path, family: str = "gpt2", **options) -> dict:
    values = {"model": str(workspace / family), "data": [str(workspace / "corpus" / "*.txt")], "output": str(output),
              "seq_len": 32, "batch_size": 2, "steps": 2, "lr": 2e-3, "eval_every": 0, "save_every": 2,
              "eval_fraction": 0.0, **options}
    return values


def run(workspace: Path, output: Path, family: str = "gpt2", **options) -> dict:
    return finetune(FinetuneConfig(**settings(workspace, output, family, **options)))


def argv(workspace: Path, output: Path, *extra: str, family: str = "gpt2") -> list[str]:
    """The command line of a tiny run; an option in ``extra`` replaces the default one (the command refuses an
    option given twice)."""
    defaults = [("--model", str(workspace / family)), ("--data", str(workspace / "corpus" / "*.txt")),
                ("--output", str(output)), ("--seq-len", "32"), ("--batch-size", "2"), ("--steps", "2"),
                ("--lr", "2e-3"), ("--eval-fraction", "0"), ("--eval-every", "0"), ("--save-every", "2")]
    given = {item.split("=", 1)[0] for item in extra if item.startswith("--")}
    return [*(part for flag, value in defaults if flag not in given for part in (flag, value)), *extra]


def one_line_error(capsys: pytest.CaptureFixture, code: int) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("hf-posswap finetune:")]
    assert code == 1 and len(lines) == 1, captured.err[-2000:]
    assert "Traceback" not in captured.err
    return lines[0]


def steps_logged(output: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (output / "loss_log.jsonl").read_text().splitlines()]


@pytest.fixture
def no_model_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a run gets as far as loading the model."""
    import hf_posswap.training.loop as loop

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad setting was refused")

    monkeypatch.setattr(loop, "_load_model", refuse)
