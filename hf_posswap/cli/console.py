"""What the command prints besides its results: Python warnings on one line each, a failed allocation as a one-line
error, and transformers' own progress bars under the command's progress policy."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TextIO

from ..errors import one_line
from .parser import PARSERS, wants_help


def one_line_warning(prog: str):
    """A ``warnings.showwarning`` that prints ``<prog>: warning: <message on one line>`` (no file:line, no source
    line: they point into the library, not at anything the user typed)."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        text = " ".join(str(message).split()) or category.__name__
        try:
            print(f"{prog}: warning: {text}", file=file if file is not None else sys.stderr, flush=True)
        except (OSError, ValueError):  # stderr closed: a warning is not worth a crash
            pass

    return show


def program_notes_hidden(program: bool) -> contextlib.AbstractContextManager:
    """Around a command run as the program (the console script, ``python -m``): library notes that are noise in its
    output stay out of it (``persistence.quiet.DEEPSPEED_CPU_NOTE``). A caller of ``main(argv)`` keeps its own."""
    if not program:
        return contextlib.nullcontext()
    from ..persistence.quiet import DEEPSPEED_CPU_NOTE, hidden_logs

    return hidden_logs("DeepSpeed", DEEPSPEED_CPU_NOTE)


def out_of_memory(error: BaseException) -> bool:
    """A failed allocation: Python's MemoryError, torch's CPU allocator or CUDA's out-of-memory error."""
    text = str(error)
    return isinstance(error, MemoryError) or "can't allocate memory" in text or "out of memory" in text.lower()


def out_of_memory_message(error: BaseException, kept: str = "Nothing was written") -> str:
    """The one line a failed allocation becomes (the user's to fix: a smaller model, batch, length or option);
    ``kept`` says what of the command's output survives."""
    return (f"ran out of memory ({one_line(error)[:300]}). {kept}; use a smaller model, batch, length or option "
            "value, or a machine with more memory.")


#: commands that load or save checkpoints through transformers (whose loading and saving bars are its own)
_LOADING_COMMANDS = ("demo", "eval", "export", "extend", "finetune", "inspect", "swap")
#: commands with a --no-progress flag
_PROGRESS_COMMANDS = ("demo", "eval", "extend", "finetune")


@contextlib.contextmanager
def library_bars_for(command: str, argv: list[str]) -> Iterator[None]:
    """transformers' own bars ("Loading weights", "Writing model shards") follow the command's progress policy: off
    with ``--no-progress`` and off when stderr is not a terminal (a log gets no carriage returns). Restored after."""
    from ..progress import is_terminal, library_bars

    wanted = is_terminal(sys.stderr) and not (command in _PROGRESS_COMMANDS and "--no-progress" in argv)
    if command not in _LOADING_COMMANDS or wants_help(argv):  # nothing that shows one: no transformers import
        wanted = True
    elif not wanted and command in PARSERS:
        PARSERS[command]().parse_args(argv)  # a malformed command line fails at once, before transformers loads
    with library_bars(wanted):
        yield
