"""``scripts/recipes/recipe_convert.py`` (convert SmolLM2 away from RoPE and recover): its budget
extrapolation against a curve with a known law, and ``--quick`` end to end (tiny LLaMA, every variant)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "recipes"))
import recipe_convert  # noqa: E402


def test_extrapolation_recovers_a_power_law() -> None:
    """Excess loss 2 * step^-0.5 over a native perplexity of 10: the 10 % target is reached where
    2 * t^-0.5 = log(1.1), t = (2 / log 1.1)^2 (worked out by hand, not by the code under test)."""
    native = 10.0
    curve = [(0, 5000.0)] + [(step, native * math.exp(2.0 * step ** -0.5)) for step in (8, 16, 24, 32, 40)]
    guess = recipe_convert.steps_to_target(curve, native, seconds_per_step=36.0)
    expected = (2.0 / math.log(1.1)) ** 2  # 440.5 steps
    assert guess is not None and abs(guess["steps"] - expected) <= 1 and guess["power"] == pytest.approx(0.5)
    assert guess["cpu_hours"] == pytest.approx(round(expected * 36 / 3600, 1), abs=0.1)


def test_extrapolation_refuses_a_curve_that_does_not_fall() -> None:
    native = 10.0
    assert recipe_convert.steps_to_target([(0, 50.0), (8, 20.0), (16, 21.0)], native, 10.0) is None
    assert recipe_convert.steps_to_target([(0, 50.0), (8, 20.0)], native, 10.0) is None  # one trained point
    assert recipe_convert.steps_to_target([(0, 50.0), (8, 9.0), (16, 8.0)], native, 10.0) is None  # below native


@pytest.mark.slow
def test_quick_mode_runs_every_variant_and_writes_table_and_curves(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- recipe-convert:start -->\nold\n<!-- recipe-convert:end -->\ntail\n", encoding="utf-8")
    results = recipe_convert.main(["--quick", "--work-dir", str(tmp_path), "--readme", str(readme)])
    written = json.loads((tmp_path / "recipe_convert.json").read_text(encoding="utf-8"))
    assert [row["variant"] for row in written["rows"]] == list(recipe_convert.variants(2, recipe_convert.QUICK))
    settings = recipe_convert.QUICK
    for row in written["rows"]:
        steps = [step for step, _ in row["curve"]]
        assert steps == list(range(0, settings.steps + 1, settings.eval_every))  # before training, then every 2
        assert all(math.isfinite(value) and value > 1 for _, value in row["curve"])
        assert set(row["reference"]) == {"short", "long"}
    by_name = {row["variant"]: row for row in written["rows"]}
    assert by_name["alibi-distill-lora"]["options"]["distill_temperature"] == 2.0
    assert by_name["nope-interleaved-plain-lora"]["options"]["scheme_options"]["overrides"] == {"none": [1]}
    # full fine-tuning moves the held-out curve, so the rows are real runs, not the starting model measured twice
    assert by_name["alibi-plain-full"]["curve"][-1][1] < by_name["alibi-plain-full"]["curve"][0][1]
    table = (tmp_path / "recipe_convert.md").read_text(encoding="utf-8")
    assert "| native (RoPE) |" in table and "| alibi-plain-full |" in table
    assert (tmp_path / "recipe_convert.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(json.dumps(results["rows"])) == written["rows"]
    section = readme.read_text(encoding="utf-8")
    assert "old" not in section and section.endswith("<!-- recipe-convert:end -->\ntail\n")
    assert "`python scripts/recipes/recipe_convert.py --quick --readme README.md`" in section
    assert "| alibi-plain-full |" in section and "](recipe_convert.png)" in section


def test_unknown_variant_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown variant.*'rope-plain'"):
        recipe_convert.main(["--quick", "--work-dir", str(tmp_path), "--variants", "rope-plain"])
