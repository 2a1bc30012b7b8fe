"""scripts/gpu_check.sh still names what exists: a lent GPU is there for minutes only, so a test file renamed, a
parametrize id changed or a benchmark option dropped since the script was written must fail here, on the CPU, and
not there. (``bash scripts/gpu_check.sh --rehearse`` runs its steps on the CPU by hand; this checks what it names.)
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "scripts" / "benchmarks"))

import bench_speed  # noqa: E402


def commands() -> list[list[str]]:
    """The script's command lines, continuation lines joined, split into words (shell variables kept as text)."""
    text = SCRIPT.read_text(encoding="utf-8").replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if not line.strip().startswith("#")]
    words = []
    for line in lines:
        try:
            words.append(shlex.split(line, comments=True))
        except ValueError:  # a line inside a multi-line string (the python -c of save_model)
            continue
    return [line for line in words if line]


def pytest_selections() -> list[tuple[list[str], str]]:
    """(test files, -k expression) of every pytest run the script starts."""
    found = []
    for line in commands():
        if "pytest" not in line:
            continue
        files = [word for word in line if word.startswith("tests/")]
        found.append((files, line[line.index("-k") + 1]))
    return found


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_file_the_script_names_exists() -> None:
    named = set(re.findall(r"\b((?:tests|scripts)/[\w/.-]+\.(?:py|sh))", SCRIPT.read_text(encoding="utf-8")))
    assert named, "the script names no file: the pattern above no longer reads it"
    assert not [path for path in sorted(named) if not (ROOT / path).is_file()]


def test_every_benchmark_case_the_script_names_exists() -> None:
    cases = set()
    for line in commands():
        if "bench_speed.py" in " ".join(line) and "--cases" in line:
            following = line[line.index("--cases") + 1:]
            cases.update(following[:next((i for i, word in enumerate(following) if word.startswith("--")),
                                         len(following))])
    assert cases and cases <= set(bench_speed.CASES), cases - set(bench_speed.CASES)


def _collected(files: list[str], selection: str) -> list[str]:
    """Test ids pytest collects for the files and -k expression, with test_cuda.py rehearsed on the CPU."""
    env = {**os.environ, "POSSWAP_TEST_DEVICE": "cpu"}
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "-m", "slow or not slow", *files, "-k", selection], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [line for line in result.stdout.splitlines() if "::" in line]


@pytest.mark.slow
def test_every_pytest_selection_of_the_script_selects_tests_in_every_file_and_term() -> None:
    selections = pytest_selections()
    assert len(selections) == 2, selections  # the GPU run's and the rehearsal's
    for files, selection in selections:
        collected = _collected(files, selection)
        for path in files:
            assert any(test.startswith(path) for test in collected), f"-k {selection!r} selects nothing in {path}"
        for term in selection.split(" or "):
            assert any(term in test for test in collected), f"-k term {term!r} of the script selects no test"


@pytest.mark.slow
def test_every_option_the_script_passes_to_a_python_program_is_one_it_takes() -> None:
    programs = {}
    for line in commands():
        modules = [line[i + 1] for i, word in enumerate(line[:-1]) if word == "-m"]
        program = next((word for word in line if word.startswith("scripts/") and word.endswith(".py")), None)
        program = program or next((module for module in modules if module.startswith("hf_posswap.")), None)
        if program is not None:
            programs.setdefault(program, set()).update(
                word for word in line[line.index(program) + 1:] if re.fullmatch(r"--[a-z][\w-]*", word))
    assert {"scripts/benchmarks/bench_speed.py", "hf_posswap.cli.finetune"} <= set(programs), programs
    for program, options in programs.items():
        command = [sys.executable, program] if program.endswith(".py") else [sys.executable, "-m", program]
        shown = subprocess.run([*command, "--help"], cwd=ROOT, capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert shown.returncode == 0, shown.stderr[-2000:]
        unknown = [option for option in sorted(options) if not re.search(rf"{re.escape(option)}\b", shown.stdout)]
        assert not unknown, f"{program} does not take {unknown}"


@pytest.mark.slow
def test_the_rehearsal_runs_every_step_on_the_cpu(tmp_path) -> None:
    """``--rehearse``: the GPU check's steps at tiny sizes on the CPU (about 30 s), each of which must exit 0."""
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(["bash", str(SCRIPT), "--rehearse", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                   timeout=600, check=True)
    steps = (tmp_path / "summary.txt").read_text(encoding="utf-8").splitlines()[1:]  # after the heading line
    assert [line.split(":")[0] for line in steps] == ["environment", "cuda_matrix", "bench"]
    failed = [line for line in steps if ": exit 0 after" not in line]
    logs = {line.split(":")[0]: (tmp_path / f"{line.split(':')[0]}.log").read_text(encoding="utf-8")[-2000:]
            for line in failed}
    assert not failed, logs
