"""Output names checked before any work: not empty, short enough for the temporary name an atomic write gives
them, and in a directory that takes a new file.

Writes go through a temporary name beside the target (:mod:`~hf_posswap.persistence.saving`): a file is written as
``.<name>.XXXXXXXX.tmp`` and a checkpoint directory is staged as ``.<name>.staging-XXXXXXXX`` (the files it
replaces wait in the shorter ``.<name>.old-XXXXXXXX`` until the new ones are in place). Those names are
longer than ``<name>``, so a name close to the file system's limit (255 bytes on most) passes every other check and
fails only when the finished results or model are written.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from .saving import OutputError

#: characters ``mkstemp`` / ``mkdtemp`` draw for a temporary name
RANDOM_CHARACTERS = 8
#: what ``write_file_atomic`` adds to a file's name: ``.<name>.XXXXXXXX.tmp``
TEMPORARY_FILE_EXTRA = len("..") + RANDOM_CHARACTERS + len(".tmp")
#: what ``staged_directory`` adds to a checkpoint directory's name: ``.<name>.staging-XXXXXXXX``
STAGING_EXTRA = len("..staging-") + RANDOM_CHARACTERS
#: the limit assumed when the file system does not say (POSIX systems' usual NAME_MAX)
DEFAULT_NAME_MAX = 255


def check_output_given(value: str | None, flag: str = "--output", example: str = "results.json") -> None:
    """Refuse an empty output name (``--output ""``): it names no file, and would otherwise mean the current
    directory or no output at all. ``example``: a name to suggest."""
    if value is not None and not str(value).strip():
        kind = "directory" if example.endswith("/") else "file"
        raise OutputError(f"{flag} is empty ({str(value)!r}); give a {kind} name, e.g. {flag} {example}.")


def name_limit(directory: Path) -> int:
    """The longest file name, in bytes, that ``directory``'s file system takes."""
    try:
        return int(os.pathconf(directory, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):
        return DEFAULT_NAME_MAX


def check_name_fits(path: str | os.PathLike[str], extra: int, flag: str = "--output") -> None:
    """Refuse ``path`` when its name plus the ``extra`` characters of its temporary name is past the file system's
    limit: the write would fail at the very end, after the work it was to save."""
    target = Path(path)
    directory = target.resolve().parent
    limit = name_limit(directory if directory.is_dir() else Path("."))
    length = len(os.fsencode(target.name))
    if length + extra > limit:
        raise OutputError(
            f"{flag} {str(path)!r}: the name is {length} bytes long, and the temporary name it is written under adds "
            f"{extra}, past this file system's limit of {limit} bytes per name; choose a name of at most "
            f"{limit - extra} bytes."
        )


def check_file_writable(path: str | os.PathLike[str], flag: str = "--output") -> None:
    """Write and remove a file under the temporary name the real write will use, in the directory of ``path``: a
    name too long for it, a full or read-only file system, or a place that takes no file (``/proc``) is refused
    now, not after the work."""
    check_name_fits(path, TEMPORARY_FILE_EXTRA, flag)
    target = Path(path)
    directory = target.resolve().parent
    try:
        handle, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    except OSError as error:
        raise OutputError(f"{flag} {str(path)!r}: cannot write a file in {str(directory)!r} "
                          f"({error.strerror or error}); choose another place.") from error
    os.close(handle)
    with contextlib.suppress(OSError):
        os.unlink(probe)
