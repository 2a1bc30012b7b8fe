"""Starting several processes from a test, and telling a process that torch's gloo transport killed from a wrong result.

On 2 CPU cores, a process of a multi-process run sometimes dies inside torch's gloo collectives: SIGABRT ("terminate
called without an active exception") or SIGSEGV, which a faulthandler trace placed in the functional collectives'
``wait_tensor`` while ``get_model_state_dict`` gathered the full state. It was seen mid-run in 2 of 26 runs of the
``fully_shard`` tests and in CI under accelerate's FSDP and DeepSpeed (0 of 25 runs of the FSDP file here), and not in
400 gathers of FSDP2 alone on plain Linear layers. When the first process of a run to fail was killed by a signal, the
run is started again from scratch in a fresh folder: ``run_again_if_killed``. A run whose first failure is an error of
its own (an exception, a failed check) is never retried, and the checks only read what a completed run wrote.
"""

from __future__ import annotations

import re
import socket
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

Result = TypeVar("Result")

#: torchrun's elastic agent names the first process that failed under "Root Cause"; ``exitcode : -6`` there means
#: a signal ended it (the others it then stops itself, with SIGTERM, and lists under "Failures")
_ROOT_CAUSE = "Root Cause (first observed failure):"
_SIGNAL_EXIT = re.compile(r"exitcode\s*:\s*-(\d+)")


class KilledBySignal(RuntimeError):
    """A process of a multi-process run was ended by a signal, not by an error of its own."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the rendezvous of one run)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_again_if_killed(run: Callable[[Path], Result], parent: Path, attempts: int = 3) -> Result:
    """``run(folder)`` in a fresh ``parent/attempt-<n>`` folder, again in a new one when a process was killed by a
    signal (at most ``attempts`` times). Every retry is reported as a warning, so a log shows how often it happens."""
    for attempt in range(1, attempts + 1):
        folder = parent / f"attempt-{attempt}"
        folder.mkdir(parents=True)
        try:
            return run(folder)
        except KilledBySignal as killed:
            if attempt == attempts:
                raise
            warnings.warn(f"run again from scratch: {killed}", stacklevel=2)
    raise AssertionError("unreachable: the last attempt returns or raises")


def spawn(worker: Callable, args: tuple, processes: int) -> None:
    """``torch.multiprocessing.spawn``, with a process ended by a signal raised as :class:`KilledBySignal`."""
    try:
        torch.multiprocessing.spawn(worker, args=args, nprocs=processes, join=True)
    except torch.multiprocessing.ProcessExitedException as error:
        if error.signal_name is None:
            raise
        raise KilledBySignal(f"process {error.error_index} ended by {error.signal_name}") from error


def run_launcher(command: list[str], env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    """Run ``accelerate launch`` (torchrun); its stderr ends a failed check. :class:`KilledBySignal` only when the
    first process to fail (torchrun's root cause) was ended by a signal: a peer that dies by a signal after another
    process failed with an error of its own does not make the run a retry."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    check_launch(result)
    return result


def check_launch(result: subprocess.CompletedProcess) -> None:
    """A finished launch passed; :class:`KilledBySignal` when torchrun's root cause was a signal; else it fails."""
    if result.returncode != 0 and _ROOT_CAUSE in result.stderr:
        signal = _SIGNAL_EXIT.search(result.stderr.split(_ROOT_CAUSE, 1)[1])
        if signal:
            raise KilledBySignal(f"a launched process ended by signal {signal.group(1)}: {result.stderr[-600:]}")
    assert result.returncode == 0, result.stderr[-4000:]


def wait_for_ranks(commands: list[list[str]], env: dict[str, str], timeout: float = 300) -> list[str]:
    """Start one process per command (one rank each) and wait for all; their stdouts, in order. The order in which
    they end is watched: :class:`KilledBySignal` only when the first to fail was ended by a signal (its peers then
    fail on the closed connection); any other failure fails the check. Every failed rank's stderr is in the message."""
    with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
        outs = [open(Path(folder) / f"rank{rank}.out", "w+", encoding="utf-8") for rank in range(len(commands))]
        errs = [open(Path(folder) / f"rank{rank}.err", "w+", encoding="utf-8") for rank in range(len(commands))]
        processes = [subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True)
                     for command, out, err in zip(commands, outs, errs, strict=True)]
        failed_in_order = _wait_in_order(processes, timeout)
        texts = []
        for handle in [*outs, *errs]:
            handle.seek(0)
            texts.append(handle.read())
            handle.close()
    stdouts, stderrs = texts[:len(commands)], texts[len(commands):]
    report = "; ".join(f"rank {rank} exit {processes[rank].returncode}: {stderrs[rank][-600:]}"
                       for rank in failed_in_order)
    if failed_in_order and processes[failed_in_order[0]].returncode < 0:
        raise KilledBySignal(report)
    assert not failed_in_order, report
    return stdouts


def _wait_in_order(processes: list[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for every process (killing all past ``timeout``); the indices of those that failed, first ended first.
    Failures seen in the same look (20 ms) put an error before a signal: when the order is unclear, nothing is
    retried."""
    deadline, failed, running = time.monotonic() + timeout, [], set(range(len(processes)))
    while running:
        ended = [index for index in sorted(running) if processes[index].poll() is not None]
        running.difference_update(ended)
        failed += sorted((index for index in ended if processes[index].returncode != 0),
                         key=lambda index: processes[index].returncode < 0)
        if time.monotonic() > deadline:
            for index in running:
                processes[index].kill()
                processes[index].wait()
            raise AssertionError(f"ranks {sorted(running)} still ran after {timeout:.0f} s")
        time.sleep(0.02)
    return failed
