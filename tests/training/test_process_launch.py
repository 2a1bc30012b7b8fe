"""The multi-process tests start a run again only when a process was killed by a signal, never when it failed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from process_launch import KilledBySignal, run_again_if_killed, run_launcher, wait_for_ranks

ABORTS = "import os; os.abort()"
FAILS = "raise SystemExit('a check failed')"
PRINTS = "print('{\"done\": 1}')"
LATER = "import time; time.sleep(0.5); "  # ends after the others (a peer failing on the closed connection)
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
#: one process failed with an error of its own; the other then died by a signal on the closed connection
PEER_ABORTED_AFTER = """Failures:
  [1]:
    rank      : 0 (local_rank: 0)
    exitcode  : -6 (pid: 10899)  (SIGABRT)
  Root Cause (first observed failure):
  [0]:
    rank      : 1 (local_rank: 1)
    exitcode  : 1 (pid: 10900)
"""


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _launcher_printing(report: str) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.stderr.write({report!r}); sys.exit(1)"]


def test_a_process_ended_by_a_signal_is_told_from_one_that_failed() -> None:
    assert wait_for_ranks([_python(PRINTS), _python(PRINTS)], env={}) == ['{"done": 1}\n'] * 2
    with pytest.raises(KilledBySignal, match="rank 1 exit -6"):
        wait_for_ranks([_python(LATER + FAILS), _python(ABORTS)], env={})  # the error came after the abort
    with pytest.raises(AssertionError, match="a check failed"):  # the abort came after the error: not a retry
        wait_for_ranks([_python(FAILS), _python(LATER + ABORTS)], env={})
    with pytest.raises(AssertionError, match="a check failed"):
        wait_for_ranks([_python(PRINTS), _python(FAILS)], env={})


def test_torchrun_reports_are_read_for_the_signal_that_ended_a_process() -> None:
    with pytest.raises(KilledBySignal, match="signal 6"):
        run_launcher(_launcher_printing(TORCHRUN_REPORT.format(code=-6)), env={})
    with pytest.raises(AssertionError):  # an error of its own; the other process's SIGTERM came from torchrun
        run_launcher(_launcher_printing(TORCHRUN_REPORT.format(code=1)), env={})
    with pytest.raises(AssertionError):  # the first failure was an error: the later abort does not make it a retry
        run_launcher(_launcher_printing(PEER_ABORTED_AFTER), env={})


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
        run_again_if_killed(lambda folder: wait_for_ranks([_python(ABORTS)], env={}), tmp_path / "always", attempts=2)
    assert sorted(p.name for p in (tmp_path / "always").iterdir()) == ["attempt-1", "attempt-2"]
