"""Writes that never lose what was there: a checkpoint is written into a staging directory beside its target and
moved into place only once complete; a failure (a full disk, a crash) leaves the old contents untouched.

A non-empty target is refused unless the caller asks to overwrite; then each file the save wrote replaces its
namesake, weight files and indexes the new checkpoint does not have are removed (:data:`WEIGHT_PATTERNS`: an old
shard or index beside new weights would mislead loading), and every other file (a user's notes, data) stays.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from ..errors import PosSwapError

#: weight files and indexes: stale ones are removed on overwrite (an old index next to new weights misleads loading)
WEIGHT_PATTERNS = (
    "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
    "pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json",
    "adapter_model.safetensors", "adapter_model.bin",
)


ADAPTER_CONFIG = "adapter_config.json"
#: a full checkpoint written over an adapter would delete the adapter's weights and leave a directory that loads
#: as neither (its adapter_config.json stays)
_ADAPTER_TARGET = ("{flag} {path!r} holds a LoRA adapter (adapter_config.json); writing a full checkpoint there "
                   "would delete the adapter's weights and leave a directory that loads as neither. Choose another "
                   "directory.")


class OutputError(PosSwapError, ValueError):
    """An output path that cannot be written as asked (a file where a directory goes, a missing parent, ...)."""


class NonFiniteWeightsError(PosSwapError, ValueError):
    """A model holding NaN or inf in its weights was asked to be saved."""


def check_finite_weights(model: Any, what: str = "the model") -> None:
    """Refuse to save ``model`` (a module, or a state dict) when a floating-point weight or buffer holds NaN or inf:
    the checkpoint would load without a complaint and compute NaN. Called before anything is written; the message
    names the first tensors that hold one. Tensors without data (meta) are skipped."""
    tensors = model.items() if isinstance(model, dict) else model.state_dict().items()
    bad = [name for name, tensor in tensors
           if getattr(tensor, "is_floating_point", lambda: False)() and not tensor.is_meta
           and not bool(tensor.isfinite().all())]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise NonFiniteWeightsError(
            f"Refusing to save {what}: {len(bad)} of its tensors hold NaN or inf ({shown}); a checkpoint written "
            "from them would load and compute NaN. Nothing was written: load or train the model again from finite "
            "weights."
        )


def check_output_dir(
    path: str | os.PathLike[str], overwrite: bool = False, flag: str = "--output",
    kind: Literal["checkpoint", "adapter", "files"] = "checkpoint",
) -> Path:
    """Validate a directory to write to, before any work: not a file, an existing writable parent, and empty or
    absent unless ``overwrite``. A full ``checkpoint`` never goes over a LoRA adapter directory, nor an ``adapter``
    over a full checkpoint (its config.json beside adapter_config.json would read as an adapter based on itself);
    other ``files`` (pictures) go anywhere."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise OutputError(f"{flag} {str(path)!r} is an existing file, not a directory; choose a directory path.")
    parent = target.resolve().parent
    if not parent.is_dir():
        raise OutputError(
            f"{flag} {str(path)!r}: the parent directory {str(parent)!r} does not exist; create it first "
            f"(mkdir -p {parent})."
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {str(path)!r}: the directory {str(parent)!r} is not writable; choose another.")
    if kind == "checkpoint" and (target / ADAPTER_CONFIG).exists():
        raise OutputError(_ADAPTER_TARGET.format(flag=flag, path=str(path)))
    if kind == "adapter" and (target / "config.json").exists() and not (target / ADAPTER_CONFIG).exists():
        raise OutputError(
            f"{flag} {str(path)!r} holds a full checkpoint (config.json); an adapter written there would make it "
            "read as an adapter whose base is itself. Choose another directory."
        )
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise OutputError(
            f"{flag} {str(path)!r} is not empty. Choose a new or empty directory, or pass --overwrite "
            "(overwrite=True) to replace the checkpoint files in it (other files are left alone)."
        )
    if target.is_dir() and not os.access(target, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {str(path)!r} is not writable; choose another directory.")
    return target


def check_output_file(path: str | os.PathLike[str], flag: str = "--output") -> Path:
    """Validate a file to write (JSON results, a picture), before any work."""
    target = Path(path)
    if target.is_dir():
        raise OutputError(f"{flag} {str(path)!r} is a directory; give a file name (e.g. {target / 'results.json'}).")
    parent = target.resolve().parent
    if not parent.is_dir():
        raise OutputError(
            f"{flag} {str(path)!r}: the directory {str(parent)!r} does not exist; create it first (mkdir -p {parent})."
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {str(path)!r}: the directory {str(parent)!r} is not writable; choose another.")
    return target


@contextlib.contextmanager
def staged_directory(
    target: str | os.PathLike[str], overwrite: bool = False, kind: Literal["checkpoint", "adapter"] = "checkpoint"
) -> Iterator[Path]:
    """Yield an empty staging directory beside ``target``; when the block succeeds, publish it into ``target``.
    When it raises, the staging directory is removed and ``target`` is left exactly as it was."""
    from safetensors import SafetensorError

    check_output_dir(target, overwrite, flag="output", kind=kind)
    target = Path(target).resolve()  # a symlinked target: write into the directory it points to
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-", dir=target.parent))
    staging.chmod(0o777 & ~_umask())  # mkdtemp makes it private (0700); the published directory gets the usual mode
    try:
        yield staging
        publish(staging, target)
    except OSError as error:
        raise OutputError(f"Could not write {str(target)!r}: {error}. Nothing was changed there.") from error
    except SafetensorError as error:  # safetensors reports a full disk or a failed write as its own error
        if "I/O error" not in str(error):
            raise
        raise OutputError(f"Could not write {str(target)!r}: {' '.join(str(error).split())}. Nothing was changed "
                          "there; free some space or choose another place.") from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def publish(staging: Path, target: Path) -> None:
    """Move the complete ``staging`` directory into ``target``. An absent or empty target is replaced in one
    rename; otherwise each staged file replaces its namesake (``config.json`` last), stale weight files are
    removed, and every other file in ``target`` stays.

    All or nothing: each file replaced or removed is first moved aside into a hidden folder beside ``target``, and
    when a move fails (a file the process may not replace, say) every move is undone before the error is raised, so
    the old checkpoint stays whole. Only a failure of the undo itself leaves files aside, and its error says where."""
    if not target.exists() or (target.is_dir() and not any(target.iterdir())):
        os.replace(staging, target)
        return
    names = sorted((p.name for p in staging.iterdir()), key=lambda name: name == "config.json")
    if (target / ADAPTER_CONFIG).exists() and ADAPTER_CONFIG not in names:  # checked before anything moves
        raise OutputError(_ADAPTER_TARGET.format(flag="output", path=str(target)))
    blocked = [name for name in names if (target / name).is_dir() and not (target / name).is_symlink()]
    if blocked:  # checked before anything moves
        raise OutputError(f"Cannot overwrite {str(target)!r}: {blocked} exist there as directories. Choose a new or "
                          "empty directory.")
    stale = [path.name for path in target.iterdir() if path.name not in names and path.is_file() and any(
        fnmatch.fnmatchcase(path.name, pattern) for pattern in WEIGHT_PATTERNS)]
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    moves: list[tuple[Path, Path]] = []  # (from, to) of every rename done, in order
    try:
        for name in names:
            if os.path.lexists(target / name):
                _move(target / name, aside / name, moves)
            _move(staging / name, target / name, moves)
        for name in stale:
            _move(target / name, aside / name, moves)
    except OSError as error:
        _undo(moves, target, aside, error)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _move(source: Path, destination: Path, moves: list[tuple[Path, Path]]) -> None:
    os.replace(source, destination)
    moves.append((source, destination))


def _undo(moves: list[tuple[Path, Path]], target: Path, aside: Path, error: OSError) -> None:
    """Rename back, last first, what ``publish`` moved before ``error``; then drop the empty ``aside`` folder."""
    try:
        for source, destination in reversed(moves):
            os.replace(destination, source)
    except OSError as undo_error:
        raise OutputError(
            f"Could not write {str(target)!r}: {error}; putting the previous files back failed too "
            f"({undo_error}): the files not back in place are in {str(aside)!r}, move them back by hand."
        ) from error
    shutil.rmtree(aside, ignore_errors=True)


def write_file_atomic(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` to a temporary file beside ``path``, then rename it over ``path``."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.resolve().parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(temporary, 0o666 & ~_umask())  # mkstemp makes it private (0600); give it open()'s usual mode
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return path


def _umask() -> int:
    """The process's umask (reading it means setting it, so it is put straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
