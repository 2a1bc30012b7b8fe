"""The command line answers at once and explains every option.

``hf-posswap --help`` and ``hf-posswap CMD --help`` must not import torch or transformers (checked from the
modules the process holds at exit, not by timing; ``scripts/benchmarks/bench_cli.py`` measures the time), every
option of every command has help text, and ``import hf_posswap`` still registers the Auto classes in an ordinary
process."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import save_tiny_checkpoint

import hf_posswap as ps
from hf_posswap.cli import parser as cli_parser
from hf_posswap.cli.main import COMMANDS

cli_main = importlib.import_module("hf_posswap.cli.main")  # the module (``hf_posswap.cli.main`` is the function)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).with_name("hf-posswap")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
HEAVY = ("torch", "transformers", "peft", "accelerate", "matplotlib")
needs_script = pytest.mark.skipif(not SCRIPT.exists(), reason=f"the console script {SCRIPT} is not installed")


#: runs a script as its console-script process would (same file, same sys.argv[0]) and reports sys.modules at exit
PROBE = ("import atexit, json, runpy, sys\n"
         "atexit.register(lambda: sys.stderr.write('\\nMODULES ' + json.dumps(sorted(sys.modules)) + '\\n'))\n"
         "sys.argv = sys.argv[1:]\n"
         "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def run_probed(*argv: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run the script ``argv[0]`` with its arguments; the modules it had imported when it exited."""
    result = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=300,
                            cwd=ROOT, env=ENV)
    lines = [line for line in result.stderr.splitlines() if line.startswith("MODULES ")]
    assert lines, result.stderr[-2000:]
    return result, set(json.loads(lines[-1].removeprefix("MODULES ")))


def imported_modules(importtime_stderr: str) -> set[str]:
    """Module names from ``python -X importtime`` output (``import time: self | cumulative | name``; modules
    loaded through ``importlib.import_module`` are not listed there, hence :func:`run_probed` where it can be used)."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


def heavy_imports(modules: set[str]) -> list[str]:
    return sorted(name for name in modules if name.split(".")[0] in HEAVY)


def run_importtime(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=ENV)


@needs_script
@pytest.mark.parametrize("argv", [["--help"], *[[command, "--help"] for command in COMMANDS], ["swap"]],
                         ids=["top", *COMMANDS, "swap-missing-arguments"])
def test_help_of_the_console_script_imports_no_torch(argv: list[str]) -> None:
    result, modules = run_probed(str(SCRIPT), *argv)
    assert "hf_posswap.cli.main" in modules, result.stderr[-2000:]  # the probe saw the command's imports
    assert not heavy_imports(modules), heavy_imports(modules)[:10]
    if argv == ["swap"]:  # a malformed command line is refused as fast, on one line
        assert result.returncode == 2 and "the following arguments are required" in result.stderr
    else:
        assert result.returncode == 0 and result.stdout.startswith("usage: hf-posswap"), result.stderr[-2000:]


@pytest.mark.parametrize("module", ["hf_posswap", "hf_posswap.cli.finetune"])
def test_help_through_python_dash_m_imports_no_torch(module: str) -> None:
    result = run_importtime("-m", module, "--help")
    assert result.returncode == 0 and "usage: hf-posswap" in result.stdout, result.stderr[-2000:]
    assert not heavy_imports(imported_modules(result.stderr))


class _Captured(BaseException):
    """Carries the parser a command built out of ``parse_args`` (not an Exception: the CLI must not catch it)."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def command_parser(command: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser ``hf-posswap COMMAND`` builds, caught as it starts parsing (works for demo's own parser too)."""
    def capture(self, args=None, namespace=None):
        raise _Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Captured) as caught:
        COMMANDS[command](["--help"])
    return caught.value.parser


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_option_of_every_command_has_help(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = command_parser(command, monkeypatch)
    assert parser.prog == f"hf-posswap {command}" and parser.description
    options = [action for action in parser._actions if not isinstance(action, argparse._HelpAction)]
    assert options or command in ("schemes", "doctor")  # commands without options
    silent = [action.option_strings or [action.dest] for action in options
              if not action.help or action.help == argparse.SUPPRESS or not action.help.strip()]
    assert not silent, f"hf-posswap {command}: options without help text: {silent}"


def test_help_shows_defaults_worth_saying() -> None:
    text = cli_parser.PARSERS["finetune"]().format_help()
    assert "(default: 0)" in " ".join(text.split())  # --warmup-steps: a zero default is still said
    assert "(default: None)" not in text and "(default: False)" not in text


def test_the_parsers_lists_match_the_registries() -> None:
    from hf_posswap.evaluation.corpora import CORPORA
    from hf_posswap.evaluation.perplexity import MODES

    assert list(cli_parser.SCHEMES) == ps.available_schemes()
    assert list(cli_parser.EXTENSION_METHODS) == ps.available_extension_methods()
    assert cli_parser.MODES == MODES and sorted(cli_parser.CORPORA) == sorted(CORPORA)
    assert set(cli_parser.PARSERS) | {"demo"} == set(COMMANDS)


def test_the_public_api_is_complete_and_lazy_names_resolve() -> None:
    assert set(ps.__all__) == set(ps._EXPORTS) | {"__version__"}
    for name in ps.__all__:
        value = getattr(ps, name)
        if name != "__version__":
            module = sys.modules[f"hf_posswap.{ps._EXPORTS[name]}"]
            assert value is getattr(module, name), name
    assert "swap" in dir(ps) and "export_standalone" in dir(ps)
    with pytest.raises(AttributeError, match="no attribute 'swop'"):
        ps.swop  # noqa: B018


def test_a_broken_pipe_ends_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hf-posswap --help | head -1``: the reader left; no traceback."""
    def closed(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli_main, "_run", closed)
    monkeypatch.setattr(os, "dup2", lambda *args: None)
    assert cli_main.main(["--help"]) == 141


# ---- an ordinary process still registers at import; the command's process registers before it loads ----------


@pytest.fixture(scope="module")
def swapped_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("cli_fast")
    save_tiny_checkpoint("llama", root / "plain")
    model = ps.swap(AutoModelForCausalLM.from_pretrained(root / "plain"), "alibi")
    model.save_pretrained(root / "swapped")
    AutoTokenizer.from_pretrained(root / "plain").save_pretrained(root / "swapped")
    return root / "swapped"


@pytest.mark.slow  # an interpreter start-up with torch and transformers
def test_import_hf_posswap_then_auto_classes_load_a_swapped_checkpoint(swapped_dir: Path) -> None:
    code = ("import hf_posswap\nfrom transformers import AutoModelForCausalLM\n"
            f"model = AutoModelForCausalLM.from_pretrained({str(swapped_dir)!r})\n"
            "print(type(model).__name__, model.config.posswap['scheme'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["PosSwapLlamaForCausalLM", "alibi"]


@pytest.mark.slow  # an interpreter start-up with torch and transformers
def test_import_hf_posswap_leaves_training_evaluation_peft_and_plots_for_later() -> None:
    probe = "import json, sys, hf_posswap; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=ENV)
    modules = set(json.loads(result.stdout.splitlines()[-1]))
    assert {"torch", "transformers", "hf_posswap.core.swap", "hf_posswap.persistence.autoload"} <= modules
    later = ("peft", "matplotlib", "hf_posswap.training", "hf_posswap.evaluation", "hf_posswap.persistence.adapters",
             "hf_posswap.persistence.export", "hf_posswap.cli")
    assert not sorted(name for name in modules if name.startswith(later))


@needs_script
@pytest.mark.slow  # an interpreter start-up with torch and transformers
@pytest.mark.parametrize("command", ["swap", "finetune"])
def test_the_console_script_registers_before_it_reads_a_swapped_checkpoint(swapped_dir: Path, tmp_path,
                                                                            command: str) -> None:
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    argv = {"swap": ["swap", "--model", str(swapped_dir), "--scheme", "t5", "--output", str(tmp_path / "out")],
            "finetune": ["finetune", "--model", str(swapped_dir), "--data", str(tmp_path / "text.txt"), "--output",
                         str(tmp_path / "out"), "--seq-len", "16", "--batch-size", "2", "--steps", "1"]}[command]
    result = subprocess.run([str(SCRIPT), *argv], capture_output=True, text=True, timeout=300, env=ENV)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert ("scheme: t5" if command == "swap" else "finished 1 steps") in result.stdout


# ---- scripts/benchmarks/bench_cli.py: the timing lives in a benchmark, as ratios against baselines of the same run


def test_the_cli_benchmark_reports_ratios_and_the_1_s_target() -> None:
    sys.path.insert(0, str(ROOT / "scripts" / "benchmarks"))
    import bench_cli

    times = {"python -c pass": [0.05, 0.04], "python -c 'import transformers'": [2.0, 1.0],
             "hf-posswap --help": [0.1, 0.2], "hf-posswap eval --help": [1.5, 1.2],
             "python -c 'import hf_posswap'": [8.0]}
    text = bench_cli.table(times)
    assert "| `hf-posswap --help` | 0.15 | 0.10 | 3.3 | 0.10 |" in text
    assert bench_cli.verdict(times) == "over 1 s: hf-posswap eval --help"
    del times["hf-posswap eval --help"]
    assert bench_cli.verdict(times) == "every --help answered under 1 s"


@needs_script
@pytest.mark.slow  # fresh interpreters that import torch and transformers (~1 min on 2 cores)
def test_the_cli_benchmark_runs(tmp_path) -> None:
    script = ROOT / "scripts" / "benchmarks" / "bench_cli.py"
    result = subprocess.run([sys.executable, str(script), "--repeats", "1", "--commands",
                             "schemes", "--output", str(tmp_path / "cli.md")], capture_output=True, text=True,
                            timeout=600, cwd=ROOT, env=ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    table = (tmp_path / "cli.md").read_text()
    assert "`hf-posswap schemes --help`" in table and "`python -c 'import hf_posswap'`" in table
