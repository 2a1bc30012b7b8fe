"""Files a user hands to a command, checked from their bytes before anything heavy reads them: JSON objects
(``config.json``, adapter records, results), weight files (safetensors headers, ``torch.save`` archives) and text
files. Each problem becomes one :class:`UserFileError` naming the file and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import PosSwapError

_MAX_HEADER = 100 * 2**20  # bytes: a safetensors header longer than this is corrupt


class UserFileError(PosSwapError, ValueError):
    """A file that is missing, unreadable, corrupt, truncated or of the wrong kind."""


def read_json(path: Path, flag: str = "--model",
              fix: str = "restore the file or re-save the checkpoint") -> dict[str, Any]:
    """A JSON object from ``path``; any problem becomes one :class:`UserFileError` naming the file (and, for a file
    that is not JSON, ``fix``: what restores it)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise UserFileError(f"{flag}: cannot read {str(path)!r}: {error.strerror or error}.") from error
    except UnicodeDecodeError as error:
        raise UserFileError(f"{flag}: {str(path)!r} is not UTF-8 text (byte {error.start}); restore it.") from error
    except json.JSONDecodeError as error:
        raise UserFileError(
            f"{flag}: {str(path)!r} is not valid JSON ({error.msg} at line {error.lineno} column {error.colno}); "
            f"{fix}."
        ) from error
    if not isinstance(data, dict):
        raise UserFileError(f"{flag}: {str(path)!r} must hold a JSON object, got {type(data).__name__}.")
    return data


def check_torch_file(path: Path) -> None:
    """Refuse a ``.bin`` weights file that is neither torch.save's zip format nor a legacy pickle."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(4)
    except OSError as error:
        raise UserFileError(f"Cannot read {str(path)!r}: {error.strerror or error}.") from error
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):
        raise UserFileError(f"{str(path)!r} is not a PyTorch weights file (empty or corrupt); re-save or "
                              "re-download the model.")


def pickled_objects_message(path: str) -> str:
    """A ``.bin`` weights file that holds pickled objects other than tensors: named, with the safe fix."""
    files = sorted(Path(path).glob("pytorch_model*.bin")) if Path(path).is_dir() else []
    named = repr(str(files[0])) if len(files) == 1 else f"the pytorch_model*.bin files in {path!r}"
    return (f"{named} holds objects other than tensors (pickled Python objects, which could run code when "
            "unpickled), so it will not be unpickled. Save the weights as safetensors from a trusted environment "
            "(model.save_pretrained(directory) writes model.safetensors) and load that directory instead.")


def check_safetensors(path: Path) -> list[str]:
    """Refuse a truncated or corrupt safetensors file from its header alone (no tensor is read); return the
    tensor names it holds."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as stream:
            head = stream.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= min(size - 8, _MAX_HEADER):
                raise ValueError("header length out of range")
            header = json.loads(stream.read(length))
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        raise UserFileError(
            f"{str(path)!r} is not a valid safetensors file ({error}); it is corrupt or truncated: re-save or "
            "re-download the model."
        ) from error
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        raise UserFileError(
            f"{str(path)!r} is truncated or corrupt: its header needs {expected} bytes, the file has {size}. "
            "Re-save or re-download the model."
        )
    _check_header_entries(path)
    return [key for key in header if key != "__metadata__"]


def _check_header_entries(path: Path) -> None:
    """Each tensor's dtype, shape and offsets agree, as the safetensors library checks them when it opens the file
    (the header only: the file is mapped, no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError as error:
        raise UserFileError(
            f"{str(path)!r} is not a valid safetensors file ({' '.join(str(error).split())}); it is corrupt: re-save "
            "or re-download the model."
        ) from error


def read_text_files(paths: list[str], flag: str = "--text") -> str:
    """The UTF-8 text of ``paths`` joined by blank lines; a missing, unreadable, binary or empty file is refused
    with its name."""
    parts = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            raise UserFileError(f"{flag} {name!r} is a directory; pass text files.")
        if path.exists() and not path.is_file():  # /dev/zero, a FIFO: reading could never end
            raise UserFileError(f"{flag} {name!r} is not a regular file; pass text files.")
        try:
            data = path.read_bytes()
        except OSError as error:
            raise UserFileError(f"{flag} {name!r}: cannot read it ({error.strerror or error}).") from error
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise UserFileError(
                f"{flag} {name!r} is not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}); "
                "convert it (iconv -t UTF-8) or pass a text file."
            ) from error
        if "\x00" in text:
            raise UserFileError(f"{flag} {name!r} holds NUL bytes: a binary file, not text; pass a text file.")
        if not text.strip():
            raise UserFileError(f"{flag} {name!r} is empty; pass a file with text in it.")
        parts.append(text)
    return "\n\n".join(parts)
