"""Built-in evaluation text that needs no download (docs/benchmarks.md): Python's documentation topics (English prose)
and standard-library source (code)."""

from __future__ import annotations

import contextlib
import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


#: inside :func:`tokenize_once`: (tokenizer, text, its token ids) of the last text tokenized, else None
_remembered: list[tuple[Any, str, list[int]]] | None = None


@contextlib.contextmanager
def tokenize_once() -> Iterator[None]:
    """Within the block, :func:`text_token_ids` tokenizes a text once per tokenizer: the CLI's ``eval`` checks the
    text's length before loading the model and ``evaluate`` then scores the same tokens (a corpus of a few MB takes
    seconds to tokenize). Scoped, so a tokenizer changed between two calls of a program is never answered from an
    old result."""
    global _remembered
    outer, _remembered = _remembered, []
    try:
        yield
    finally:
        _remembered = outer


def text_token_ids(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer(text)["input_ids"]`` (remembered inside :func:`tokenize_once`)."""
    if _remembered is not None:
        for known, known_text, ids in _remembered:
            if known is tokenizer and known_text == text:
                return ids
    ids = list(tokenizer(text)["input_ids"])
    if _remembered is not None:
        _remembered[:] = [(tokenizer, text, ids)]
    return ids
