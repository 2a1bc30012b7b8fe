"""Replace a generated section of README.md, between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``."""

from __future__ import annotations

from pathlib import Path

from hf_posswap.persistence.saving import write_file_atomic


def replace_section(readme: Path, name: str, body: str) -> None:
    """Rewrite the text between the markers of ``name`` in ``readme`` with ``body``; the markers must exist."""
    text = readme.read_text(encoding="utf-8")
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in text or end not in text:
        raise SystemExit(f"{readme} has no '{start}' ... '{end}' markers; add them where the section should go.")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    write_file_atomic(readme, f"{head}{start}\n{body.strip()}\n{end}{tail}")  # never a half-written README
