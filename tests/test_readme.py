"""The README cannot drift: its support matrix is the registries' and its test command is CI's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_support_matrix_in_readme_is_generated_from_the_registries() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "support_matrix.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "bash scripts/test.sh" in readme and "bash scripts/demo.sh" in readme
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_cli_lists_the_matrix() -> None:
    result = subprocess.run([sys.executable, "-m", "hf_posswap", "schemes"], capture_output=True, text=True)
    assert result.returncode == 0 and "| `gpt2` |" in result.stdout


def test_cli_unknown_command_is_one_clear_line() -> None:
    result = subprocess.run([sys.executable, "-m", "hf_posswap", "swapp"], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "hf-posswap: unknown command 'swapp'; choose from demo, eval, export, finetune, inspect, plot, schemes."
    )
