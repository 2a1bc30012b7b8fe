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
        "hf-posswap: unknown command 'swapp'; choose from demo, eval, export, extend, finetune, inspect, plot, "
        "schemes, swap."
    )


def test_cli_swap_and_extend(tmp_path) -> None:
    from conftest import save_tiny_checkpoint

    save_tiny_checkpoint("gpt2", tmp_path / "model")
    swap = subprocess.run([sys.executable, "-m", "hf_posswap", "swap", "--model", str(tmp_path / "model"), "--scheme",
                           "rope", "--option", "rope_theta=500", "--output", str(tmp_path / "rope")],
                          capture_output=True, text=True, timeout=300)
    assert swap.returncode == 0, swap.stderr[-2000:]
    assert "scheme: rope" in swap.stdout and "rope_theta=500.0" in swap.stdout
    extend = subprocess.run([sys.executable, "-m", "hf_posswap", "extend", "--model", str(tmp_path / "rope"), "--to",
                             "256", "--method", "yarn", "--output", str(tmp_path / "long")],
                            capture_output=True, text=True, timeout=300)
    assert extend.returncode == 0, extend.stderr[-2000:]
    assert "extended from 64 to 256 tokens with 'yarn'" in extend.stdout
    assert (tmp_path / "long" / "tokenizer.json").exists()
    bad = subprocess.run([sys.executable, "-m", "hf_posswap", "extend", "--model", str(tmp_path / "rope"), "--to",
                          "32", "--output", str(tmp_path / "x")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1].startswith(
        "hf-posswap extend: max_positions=32 is shorter than the model's current length 64")
