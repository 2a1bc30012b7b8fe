"""Built-in evaluation text that needs no download (docs/benchmarks.md): Python's documentation topics (English prose)
and standard-library source (code)."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

CORPORA = ("pydoc", "stdlib", "reference")
REFERENCE_FILES = ("typing.py", "argparse.py", "tarfile.py")


def corpus_text(name: str) -> str:
    """``pydoc``: pydoc_data.topics in sorted order; ``stdlib``: the standard library's top-level .py files in sorted
    order; ``reference``: typing.py + argparse.py + tarfile.py (the docs/benchmarks.md reference window)."""
    if name == "pydoc":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[key] for key in sorted(topics))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if name == "stdlib":
        return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py")))
    if name == "reference":
        return "".join((stdlib / f).read_text(encoding="utf-8") for f in REFERENCE_FILES)
    from ..errors import InvalidConfigError

    raise InvalidConfigError(f"Unknown corpus '{name}'. Built-in corpora: {', '.join(CORPORA)}; or pass text files.")


def text_digest(text: str) -> str:
    """The SHA-256 of ``text`` (UTF-8), all 64 hex digits: what the results' ``sha256`` field holds."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
