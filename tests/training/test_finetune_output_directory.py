"""Fine-tuning keeps runs from being lost through their output directory: a used output is refused unless
``--overwrite-output-dir``, which replaces only what a run writes (a symlinked result is unlinked, its target
untouched); the directory is locked while a run owns it and a crashed owner releases it; an output that is a file
or a dangling symlink is refused."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import finetune_runs
import pytest
from finetune_runs import argv, one_line_error, run, steps_logged

from hf_posswap.cli.finetune import main

workspace = finetune_runs.workspace  # the shared fixtures (assigned: ruff reads imported ones as unused)
no_model_loading = finetune_runs.no_model_loading


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


def test_a_dangling_symlink_output_is_refused(workspace, tmp_path, capsys, no_model_loading) -> None:
    (tmp_path / "out").symlink_to(tmp_path / "nowhere")
    assert "is a symlink to nothing" in one_line_error(capsys, main(argv(workspace, tmp_path / "out")))


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
def test_overwrite_refuses_to_remove_the_model_it_is_to_train(workspace, tmp_path, capsys) -> None:
    """Continuing from a run's own result (``--model out/final --output out --overwrite-output-dir``) would delete
    that model before loading it: refused before anything is removed."""
    run(workspace, tmp_path, steps=2)
    weights = (tmp_path / "final" / "model.safetensors").read_bytes()
    code = main(argv(workspace, tmp_path, "--overwrite-output-dir", "--model", str(tmp_path / "final")))
    line = one_line_error(capsys, code)
    assert f"--model '{tmp_path / 'final'}' lies inside {tmp_path / 'final'}, which --overwrite-output-dir" in line
    assert (tmp_path / "final" / "model.safetensors").read_bytes() == weights
    assert steps_logged(tmp_path) == [1, 2]


def test_overwrite_leaves_result_folders_no_run_recorded(workspace, tmp_path, capsys, no_model_loading) -> None:
    """A ``final/`` (or ``adapter/``, ``merged/``) without the run's ``finetune_config.json`` was not written by a
    run: ``--overwrite-output-dir`` refuses rather than delete it."""
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "mine.txt").write_text("keep")
    line = one_line_error(capsys, main(argv(workspace, tmp_path, "--overwrite-output-dir")))
    assert "holds final/ but no finetune_config.json, so no finetune run wrote it" in line
    assert (tmp_path / "final" / "mine.txt").read_text() == "keep"
