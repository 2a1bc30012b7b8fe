"""scripts/benchmarks/bench_scaling_memory.py: the exact byte counts of one rank (in this process, fast) and a
whole run on the tiny model in fresh processes, FSDP2 over 2 gloo ranks halving each rank's bytes (slow)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from process_launch import KilledBySignal, run_again_if_killed

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "benchmarks"))

import bench_scaling_memory as bench  # noqa: E402


def _spec(config: str, tmp_path: Path) -> dict:
    return {"config": config, "scheme": "alibi", "length": 32, "rank": 0, "world": 1, "model": "tiny",
            "device": "cpu", "dtype": "float32", "result": str(tmp_path / "r.json"), "threads": 1,
            "store": str(tmp_path / "store")}


@pytest.mark.parametrize("config", ["plain", "lora"])
def test_one_rank_counts_parameter_gradient_and_adamw_bytes_exactly(config: str, tmp_path: Path) -> None:
    rank = bench.Rank(_spec(config, tmp_path))
    params = list(rank.model.parameters())
    trainable = [p for p in params if p.requires_grad]
    counts = rank.step(32)
    assert bench.local_bytes(params) == 4 * sum(p.numel() for p in params)
    assert counts["grad_bytes"] == 4 * sum(p.numel() for p in trainable)
    # AdamW: exp_avg and exp_avg_sq as large as each trainable parameter, plus a 4-byte step count per parameter
    assert counts["optimizer_bytes"] == 2 * counts["grad_bytes"] + 4 * len(trainable)
    if config == "lora":
        assert counts["grad_bytes"] < bench.local_bytes(params) / 10


def test_markdown_names_why_a_row_has_no_numbers() -> None:
    results = {"environment": {"model": "tiny", "parameters": "0.1 M", "device": "cpu", "dtype": "float32",
                               "threads": 2, "torch": "x"},
               "rows": [{"config": "cp", "scheme": "rope", "length": 64, "world": 2, "refused": "no hook"},
                        {"config": "ckpt", "scheme": "rope", "length": 64, "world": 1,
                         "skipped": "not run: --budget-seconds spent"}]}
    table = bench.markdown(results)
    assert "| cp | rope | 64 | 2 | refused: no hook |" in table and "--budget-seconds spent" in table
    assert all(line.count("|") == 14 for line in table.splitlines() if line.startswith("|"))


def _tiny_run(folder: Path) -> tuple[dict, Path]:
    """The benchmark's rows by config, and its table; a rank killed by a signal (gloo) runs it again."""
    out, table = folder / "m.json", folder / "m.md"
    bench.main(["--model", "tiny", "--lengths", "64", "--schemes", "alibi", "--configs", "ckpt", "fsdp",
                "--json", str(out), "--output", str(table)])
    rows = {row["config"]: row for row in json.loads(out.read_text(encoding="utf-8"))["rows"]}
    killed = [row["error"] for row in rows.values() if row.get("error", "").startswith("exit -")]
    if killed:
        raise KilledBySignal(f"a rank of the benchmark ended by a signal: {killed}")
    return rows, table


@pytest.mark.slow  # 3-4 fresh interpreters, ~40 s on 2 cores
def test_a_tiny_run_writes_every_row_and_fsdp_halves_each_ranks_bytes(tmp_path: Path) -> None:
    rows, table = run_again_if_killed(_tiny_run, tmp_path)
    assert set(rows) == {"ckpt", "fsdp"} and "| fsdp | alibi | 64 | 2 |" in table.read_text(encoding="utf-8")
    whole, shards = rows["ckpt"]["ranks"][0], rows["fsdp"]["ranks"]
    assert len(shards) == 2
    for key in ("param_bytes", "grad_bytes"):  # dim-0 shards: each rank half, up to padding of odd rows
        assert sum(rank[key] for rank in shards) == pytest.approx(whole[key], rel=0.02)
        assert max(rank[key] for rank in shards) < 0.55 * whole[key]
    for rank in [whole, *shards]:
        assert rank["peak_bytes"] >= rank["idle_bytes"] > 0 and rank["seconds"] > 0
