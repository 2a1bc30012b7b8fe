"""scripts/benchmarks/bench_compiled_decode.py: a case it does not know is refused in one line, before any model is
built; a swapped and a native model of each family are what it compares."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "benchmarks"))

import bench_compiled_decode as bench  # noqa: E402


def test_an_unknown_case_is_refused_in_one_line() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts/benchmarks/bench_compiled_decode.py"), "--cases",
                             "llama-bogus"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "case 'llama-bogus'" in result.stderr and "Traceback" not in result.stderr


def test_every_default_case_builds_a_swapped_model_beside_its_native_one() -> None:
    for case in bench.DEFAULT_CASES:
        family, scheme = case.split("-", 1)
        swapped, native = bench.build(family, scheme), bench.build(family, None)
        assert hasattr(swapped.config, "posswap") and not hasattr(native.config, "posswap"), case
