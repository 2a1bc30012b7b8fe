"""The README and the pages it links cannot drift: every ```python and ```bash block of README.md, CONTRIBUTING.md
and docs/*.md runs (or is listed below with the reason it cannot), every `hf-posswap` command in them parses with
the real command-line parsers, every `python scripts/...` command names a script and options that exist, every link
points to a file (and heading) in the repository, and the README's support matrix is the registries'.

Blocks run in a fresh working directory holding tiny stand-ins at the paths the documents name (``STAND_INS``);
the text is executed as written except for the training budgets in ``BUDGET`` (500 optimizer steps are minutes
even on a tiny model; the options themselves are all exercised).
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import save_tiny_checkpoint, write_corpus

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# Every document whose blocks, commands and links are checked: the README, CONTRIBUTING and the task pages.
DOCUMENTS = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]

# Paths the README's examples name, and the tiny stand-in the test puts there: a family for save_tiny_checkpoint,
# or "corpus" for a directory of text files.
STAND_INS = {
    "path/to/checkpoint": "llama",  # the first snippet: any causal LM
    "path/to/llama-like": "llama-12-layers",  # Per-layer schemes (layers 3, 7, 11), Extending context
    "path/to/gpt2": "gpt2",  # Extending context: a GPT-2 swapped to RoPE with YaRN
    "ckpt": "llama",  # Measuring, Fine-tuning
    "out/final": "llama",  # Measuring: a fine-tuned model
    "corpus": "corpus",  # Fine-tuning: 'corpus/*.txt'
}

# Training budgets shortened for the test: (README text, text run instead).
BUDGET = [("--steps 500", "--steps 2"), ("steps=500", "steps=2")]

# Commands in the README that no test can run, with the reason.
NOT_RUN = {
    "bash scripts/demo.sh": "creates a virtual environment and runs SmolLM2 for minutes; `hf-posswap demo` runs "
                            "with short lengths in tests/families/test_real_checkpoints.py and on a tiny model in "
                            "tests/training/test_progress.py",
    "bash scripts/test.sh": "is CI itself (.ci/run runs exactly this)",
    "pip install -e .": "installs into the running environment; scripts/maintenance/compat.py installs the package "
                        "into fresh environments of each tested transformers release and runs the suite there",
    "python scripts/benchmarks/bench_tiny.py --device cuda":
        "trains 14 tiny models x 10,000 steps on a GPU (hours on CPU); its --quick mode runs in "
        "tests/scripts/test_bench_tiny_command.py",
    "python scripts/benchmarks/bench_tiny.py --schemes":
        "trains a tiny model for 10,000-20,000 steps per run (16-59 min on 2 cores); tests/scripts/test_bench_tiny.py "
        "runs scheme options and probes for a few steps",
    "python scripts/benchmarks/bench_tiny.py --report":
        "merges runs' results (GPU seeds, CPU parts); tests/scripts/test_bench_tiny_report.py tests the merge",
    "python -m pytest": "is this test suite (CONTRIBUTING's commands to run it)",
    "ruff check": "lint; a development tool, not a package dependency",
    "bash scripts/gpu_check.sh": "needs a CUDA GPU; tests/scripts/test_gpu_check_script.py runs its --rehearse mode",
    "python scripts/benchmarks/bench_speed.py":
        "measures for minutes to most of an hour; tests/scripts/test_bench_speed.py runs it on tiny settings",
    "python scripts/benchmarks/bench_tiny.py --quick":
        "trains 14 tiny models (11 min); tests/scripts/test_bench_tiny_command.py runs it for a few steps",
    "accelerate launch": "needs two processes; tests/training/test_finetune.py::test_two_processes_train_data_parallel "
                         "runs finetune() under the same launcher",
    "pip install hf_posswap[deepspeed]": "installs the DeepSpeed extra, which scripts/setup.sh installs for the tests",
}


def readme() -> str:
    return README.read_text(encoding="utf-8")


def document_blocks(language: str) -> list[tuple[Path, int, str]]:
    """(document, line number, code) of every fenced block of ``language`` in every checked document."""
    return [(path, line, block) for path in DOCUMENTS if path.exists()
            for line, block in code_blocks(path.read_text(encoding="utf-8"), language)]


def block_id(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT).as_posix()}:{line}"


def code_blocks(text: str, language: str) -> list[tuple[int, str]]:
    """(line number, code) of every fenced block of ``language``."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(text.splitlines(), 1):
        if current is None and line.strip() == f"```{language}":
            current, start = [], number + 1
        elif current is not None and line.strip() == "```":
            blocks.append((start, "\n".join(current)))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def shell_commands(block: str) -> list[list[str]]:
    """One argv per command: backslash continuations joined, comments dropped."""
    return [words for line in block.replace("\\\n", " ").splitlines() if (words := shlex.split(line, comments=True))]


def not_run_reason(argv: list[str]) -> str | None:
    line = " ".join(argv)
    return next((reason for prefix, reason in NOT_RUN.items() if line.startswith(prefix)), None)


def cli_commands() -> list[list[str]]:
    """Every `hf-posswap ...` command of the README's bash blocks, without the program name."""
    return [argv[1:] for _, _, block in document_blocks("bash") for argv in shell_commands(block)
            if argv[0] == "hf-posswap"]


def with_budget(text: str) -> str:
    for written, run in BUDGET:
        text = text.replace(written, run)
    return text


def make_stand_ins(directory: Path, block: str) -> None:
    """A tiny stand-in at every path of ``STAND_INS`` that ``block`` names (and only those: a block may write into
    a directory another block reads)."""
    for path, kind in STAND_INS.items():
        if path not in block:
            continue
        target = directory / path
        target.mkdir(parents=True)
        if kind == "corpus":
            write_corpus(target, documents=8)
        elif kind == "llama-12-layers":
            save_tiny_checkpoint("llama", target, num_hidden_layers=12)
        else:
            save_tiny_checkpoint(kind, target)


# --- the blocks are what the tests below run ---------------------------------------------------------------------


def test_every_shell_command_in_the_documents_is_run_here_or_listed_with_its_reason() -> None:
    assert len([argv for _, block in code_blocks(readme(), "bash") for argv in shell_commands(block)]) >= 8, (
        "the README's bash blocks were not found")
    commands = [argv for _, _, block in document_blocks("bash") for argv in shell_commands(block)]
    unknown = [" ".join(argv) for argv in commands if argv[0] != "hf-posswap" and not_run_reason(argv) is None]
    assert not unknown, f"commands this test neither runs nor lists in NOT_RUN: {unknown}"
    used = {prefix for prefix in NOT_RUN for argv in commands if " ".join(argv).startswith(prefix)}
    assert used == set(NOT_RUN), f"NOT_RUN lists commands no document shows any more: {set(NOT_RUN) - used}"


class _Parsed(Exception):  # noqa: N818  (a signal, not an error)
    """Raised by the patched parser once a subcommand's arguments are parsed: nothing after parsing runs."""

    def __init__(self, prog: str, namespace: argparse.Namespace) -> None:
        super().__init__(prog)
        self.prog, self.namespace = prog, namespace


def parse_only(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """``hf-posswap ARGV`` through the CLI's own ``main`` and parsers, stopped right after the subcommand's options
    are parsed (nothing is loaded or written); returns what its parser produced."""
    from hf_posswap.cli.main import main

    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        parsed = original(self, args, namespace)
        if self.prog.split()[-1] == argv[0]:
            raise _Parsed(self.prog, parsed)
        return parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    with pytest.raises(_Parsed) as parsed:
        main(list(argv))
    assert parsed.value.prog == f"hf-posswap {argv[0]}"
    return parsed.value.namespace


@pytest.mark.parametrize("argv", cli_commands(), ids=lambda argv: " ".join(argv)[:60])
def test_every_cli_command_in_the_readme_parses(argv, monkeypatch) -> None:
    args = parse_only(argv, monkeypatch)
    if argv[0] == "eval":  # and passes the check eval makes before loading (it once asked for tail_from > length)
        from hf_posswap.evaluation.checks import check_settings

        check_settings(args.lengths, args.mode, args.stride, args.tail_from, args.max_windows, args.passkey_lengths,
                       args.depths, args.trials)


@pytest.mark.slow
@pytest.mark.parametrize(("path", "line", "block"),
                         [pytest.param(*entry, id=block_id(*entry[:2])) for entry in document_blocks("bash")])
def test_bash_block_runs_on_tiny_models(path, line, block, tmp_path, monkeypatch, capsys) -> None:
    """Every `hf-posswap` command of one block, in order, in-process, on the stand-ins."""
    from hf_posswap.cli.main import main

    make_stand_ins(tmp_path, block)
    monkeypatch.chdir(tmp_path)
    for argv in shell_commands(with_budget(block)):
        if not_run_reason(argv) is not None:
            continue
        code = main(argv[1:])
        assert code == 0, f"{block_id(path, line)}: `{' '.join(argv)}` exited {code}: {capsys.readouterr().err[-2000:]}"


def python_blocks() -> list:
    """Every document's python blocks; those that train a model are slow."""
    return [pytest.param(path, line, block, marks=[pytest.mark.slow] if "finetune(" in block else [],
                         id=block_id(path, line))
            for path, line, block in document_blocks("python")]


@pytest.mark.parametrize(("path", "line", "block"), python_blocks())
def test_python_block_runs_on_tiny_models(path, line, block, tmp_path, monkeypatch) -> None:
    make_stand_ins(tmp_path, block)
    monkeypatch.chdir(tmp_path)
    exec(compile(with_budget(block), f"{block_id(path, line)}, block", "exec"), {"__name__": "__readme__"})


def test_readme_blocks_are_found() -> None:
    text = readme()
    assert len(code_blocks(text, "python")) >= 3 and len(code_blocks(text, "bash")) >= 3
    assert sum(block.count("```") for _, _, block in document_blocks("python")) == 0


def test_every_document_is_checked_and_linked_from_the_readme() -> None:
    assert (ROOT / "CONTRIBUTING.md").exists() and len(DOCUMENTS) >= 10
    links = set(re.findall(r"\]\(([^)#\s]+)", readme()))
    unlinked = [path.relative_to(ROOT).as_posix() for path in DOCUMENTS[1:]
                if path.relative_to(ROOT).as_posix() not in links]
    assert not unlinked, f"pages the README does not link: {unlinked}"


# --- commands in the running text, links ------------------------------------------------------------------------


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_script_commands_name_scripts_and_options_that_exist(path) -> None:
    commands = re.findall(r"`python (scripts/[\w./-]+\.py)((?: --?[\w-]+(?: [\w.=/-]+)*)*)`",
                          path.read_text(encoding="utf-8"))
    assert path != README or len(commands) >= 1
    for script, options in commands:
        source = (ROOT / script).read_text(encoding="utf-8")
        for option in re.findall(r"--[\w-]+", options):
            assert f'"{option}"' in source, f"{path.name}: `python {script}{options}`: {script} has no {option} option"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_links_point_into_the_repository(document) -> None:
    """Relative to the document (pages under docs/ reach pictures with ../), anchors included, in-page ones too."""
    text = document.read_text(encoding="utf-8")
    assert "../shared" not in text, f"{document.name} points outside the repository"
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert document != README or any(link.startswith("docs/benchmarks.md") for link in links)
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = (document.parent / path).resolve() if path else document
        assert target.exists(), f"{document.name} links to {link}, which does not exist"
        assert target.is_relative_to(ROOT), f"{document.name} links outside the repository: {link}"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(encoding="utf-8"), re.MULTILINE)
            assert anchor in {_anchor(heading) for heading in headings}, (
                f"{document.name} links to a missing heading: {link}")


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_documents_name_no_issue_numbers(document) -> None:
    found = re.findall(r".{0,30}issue ?[0-9]+.{0,30}", document.read_text(encoding="utf-8"), re.IGNORECASE)
    assert not found, f"{document.name} names work items instead of what they were: {found}"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# --- generated sections and the CLI's answers --------------------------------------------------------------------


def test_support_matrix_in_readme_is_generated_from_the_registries() -> None:
    from hf_posswap.cli.matrix import support_matrix_markdown

    section = readme().split("<!-- support-matrix:start -->\n", 1)[1].split("\n<!-- support-matrix:end -->", 1)[0]
    assert section == support_matrix_markdown(), ("README's matrix is stale: run "
                                                  "python scripts/maintenance/support_matrix.py")


@pytest.mark.slow
def test_support_matrix_script_checks_the_readme() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "maintenance" / "support_matrix.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_ci_runs_the_readme_test_command() -> None:
    text = readme()
    assert "bash scripts/test.sh" in text and "bash scripts/demo.sh" in text
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


@pytest.mark.slow
def test_cli_lists_the_matrix() -> None:
    result = subprocess.run([sys.executable, "-m", "hf_posswap", "schemes"], capture_output=True, text=True)
    assert result.returncode == 0 and "| `gpt2` |" in result.stdout


def test_cli_unknown_command_is_one_clear_line() -> None:
    result = subprocess.run([sys.executable, "-m", "hf_posswap", "swapp"], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "hf-posswap: unknown command 'swapp'; choose from demo, doctor, eval, export, extend, finetune, inspect, plot, "
        "schemes, swap."
    )


@pytest.mark.slow
def test_cli_swap_and_extend(tmp_path) -> None:
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
        "hf-posswap extend: --to 32 is shorter than the model's current length 64")


# --- the generated sections live in the pages that show them ------------------------------------------------------

GENERATED = {  # marker name -> the page that holds it (the scripts rewrite it with --readme PAGE)
    "support-matrix": "README.md", "demo-extension": "docs/results.md", "recipe-extend": "docs/results.md",
    "recipe-convert": "docs/results.md", "recipe-convert-tiny": "docs/results.md", "bench-tiny": "docs/results.md",
    "bench-speed": "docs/speed.md", "context-acceptance": "docs/extending-context.md",
    "finetune-example": "docs/fine-tuning.md", "compatibility-table": "docs/compatibility.md",
}


@pytest.mark.parametrize(("name", "page"), GENERATED.items(), ids=list(GENERATED))
def test_each_generated_section_is_in_its_page_once(name, page) -> None:
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        expected = 1 if path == ROOT / page else 0
        assert text.count(f"<!-- {name}:start -->") == expected == text.count(f"<!-- {name}:end -->"), (
            f"{path.name}: the {name} section belongs in {page} only")


def test_section_writers_name_the_page_and_link_pictures_from_it(tmp_path) -> None:
    sys.path.insert(0, str(ROOT / "scripts" / "maintenance"))
    from readme_section import picture_link, project_root, shown_path

    page = ROOT / "docs" / "results.md"
    picture = ROOT / "scripts" / "results" / "bench_tiny.png"
    assert shown_path(page) == "docs/results.md" and shown_path(README) == "README.md"
    assert picture_link(picture, page) == "../scripts/results/bench_tiny.png"
    assert picture_link(picture, README) == "scripts/results/bench_tiny.png"
    assert project_root(page) == ROOT  # a docs page's pictures go to the repository's scripts/results/
    scratch = tmp_path / "README.md"  # a page outside the repository (tests write those) keeps its own folder
    assert shown_path(scratch) == "README.md" and project_root(scratch) == tmp_path
