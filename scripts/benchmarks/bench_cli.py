"""How fast the command line answers: ``hf-posswap --help``, ``hf-posswap CMD --help`` and ``import hf_posswap``,
each a fresh interpreter, against baselines measured in the same run (``python -c pass``, ``import transformers``,
``import torch``, and what a user's script imports anyway, ``import torch; from transformers import
AutoModelForCausalLM, AutoModel``: ``import hf_posswap`` registers its classes lazily and should cost about that).

The cases run round-robin (one of each, then again), so a busy machine slows them all alike; the table gives the
median and fastest wall time of each and the median's ratio to the ``python -c pass`` and ``import transformers``
baselines. Absolute times depend on the machine and its load; the ratios are the result. The target:
every ``--help`` under 1 s, i.e. no torch or transformers import (tests/cli/test_cli_fast.py checks the imports).

    python scripts/benchmarks/bench_cli.py                        # 5 rounds, every command
    python scripts/benchmarks/bench_cli.py --repeats 3 --commands eval swap --output cli.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("demo", "eval", "export", "extend", "finetune", "inspect", "plot", "schemes", "swap")
BASELINES = {
    "python -c pass": ["-c", "pass"],
    "python -c 'import transformers'": ["-c", "import transformers"],
    "python -c 'import torch'": ["-c", "import torch"],
    # what a script that loads a model imports anyway: the reference for `import hf_posswap` (lazy registration)
    "python -c 'import torch; from transformers import AutoModelForCausalLM, AutoModel'": [
        "-c", "import torch; from transformers import AutoModelForCausalLM, AutoModel"],
}
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def console_script() -> str:
    """The installed ``hf-posswap`` (beside this interpreter, else on PATH)."""
    beside = Path(sys.executable).with_name("hf-posswap")
    found = str(beside) if beside.exists() else shutil.which("hf-posswap")
    if found is None:
        raise SystemExit("hf-posswap is not installed (pip install -e .); nothing to measure.")
    return found


def cases(commands: list[str]) -> dict[str, list[str]]:
    """Label -> command line, baselines first."""
    script = console_script()
    runs = {label: [sys.executable, *argv] for label, argv in BASELINES.items()}
    runs["hf-posswap --help"] = [script, "--help"]
    runs.update({f"hf-posswap {command} --help": [script, command, "--help"] for command in commands})
    runs["python -c 'import hf_posswap'"] = [sys.executable, "-c", "import hf_posswap"]
    return runs


def wall_time(argv: list[str]) -> float:
    """Seconds from start to exit of one process (its output discarded); a failure stops the benchmark."""
    started = time.perf_counter()
    result = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()[-500:]}")
    return elapsed


def measure(runs: dict[str, list[str]], repeats: int) -> dict[str, list[float]]:
    """Round-robin: every case once per round, ``repeats`` rounds (one warm-up round first, not counted)."""
    for argv in runs.values():
        wall_time(argv)
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(repeats):
        for label, argv in runs.items():
            times[label].append(wall_time(argv))
    return times


def table(times: dict[str, list[float]]) -> str:
    """Markdown: median and fastest seconds, and the median against the two baselines."""
    bare = statistics.median(times["python -c pass"])
    transformers = statistics.median(times["python -c 'import transformers'"])
    lines = ["| process | median s | fastest s | x `python -c pass` | x `import transformers` |",
             "|---|---|---|---|---|"]
    for label, values in times.items():
        median = statistics.median(values)
        lines.append(f"| `{label}` | {median:.2f} | {min(values):.2f} | {median / bare:.1f} | "
                     f"{median / transformers:.2f} |")
    return "\n".join(lines)


def verdict(times: dict[str, list[float]]) -> str:
    """Which ``--help`` runs miss the 1 s target (by their median)."""
    slow = [label for label, values in times.items() if label.endswith("--help") and statistics.median(values) >= 1.0]
    return "every --help answered under 1 s" if not slow else f"over 1 s: {', '.join(slow)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds of measurements (default: 5)")
    parser.add_argument("--commands", nargs="*", default=list(COMMANDS), choices=COMMANDS,
                        help="the commands whose --help is measured (default: all)")
    parser.add_argument("--output", type=Path, help="also write the table to this Markdown file")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: measure at least one round")
    times = measure(cases(args.commands), args.repeats)
    report = f"{table(times)}\n\n{verdict(times)} ({args.repeats} rounds, {os.cpu_count()} CPUs)\n"
    print(report, end="")
    if args.output:
        args.output.write_text(report, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
