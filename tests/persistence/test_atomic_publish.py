"""Writing a checkpoint over an existing one is all or nothing: a file that cannot be replaced halfway through puts
every file back (the old checkpoint stays whole and loadable), a full disk while safetensors writes is one error
saying nothing changed, and an undo that fails too says where the previous files are, deleting none of them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from safetensors import SafetensorError

from hf_posswap.persistence import saving
from hf_posswap.persistence.saving import OutputError, publish, staged_directory

OLD = {"config.json": "old config", "model.safetensors": "old weights", "generation_config.json": "old generation",
       "pytorch_model.bin": "stale weights", "notes.txt": "the user's notes"}
NEW = {"config.json": "new config", "model.safetensors": "new weights", "generation_config.json": "new generation"}


def _folder(path: Path, files: dict[str, str]) -> Path:
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def _contents(path: Path) -> dict[str, str]:
    return {child.name: child.read_text() for child in path.iterdir()}


def _failing_replace(monkeypatch: pytest.MonkeyPatch, fails) -> None:
    """``os.replace`` that raises PermissionError where ``fails(source, destination)`` says so."""
    real = os.replace

    def replace(source, destination):
        if fails(Path(source), Path(destination)):
            raise PermissionError(1, "Operation not permitted", str(source))
        real(source, destination)

    monkeypatch.setattr(saving.os, "replace", replace)


@pytest.mark.parametrize("failing", ["generation_config.json", "config.json", "pytorch_model.bin"])
def test_a_file_that_cannot_be_replaced_puts_every_file_back(tmp_path, monkeypatch, failing: str) -> None:
    """The first, the last staged file and the stale weights' removal: each failure leaves the old checkpoint as
    it was, with nothing left beside it."""
    target, staging = _folder(tmp_path / "ckpt", OLD), _folder(tmp_path / "staging", NEW)
    _failing_replace(monkeypatch, lambda source, destination: source == target / failing)
    with pytest.raises(PermissionError):
        publish(staging, target)
    assert _contents(target) == OLD
    assert _contents(staging) == NEW
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt", "staging"]  # no folder left aside


def test_an_overwrite_that_succeeds_replaces_checkpoint_files_and_keeps_the_users(tmp_path) -> None:
    target, staging = _folder(tmp_path / "ckpt", OLD), _folder(tmp_path / "staging", NEW)
    publish(staging, target)
    assert _contents(target) == {**NEW, "notes.txt": "the user's notes"}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt", "staging"]  # none left aside
    assert list(staging.iterdir()) == []


def test_a_failed_undo_says_where_the_previous_files_are_and_deletes_none(tmp_path, monkeypatch) -> None:
    target, staging = _folder(tmp_path / "ckpt", OLD), _folder(tmp_path / "staging", NEW)
    _failing_replace(monkeypatch, lambda source, destination: source == target / "config.json"
                     or (source.name == "model.safetensors" and destination == target / "model.safetensors"
                         and source.parent.name.startswith(".ckpt.old-")))
    with pytest.raises(OutputError, match=r"putting the previous files back failed too .* are in '.*\.ckpt\.old-"):
        publish(staging, target)
    aside = next(tmp_path.glob(".ckpt.old-*"))
    assert (aside / "model.safetensors").read_text() == "old weights"
    assert (target / "notes.txt").read_text() == "the user's notes"


def test_a_full_disk_while_safetensors_writes_is_one_error_and_changes_nothing(tmp_path) -> None:
    target = _folder(tmp_path / "ckpt", OLD)
    with pytest.raises(OutputError, match=r"No space left on device.*Nothing was changed there; free some space"):
        with staged_directory(target, overwrite=True):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert _contents(target) == OLD
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]


def test_other_safetensors_errors_are_not_taken_for_a_full_disk(tmp_path) -> None:
    with pytest.raises(SafetensorError, match="shared tensors"):
        with staged_directory(tmp_path / "ckpt"):
            raise SafetensorError("Some tensors share memory: shared tensors found")
    assert list(tmp_path.iterdir()) == []
