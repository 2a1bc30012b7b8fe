"""scripts/maintenance/compat.py and docs/compatibility.md: the declared window is the measured one.

The script itself builds environments (minutes each; CI runs it for the floor and the newest releases); here its
pure parts run, and the table it wrote must show the declared floor and the newest tested release passing.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from hf_posswap.transformers_internals import NEWEST_TESTED, OLDEST_TESTED

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "compatibility.md"


@pytest.fixture(scope="module")
def compat():
    spec = importlib.util.spec_from_file_location("compat", ROOT / "scripts" / "maintenance" / "compat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table_rows() -> list[list[str]]:
    """The cells of every row of docs/compatibility.md's table (a transformers release may have one per torch)."""
    text = DOC.read_text(encoding="utf-8")
    table = text.split("<!-- compatibility-table:start -->")[1].split("<!-- compatibility-table:end -->")[0]
    rows = [line for line in table.strip().splitlines()[2:] if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_the_floor_environment_pins_every_declared_floor(compat) -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    pins = compat.requirements("floor")
    assert len(pins) == len(compat.FLOOR_PACKAGES)
    for pin in pins:
        name, version = pin.split("==")
        assert f'"{name}>={version}' in pyproject


def test_releases_below_the_floor_install_without_the_packages_range(compat) -> None:
    assert compat.below_floor("5.4.0") and not compat.below_floor(OLDEST_TESTED)
    assert not compat.below_floor("floor") and not compat.below_floor("latest")
    assert not any(spec.startswith(("transformers", "torch")) for spec in compat.dependencies_without_transformers())


def test_a_new_run_replaces_the_row_of_its_releases_and_keeps_the_others(compat, tmp_path, monkeypatch) -> None:
    def line(transformers: str, torch: str, note: str) -> str:
        return f"| {transformers} | 0.21.2 | 1.15.0 | 0.8.0 | 6.2.0 | {torch} | {note} |"

    doc = tmp_path / "compatibility.md"
    cpu = "2.13.0+cpu"
    old = [line("5.9.0", cpu, "old"), line("5.10.0", cpu, "kept"), line("5.24.0", cpu, "kept")]
    doc.write_text(f"intro\n{compat.START}\n{compat.HEADER}\n" + "\n".join(old) + f"\n{compat.END}\nend\n")
    monkeypatch.setattr(compat, "DOC", doc)
    new = [line("5.9.0", cpu, "new"), line("5.24.0", "2.14.1", "added"), line("5.30.0", cpu, "added")]
    compat.update_doc(new)
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("end\n")
    order = [new[0], old[1], old[2], new[1], new[2]]  # by transformers, then torch; another torch is another row
    assert [text.index(row) for row in order] == sorted(text.index(row) for row in order)
    assert "old" not in text


def test_the_table_shows_the_declared_window_passing() -> None:
    rows = table_rows()
    for release in (OLDEST_TESTED, NEWEST_TESTED):
        of_release = [cells for cells in rows if cells[0] == release]
        assert of_release, f"docs/compatibility.md has no row for transformers {release}"
        for cells in of_release:
            suite, doctor = cells[6], cells[7]
            assert re.fullmatch(r"\d+ passed, 0 failed, \d+ skipped", suite) and doctor == "passed", cells


def test_every_release_in_the_window_that_was_run_passed() -> None:
    def key(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in version.split("."))

    inside = [cells for cells in table_rows() if key(OLDEST_TESTED) <= key(cells[0]) <= key(NEWEST_TESTED)]
    failing = [cells for cells in inside if " 0 failed" not in cells[6]]
    assert not failing
