"""Fine-tuning refuses impossible settings, unreadable data files and wrong models with one-line errors (no
traceback), checked before any model is loaded and before anything is written; both entry points print the one
line and fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import finetune_runs
import pytest
import torch
from finetune_runs import argv, one_line_error, run

from hf_posswap.cli.finetune import main

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

workspace = finetune_runs.workspace  # the shared fixtures (assigned: ruff reads imported ones as unused)
no_model_loading = finetune_runs.no_model_loading


@pytest.mark.parametrize(("flags", "named"), [
    (["--lr", "inf"], "lr must be a finite number in (0, 1], got inf; use a learning rate such as 1e-4"),
    (["--lr", "1e38"], "got 1e+38"),
    (["--lr", "nan"], "got nan"),
    (["--lr", "0"], "got 0.0"),
    (["--lr=-1e-4"], "got -0.0001"),
    (["--distill", "--distill-temperature", "0"],
     "distill_temperature must be a finite number in [0.01, 100], got 0.0"),
    (["--mlm-probability", "0"], "mlm_probability must be a finite number in (0, 1], got 0.0"),
    (["--mlm-probability", "1.5"], "got 1.5"),
    (["--lr-schedule", "cosin"], "lr_schedule 'cosin' is not supported; choose one of linear, cosine"),
    (["--lr-schedule", "reduce_lr_on_plateau"], "lr_schedule 'reduce_lr_on_plateau' is not supported"),
    (["--weight-decay", "nan"], "weight_decay must be a finite number"),
    (["--lora", "--lora-dropout", "1"], "lora_dropout must be a finite number in [0, 1), got 1.0"),
    (["--steps", "3", "--warmup-steps", "4"], "--warmup-steps 4 is more than --steps 3: the learning rate would "
     "still be warming up when training ends and never reach lr=0.002; pass --warmup-steps 3 or less, or more "
     "--steps."),
])
def test_impossible_settings_are_refused_before_loading(workspace, tmp_path, capsys, no_model_loading, flags,
                                                        named) -> None:
    line = one_line_error(capsys, main(argv(workspace, tmp_path / "run", *flags, family="bert")))
    assert named in line
    assert not (tmp_path / "run").exists(), "nothing may be written for a refused run"


# --- one line naming the bad value or file, before expensive work ---------------------------------------


def test_data_files_that_cannot_be_read_are_named(workspace, tmp_path, capsys, no_model_loading) -> None:
    binary = tmp_path / "weights.txt"
    binary.write_bytes(b"\x00\xff\xfe binary")
    broken = tmp_path / "docs.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": "cut\n')
    dangling = tmp_path / "gone.txt"
    dangling.symlink_to(tmp_path / "nowhere.txt")
    not_text = tmp_path / "numbers.jsonl"
    not_text.write_text('{"text": 12}\n')
    expected = {binary: f"Data file {binary} is not UTF-8 text (byte 0xff at offset 1)",
                broken: f"{broken}:2 is not valid JSON",
                dangling: f"Data file {dangling} cannot be read",
                not_text: f"{not_text}:1: field 'text' holds int, not text"}
    for path, message in expected.items():
        code = main(["--model", str(workspace / "gpt2"), "--data", str(path), "--output", str(tmp_path / "out")])
        assert message in one_line_error(capsys, code)


def test_objective_against_the_model_is_checked_before_loading(workspace, tmp_path, capsys,
                                                               no_model_loading) -> None:
    line = one_line_error(capsys, main(argv(workspace, tmp_path / "a", "--objective", "mlm")))
    assert "--objective mlm needs a masked-LM encoder" in line and "'gpt2' decoder" in line
    line = one_line_error(capsys, main(argv(workspace, tmp_path / "b", "--objective", "causal", family="bert")))
    assert "--objective causal on" in line and "'bert' encoder" in line and "use --objective mlm" in line


@pytest.mark.parametrize(("flags", "named"), [
    (["--seq-len", "128"], "--seq-len 128 is past the model's learned position table (64 positions)"),
    (["--scheme", "learned", "--seq-len", "100"], "--seq-len 100 is past the model's learned position table"),
    (["--seq-len", "16", "--pose-target", "256"], "--pose-target 256 is past the model's learned position table"),
    # distillation: the teacher is the model as loaded, whose table the swap or extension does not grow
    (["--scheme", "alibi", "--seq-len", "100", "--distill"],
     "--distill: the teacher is the model as loaded, before --scheme / --extend-to, and its learned position table "
     "has 64 positions, so it cannot read --seq-len 100; pass --seq-len 64 or less"),
    (["--extend-to", "128", "--seq-len", "128", "--distill"], "it cannot read --seq-len 128"),
    (["--scheme", "rope", "--seq-len", "16", "--pose-target", "100", "--distill"],
     "it cannot read --pose-target 100; pass --pose-target 64 or less"),
])
def test_sequences_past_a_learned_table_are_refused_before_training(workspace, tmp_path, capsys, flags,
                                                                    named) -> None:
    line = one_line_error(capsys, main(argv(workspace, tmp_path / "runs" / "run", *flags)))
    assert named in line
    assert not (tmp_path / "runs").exists(), "a run refused after loading leaves no folder or lock file behind"


def test_a_refused_run_keeps_an_existing_output_folder_as_it_was(workspace, tmp_path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    line = one_line_error(capsys, main(argv(workspace, tmp_path, "--seq-len", "128")))
    assert "--seq-len 128 is past the model's learned position table" in line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.slow
def test_longer_sequences_work_with_a_scheme_that_has_no_table(workspace, tmp_path) -> None:
    assert run(workspace, tmp_path, scheme="alibi", seq_len=100, steps=1)["steps"] == 1


def test_a_missing_or_adapter_model_is_one_line(workspace, tmp_path, capsys) -> None:
    line = one_line_error(capsys, main(argv(workspace, tmp_path / "a", "--model", str(tmp_path / "missing"))))
    assert str(tmp_path / "missing") in line
    run(workspace, tmp_path / "lora", steps=1, scheme="alibi", lora=True, save_every=1)
    adapter = str(tmp_path / "lora" / "adapter")
    line = one_line_error(capsys, main(argv(workspace, tmp_path / "b", "--model", adapter)))
    assert "is a LoRA adapter directory" in line


@pytest.mark.parametrize(("entry", "flags", "named"), [
    (["-m", "hf_posswap.cli.finetune"], ["--lr", "nan"], "lr must be a finite number in (0, 1], got nan"),
    (["-m", "hf_posswap", "finetune"], ["--output", "{file}"], "--output '{file}' is a file"),
    pytest.param(["-m", "hf_posswap.cli.finetune"], ["--steps", "abc"], "argument --steps: invalid int value: 'abc'",
                 marks=pytest.mark.slow),
    pytest.param(["-m", "hf_posswap", "finetune"], ["--lr-schedule", "warmup_stable_decay"],
                 "lr_schedule 'warmup_stable_decay' is not supported", marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_both_entry_points_print_one_line_and_fail(workspace, tmp_path, entry, flags, named) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    flags = [flag.replace("{file}", str(a_file)) for flag in flags]
    named = named.replace("{file}", str(a_file))
    command = [sys.executable, *entry, *argv(workspace, tmp_path / "out", *flags)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=ENV)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert named in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("flags", "named"), [
    (["--output", ""], "--output must be a non-empty path, got ''"),
    (["--scheme", "alibu"], "Unknown position scheme 'alibu'"),
    (["--scheme", "t5", "--scheme-option", "num_buckets=-3"], "num_buckets must be an integer >= 2, got -3"),
    (["--extend-to", "128", "--extend-method", "yarnn"], "Unknown extension method 'yarnn'"),
    (["--extend-method", "yarn"], "--extend-method 'yarn' needs --extend-to"),
    (["--extend-to", "0"], "--extend-to must be a positive integer or None, got 0"),
    (["--seq-len", "1"], "--seq-len 1 leaves nothing to predict for a causal LM"),
    (["--resume", "--overwrite-output-dir"], "--resume and --overwrite-output-dir exclude each other"),
    (["--lr", "1e-7", "--lr-schedule", "polynomial"],
     "--lr-schedule 'polynomial' decays to 1e-07, so --lr must be above it, got 1e-07; pass a larger --lr"),
    (["--seq-len", "1", "--pose-target", "8"], "--pose-target needs --seq-len 2 or more (PoSE cuts each sequence"),
])
def test_more_bad_settings_are_refused_before_loading(workspace, tmp_path, capsys, no_model_loading, flags,
                                                      named) -> None:
    assert named in one_line_error(capsys, main(argv(workspace, tmp_path / "run", *flags)))


def test_odd_data_files(workspace, tmp_path, capsys, no_model_loading) -> None:
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes('\ufeff{"text": "written by an editor that adds a byte-order mark"}\n'.encode())
    from hf_posswap.training.data import read_documents

    assert read_documents([bom]) == ["written by an editor that adds a byte-order mark"]
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    for data, message in ((empty, "The training data holds no text"),
                          ("/dev/zero", "Data file /dev/zero is not a regular file"),
                          (workspace / "corpus", "is a directory but not a `datasets` dataset")):
        code = main(["--model", str(workspace / "gpt2"), "--data", str(data), "--output", str(tmp_path / "out")])
        assert message in one_line_error(capsys, code)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 trains on a GPU")
def test_fp16_on_the_cpu_is_refused_rather_than_run_in_float32(workspace, tmp_path, capsys, no_model_loading) -> None:
    """accelerate runs ``mixed_precision="fp16"`` on the CPU without autocast or a loss scaler: fp32 under fp16's
    name (and the gradient check that trusts the scaler would be off). Refused before the model loads."""
    line = one_line_error(capsys, main(argv(workspace, tmp_path / "run", "--mixed-precision", "fp16")))
    assert "--mixed-precision fp16 needs a GPU" in line and "--mixed-precision bf16" in line


def test_running_out_of_memory_in_the_finetune_entry_point_is_one_line(workspace, tmp_path, capsys,
                                                                       monkeypatch) -> None:
    """``python -m hf_posswap.cli.finetune`` (and ``accelerate launch -m`` of it) prints a failed allocation as one
    line, as ``hf-posswap`` does, and says what is kept; other RuntimeErrors keep their traceback."""
    import hf_posswap.training.loop as loop

    def allocate(config):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4000000000000 bytes.")

    monkeypatch.setattr(loop, "finetune", allocate)
    line = one_line_error(capsys, main(argv(workspace, tmp_path / "run")))
    assert "ran out of memory" in line and "Checkpoints written so far are kept (continue with --resume)" in line

    def broken(config):
        raise RuntimeError("a bug")

    monkeypatch.setattr(loop, "finetune", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(argv(workspace, tmp_path / "run"))
