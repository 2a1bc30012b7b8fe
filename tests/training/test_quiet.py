"""Quiet, clean output, and saved folders that carry their tokenizer.

A fine-tuning run prints no library message that misleads (deprecated gradient-checkpointing names, accelerate's
"Removed shared tensor", "model of type gpt2 to instantiate hf_posswap_gpt2", a "corrupted" checkpoint that only
lacks a new head, tokenizer length warnings for text the library chunks itself); numbers are rounded; every folder
that ``swap``, ``extend`` and ``export`` write carries the source's tokenizer, and ``eval`` on a folder without one
names the missing files (never "install sentencepiece")."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import BYTE_VOCAB, save_tiny_checkpoint, tiny_config, write_corpus

from hf_posswap.cli import main
from hf_posswap.cli.finetune import summary
from hf_posswap.evaluation import byte_tokenizer
from hf_posswap.persistence.quiet import hidden_logs, release
from hf_posswap.training import FinetuneConfig, finetune
from hf_posswap.training.data import pack
from hf_posswap.training.model import new_head

ROOT = Path(__file__).resolve().parents[2]

NOISE = (
    "is_gradient_checkpointing",  # transformers 5.x deprecations, read by peft
    "gradient_checkpointing_enable",
    "Removed shared tensor",  # accelerate, for tied weights in a checkpoint
    "to instantiate a model of type",  # peft reading the base config through the swapped config class
    "seem corrupted",  # transformers, for a head that is new
    "loss_type=None",  # transformers, for GPT2LMHeadModel
    "Token indices sequence length",  # the tokenizer, for documents the library cuts itself
    "incompatible with gradient checkpointing",  # a KV cache built during training
)


def noise_in(text: str) -> list[str]:
    return [needle for needle in NOISE if needle in text]


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("quiet")
    for family in ("gpt2", "llama"):
        save_tiny_checkpoint(family, root / family)
    config = json.loads((root / "gpt2" / "tokenizer_config.json").read_text())
    (root / "gpt2" / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 64}))
    torch.manual_seed(0)  # an encoder saved without its masked-LM head, as sentence-embedding checkpoints are
    encoder = tiny_config("bert")
    encoder.vocab_size, encoder.pad_token_id = BYTE_VOCAB, BYTE_VOCAB - 1
    from transformers import BertModel

    BertModel(encoder).save_pretrained(root / "encoder")
    byte_tokenizer().save_pretrained(root / "encoder")
    (root / "corpus").mkdir()
    write_corpus(root / "corpus", documents=12)
    return root


class Collector(logging.Handler):
    """Every record that reaches the libraries' loggers' handlers (transformers' own stream handler keeps the stderr
    of its import time, which capfd does not see, so the records are collected where they are handled)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        # transformers does not propagate to the root logger unless something enabled it earlier in the session
        # (then the same record reaches this handler twice): count each record once
        if not any(seen is record for seen in self.records):
            self.records.append(record)
            self.messages.append(record.getMessage())


@pytest.fixture
def library_logs():
    collector = Collector()
    loggers = [logging.getLogger(name) for name in ("transformers", "accelerate", "peft", "")]
    for logger in loggers:  # transformers does not propagate to the root logger; accelerate and peft do
        logger.addHandler(collector)
    yield collector
    for logger in loggers:
        logger.removeHandler(collector)


def run_quietly(config: FinetuneConfig, capfd: pytest.CaptureFixture[str], logs: Collector) -> tuple[dict, str]:
    """Run ``config``; return its result and everything it printed, logged or warned."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = finetune(config)
    captured = capfd.readouterr()
    return result, "\n".join([captured.out, captured.err, *logs.messages, *(str(w.message) for w in caught)])


@pytest.mark.slow  # a second fine-tuning run; the full run below checks the same filter in the default run
def test_a_lora_run_with_gradient_checkpointing_prints_no_library_noise(ws, tmp_path, capfd, library_logs) -> None:
    config = FinetuneConfig(model=str(ws / "gpt2"), data=[str(ws / "corpus" / "*.txt")], output=str(tmp_path / "run"),
                            scheme="t5", seq_len=32, batch_size=2, steps=2, eval_every=1, save_every=1, lora=True,
                            merge_lora=True, gradient_checkpointing=True)
    result, printed = run_quietly(config, capfd, library_logs)
    assert result["steps"] == 2 and (tmp_path / "run" / "merged" / "tokenizer.json").exists()
    assert not noise_in(printed), printed[-3000:]


def test_a_full_run_with_tied_weights_prints_no_library_noise(ws, tmp_path, capfd, library_logs) -> None:
    config = FinetuneConfig(model=str(ws / "gpt2"), data=[str(ws / "corpus" / "*.txt")], output=str(tmp_path / "run"),
                            scheme="alibi", seq_len=32, batch_size=2, steps=1, save_every=1,
                            gradient_checkpointing=True)
    _, printed = run_quietly(config, capfd, library_logs)
    assert not noise_in(printed), printed[-3000:]
    for name in ("transformers.modeling_utils", "transformers.configuration_utils", "accelerate.utils.other"):
        assert not logging.getLogger(name).filters, name  # hiding was scoped to the calls


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None or torch.cuda.is_available(),
                    reason="DeepSpeed's note is printed only where it is installed and torch sees no CUDA")
@pytest.mark.parametrize("entry", [["-m", "hf_posswap", "finetune"], ["-m", "hf_posswap.cli.finetune"]],
                         ids=["hf-posswap", "cli.finetune"])
def test_the_programs_keep_deepspeeds_cpu_note_out_of_their_output(ws, tmp_path, entry) -> None:
    """accelerate imports DeepSpeed while a run saves; on a machine without CUDA DeepSpeed then says it was "unable
    to detect" a GPU, in the middle of the command's output. The programs hide that one note."""
    command = [sys.executable, *entry, "--model", str(ws / "gpt2"), "--data", str(ws / "corpus" / "*.txt"),
               "--output", str(tmp_path / "run"), "--seq-len", "32", "--steps", "1", "--batch-size", "2",
               "--eval-fraction", "0", "--no-progress"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "finished 1 steps" in result.stdout
    assert "unable to detect" not in result.stdout + result.stderr, result.stderr[-2000:]


def test_a_new_masked_lm_head_is_explained_not_called_corrupted(ws, tmp_path, capfd, library_logs) -> None:
    config = FinetuneConfig(model=str(ws / "encoder"), data=[str(ws / "corpus" / "*.txt")],
                            output=str(tmp_path / "run"), scheme="alibi", seq_len=32, batch_size=2, steps=1)
    _, printed = run_quietly(config, capfd, library_logs)
    assert not noise_in(printed) and "LOAD REPORT" not in printed, printed[-3000:]
    assert "was saved as BertModel, without a masked-LM head: a new head (cls.predictions) is initialised" in printed


def test_only_a_new_head_is_explained_other_missing_weights_keep_the_report() -> None:
    from transformers import BertForMaskedLM

    model = BertForMaskedLM(tiny_config("bert"))
    head = {"cls.predictions.bias", "cls.predictions.transform.dense.weight"}
    assert new_head(model, {"missing_keys": head, "unexpected_keys": {"pooler.dense.weight"}}) == ["cls.predictions"]
    assert new_head(model, {"missing_keys": head | {"bert.encoder.layer.0.attention.self.query.weight"}}) is None
    assert new_head(model, {"missing_keys": head, "unexpected_keys": {"classifier.weight"}}) is None
    assert new_head(model, {"missing_keys": set(), "unexpected_keys": set()}) is None


def test_held_back_records_can_be_let_through(library_logs) -> None:
    logger = logging.getLogger("transformers.modeling_utils")
    with hidden_logs("transformers.modeling_utils", r"LOAD REPORT") as held:
        logger.warning("BertForMaskedLM LOAD REPORT from: somewhere")
        logger.warning("something else")
    assert [record.getMessage() for record in held] == ["BertForMaskedLM LOAD REPORT from: somewhere"]
    assert library_logs.messages == ["something else"]
    logger.warning("BertForMaskedLM LOAD REPORT after the block")  # hiding ends with the block
    release(held)
    assert library_logs.messages[1:] == ["BertForMaskedLM LOAD REPORT after the block",
                                         "BertForMaskedLM LOAD REPORT from: somewhere"]


def test_packing_long_documents_does_not_warn_about_the_model_length(library_logs) -> None:
    tokenizer = byte_tokenizer()
    tokenizer.model_max_length = 16
    ids = pack(["x" * 100, "y" * 50], tokenizer, seq_len=8)
    assert ids.numel() == 152
    assert not noise_in("\n".join(library_logs.messages)), library_logs.messages


def test_the_closing_line_rounds_losses() -> None:
    line = summary({"steps": 3, "train_loss": 8.553912345678, "eval_loss": 8.55412345678901, "output": "run/final"})
    assert line == "finished 3 steps: train loss 8.554, eval loss 8.554, written to run/final"
    assert "eval loss n/a (no held-out data)" in summary({"steps": 1, "train_loss": 2.0, "eval_loss": None,
                                                          "output": "o"})


# ---- every folder the CLI writes carries the source's tokenizer; eval names what is missing -------------


def test_swap_extend_and_export_write_the_tokenizer_of_the_source(ws, tmp_path, capsys) -> None:
    from transformers import AutoTokenizer

    outputs = {
        "swap": ["swap", "--model", str(ws / "llama"), "--scheme", "alibi", "--output", str(tmp_path / "swapped")],
        "export": ["export", str(tmp_path / "swapped"), str(tmp_path / "exported")],
        "extend": ["extend", "--model", str(ws / "llama"), "--to", "256", "--output", str(tmp_path / "extended")],
    }
    for name, argv in outputs.items():
        assert main(argv) == 0, capsys.readouterr().err
        directory = Path(argv[-1] if name != "export" else argv[2])
        assert (directory / "tokenizer.json").exists() and (directory / "tokenizer_config.json").exists(), name
        assert AutoTokenizer.from_pretrained(directory)("abc")["input_ids"] == byte_tokenizer()("abc")["input_ids"]


@pytest.mark.parametrize(("kept", "needle"), [
    (["tokenizer_config.json"], "holds an incomplete tokenizer: tokenizer_config.json but no vocabulary (one of "
                                "tokenizer.json"),
    ([], "has no tokenizer: none of tokenizer.json, tokenizer_config.json"),
], ids=["settings-only", "none"])
def test_eval_on_a_folder_without_a_tokenizer_names_the_missing_files(ws, tmp_path, capsys, kept, needle) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", *kept):
        shutil.copy(ws / "llama" / name, folder / name)
    code = main(["eval", "--model", str(folder), "--lengths", "16", "--corpus", "pydoc"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "sentencepiece" not in err, err
    assert "save_pretrained" in lines[0]  # how to fix it
