"""Fine-tuning never turns a NaN into a checkpoint, and resumes truthfully: a non-finite loss or weight stops the
run and keeps the last good checkpoint; resume continues the newest valid checkpoint with the recorded settings
(refusing changed ones), and a run interrupted or killed after a checkpoint resumes without lost or duplicated
steps."""

from __future__ import annotations

import json

import finetune_runs
import pytest
import torch
from finetune_runs import argv, one_line_error, run, steps_logged
from safetensors.torch import load_file

import hf_posswap as ps
from hf_posswap.cli.finetune import main

workspace = finetune_runs.workspace  # the shared fixture (assigned: ruff reads an imported one as unused)


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
def test_a_checkpoint_continues_only_in_as_many_processes_as_wrote_it(workspace, tmp_path, capsys,
                                                                       monkeypatch) -> None:
    """Each process's batches, the global batch and the data position belong to the processes that wrote a
    checkpoint: a resume in another number of them is refused before the model loads, and nothing is written."""
    run(workspace, tmp_path, steps=2)
    state = tmp_path / "checkpoints" / "step-2" / "trainer_state.json"
    recorded = json.loads(state.read_text())
    assert recorded["processes"] == 1
    state.write_text(json.dumps({**recorded, "processes": 2}))  # as a run over 2 processes writes it
    files = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    import hf_posswap.training.loop as loop

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the resume was refused")

    with monkeypatch.context() as patched:
        patched.setattr(loop, "_load_model", refuse)
        line = one_line_error(capsys, main(argv(workspace, tmp_path, "--resume", "--steps", "4")))
    assert f"{state.parent} was written by 2 process(es) and this run has 1" in line
    assert "accelerate launch --num_processes 2" in line and "--overwrite-output-dir" in line
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == files
    state.write_text(json.dumps({**recorded, "processes": 0}))
    assert "processes is 0, and must be a positive integer" in one_line_error(
        capsys, main(argv(workspace, tmp_path, "--resume", "--steps", "4")))
    # an older checkpoint of another count, tried because the newest does not load: both reasons in one line
    run(workspace, tmp_path / "fallback", steps=4, save_every=2)
    checkpoints = tmp_path / "fallback" / "checkpoints"
    older = checkpoints / "step-2" / "trainer_state.json"
    older.write_text(json.dumps({**json.loads(older.read_text()), "processes": 2}))
    newest = checkpoints / "step-4" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated: does not load
    line = one_line_error(capsys, main(argv(workspace, tmp_path / "fallback", "--resume", "--steps", "6",
                                            "--save-every", "2")))
    assert "step-2 was written by 2 process(es)" in line and "tried because of" in line, line
    assert "step-4 does not load" in line, line
    # a checkpoint written before the count was kept resumes as before
    state.write_text(json.dumps({key: value for key, value in recorded.items() if key != "processes"}))
    assert main(argv(workspace, tmp_path, "--resume", "--steps", "4")) == 0 and steps_logged(tmp_path) == [1, 2, 3, 4]
    assert json.loads((tmp_path / "checkpoints" / "step-4" / "trainer_state.json").read_text())["processes"] == 1


@pytest.mark.slow
def test_a_run_killed_after_its_checkpoint_resumes_without_duplicate_log_lines(workspace, tmp_path) -> None:
    run(workspace, tmp_path, steps=2)
    with open(tmp_path / "loss_log.jsonl", "a") as log:  # steps logged after the checkpoint, then a half line
        log.write('{"step": 3, "loss": 1.0, "lr": 0.1}\n{"step": 4, "lo')
    run(workspace, tmp_path, steps=4, resume=True)
    assert steps_logged(tmp_path) == [1, 2, 3, 4]


@pytest.mark.slow
def test_resume_into_a_fresh_directory_starts_at_step_zero(workspace, tmp_path, capsys) -> None:
    assert main(argv(workspace, tmp_path, "--resume")) == 0
    assert "no previous run" in capsys.readouterr().err and steps_logged(tmp_path) == [1, 2]
    (tmp_path / "finetune_config.json").unlink()
    line = one_line_error(capsys, main(argv(workspace, tmp_path, "--resume", "--steps", "4")))
    assert "finetune_config.json is missing, so the settings of the run to resume are unknown" in line


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


@pytest.mark.slow
def test_resume_compares_paths_where_the_run_found_them(workspace, tmp_path, capsys, monkeypatch) -> None:
    """Relative paths are recorded as absolute ones: a resume from another working directory with the same relative
    arguments would read other files and is refused; the same files named by absolute paths resume."""
    import shutil

    monkeypatch.chdir(workspace)
    relative = {"model": "gpt2", "data": ["corpus/*.txt"]}
    run(workspace, tmp_path / "run", steps=2, **relative)
    recorded = json.loads((tmp_path / "run" / "finetune_config.json").read_text())
    assert recorded["model"] == str(workspace / "gpt2") and recorded["data"] == [str(workspace / "corpus" / "*.txt")]

    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(workspace / "gpt2", elsewhere / "gpt2")
    shutil.copytree(workspace / "corpus", elsewhere / "corpus")
    monkeypatch.chdir(elsewhere)
    with pytest.raises(ps.PosSwapError, match=r"model: '[^']*/gpt2' -> 'gpt2'; data: "):
        run(workspace, tmp_path / "run", steps=4, resume=True, **relative)
    result = run(workspace, tmp_path / "run", steps=4, resume=True)  # absolute paths to the run's own files
    assert result["first_step"] == 2 and steps_logged(tmp_path / "run") == [1, 2, 3, 4]


@pytest.mark.slow
def test_resuming_a_finished_run_reports_its_last_loss(workspace, tmp_path) -> None:
    """Nothing is left to train, so the closing loss is the one logged at the last step, not NaN."""
    first = run(workspace, tmp_path, steps=2)
    again = run(workspace, tmp_path, steps=2, resume=True)
    logged = [json.loads(line) for line in (tmp_path / "loss_log.jsonl").read_text().splitlines()]
    assert again["first_step"] == again["steps"] == 2
    assert again["train_loss"] == logged[-1]["loss"] == first["train_loss"]
