"""Replace a generated section of a Markdown page (README.md, docs/results.md, docs/speed.md), between
``<!-- NAME:start -->`` and ``<!-- NAME:end -->``."""

from __future__ import annotations

from pathlib import Path

from hf_posswap.persistence.saving import write_file_atomic

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is scripts/maintenance/readme_section.py)


def replace_section(readme: Path, name: str, body: str) -> None:
    """Rewrite the text between the markers of ``name`` in ``readme`` with ``body``; the markers must exist."""
    text = readme.read_text(encoding="utf-8")
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in text or end not in text:
        raise SystemExit(f"{readme} has no '{start}' ... '{end}' markers; add them where the section should go.")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    write_file_atomic(readme, f"{head}{start}\n{body.strip()}\n{end}{tail}")  # never a half-written page


def shown_path(page: Path) -> str:
    """``page`` as a command run from the repository root names it (docs/results.md); a page outside the repository
    by its file name."""
    resolved = page.resolve()
    return resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else page.name


def picture_link(picture: Path, page: Path) -> str:
    """The link from ``page`` to ``picture``, relative to the page's folder (../scripts/... from docs/)."""
    import os

    return Path(os.path.relpath(picture.resolve(), page.resolve().parent)).as_posix()


def project_root(page: Path) -> Path:
    """The folder whose scripts/results/ holds the page's pictures: the repository for a page inside it (docs/ pages
    included), the page's own folder for a scratch page elsewhere (tests write those)."""
    resolved = page.resolve()
    return ROOT if resolved.is_relative_to(ROOT) else resolved.parent
