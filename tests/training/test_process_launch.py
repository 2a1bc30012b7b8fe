"""The multi-process tests start a run again only when a process was killed by a signal, never when it failed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from process_launch import KilledBySignal, check_processes, run_again_if_killed, run_launcher

ABORTS = "import os; os.abort()"
FAILS = "raise SystemExit('a check failed')"
PRINTS = "print('{\"done\": 1}')"
#: how torchrun's elastic agent ends its report when one process aborted and it stopped the other
TORCHRUN_REPORT = """Failures:
  [1]:
    rank      : 0 (local_rank: 0)
    exitcode  : -15 (pid: 10899)  (SIGTERM)
  Root Cause (first observed failure):
  [0]:
    rank      : 1 (local_rank: 1)
    exitcode  : {code} (pid: 10900)
"""


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _launcher_printing(report: str) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.stderr.write({report!r}); sys.exit(1)"]


def test_a_process_ended_by_a_signal_is_told_from_one_that_failed() -> None:
    assert check_processes([_python(PRINTS), _python(PRINTS)]) == ['{"done": 1}\n'] * 2
    with pytest.raises(KilledBySignal, match="process 1 ended by signal 6"):
        check_processes([_python(FAILS), _python(ABORTS)])  # the peer's own error comes after the abort
    with pytest.raises(AssertionError, match="a check failed"):
        check_processes([_python(PRINTS), _python(FAILS)])


def test_torchrun_reports_are_read_for_the_signal_that_ended_a_process() -> None:
    with pytest.raises(KilledBySignal, match="signal 6"):
        run_launcher(_launcher_printing(TORCHRUN_REPORT.format(code=-6)), env={})
    with pytest.raises(AssertionError):  # an error of its own; the other process's SIGTERM came from torchrun
        run_launcher(_launcher_printing(TORCHRUN_REPORT.format(code=1)), env={})


def test_only_killed_runs_are_started_again_each_in_a_fresh_folder(tmp_path: Path) -> None:
    folders: list[Path] = []

    def killed_once(folder: Path) -> str:
        assert not any(folder.iterdir()), "a retry starts in an empty folder"
        folders.append(folder)
        (folder / "partial").touch()
        if len(folders) == 1:
            raise KilledBySignal("process 0 ended by SIGABRT")
        return "finished"

    with pytest.warns(UserWarning, match="run again from scratch"):
        assert run_again_if_killed(killed_once, tmp_path) == "finished"
    assert [folder.name for folder in folders] == ["attempt-1", "attempt-2"]

    def fails(folder: Path) -> None:
        folders.append(folder)
        raise AssertionError("wrong losses")

    with pytest.raises(AssertionError, match="wrong losses"):
        run_again_if_killed(fails, tmp_path / "other")
    assert folders[-1].name == "attempt-1" and len(folders) == 3, "a failed check is never run again"
    with pytest.raises(KilledBySignal), pytest.warns(UserWarning):
        run_again_if_killed(lambda folder: check_processes([_python(ABORTS)]), tmp_path / "always", attempts=2)
    assert sorted(p.name for p in (tmp_path / "always").iterdir()) == ["attempt-1", "attempt-2"]
