"""Fine-tuning guards: no NaN checkpoint, truthful resume, no lost runs, one-line
errors checked before any model is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_checkpoint, write_corpus
from safetensors.torch import load_file

import hf_posswap as ps
from hf_posswap.cli.finetune import main
from hf_posswap.training import FinetuneConfig, finetune

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


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
    return ["--model", str(workspace / family), "--data", str(workspace / "corpus" / "*.txt"), "--output",
            str(output), "--seq-len", "32", "--batch-size", "2", "--steps", "2", "--lr", "2e-3", "--eval-fraction", "0",
            "--eval-every", "0", "--save-every", "2", *extra]


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


# --- impossible settings are refused before anything runs; a NaN never becomes a checkpoint --------------


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
])
def test_impossible_settings_are_refused_before_loading(workspace, tmp_path, capsys, no_model_loading, flags,
                                                        named) -> None:
    line = one_line_error(capsys, main(argv(workspace, tmp_path / "run", *flags, family="bert")))
    assert named in line
    assert not (tmp_path / "run").exists(), "nothing may be written for a refused run"


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(workspace, tmp_path,
                                                                            monkeypatch) -> None:
    import hf_posswap.training.loop as loop

    calls = {"n": 0}
    original = loop._loss

    def poisoned(*args, **kwargs):  # from the 5th batch on the loss is NaN (as after an overflow)
        calls["n"] += 1
        loss = original(*args, **kwargs)
        return loss * float("nan") if calls["n"] >= 5 else loss

    monkeypatch.setattr(loop, "_loss", poisoned)
    with pytest.raises(ps.PosSwapError, match=r"Training diverged at step 5: the gradient norm is nan; the run "
                       r"stopped and saved nothing of this state \(the last good checkpoint is .*step-4\)"):
        run(workspace, tmp_path, steps=6, save_every=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-2", "step-4"]
    assert not (tmp_path / "final").exists()
    weights = load_file(tmp_path / "checkpoints" / "step-4" / "model.safetensors")
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())
    assert steps_logged(tmp_path) == [1, 2, 3, 4]


def test_a_nan_at_the_first_step_stops_before_any_save(workspace, tmp_path, capsys, monkeypatch) -> None:
    import hf_posswap.training.loop as loop

    original = loop._loss
    monkeypatch.setattr(loop, "_loss", lambda *args, **kwargs: original(*args, **kwargs) * float("inf"))
    line = one_line_error(capsys, main(argv(workspace, tmp_path, "--max-grad-norm", "0")))
    assert "Training diverged at step 1" in line and "no checkpoint had been written yet" in line
    assert not (tmp_path / "final").exists() and not list((tmp_path / "checkpoints").glob("step-*"))


@pytest.mark.slow
def test_non_finite_weights_never_reach_a_checkpoint(workspace, tmp_path, monkeypatch) -> None:
    calls = {"n": 0}
    original = torch.optim.AdamW.step

    def step_then_poison(self, *args, **kwargs):  # a finite loss and gradient, but the update overflows
        result = original(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 3:
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(float("inf"))
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_poison)
    with pytest.raises(ps.PosSwapError, match=r"Training diverged at step 3: the weights' value is nan.*"
                       r"the last good checkpoint is .*step-2"):
        run(workspace, tmp_path, steps=4, save_every=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-1", "step-2"]
    assert not (tmp_path / "final").exists()


def test_masked_lm_batches_always_hold_a_masked_token(workspace, tmp_path) -> None:
    result = run(workspace, tmp_path, family="bert", mlm_probability=1e-9, steps=2)
    assert torch.isfinite(torch.tensor(result["train_loss"]))


# --- resume continues the newest valid checkpoint, with the recorded settings -----------------------------


@pytest.mark.slow
def test_resume_falls_back_to_the_newest_valid_checkpoint(workspace, tmp_path, capsys) -> None:
    run(workspace, tmp_path, steps=4, save_every=2)
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "latest").unlink()
    run(workspace, tmp_path, steps=4, save_every=2, resume=True)  # the pointer is gone: step-4 is still found
    assert "Resumed from" in capsys.readouterr().err and steps_logged(tmp_path) == [1, 2, 3, 4]
    raw = (checkpoints / "step-4" / "model.safetensors").read_bytes()
    (checkpoints / "step-4" / "model.safetensors").write_bytes(raw[: len(raw) // 2])  # truncated: does not load
    result = run(workspace, tmp_path, steps=6, save_every=2, resume=True)
    err = capsys.readouterr().err
    assert "step-4 does not load" in err and "Resuming from the older" in err and "step-2" in err
    assert result["steps"] == 6 and steps_logged(tmp_path) == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_resume_with_a_deleted_checkpoint_does_not_restart_at_step_zero(workspace, tmp_path) -> None:
    import shutil

    assert run(workspace, tmp_path, steps=4, save_every=2)["first_step"] == 0
    shutil.rmtree(tmp_path / "checkpoints" / "step-4")  # the step `latest` names
    result = run(workspace, tmp_path, steps=4, save_every=2, resume=True)
    assert result["steps"] == 4 and steps_logged(tmp_path) == [1, 2, 3, 4]
    assert result["first_step"] == 2  # what a caller needs to time the resumed part per step
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-2", "step-4"]


@pytest.mark.slow
def test_resume_with_changed_settings_is_refused_and_the_record_kept(workspace, tmp_path, capsys) -> None:
    run(workspace, tmp_path, steps=2, scheme="alibi")
    record = (tmp_path / "finetune_config.json").read_bytes()
    code = main(argv(workspace, tmp_path, "--resume", "--lr", "1e-3", "--seq-len", "16", "--scheme", "t5"))
    line = one_line_error(capsys, code)
    assert "scheme: 'alibi' -> 't5'" in line and "seq_len: 32 -> 16" in line and "lr: 0.002 -> 0.001" in line
    assert "only steps, eval_every, save_every may change" in line
    assert (tmp_path / "finetune_config.json").read_bytes() == record


@pytest.mark.slow
def test_resume_with_more_steps_is_applied_and_recorded(workspace, tmp_path) -> None:
    run(workspace, tmp_path, steps=2)
    result = run(workspace, tmp_path, steps=4, resume=True)
    assert result["steps"] == 4 and steps_logged(tmp_path) == [1, 2, 3, 4]
    record = json.loads((tmp_path / "finetune_config.json").read_text())
    assert record["steps"] == 4
    assert record["resumed"] == [{"at_step": 2, "changed": {"steps": [2, 4]}}]
    with pytest.raises(ps.PosSwapError, match=r"steps=3 is below the step of the checkpoint to resume"):
        run(workspace, tmp_path, steps=3, resume=True)


@pytest.mark.slow
def test_a_corrupt_trainer_state_is_one_line_naming_the_file(workspace, tmp_path, capsys) -> None:
    run(workspace, tmp_path, steps=2)
    state = tmp_path / "checkpoints" / "step-2" / "trainer_state.json"
    state.write_text('{"step": 2, "epo')
    line = one_line_error(capsys, main(argv(workspace, tmp_path, "--resume")))
    assert str(state) in line and "corrupt" in line and "--overwrite-output-dir" in line
    assert state.read_text() == '{"step": 2, "epo'


@pytest.mark.slow
def test_a_run_killed_after_its_checkpoint_resumes_without_duplicate_log_lines(workspace, tmp_path) -> None:
    run(workspace, tmp_path, steps=2)
    with open(tmp_path / "loss_log.jsonl", "a") as log:  # steps logged after the checkpoint, then a half line
        log.write('{"step": 3, "loss": 1.0, "lr": 0.1}\n{"step": 4, "lo')
    run(workspace, tmp_path, steps=4, resume=True)
    assert steps_logged(tmp_path) == [1, 2, 3, 4]


# --- a used output directory is refused; the directory is locked while a run owns it ---------------------


@pytest.mark.slow
def test_a_second_run_into_a_used_output_is_refused(workspace, tmp_path, capsys) -> None:
    run(workspace, tmp_path, steps=2)
    final = (tmp_path / "final" / "model.safetensors").read_bytes()
    line = one_line_error(capsys, main(argv(workspace, tmp_path, "--lr", "1e-3")))
    assert f"--output '{tmp_path}' holds a previous run" in line and "--overwrite-output-dir" in line
    assert (tmp_path / "final" / "model.safetensors").read_bytes() == final
    assert steps_logged(tmp_path) == [1, 2]


@pytest.mark.slow
def test_overwrite_output_dir_replaces_only_what_a_run_writes(workspace, tmp_path, capsys) -> None:
    run(workspace, tmp_path, steps=2, save_every=1)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "checkpoints" / "my-notes.md").write_text("also mine")
    code = main(argv(workspace, tmp_path, "--overwrite-output-dir", "--seq-len", "128"))  # refused: nothing removed
    assert "past the model's learned position table" in one_line_error(capsys, code)
    assert (tmp_path / "final").is_dir() and (tmp_path / "checkpoints" / "step-1").is_dir()
    assert main(argv(workspace, tmp_path, "--overwrite-output-dir", "--steps", "3", "--save-every", "3")) == 0
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "checkpoints" / "my-notes.md").read_text() == "also mine"
    assert steps_logged(tmp_path) == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-3"]
    assert json.loads((tmp_path / "finetune_config.json").read_text())["steps"] == 3


HOLDER = textwrap.dedent("""
    import fcntl, os, sys, time
    handle = open(sys.argv[1], "a+")
    fcntl.flock(handle, fcntl.LOCK_EX)
    handle.write(str(os.getpid())); handle.flush()
    print("locked", flush=True)
    if sys.argv[2] == "crash":
        os._exit(3)
    time.sleep(60)
    """)


@pytest.mark.slow
def test_a_locked_output_is_refused_and_a_crashed_owner_releases_it(workspace, tmp_path, capsys) -> None:
    from hf_posswap.training.guards import LOCK_FILE

    tmp_path.joinpath("out").mkdir()
    lock = tmp_path / "out" / LOCK_FILE
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), "hold"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        line = one_line_error(capsys, main(argv(workspace, tmp_path / "out")))
        assert f"--output '{tmp_path / 'out'}' is in use by another finetune run (pid {holder.pid})" in line
        assert not (tmp_path / "out" / "finetune_config.json").exists()
    finally:
        holder.kill()
        holder.wait()
    crashed = subprocess.run([sys.executable, "-c", HOLDER, str(lock), "crash"], capture_output=True, timeout=60)
    assert crashed.returncode == 3
    assert main(argv(workspace, tmp_path / "out")) == 0  # the kernel dropped the dead owner's lock


def test_an_output_that_is_a_file_is_refused(workspace, tmp_path, capsys, no_model_loading) -> None:
    target = tmp_path / "run.txt"
    target.write_text("not a directory")
    line = one_line_error(capsys, main(argv(workspace, target)))
    assert f"--output '{target}' is a file; pass a directory" in line
    assert target.read_text() == "not a directory"


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
])
def test_sequences_past_a_learned_table_are_refused_before_training(workspace, tmp_path, capsys, flags,
                                                                    named) -> None:
    line = one_line_error(capsys, main(argv(workspace, tmp_path, *flags)))
    assert named in line
    assert not (tmp_path / "loss_log.jsonl").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_longer_sequences_work_with_a_scheme_that_has_no_table(workspace, tmp_path) -> None:
    assert run(workspace, tmp_path, scheme="alibi", seq_len=100, steps=1)["steps"] == 1


def test_a_missing_or_adapter_model_is_one_line(workspace, tmp_path, capsys) -> None:
    line = one_line_error(capsys, main(argv(workspace, tmp_path / "a") + ["--model", str(tmp_path / "missing")]))
    assert str(tmp_path / "missing") in line
    run(workspace, tmp_path / "lora", steps=1, scheme="alibi", lora=True, save_every=1)
    adapter = str(tmp_path / "lora" / "adapter")
    line = one_line_error(capsys, main(argv(workspace, tmp_path / "b") + ["--model", adapter]))
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
    command = [sys.executable, *entry, *argv(workspace, tmp_path / "out"), *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=ENV)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert named in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "out").exists()


# --- more bad settings, odd files and interrupted runs ------------------------------------------------------------


@pytest.mark.parametrize(("flags", "named"), [
    (["--output", ""], "--output must be a non-empty path, got ''"),
    (["--scheme", "alibu"], "Unknown position scheme 'alibu'"),
    (["--scheme", "t5", "--scheme-option", "num_buckets=-3"], "num_buckets must be an integer >= 2, got -3"),
    (["--extend-to", "128", "--extend-method", "yarnn"], "Unknown extension method 'yarnn'"),
    (["--extend-method", "yarn"], "--extend-method 'yarn' needs --extend-to"),
    (["--extend-to", "0"], "--extend-to must be a positive integer or None, got 0"),
    (["--seq-len", "1"], "--seq-len 1 leaves nothing to predict for a causal LM"),
    (["--resume", "--overwrite-output-dir"], "--resume and --overwrite-output-dir exclude each other"),
])
def test_more_bad_settings_are_refused_before_loading(workspace, tmp_path, capsys, no_model_loading, flags,
                                                      named) -> None:
    assert named in one_line_error(capsys, main(argv(workspace, tmp_path / "run") + flags))


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


def test_a_dangling_symlink_output_is_refused(workspace, tmp_path, capsys, no_model_loading) -> None:
    (tmp_path / "out").symlink_to(tmp_path / "nowhere")
    assert "is a symlink to nothing" in one_line_error(capsys, main(argv(workspace, tmp_path / "out")))


@pytest.mark.slow
def test_resume_into_a_fresh_directory_starts_at_step_zero(workspace, tmp_path, capsys) -> None:
    assert main(argv(workspace, tmp_path, "--resume")) == 0
    assert "no previous run" in capsys.readouterr().err and steps_logged(tmp_path) == [1, 2]
    (tmp_path / "finetune_config.json").unlink()
    line = one_line_error(capsys, main(argv(workspace, tmp_path, "--resume", "--steps", "4")))
    assert "finetune_config.json is missing, so the settings of the run to resume are unknown" in line


@pytest.mark.slow
def test_overwrite_unlinks_a_symlinked_result_without_touching_its_target(workspace, tmp_path) -> None:
    import shutil

    run(workspace, tmp_path / "run")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "precious.txt").write_text("keep")
    shutil.rmtree(tmp_path / "run" / "final")
    (tmp_path / "run" / "final").symlink_to(mine)
    run(workspace, tmp_path / "run", overwrite_output_dir=True)
    assert (mine / "precious.txt").read_text() == "keep"
    assert (tmp_path / "run" / "final").is_dir() and not (tmp_path / "run" / "final").is_symlink()


@pytest.mark.slow
def test_an_interrupted_run_exits_130_releases_its_lock_and_resumes(workspace, tmp_path, capsys,
                                                                   monkeypatch) -> None:
    import hf_posswap.training.loop as loop

    original = loop._loss
    calls = {"n": 0}

    def interrupt_at_third_batch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(loop, "_loss", interrupt_at_third_batch)
    assert main(argv(workspace, tmp_path, "--steps", "4")) == 130
    assert "interrupted; checkpoints written so far are kept" in capsys.readouterr().err
    monkeypatch.setattr(loop, "_loss", original)
    assert main(argv(workspace, tmp_path, "--steps", "4", "--resume")) == 0
    assert steps_logged(tmp_path) == [1, 2, 3, 4]
