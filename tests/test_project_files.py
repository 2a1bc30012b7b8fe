"""Files a newcomer relies on: the LICENSE matches pyproject, examples/README.md lists every example, every dotted
``hf_posswap.<module>.<name>`` the text mentions exists, docs/architecture.md places every attention path and core
module, and the README's line that prints where the offline checkpoints live works."""

from __future__ import annotations

import importlib.util
import math
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


#: a dotted name under the package, as docstrings, comments, error messages and docs write it
DOTTED_NAME = re.compile(r"\bhf_posswap(?:\.[A-Za-z_]\w*)+(?![\w<])")


def _resolves(dotted: str) -> bool:
    """True when ``dotted`` is a module, or a module's attribute (its longest importable prefix, then getattr)."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


def test_every_dotted_name_the_text_mentions_exists() -> None:
    """A docstring or an error that names a function in the module it lived in before a move sends the reader
    nowhere; the package, docs, examples, scripts and tests are read for such names."""
    texts = [*(ROOT / "hf_posswap").rglob("*.py"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md",
             ROOT / "CONTRIBUTING.md", *(ROOT / "examples").glob("*.py"), *(ROOT / "scripts").rglob("*.py"),
             *(ROOT / "tests").rglob("*.py")]
    missing = []
    for path in texts:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in DOTTED_NAME.finditer(line):
                name = match.group(0)
                if not name.endswith((".py", ".md", ".json")) and not _resolves(name):
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    assert not missing, "names that do not exist:\n" + "\n".join(missing)


def test_architecture_page_lists_every_attention_path() -> None:
    """docs/architecture.md's table of attention paths names each path core/paths.py records, and no other."""
    from hf_posswap.core import paths

    recorded = {value for name, value in vars(paths).items() if name.isupper() and isinstance(value, str)}
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = page[page.index("| path name |"):].split("\n\n")[0]
    listed = {name for row in table.splitlines()[2:] for name in re.findall(r"`([a-z0-9-]+)`", row.split(" | ")[0])}
    assert listed == recorded



def test_architecture_page_places_every_core_module() -> None:
    """docs/architecture.md's table of core/ modules names each module of hf_posswap/core, and no other, so a
    module added there gets a line a newcomer finds."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = page[page.index("| concern | modules |"):].split("\n\n")[0]
    listed = set(re.findall(r"`([a-z_]+\.py)`", table))
    modules = {path.name for path in (ROOT / "hf_posswap" / "core").glob("*.py")} - {"__init__.py"}
    assert listed == modules, f"not listed: {sorted(modules - listed)}; no such module: {sorted(listed - modules)}"

@pytest.mark.slow
def test_readme_command_prints_where_the_offline_checkpoints_live() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = re.search(r'`python -c "(from hf_posswap\.persistence\.offline_checkpoints import [^"]+)"`', readme)
    assert command, "the README line printing the checkpoint paths is gone"
    result = subprocess.run([sys.executable, "-c", command.group(1)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    paths = result.stdout.split()
    assert len(paths) == 2 and all(Path(path, "config.json").exists() for path in paths)


def load_example(name: str):
    """An example script as a module (its ``main`` is not run on import)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_bert_finetuning_example_runs_on_a_tiny_bert(tmp_path, capsys) -> None:
    """The example's whole path (swap, two masked-LM fine-tunes, save, reload, long text) on a tiny BERT."""
    from conftest import save_tiny_checkpoint

    example = load_example("finetune_bert_alibi")
    save_tiny_checkpoint("bert", tmp_path / "bert")
    rows = example.main(["--model", str(tmp_path / "bert"), "--steps", "2", "--seq-len", "32", "--batch-size", "2",
                         "--topics", "3", "--output", str(tmp_path / "run")])
    printed = capsys.readouterr().out
    trained = [label for label in rows if "after 2 steps" in label]
    assert len(trained) == 2 and all(math.isfinite(rows[label]["mlm_loss"]) for label in trained)
    assert all(-1.0 <= row["similarity"] <= 1.0 + 1e-6 for row in rows.values())
    for name in ("mlm", "distill"):
        assert (tmp_path / "run" / name / "final" / "config.json").exists()
    assert "embedded a 128-token text (the original table holds 64)" in printed
    assert "| alibi after 2 steps, masked LM (reloaded)" in printed
