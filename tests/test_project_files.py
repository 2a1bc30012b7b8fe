"""Files a newcomer relies on: the LICENSE matches pyproject, examples/README.md lists every example, and the
README's line that prints where the offline checkpoints live works."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_license_file_matches_pyproject() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    declared = re.search(r'^license = \{ text = "([^"]+)" \}', pyproject, re.MULTILINE).group(1)  # 3.10: no tomllib
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert declared == "Apache-2.0"
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_examples_readme_lists_every_example_with_a_runtime() -> None:
    listing = (ROOT / "examples" / "README.md").read_text(encoding="utf-8")
    scripts = sorted(path.name for path in (ROOT / "examples").glob("*.py"))
    assert scripts
    rows = {row.split("`")[1]: row for row in listing.splitlines() if row.startswith("| [`")}
    assert sorted(rows) == scripts
    for name, row in rows.items():
        assert re.search(r"\d+ (s|min)", row), f"{name} has no runtime"


@pytest.mark.slow
def test_readme_command_prints_where_the_offline_checkpoints_live() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = re.search(r'`python -c "(from hf_posswap\.persistence\.offline_checkpoints import [^"]+)"`', readme)
    assert command, "the README line printing the checkpoint paths is gone"
    result = subprocess.run([sys.executable, "-c", command.group(1)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    paths = result.stdout.split()
    assert len(paths) == 2 and all(Path(path, "config.json").exists() for path in paths)
