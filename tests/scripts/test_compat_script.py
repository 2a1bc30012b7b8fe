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


#: the table's column names, in order
HEADER = [cell.strip() for cell in DOC.read_text(encoding="utf-8").split("<!-- compatibility-table:start -->")[1]
          .strip().splitlines()[0].strip("|").split("|")]


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
    def line(transformers: str, torch: str, note: str, python: str = "3.11.7") -> str:
        return f"| {transformers} | 0.21.2 | 1.15.0 | 0.8.0 | 6.2.0 | {torch} | {python} | {note} |"

    doc = tmp_path / "compatibility.md"
    cpu = "2.13.0+cpu"
    old = [line("5.9.0", cpu, "old"), line("5.10.0", cpu, "kept"), line("5.24.0", cpu, "kept")]
    doc.write_text(f"intro\n{compat.START}\n{compat.HEADER}\n" + "\n".join(old) + f"\n{compat.END}\nend\n")
    monkeypatch.setattr(compat, "DOC", doc)
    new = [line("5.9.0", cpu, "new"), line("5.24.0", "2.14.1", "added"), line("5.30.0", cpu, "added"),
           line("5.9.0", cpu, "added", python="3.10.13")]
    compat.update_doc(new)
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("end\n")
    # by transformers, then torch, then Python; another torch or Python is another row
    order = [new[3], new[0], old[1], old[2], new[1], new[2]]
    assert [text.index(row) for row in order] == sorted(text.index(row) for row in order)
    assert "old" not in text


def test_the_table_shows_the_declared_window_passing() -> None:
    rows = table_rows()
    for release in (OLDEST_TESTED, NEWEST_TESTED):
        of_release = [cells for cells in rows if cells[0] == release]
        assert of_release, f"docs/compatibility.md has no row for transformers {release}"
        for cells in of_release:
            suite, doctor = cells[HEADER.index("fast suite")], cells[HEADER.index("doctor")]
            assert re.fullmatch(r"\d+ passed, 0 failed, \d+ skipped", suite) and doctor == "passed", cells


def test_every_release_in_the_window_that_was_run_passed() -> None:
    def key(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in version.split("."))

    inside = [cells for cells in table_rows() if key(OLDEST_TESTED) <= key(cells[0]) <= key(NEWEST_TESTED)]
    failing = [cells for cells in inside if " 0 failed" not in cells[HEADER.index("fast suite")]]
    assert not failing


def test_the_interpreter_is_found_by_version_and_a_missing_one_is_refused(compat) -> None:
    import sys

    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert compat.minor_version(compat.find_python(running)) == running
    assert compat.find_python(sys.executable) == sys.executable
    assert compat.minor_version(compat.find_python("python3")).startswith("3.")  # a command on PATH
    for missing in ("3.99", "/no/such/python", "no-such-python"):
        with pytest.raises(SystemExit, match=rf"--python {re.escape(missing)}: no such interpreter runs here"):
            compat.find_python(missing)


def test_a_path_in_the_way_of_an_environment_is_refused_and_kept(compat, tmp_path) -> None:
    broken_link, folder = tmp_path / "compat-5.9.0", tmp_path / "compat-5.10.0"
    broken_link.symlink_to(tmp_path / "gone")
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    for venv in (broken_link, folder):
        with pytest.raises(SystemExit, match=rf"{re.escape(str(venv))} is in the way: it is not a virtual environment"):
            compat.build("5.9.0", venv, fresh=True, log=tmp_path / "log")
    assert broken_link.is_symlink() and (folder / "notes.txt").read_text() == "mine"


def test_every_python_the_package_claims_has_a_passing_row() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    claimed = re.findall(r'"Programming Language :: Python :: (3\.\d+)"', pyproject)
    floor = re.search(r'^requires-python = ">=(3\.\d+)"', pyproject, re.MULTILINE).group(1)
    assert floor in claimed, f"requires-python's floor {floor} is not among the classifiers {claimed}"
    suite, doctor, python = (HEADER.index(name) for name in ("fast suite", "doctor", "python"))
    passed = {".".join(cells[python].split(".")[:2]) for cells in table_rows()
              if " 0 failed" in cells[suite] and cells[doctor] == "passed"}
    assert not set(claimed) - passed, f"classifiers claim Pythons without a passing row: {set(claimed) - passed}"


def test_latest_means_the_newest_release_the_registry_lists_in_the_declared_range(compat) -> None:
    # pip's resolver falls back to an older transformers when a dependency of the newest is not on the registry
    # (transformers 5.25 requires kernels 0.19.1); the newest listed release in the range is tested all the same
    listing = "transformers (6.0.0)\nAvailable versions: 6.0.0, 5.25.0, 5.24.0, 5.25.0rc1, 5.5.0\n"
    assert compat.newest_allowed(listing, ">=5.5,<6") == "5.25.0"
    assert compat.newest_allowed(listing, ">=6.1") is None
    assert compat.newest_allowed("ERROR: No matching distribution found for transformers", ">=5.5,<6") is None


def test_a_missing_dependency_sets_the_switch_transformers_documents_for_it(compat, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    assert "USE_HUB_KERNELS" not in compat.environment(tmp_path)
    assert compat.environment(tmp_path, ["kernels"])["USE_HUB_KERNELS"] == "NO"
    assert compat.environment(tmp_path, ["some-other-package"]).get("USE_HUB_KERNELS") is None
