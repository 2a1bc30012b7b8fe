"""Starting several processes from a test, and telling a process that torch's gloo transport killed from a wrong result.

On 2 CPU cores, a process of a multi-process run sometimes dies inside torch's gloo collectives: SIGABRT ("terminate
called without an active exception") or SIGSEGV, which a faulthandler trace placed in the functional collectives'
``wait_tensor`` while ``get_model_state_dict`` gathered the full state. It was seen mid-run in 2 of 26 runs of the
``fully_shard`` tests and once in CI under accelerate's FSDP (0 of 25 runs of that file here), and not in 400 gathers of
FSDP2 alone on plain Linear layers. Such a run is started again from scratch in a fresh folder: ``run_again_if_killed``.
A process that ends with an error (an exception, a failed check) is never retried, and the checks only read what a
completed run wrote.
"""

from __future__ import annotations

import re
import socket
import subprocess
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

Result = TypeVar("Result")

#: a process torchrun's elastic agent reports as ended by a signal (``exitcode : -6``); SIGTERM (15) is not one of
#: them: the agent sends it itself to the processes left when one has failed
_SIGNAL_EXIT = re.compile(r"exitcode\s*:\s*-(?!15\b)(\d+)")


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
    """Run ``accelerate launch`` (torchrun); its stderr ends a failed check. :class:`KilledBySignal` when a process
    was ended by a signal other than the SIGTERM with which torchrun stops the others."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if result.returncode != 0:
        signal = _SIGNAL_EXIT.search(result.stderr)
        if signal:
            raise KilledBySignal(f"a launched process ended by signal {signal.group(1)}: {result.stderr[-600:]}")
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def check_processes(processes: list[subprocess.Popen], timeout: float = 300) -> list[str]:
    """Wait for processes started with ``Popen`` (stdout and stderr piped); their outputs, in order. A process ended by
    a signal (a negative return code) raises :class:`KilledBySignal`, even when its peers then failed with an error of
    their own (a closed connection); otherwise any failure fails the check."""
    outputs = [process.communicate(timeout=timeout) for process in processes]  # (stdout, stderr) each
    finished = [(process.returncode, out, err) for process, (out, err) in zip(processes, outputs, strict=True)]
    killed = [f"process {index} ended by signal {-code}: {err[-600:]}"
              for index, (code, _, err) in enumerate(finished) if code < 0]
    if killed:
        raise KilledBySignal("; ".join(killed))
    for code, _, err in finished:
        assert code == 0, err[-3000:]
    return [out for _, out, _ in finished]
