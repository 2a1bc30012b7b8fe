"""The benchmark scripts run end to end on tiny settings and write what the README shows (their numbers are
measurements, not test expectations); the byte tokenizer and the passkey filler they rely on."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from hf_posswap.evaluation import BYTE_VOCAB_SIZE, byte_tokenizer, corpus_text, passkey_prompt

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts" / "benchmarks"), str(ROOT / "scripts" / "maintenance")]

import bench_speed  # noqa: E402
import bench_speed_measure  # noqa: E402
import bench_tiny  # noqa: E402
import bench_tiny_report  # noqa: E402
from readme_section import replace_section  # noqa: E402

DEFAULTS = dataclasses.asdict(bench_tiny.Settings())  # what --report fills into results older than a setting


def test_byte_tokenizer_round_trips_any_text() -> None:
    tokenizer = byte_tokenizer()
    text = "def f(x):\n    return 'héllo ✓' * 2\t# ünïcode"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text.encode("utf-8")) and max(ids) < 256 and len(tokenizer) == BYTE_VOCAB_SIZE
    assert tokenizer.decode(ids) == text


def test_passkey_prompt_takes_a_filler() -> None:
    tokenizer = byte_tokenizer()
    text = tokenizer.decode(passkey_prompt(tokenizer, 300, 0.5, "12345", filler="Rain falls. "))
    assert "Rain falls." in text and "grass" not in text and text.count("12345") == 2


def test_training_examples_have_the_length_and_hold_the_answer() -> None:
    import random

    tokenizer, rng = byte_tokenizer(), random.Random(0)
    for length in (128, 256):
        passkey = tokenizer.decode(bench_tiny.passkey_example(tokenizer, length, rng))
        key = passkey.rsplit("The pass key is ", 1)[1][:5]
        assert len(passkey) == length and passkey.count(key) == 3 and passkey.endswith(f" {key}.")
        copy = tokenizer.decode(bench_tiny.copy_example(tokenizer, length, rng))
        chunk = copy.split("|")[0]
        assert len(copy) == length and copy.startswith(f"{chunk}|{chunk}")


@pytest.mark.slow
def test_bench_tiny_writes_table_plot_and_readme_section(tmp_path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- bench-tiny:start -->\nold\n<!-- bench-tiny:end -->\nafter\n", encoding="utf-8")
    out = tmp_path / "out"
    argv = ["--quick", "--schemes", "learned", "learned+concat", "alibi", "rope", "nope-interleaved", "--scalings",
            "yarn", "longrope", "self_extend", "--steps", "2", "--finetune-steps", "1", "--length", "16", "--trials",
            "1", "--seeds", "0", "1", "--jobs", "2", "--output-dir", str(out), "--readme", str(readme)]
    assert bench_tiny.main(argv) == 0
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert list(results["runs"]) == ["learned", "learned+concat", "alibi", "rope", "nope-interleaved",
                                     "rope+yarn (zero-shot)", "rope+yarn (fine-tuned)",
                                     "rope+longrope (zero-shot)", "rope+longrope (fine-tuned)",
                                     "rope+self_extend (zero-shot)", "rope+self_extend (fine-tuned)"]
    assert all(len(rows) == 2 for rows in results["runs"].values())  # one row per seed
    row = results["runs"]["alibi"][0]
    assert set(row["windows"]) == {"1", "2", "4", "8"} and set(row["tail"]) == {"2", "4", "8"}
    assert all(0.0 <= value <= 1.0 for value in row["passkey"].values())
    table = (out / "results.md").read_text(encoding="utf-8")
    assert "| rope+yarn (fine-tuned)" in table and "ppl 8x" in table and "passkey 8x" in table
    assert "| learned+concat" in table and "| nope-interleaved" in table
    assert "seeds 0, 1 (mean ± std)" in table and " ± " in table.split("| alibi")[1].splitlines()[0]
    assert (out / "bench_tiny.png").stat().st_size > 10_000
    text = readme.read_text(encoding="utf-8")
    assert "old" not in text and "| alibi" in text and text.endswith("<!-- bench-tiny:end -->\nafter\n")
    assert (tmp_path / "scripts" / "results" / "bench_tiny.png").exists()
    redrawn = tmp_path / "redrawn"
    assert bench_tiny.main(["--report", str(out / "results.json"), "--output-dir", str(redrawn)]) == 0
    assert (redrawn / "results.md").read_text(encoding="utf-8") == table


def test_bench_tiny_runs_cover_the_registered_schemes_and_build_what_they_name() -> None:
    import hf_posswap as ps

    runs = bench_tiny.available_runs()
    for scheme in ("kerple", "sandwich", "fire", "learned", "sinusoidal"):
        assert scheme in runs
    assert {"learned+concat", "sinusoidal+concat", "nope-interleaved"} <= set(runs)
    settings = bench_tiny.Settings(length=16, hidden=32, heads=2, kv_heads=1)
    concat = bench_tiny.build_model(settings, "learned+concat", 0)
    assert ps.describe(concat).settings["combine"] == "concat"
    mixed = bench_tiny.build_model(settings, "nope-interleaved", 0)
    assert ps.describe(mixed).scheme == "layer_mix"
    bench_tiny.tile_learned_table(concat, 64)  # the table inside the concatenation grows; rows < 16 are kept
    assert concat.model.posswap_positions.positions.weight.shape == (64, 32)


def test_bench_tiny_runs_take_scheme_options_checked_before_training() -> None:
    import argparse

    import hf_posswap as ps

    assert bench_tiny.split_run("fire:shared_across_layers=false,mlp_width=8") == (
        "fire", {"shared_across_layers": False, "mlp_width": 8})
    assert bench_tiny.split_run("learned+concat") == ("learned+concat", {})
    assert bench_tiny.run_label("sandwich:dim=32") == "sandwich:dim=32"
    for bad, says in (("sandwich:dim=33", "even integer"), ("sandwhich", "choose from"), ("rope:x=1", "no options"),
                      ("fire:width=8", "width"), ("alibi:oops", "KEY=VALUE")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            bench_tiny.run_label(bad)
    settings = bench_tiny.Settings(length=16, hidden=32, heads=2, kv_heads=1)
    fire = bench_tiny.build_model(settings, "fire:shared_across_layers=false", 0)
    assert ps.describe(fire).settings["shared_across_layers"] is False
    sandwich = bench_tiny.build_model(settings, "sandwich:dim=8", 0)
    assert ps.describe(sandwich).settings["dim"] == 8


def test_bench_tiny_probes_record_passkey_heldout_and_training_perplexity(capsys) -> None:
    from hf_posswap.schemes.sandwich import sandwich_distance_table

    settings = bench_tiny.Settings(length=16, hidden=32, heads=2, kv_heads=1, steps=4, factors=(1, 2), trials=1,
                                   max_windows=1, depths=(0.5,))
    row = bench_tiny.train_and_measure(settings, bench_tiny.Task("sandwich:dim=8", 0), "cpu", 2, None)
    assert [entry[0] for entry in row["probe"]] == [2, 4]
    assert all(0.0 <= accuracy <= 1.0 and 1.0 < heldout < 1e4 and 1.0 < seen < 1e4
               for _, accuracy, heldout, seen in row["probe"])
    assert all(heldout != seen for _, _, heldout, seen in row["probe"])  # two texts, not one read twice
    step, accuracy, heldout, seen = row["probe"][-1]
    assert (f"sandwich:dim=8 seed 0 step 4: passkey {accuracy:.0%}, held-out ppl {heldout:.2f}, training ppl "
            f"{seen:.2f}") in capsys.readouterr().out  # a log shows them as they come
    table = sandwich_distance_table(16, 8, 10_000.0, 2, torch.device("cpu"))  # [H, distance]
    expected = table[:, row["bias_profile"]["distances"]]
    assert torch.allclose(torch.tensor(row["bias_profile"]["layers"][1]), expected, atol=1e-3)


def test_bench_tiny_bias_profile_reads_what_the_bias_scheme_adds() -> None:
    """ALiBi's profile is -slope x distance with Press et al.'s slopes 2^(-8h/H) (formula written here, not read
    from the library); rotary and absolute schemes have none."""
    settings = bench_tiny.Settings(length=16, hidden=32, heads=4, kv_heads=2)
    profile = bench_tiny.bias_profile(bench_tiny.build_model(settings, "alibi", 0), 16)
    assert profile["distances"] == [0, 1, 2, 4, 8, 15] and len(profile["layers"]) == settings.layers
    for layer in profile["layers"]:
        for head, row in enumerate(layer, start=1):
            assert row == pytest.approx([-(2 ** (-8 * head / 4)) * d for d in profile["distances"]], abs=1e-3)
    assert bench_tiny.bias_profile(bench_tiny.build_model(settings, "rope", 0), 16) is None
    assert bench_tiny.bias_profile(bench_tiny.build_model(settings, "learned", 0), 16) is None
    fire = bench_tiny.bias_profile(bench_tiny.build_model(settings, "fire", 0), 16)
    assert fire["layers"][0] == [[0.0] * 6] * 4  # FIRE's output layer starts at zero


def test_bench_tiny_schedule_fixed_and_until_retrieval() -> None:
    fixed = bench_tiny.Schedule(100, 0.8)  # warm-up 5 steps, stable to 80, linear decay to 10 % at 100
    expected = [(s + 1) / 5 if s < 5 else 1.0 if s < 80 else 1.0 - 0.9 * (s - 80) / 20 for s in range(100)]
    assert [fixed.factor(s) for s in range(100)] == pytest.approx(expected) and fixed.total_steps == 100
    fixed.observe(90, 1.0)  # a fixed schedule ignores the probes
    assert fixed.decay_start == 80
    late = bench_tiny.Schedule(100, 0.8, max_steps=300)
    assert late.decay_start is None and late.total_steps == 300 and late.factor(150) == 1.0
    late.observe(40, 1.0)  # retrieval before the nominal decay: the stable phase still lasts to 80
    late.observe(80, 0.5)
    assert late.decay_start is None
    late.observe(120, 0.9)
    assert late.decay_start == 120 and late.total_steps == 140 and late.factor(130) == pytest.approx(0.55)
    never = bench_tiny.Schedule(100, 0.8, max_steps=300)
    never.observe(279, 0.0)
    never.observe(280, None)  # no retrieval: the decay starts where it still ends by max_steps
    assert never.decay_start == 280 and never.total_steps == 300


def test_bench_tiny_until_retrieval_can_ask_for_probes_in_a_row() -> None:
    plan = bench_tiny.Schedule(100, 0.8, max_steps=300, confirm=2)
    plan.observe(80, 1.0)  # one lucky probe: the stable phase goes on
    assert plan.decay_start is None
    plan.observe(81, None)  # steps without a probe do not break the row
    plan.observe(90, 0.5)  # a miss starts the count again
    plan.observe(100, 0.9)
    assert plan.decay_start is None
    plan.observe(110, 0.95)
    assert plan.decay_start == 110 and plan.total_steps == 130
    early = bench_tiny.Schedule(100, 0.8, max_steps=300, confirm=2)
    early.observe(70, 1.0)  # a row begun before the nominal decay counts once the stable phase may end
    early.observe(80, 1.0)
    assert early.decay_start == 80
    settings = {**DEFAULTS, "until_retrieval": 300, "confirm_retrieval": 2, "factors": [1], "seeds": [0]}
    row = {"windows": {"1": 4.0}, "tail": {}, "passkey": {"1": 1.0}}
    table = bench_tiny_report.markdown({"settings": settings, "runs": {"alibi": [row]}})
    assert "until 2 training probes in a row retrieved" in table


def test_bench_tiny_length_curriculum_grows_from_a_quarter_to_l() -> None:
    ramp = bench_tiny.LengthRamp(256, 100, 0.5)  # 64 -> 256 over 50 batches, in multiples of 8, then 256
    expected = [max(64, int((64 + 192 * step / 50) // 8) * 8) for step in range(50)] + [256] * 10
    assert [ramp() for _ in range(60)] == expected and expected[0] == 64 and expected[25] == 160
    data = bench_tiny.batches(bench_tiny.byte_tokenizer(), torch.randint(0, 200, (4000,)),
                              bench_tiny.LengthRamp(32, 4, 0.5), 3, 0.5, 0)
    assert [tuple(next(data).shape) for _ in range(3)] == [(3, 9), (3, 16), (3, 32)]  # L/4 = 8 is too short: 9
    settings = bench_tiny.Settings(length=32, hidden=32, heads=2, kv_heads=1, steps=4, factors=(1,), trials=1,
                                   max_windows=1, depths=(0.5,), curriculum=0.5)
    row = bench_tiny.train_and_measure(settings, bench_tiny.Task("none", 0), "cpu", 0, None)
    assert row["steps"] == 4
    table = bench_tiny_report.markdown({"settings": {**DEFAULTS, "curriculum": 0.5, "factors": [1], "seeds": [0]},
                                        "runs": {"none": [{"windows": {"1": 4.0}, "tail": {}, "passkey": {"1": 1.0}}]}})
    assert "growing from L/4 to L over the first 50% of 2500 steps" in table


@pytest.mark.parametrize("accuracy, steps", [(1.0, 10), (0.0, 40)], ids=["retrieves", "never-retrieves"])
def test_bench_tiny_trains_until_retrieval(accuracy: float, steps: int) -> None:
    settings = bench_tiny.Settings(length=16, hidden=32, heads=2, kv_heads=1)
    model = bench_tiny.build_model(settings, "alibi", 0)
    data = bench_tiny.batches(bench_tiny.byte_tokenizer(), torch.randint(0, 200, (400,)), 16, 2, 0.0, 0)
    losses, curve, plan = bench_tiny.train(model, data, 10, 1e-3, "t", lambda: [accuracy, 9.0], 2, 0.8, 40)
    assert len(losses) == plan.total_steps == steps and curve[0] == [2, accuracy, 9.0]
    assert plan.decay_start == steps - 2


def test_bench_tiny_trains_on_past_a_probe_that_retrieves_alone() -> None:
    settings = bench_tiny.Settings(length=16, hidden=32, heads=2, kv_heads=1)
    model = bench_tiny.build_model(settings, "alibi", 0)
    data = bench_tiny.batches(bench_tiny.byte_tokenizer(), torch.randint(0, 200, (400,)), 16, 2, 0.0, 0)
    reads = iter([1.0, 0.0] * 20)  # every other probe retrieves: never two in a row
    losses, curve, plan = bench_tiny.train(model, data, 10, 1e-3, "t", lambda: [next(reads), 9.0], 2, 0.8, 40,
                                           confirm=2)
    assert len(losses) == 40 and plan.decay_start == 38 and [c[1] for c in curve[:3]] == [1.0, 0.0, 1.0]


def test_bench_tiny_run_takes_confirm_retrieval_from_its_settings(monkeypatch) -> None:
    reads = iter([1.0, 0.0] * 10)  # probes at steps 2, 4, 6, ...: one alone would start the decay at step 6
    monkeypatch.setattr(bench_tiny, "make_probe", lambda *args: lambda: [next(reads), 9.0, 9.0])
    settings = bench_tiny.Settings(length=32, hidden=32, heads=2, kv_heads=1, steps=4, until_retrieval=12,
                                   confirm_retrieval=2, factors=(1,), trials=1, max_windows=1, depths=(0.5,))
    row = bench_tiny.train_and_measure(settings, bench_tiny.Task("alibi", 0), "cpu", 2, None)
    assert row["steps"] == 12  # never two in a row: the stable phase ran to the maximum


def test_bench_tiny_until_retrieval_needs_probes_and_a_larger_maximum(capsys) -> None:
    for argv in (["--until-retrieval", "20000"], ["--until-retrieval", "5000", "--probe-every", "1000"]):
        with pytest.raises(SystemExit) as stopped:
            bench_tiny.main(argv)
        assert stopped.value.code == 2 and "--until-retrieval" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--length", "8"], "--length 8: must be more than 8"),
    (["--jobs", "0"], "--jobs 0"),
    (["--lr", "-1"], "--lr -1.0"),
    (["--layers", "0"], "--layers 0: must be at least 1"),
    (["--weight-decay", "nan"], "--weight-decay nan: must be a number >= 0"),
    (["--synthetic", "1.5"], "--synthetic 1.5"),
    (["--decay-from", "1.5"], "--decay-from 1.5"),
    (["--curriculum", "0.9"], "--curriculum 0.9"),
    (["--curriculum", "-0.1"], "--curriculum -0.1"),
    (["--probe-every", "-5"], "--probe-every -5"),
    (["--confirm-retrieval", "0"], "--confirm-retrieval 0: must be at least 1"),
    (["--confirm-retrieval", "2"], "more than 1 only with --until-retrieval"),
    (["--seeds", "2", "2"], "a seed is given twice"),
    (["--schemes", "alibi", "alibi"], "a run is given twice"),
], ids=["steps", "length", "jobs", "lr", "layers", "weight-decay", "synthetic",
        "decay-from", "curriculum-late", "curriculum-negative",
        "probe-every", "confirm-retrieval-zero", "confirm-retrieval-alone", "seeds", "schemes"])
def test_bench_tiny_refuses_bad_numbers_before_training(argv: list[str], says: str, capsys) -> None:
    tiny = ["--quick", "--steps", "1", "--length", "16", "--trials", "1", "--scalings", "--schemes", "alibi"]
    with pytest.raises(SystemExit) as stopped:  # a check that misses would train a tiny model, not hang the tests
        bench_tiny.main([*tiny, *argv, "--output-dir", "/nonexistent/never-written"])
    assert stopped.value.code == 2 and says in capsys.readouterr().err


def test_bench_tiny_table_shows_the_steps_each_run_took() -> None:
    settings = {**DEFAULTS, "until_retrieval": 300, "steps": 100}
    row = {"windows": {"1": 4.0}, "tail": {}, "passkey": {"1": 1.0}}
    table = bench_tiny_report.markdown({"settings": {**settings, "factors": [1], "seeds": [0, 1]}, "runs": {
        "alibi": [{**row, "steps": 120}, {**row, "steps": 140}], "fire": [{**row, "steps": 300}] * 2,
        "rope": [{**row, "steps": 200}, {**row, "steps": 260}], "rope+yarn (zero-shot)": [row, row]}})
    assert "at most 300, column `steps`" in table and "| run | steps | ppl 1x |" in table
    assert "| alibi | 130 ± 14 | 4.00 ± 0.00 |" in table and "| fire | 300 ± 0 |" in table
    assert "| rope+yarn (zero-shot) | 230 ± 42 |" in table  # the RoPE model it extends trained that long


def test_bench_tiny_report_merges_seeds_in_order() -> None:
    def part(seed: int, ppl: float) -> dict:
        row = {"windows": {"1": ppl}, "passkey": {"1": 1.0}}
        return {"settings": {"length": 16, "seeds": [seed]}, "runs": {"rope": [row]}, "seconds": 10.0,
                "command": f"python scripts/benchmarks/bench_tiny.py --seeds {seed}", "versions": {}}

    merged = bench_tiny_report.merge([part(1, 5.0), part(0, 4.0)], DEFAULTS)
    assert merged["settings"]["seeds"] == [0, 1] and merged["seconds"] == 20.0
    assert [r["windows"]["1"] for r in merged["runs"]["rope"]] == [4.0, 5.0]
    other = part(2, 6.0)
    other["settings"]["length"] = 32
    with pytest.raises(SystemExit, match="differ in settings other than seeds"):
        bench_tiny_report.merge([part(0, 4.0), other], DEFAULTS)


def test_bench_tiny_report_merges_other_runs_of_one_seed_and_refuses_repeats() -> None:
    def part(label: str, ppl: float) -> dict:
        row = {"windows": {"1": ppl}, "tail": {}, "passkey": {"1": 1.0}}
        return {"settings": {**DEFAULTS, "seeds": [2], "factors": [1]}, "runs": {label: [row]}, "seconds": 1.0,
                "command": label}

    merged = bench_tiny_report.merge([part("fire", 4.0), part("sandwich", 5.0)], DEFAULTS)
    assert merged["settings"]["seeds"] == [2] and list(merged["runs"]) == ["fire", "sandwich"]
    assert "seeds 2." in bench_tiny_report.markdown(merged)
    later = {**part("alibi", 4.5), "settings": {**DEFAULTS, "seeds": [1], "factors": [1]}}
    merged = bench_tiny_report.merge([part("fire", 4.0), later, part("sandwich", 5.0)], DEFAULTS)
    assert list(merged["runs"]) == ["fire", "alibi", "sandwich"]  # as given, though seed 1 sorts first
    rope = {**part("rope", 4.0), "runs": {"rope": [{}], "rope+yarn (zero-shot)": [{}], "rope+yarn (fine-tuned)": [{}]}}
    merged = bench_tiny_report.merge([rope, part("sandwich", 5.0)], DEFAULTS)
    assert list(merged["runs"]) == ["rope", "sandwich", "rope+yarn (zero-shot)", "rope+yarn (fine-tuned)"]
    with pytest.raises(SystemExit, match="'fire' seed 2 is in two"):
        bench_tiny_report.merge([part("fire", 4.0), part("fire", 4.1)], DEFAULTS)


def test_bench_tiny_merge_of_two_machines_names_both(tmp_path) -> None:
    """NoPE's 3-layer seeds 0-2 ran on this CPU and seeds 3-4 on an H100; the merge kept only the first part's
    versions, so its README line said every seed ran on 1 CPU thread. A merge now keeps each part's command and
    versions, claims only what every part shares, and a split gives each file its own part's."""
    def part(label: str, seeds: list[int], versions: dict) -> dict:
        row = {"windows": {"1": 4.0}, "tail": {}, "passkey": {"1": 1.0}}
        return {"settings": {**DEFAULTS, "seeds": seeds, "factors": [1]}, "runs": {label: [row] * len(seeds)},
                "seconds": 60.0, "command": f"{label} {seeds}", "versions": versions}

    cpu = {"torch": "2.13.0+cpu", "python": "3.11.7", "threads": 1, "device": "cpu", "jobs": 1}
    gpu = {"torch": "2.11.0+cu130", "python": "3.11.7", "threads": 16, "device": "NVIDIA H100", "jobs": 2}
    merged = bench_tiny_report.merge([part("none", [3, 4], gpu), part("none", [0, 1], cpu)], DEFAULTS)
    assert merged["versions"] == {"python": "3.11.7"}  # what is true of every seed
    assert [entry["seeds"] for entry in merged["parts"]] == [[0, 1], [3, 4]]
    assert bench_tiny_report.machines(merged) == (
        "1 CPU thread, torch 2.13.0+cpu (seeds 0, 1) and one NVIDIA H100, 2 runs at a time, torch 2.11.0+cu130 "
        "(seeds 3, 4)")
    alone = part("none", [0], cpu)
    assert bench_tiny_report.machines(alone) == "1 CPU thread, torch 2.13.0+cpu"
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bench-tiny:start -->\n<!-- bench-tiny:end -->\n", encoding="utf-8")
    bench_tiny_report.report(merged, tmp_path / "out", readme)
    assert "(seeds 0, 1) and one NVIDIA H100" in readme.read_text(encoding="utf-8")
    again = bench_tiny_report.merge([merged, part("none", [5], cpu)], DEFAULTS)  # a merge merged again
    assert [entry["seeds"] for entry in again["parts"]] == [[0, 1], [3, 4], [5]]
    split = bench_tiny_report.merge([part("alibi", [3], gpu), part("t5", [3], cpu)], DEFAULTS)
    written = bench_tiny_report.write_split(split, tmp_path / "parts", bench_tiny.RUNS)
    files = {path.name: json.loads(path.read_text(encoding="utf-8")) for path in written}
    assert files["07_alibi_seed3.json"]["versions"] == gpu and files["08_t5_seed3.json"]["versions"] == cpu
    assert files["07_alibi_seed3.json"]["command"] == "alibi [3]" and "parts" not in files["08_t5_seed3.json"]
    remerged = bench_tiny_report.merge(list(files.values()), DEFAULTS)
    assert len(remerged["parts"]) == 2 and bench_tiny_report.machines(remerged).count("seeds 3") == 2
    del split["parts"][0]["command"]  # an entry the loader accepts (seeds and versions) without a command
    written = bench_tiny_report.write_split(split, tmp_path / "parts2", bench_tiny.RUNS)
    assert json.loads(written[0].read_text(encoding="utf-8"))["command"] == "?"


def test_bench_tiny_merges_results_written_before_a_setting_existed() -> None:
    """Seeds 0 and 1 were run before ``decay_from`` became a setting (the code decayed from 0.8 of the steps, the
    default): a later part at the default merges with them, one at another value is refused."""
    settings = {**dataclasses.asdict(bench_tiny.FULL), "seeds": [0, 1]}
    del settings["decay_from"]
    row = {"windows": {"1": 4.0}, "passkey": {"1": 1.0}}
    old = {"settings": settings, "runs": {"fire": [row, row], "t5": [row, row]}, "seconds": 1.0}
    later = {"settings": {**dataclasses.asdict(bench_tiny.FULL), "seeds": [2]}, "runs": {"fire": [row]},
             "seconds": 1.0}
    merged = bench_tiny_report.merge([later, old], DEFAULTS)
    assert merged["settings"]["seeds"] == [0, 1, 2] and len(merged["runs"]["fire"]) == 3
    table = bench_tiny_report.markdown({**merged, "runs": {
        label: [{**r, "tail": {str(f): 4.0 for f in (2, 4, 8)}, "windows": {str(f): 4.0 for f in (1, 2, 4, 8)},
                 "passkey": {str(f): 1.0 for f in (1, 2, 4, 8)}} for r in rows]
        for label, rows in merged["runs"].items()}})
    assert "| run | seeds | ppl 1x" in table
    assert "| fire | 3 |" in table and "| t5 | 2 |" in table and "how many of them each run has" in table
    other = {**later, "settings": {**later["settings"], "decay_from": 0.5}}
    with pytest.raises(SystemExit, match="differ in settings other than seeds"):
        bench_tiny_report.merge([other, old], DEFAULTS)


def test_bench_tiny_refuses_to_merge_runs_on_different_corpora() -> None:
    """The corpus is Python's pydoc topics, which change with the Python version: seeds 0 and 1 ran under 3.12 on
    a GPU, seed 2 under 3.11 on this machine read 4.07 perplexity where seeds 0 and 1 gave 4.68-4.92. Such parts
    must not be averaged. Parts with one fingerprint merge; parts from before fingerprints read their own Python's
    topics, known here only for this Python (a 3.12 part could have been compared with a part that read 3.11's
    topics through --corpus-file under 3.12), so they merge with each other by version."""
    import sys

    this = f"{sys.version_info.major}.{sys.version_info.minor}.0"
    other = "3.12.3" if not this.startswith("3.12") else "3.11.7"

    def part(seed: int, python: str, corpus: str | None = None) -> dict:
        found = {"settings": {"length": 16, "seeds": [seed]}, "runs": {"rope": [{"windows": {"1": 4.0}}]},
                 "versions": {"python": python}}
        return {**found, "corpus": corpus} if corpus else found

    native = bench_tiny.corpus_fingerprint()
    for parts in ([part(0, other), part(2, this, native)], [part(0, this, "aaaa"), part(1, this, "bbbb")],
                  [part(0, other), part(1, other, native)], [part(0, this), part(1, this, "aaaa")]):
        with pytest.raises(SystemExit, match="different text.*the same --corpus-file"):
            bench_tiny_report.merge(parts, DEFAULTS)
    for parts in ([part(0, other), part(1, other[:5] + "1")], [part(0, this), part(1, other, native)],
                  [part(0, this, "aaaa"), part(1, other, "aaaa")]):
        assert bench_tiny_report.merge(parts, DEFAULTS)["settings"]["seeds"] == [0, 1]
    assert len(native) == 16


def test_bench_tiny_corpus_file_carries_the_text_to_another_python(tmp_path, monkeypatch, capsys) -> None:
    """Seeds run under another Python (a GPU machine's 3.12) read this Python's topics from a file: the text comes
    back byte for byte with the same fingerprint, training reads it (not the running Python's), results record it,
    and bad files are refused in one line before training."""
    path = tmp_path / "topics.txt"
    assert bench_tiny.main(["--write-corpus", str(path)]) == 0
    native = corpus_text("pydoc")
    assert bench_tiny.read_corpus_file(path) == native and path.read_bytes() == native.encode("utf-8")
    assert f"corpus {bench_tiny.corpus_fingerprint()}" in capsys.readouterr().out
    other = tmp_path / "other.txt"
    other.write_bytes(("Another Python's topics.\r\n" + native[:200_000]).encode("utf-8"))  # \r kept as written
    text = bench_tiny.read_corpus_file(other)
    assert text.startswith("Another Python's topics.\r\n")
    seen = []

    def split(tokenizer, text=None):
        seen.append(text)
        return real_split(tokenizer, text)

    real_split = bench_tiny.corpus_split
    monkeypatch.setattr(bench_tiny, "corpus_split", split)
    out = tmp_path / "out"
    argv = ["--quick", "--schemes", "alibi", "rope", "--scalings", "yarn", "--steps", "1", "--finetune-steps", "1",
            "--length", "16", "--trials", "1", "--corpus-file", str(other), "--output-dir", str(out)]
    assert bench_tiny.main(argv) == 0
    assert len(seen) == 4 and all(found == text for found in seen)  # the length check, two runs and the scaling
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert results["corpus"] == bench_tiny.corpus_fingerprint(text) != bench_tiny.corpus_fingerprint()
    short, binary = tmp_path / "short.txt", tmp_path / "binary.txt"
    short.write_text("too short", encoding="utf-8")
    binary.write_bytes(b"\xff\xfe" * 100_000)
    for bad, says in ((tmp_path / "missing.txt", "cannot read"), (short, "too short"), (binary, "as UTF-8")):
        with pytest.raises(SystemExit) as stopped:
            bench_tiny.main([*argv[:-2], "--corpus-file", str(bad), "--output-dir", str(tmp_path / "never")])
        assert stopped.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
    with pytest.raises(SystemExit) as stopped:  # a directory where the file should go: one line, nothing left
        bench_tiny.main(["--write-corpus", str(tmp_path)])
    assert stopped.value.code == 2 and "--write-corpus" in capsys.readouterr().err
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.slow  # trains four tiny runs; merging and split refusals are checked fast on written results
def test_bench_tiny_partial_results_merge_and_split_into_parts(tmp_path, capsys) -> None:
    """A run stopped early (a lent GPU's time ran out) leaves partial.json, which carries what --report needs (corpus,
    versions, command, each row's seed); --split writes it as the parts a run in parts writes, one per (run, seed),
    named so that a glob keeps the full mode's order, a seed's RoPE scalings with its RoPE run."""
    out = tmp_path / "out"
    argv = ["--quick", "--schemes", "rope", "sandwich:dim=8", "--scalings", "yarn", "--steps", "1", "--finetune-steps",
            "1", "--length", "16", "--trials", "1", "--seeds", "0", "2", "--output-dir", str(out)]
    assert bench_tiny.main(argv) == 0
    partial = json.loads((out / "partial.json").read_text(encoding="utf-8"))
    assert partial["corpus"] == bench_tiny.corpus_fingerprint() and partial["versions"]["device"] == "cpu"
    assert partial["command"].endswith(str(out)) and partial["seconds"] > 0
    assert [row["seed"] for row in partial["runs"]["rope+yarn (fine-tuned)"]] == [0, 2]
    parts = tmp_path / "parts"
    assert bench_tiny.main(["--report", str(out / "partial.json"), "--split", str(parts)]) == 0
    names = sorted(path.name for path in parts.glob("*.json"))
    assert names == ["06_rope_seed0.json", "06_rope_seed2.json", "10_sandwich_dim_8_seed0.json",
                     "10_sandwich_dim_8_seed2.json"]
    rope2 = json.loads((parts / "06_rope_seed2.json").read_text(encoding="utf-8"))
    assert rope2["settings"]["seeds"] == [2] and list(rope2["runs"]) == [
        "rope", "rope+yarn (zero-shot)", "rope+yarn (fine-tuned)"]
    assert all(rows[0]["seed"] == 2 and len(rows) == 1 for rows in rope2["runs"].values())
    merged = bench_tiny_report.merge([json.loads(p.read_text(encoding="utf-8")) for p in sorted(parts.glob("*"))],
                                     DEFAULTS)
    assert {label: [r["seed"] for r in rows] for label, rows in merged["runs"].items()} == {
        label: [r["seed"] for r in rows] for label, rows in partial["runs"].items()}
    with pytest.raises(SystemExit, match="already exist"):  # nothing written is replaced
        bench_tiny.main(["--report", str(out / "partial.json"), "--split", str(parts)])
    old = {**partial, "runs": {"alibi": [{k: v for k, v in partial["runs"]["rope"][0].items() if k != "seed"}]}}
    with pytest.raises(SystemExit, match="no seed in them"):  # rows of an older run: which seed is it?
        bench_tiny_report.merge([old], DEFAULTS)
    with pytest.raises(SystemExit) as stopped:
        bench_tiny.main(["--split", str(parts)])
    assert stopped.value.code == 2 and "--split DIR needs --report" in capsys.readouterr().err


def test_bench_tiny_workers_share_the_cpu_threads() -> None:
    """Spawned workers each took every core: two workers of two threads on two cores trained 7-10x slower."""
    threads = torch.get_num_threads()
    assert bench_tiny.worker_threads("cpu", 1) == threads
    assert bench_tiny.worker_threads("cpu", 2) == max(1, threads // 2)
    assert bench_tiny.worker_threads("cpu", 64) == 1
    assert bench_tiny.worker_threads("cuda", 16) == 1


def test_bench_speed_writes_its_tables_and_readme_section(tmp_path) -> None:
    readme, output = tmp_path / "README.md", tmp_path / "speed.md"
    readme.write_text("<!-- bench-speed:start -->\nold\n<!-- bench-speed:end -->\nafter\n", encoding="utf-8")
    argv = ["--quick", "--threads", "1", "--cases", "llama-alibi", "bert-t5", "--lengths", "32", "--new-tokens", "2",
            "--no-memory", "--max-train-length", "16", "--output", str(output), "--readme", str(readme)]
    assert bench_speed.main(argv) == 0
    text = readme.read_text(encoding="utf-8")
    assert "old" not in text and text.endswith("<!-- bench-speed:end -->\nafter\n") and "--lengths 32" in text
    table = output.read_text(encoding="utf-8")
    assert table.strip() in text
    assert ("| case | forward 2,048 | forward 8,192 | train step 2,048 | peak memory 8,192 | cached decode "
            "| paths (patched) |") in table
    assert re.search(r"^\| llama-alibi \| not run \| not run \| not run \| not run \| \d+\.\d\d [✓✗] \(≤ 1\.11\) "
                     r"\| [a-z-]+(, [a-z-]+)* \|$", table, re.MULTILINE)  # only decode has a target at 32 tokens
    decode = next(line for line in table.splitlines() if line.startswith("| llama-alibi | 32 | 2 cached decode"))
    assert decode.endswith(("≤ 1.11 ✓ |", "≤ 1.11 ✗ |")) and decode.count("–") == 1  # ratio (min–max)
    assert "| llama-alibi | 32 | forward ms |" in table and "| bert-t5 | 32 | forward ms |" in table
    assert "train step ms" not in table  # 32 tokens > --max-train-length 16
    assert "| bert-t5 | 32 | 2 cached decode" not in table  # BERT does not decode
    assert "| bert-t5 | not run | not run | not run | not run | – |" in table


def test_bench_speed_judges_each_ratio_against_its_target() -> None:
    def row(measure: str, tokens: int, ratio: float | None) -> dict:
        return {"case": "llama-t5", "tokens": tokens, "measure": measure, "ratio": ratio,
                "target": bench_speed.target_for("llama-t5", measure, tokens)}

    rows = [row("forward", 2048, 1.49), row("forward", 8192, 1.51), row("decode", 2048, 1.05),
            row("decode", 8192, 1.2), row("forward", 512, 3.0), row("memory", 8192, None)]
    cells = [bench_speed.summary_cell(rows, "llama-t5", m, n) for m, n, _ in bench_speed.SUMMARY]
    assert cells == ["1.49 ✓ (≤ 1.50)", "1.51 ✗ (≤ 1.50)", "not run", "failed ✗ (≤ 1.50)",
                     "1.20 ✗ (≤ 1.11; worst at 8,192)"]
    assert bench_speed.target_for("llama-t5", "forward", 512) is None  # targets are set at 2,048 and 8,192
    assert bench_speed.summary_cell(rows, "bert-rope", "decode", None) == "–"


def test_bench_speed_alternates_the_order_and_reports_the_spread() -> None:
    calls: list[str] = []
    times = iter([9.0, 9.0, 1.0, 1.1, 1.3, 1.0, 1.0, 1.2])  # warm-ups, then native/patched, patched/native, ...

    def timed(name: str):
        return lambda: calls.append(name) or next(times)

    result = bench_speed.alternate(timed("native"), timed("patched"), repeats=3)
    assert calls == ["native", "patched", "native", "patched", "patched", "native", "native", "patched"]
    assert result["ratio"] == pytest.approx(1.2) and result["low"] == pytest.approx(1.1)
    assert result["high"] == pytest.approx(1.3) and result["native"] == 1.0 and result["patched"] == pytest.approx(1.2)


def test_bench_speed_rejects_a_bad_length(capsys) -> None:
    with pytest.raises(SystemExit) as raised:
        bench_speed.main(["--lengths", "0"])
    assert raised.value.code == 2 and "expected a whole number >= 1, got '0'" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_speed_measures_peak_memory_over_the_idle_process() -> None:
    rows = bench_speed.memory_rows("llama-alibi", 64, bench_speed.parse_args(["--quick"]))
    total, over_idle = rows
    assert [r["measure"] for r in rows] == ["memory-total", "memory"]
    for side in ("native", "patched"):
        assert 0 < over_idle[side] < total[side]  # the forward's own allocations, not the interpreter's
    assert over_idle["ratio"] == pytest.approx(over_idle["patched"] / over_idle["native"])


def test_readme_section_needs_its_markers(tmp_path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"has no '<!-- bench-tiny:start -->' ... '<!-- bench-tiny:end -->' markers"):
        replace_section(readme, "bench-tiny", "table")


def test_bench_speed_memory_probes_can_fix_the_mmap_threshold(monkeypatch) -> None:
    """--mmap-threshold reaches glibc in the probe processes (MALLOC_MMAP_THRESHOLD_); without it they inherit the
    environment unchanged; the table says which."""
    seen: list[dict | None] = []

    def probe(command, **kwargs):
        seen.append(kwargs.get("env"))
        return type("Done", (), {"returncode": 0, "stdout": '{"peak_mb": 2.0, "over_idle_mb": 1.0}', "stderr": ""})

    monkeypatch.setattr(bench_speed_measure.subprocess, "run", probe)
    settings = bench_speed.parse_args(["--quick", "--mmap-threshold", "65536"])
    rows = bench_speed.memory_rows("gpt2-rope", 64, settings)
    assert [env["MALLOC_MMAP_THRESHOLD_"] for env in seen] == ["65536", "65536"] and rows[1]["ratio"] == 1.0
    assert "mmap threshold fixed at 65,536 bytes" in bench_speed.markdown(rows, settings, 1.0)
    seen.clear()
    default = bench_speed.parse_args(["--quick"])
    bench_speed.memory_rows("gpt2-rope", 64, default)
    assert seen == [None, None] and "mmap threshold" not in bench_speed.markdown(rows, default, 1.0)


def test_bench_speed_runs_in_bfloat16_and_writes_its_rows_as_json(tmp_path) -> None:
    """--dtype reaches both models; --json holds every row, the environment and the settings; Self-Extend is timed
    forward only; each row names the attention paths the patched model took."""
    path = tmp_path / "speed.json"
    argv = ["--quick", "--threads", "1", "--dtype", "bfloat16", "--cases", "llama-kerple", "llama-self-extend",
            "--lengths", "32",
            "--steps", "forward", "decode", "--new-tokens", "2", "--no-memory", "--json", str(path)]
    assert bench_speed.main(argv) == 0
    record = json.loads(path.read_text(encoding="utf-8"))
    assert record["environment"]["dtype"] == "bfloat16" and record["environment"]["device"] == "cpu"
    assert record["settings"]["lengths"] == [32] and record["stopped"] is None
    assert [(r["case"], r["measure"]) for r in record["rows"]] == [
        ("llama-kerple", "forward"), ("llama-kerple", "decode"), ("llama-self-extend", "forward")]
    kerple, _, self_extend = record["rows"]
    assert kerple["paths"] == ["dense"] and self_extend["paths"] == ["self-extend-merged"]
    assert all(r["native"] > 0 and r["patched"] > 0 and r["first_native"] > 0 for r in record["rows"])
    model = bench_speed.build("llama", bench_speed.QUICK_SHAPE, 32, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def _canned(case: str, length: int, measure: str, *args) -> list[dict]:
    return [{"case": case, "tokens": length, "measure": measure, "native": 1.0, "patched": 1.0, "ratio": 1.0,
             "target": None}]


def test_bench_speed_writes_after_every_row_so_a_killed_run_keeps_them(tmp_path, monkeypatch) -> None:
    calls: list[str] = []

    def measure(case: str, length: int, measure: str, *args) -> list[dict]:
        calls.append(measure)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the run is killed during its second measurement
        return _canned(case, length, measure)

    monkeypatch.setattr(bench_speed, "measure_rows", measure)
    path, table = tmp_path / "speed.json", tmp_path / "speed.md"
    with pytest.raises(KeyboardInterrupt):
        bench_speed.main(["--quick", "--cases", "llama-alibi", "--lengths", "16", "--json", str(path),
                          "--output", str(table)])
    assert [r["measure"] for r in json.loads(path.read_text(encoding="utf-8"))["rows"]] == ["forward"]
    assert "| llama-alibi | 16 | forward ms |" in table.read_text(encoding="utf-8")
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically: no temporary file left behind


def test_bench_speed_stops_at_its_budget_and_keeps_what_it_measured(tmp_path, monkeypatch) -> None:
    """Once --budget-seconds have passed no new measurement starts; the rows so far and the reason are written."""
    def measure(case: str, length: int, measure: str, settings, *args) -> list[dict]:
        settings.started -= 100  # the first measurement took 100 s
        return _canned(case, length, measure)

    monkeypatch.setattr(bench_speed, "measure_rows", lambda *a: measure(*a[:3], a[-1]))
    path = tmp_path / "speed.json"
    assert bench_speed.main(["--quick", "--cases", "llama-alibi", "bert-t5", "--lengths", "16", "--budget-seconds",
                             "50", "--json", str(path), "--output", str(tmp_path / "speed.md")]) == 0
    record = json.loads(path.read_text(encoding="utf-8"))
    assert [r["measure"] for r in record["rows"]] == ["forward"]
    assert record["stopped"].startswith("stopped by --budget-seconds 50 after 10")
    assert record["stopped"].endswith("before llama-alibi at 16 tokens, train")
    table = (tmp_path / "speed.md").read_text(encoding="utf-8")
    assert "The run was stopped by --budget-seconds 50" in table and "| bert-t5 | not run |" in table
    assert bench_speed.main(["--quick", "--lengths", "16", "--budget-seconds", "0", "--json", str(path)]) == 0
    assert json.loads(path.read_text(encoding="utf-8"))["rows"] == []


def test_bench_speed_stops_when_the_device_fails_and_keeps_the_failed_row(tmp_path, monkeypatch) -> None:
    """A kernel fault (CUDA illegal memory access) leaves the process unable to use the device: the failed row is
    written, then the run stops and says why, instead of failing every later case (or crashing without rows)."""
    def fault(case: str, length: int, measure: str, *args) -> list[dict]:
        return [{**_canned(case, length, measure)[0], "ratio": None, "error": "AcceleratorError: illegal memory"}]

    monkeypatch.setattr(bench_speed, "measure_rows", fault)
    monkeypatch.setattr(bench_speed, "release_cuda_memory", lambda device: False)
    path = tmp_path / "speed.json"
    assert bench_speed.main(["--quick", "--cases", "llama-t5", "bert-t5", "--lengths", "16", "--json", str(path)]) == 0
    record = json.loads(path.read_text(encoding="utf-8"))
    assert [(r["case"], r["measure"], r["error"]) for r in record["rows"]] == [
        ("llama-t5", "forward", "AcceleratorError: illegal memory")]
    assert record["stopped"].startswith("stopped: the CUDA device failed during llama-t5 at 16 tokens, forward")


def test_bench_speed_on_cuda_needs_a_device_and_keeps_cpu_flags_off_it(capsys, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as raised:
        bench_speed.main(["--device", "cuda"])
    error = capsys.readouterr().err
    assert raised.value.code == 2 and error.count("\n") == 1 and "--device cuda, but this torch" in error
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for flag in (["--threads", "4"], ["--mmap-threshold", "65536"]):
        with pytest.raises(SystemExit) as raised:
            bench_speed.parse_args(["--device", "cuda", *flag])
        assert raised.value.code == 2 and f"{flag[0]} applies to --device cpu only" in capsys.readouterr().err
    settings = bench_speed.parse_args(["--device", "cuda"])
    assert settings.lengths == [8192, 32768] and settings.max_train_length is None and settings.warmups == 2
    assert settings.shape == bench_speed.CUDA_SHAPE and "llama-self-extend" in settings.cases


class FakeCuda:
    """torch.cuda's clock and memory calls, recorded; the tensors stay on the CPU."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        answers = {"is_available": True, "get_device_name": "Fake GPU", "memory_allocated": 2**20,
                   "max_memory_allocated": 3 * 2**20}
        for name in ("is_available", "get_device_name", "synchronize", "empty_cache", "reset_peak_memory_stats",
                     "memory_allocated", "max_memory_allocated"):
            monkeypatch.setattr(torch.cuda, name, self._recorder(name, answers.get(name)))

    def _recorder(self, name: str, answer: object):
        return lambda *args, **kwargs: self.calls.append(name) or answer


@pytest.fixture
def one_thread():
    """torch on one thread for the test (tiny models on a loaded machine: two threads wait on each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_bench_speed_cuda_flow_runs_with_the_device_calls_stubbed(tmp_path, monkeypatch, one_thread) -> None:
    """The CUDA run on the CPU: models in bf16, memory from the allocator's peak in this process (reset before, read
    after, for a forward and a training step), the GPU's name, its targets and the first calls in the tables."""
    cuda = FakeCuda(monkeypatch)
    parse = bench_speed.parse_args

    def on_cpu(argv):
        settings = parse(argv)
        settings.torch_device = torch.device("cpu")
        return settings

    monkeypatch.setattr(bench_speed, "parse_args", on_cpu)
    path, table = tmp_path / "speed.json", tmp_path / "speed.md"
    assert bench_speed.main(["--device", "cuda", "--quick", "--dtype", "float32", "--cases", "llama-t5",
                             "llama-self-extend", "--lengths", "32", "--steps", "forward", "train", "--warmups", "1",
                             "--json", str(path), "--output", str(table)]) == 0
    record = json.loads(path.read_text(encoding="utf-8"))
    assert record["environment"]["gpu"] == "Fake GPU" and "threads" not in record["environment"]
    assert [(r["case"], r["measure"]) for r in record["rows"]] == [
        ("llama-t5", "forward"), ("llama-t5", "train"), ("llama-t5", "memory"),
        ("llama-t5", "memory-train"), ("llama-self-extend", "forward"), ("llama-self-extend", "memory")]
    rows = {(r["case"], r["measure"]): r for r in record["rows"]}
    assert rows["llama-t5", "memory-train"]["native"] == 2.0 and rows["llama-t5", "memory"]["ratio"] == 1.0
    assert rows["llama-t5", "train"]["target"] == 1.3 and rows["llama-self-extend", "forward"]["target"] == 2.0
    measured = ["synchronize", "empty_cache", "reset_peak_memory_stats", "memory_allocated", "synchronize",
                "max_memory_allocated"]  # the peak is reset after the warm-up call and read after the measured one
    found = [c for c in cuda.calls if c not in ("is_available", "get_device_name")]
    assert found == measured * 6  # 2 models x (forward, training step) for T5, 2 forwards for Self-Extend
    text = table.read_text(encoding="utf-8")
    assert text.startswith("Fake GPU, torch ") and "| case | forward 8,192 | forward 32,768 |" in text
    assert "first call ms (native / patched) |" in text and "| llama-t5 | 32 | train step peak MB over idle |" in text


# --- failed runs, interrupted pools and odd arguments -----------------------------------------------------------------

TINY = ["--quick", "--schemes", "alibi", "--scalings", "--steps", "1", "--length", "16", "--trials", "1"]


def fake_worker(settings, task, device, probe_every, state_dir, threads=None, text=None):  # noqa: ANN001
    """A stand-in for bench_tiny's worker (top level: spawned processes import it): "learned" fails, others give a
    row at once."""
    if task.label == "learned":
        raise ValueError("deliberate failure")
    row = {"windows": {f: 4.0 for f in settings.factors}, "passkey": {f: 1.0 for f in settings.factors},
           "seed": task.seed}
    return task, [row]


@pytest.mark.slow  # starts a pool of worker processes
def test_bench_tiny_a_failed_run_in_a_pool_keeps_the_others_results(tmp_path) -> None:
    """One failing task used to let the others run on, then throw every result away (nothing in partial.json)."""
    settings = bench_tiny.Settings(length=16, factors=(1,), seeds=(0, 1))
    with pytest.raises(bench_tiny.TrainingFailed, match="learned seed 0: deliberate failure"):
        bench_tiny.run(settings, ("learned", "alibi"), (), lambda line: None, tmp_path / "partial.json", "cpu", 2,
                       worker=fake_worker)
    kept = json.loads((tmp_path / "partial.json").read_text(encoding="utf-8"))
    assert [row["seed"] for row in kept["runs"]["alibi"]] == [0, 1] and "learned" not in kept["runs"]
    assert kept["settings"]["seeds"] == [0, 1]


def test_bench_tiny_stops_a_diverged_run_and_never_tables_a_nan(capsys) -> None:
    settings = bench_tiny.Settings(length=16, hidden=32, heads=2, kv_heads=1)
    model = bench_tiny.build_model(settings, "alibi", 0)
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(float("nan"))
    data = bench_tiny.batches(bench_tiny.byte_tokenizer(), torch.randint(0, 200, (400,)), 16, 2, 0.0, 0)
    with pytest.raises(bench_tiny.TrainingDiverged, match="alibi: the loss is nan at step 1; lower --lr"):
        bench_tiny.train(model, data, 5, 1e-3, "alibi")
    row = {"windows": {"1": float("nan")}, "tail": {}, "passkey": {"1": float("nan")}}
    table = bench_tiny_report.markdown({"settings": {**DEFAULTS, "factors": [1], "seeds": [0, 1]},
                                        "runs": {"alibi": [row, row]}})
    assert "| alibi ⚠ | not finite ✗ |" in table  # flagged, not averaged into a number (it raised before)


@pytest.mark.parametrize("content, says", [
    (None, "cannot read it"), ("", "cannot read it"), ("[]", "no 'settings' and 'runs'"),
    ("{}", "no 'settings' and 'runs'"), ('{"settings": {"seeds": [0]}, "runs": {"alibi": []}}', "has no rows"),
    ('{"settings": {"seeds": [0]}, "runs": {"alibi": [{"probe": [[1000, 0.5]]}]}}', "'probe' is not a list"),
    ('{"settings": {"seeds": [0]}, "runs": {"alibi": [{"probe": "x"}]}}', "'probe' is not a list"),
    ('{"settings": {"seeds": [0]}, "runs": {"alibi": [3]}}', "a row that is not an object"),
    ('{"settings": {"seeds": [0]}, "runs": {"alibi": [{}]}, "parts": []}', "its 'parts' is not a list"),
    ('{"settings": {"seeds": [0]}, "runs": {"alibi": [{}]}, "parts": [{"seeds": 0, "versions": {}}]}',
     "its 'parts' is not a list"),
], ids=["missing", "empty", "list", "object", "no-rows", "short-probe", "probe-text", "row-not-object",
        "parts-empty", "parts-seeds-not-list"])
def test_bench_tiny_report_refuses_bad_results_in_one_line(content, says, tmp_path) -> None:
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(SystemExit, match=says):
        bench_tiny.main(["--report", str(path), "--output-dir", str(tmp_path / "out")])


def test_bench_tiny_report_merges_by_the_seeds_rows_carry(tmp_path, capsys) -> None:
    """A stopped multi-seed run's partial results merge with a separate run of the missing seed (the duplicate check
    read the planned seeds, not the rows'); rows of old parts take their part's seeds, so interleaved old parts are
    not mislabelled (seeds 0, 2 then 1 came out labelled 0, 1, 2)."""
    def row(seed: int | None, ppl: float) -> dict:
        found = {"windows": {"1": ppl}, "tail": {}, "passkey": {"1": 1.0}}
        return found if seed is None else {**found, "seed": seed}

    stopped = {"settings": {**DEFAULTS, "factors": [1], "seeds": [0, 1]}, "runs": {"alibi": [row(0, 4.0)]}}
    later = {"settings": {**DEFAULTS, "factors": [1], "seeds": [1]}, "runs": {"alibi": [row(1, 5.0)]}}
    merged = bench_tiny_report.merge([stopped, later], DEFAULTS)
    assert [r["seed"] for r in merged["runs"]["alibi"]] == [0, 1] and merged["settings"]["seeds"] == [0, 1]
    alone = bench_tiny_report.merge([stopped], DEFAULTS)
    assert alone["settings"]["seeds"] == [0]  # the table says the seeds it has, not the ones planned
    old02 = {"settings": {**DEFAULTS, "factors": [1], "seeds": [0, 2]},
             "runs": {"t5": [row(None, 100), row(None, 300)]}}
    old1 = {"settings": {**DEFAULTS, "factors": [1], "seeds": [1]}, "runs": {"t5": [row(None, 200)]}}
    merged = bench_tiny_report.merge([old02, old1], DEFAULTS)
    assert [(r["seed"], r["windows"]["1"]) for r in merged["runs"]["t5"]] == [(0, 100), (1, 200), (2, 300)]
    twice = {"settings": {**DEFAULTS, "factors": [1], "seeds": [0]}, "runs": {"t5": [row(0, 1.0), row(0, 2.0)]}}
    with pytest.raises(SystemExit, match="two rows of one seed"):
        bench_tiny_report.merge([twice], DEFAULTS)


@pytest.mark.parametrize("runs, says", [
    ({"rope+yarn (zero-shot)": [{"seed": 0}]}, "no RoPE row"),
    ({"rope": [{"seed": 0}], "rope+yarn (fine-tuned)": [{"seed": 0}, {"seed": 1}]}, "seed 1 have no RoPE row"),
    ({"mystery": [{"seed": 0}]}, "not one of bench_tiny's runs"),
    ({}, "nothing to split"),
], ids=["scalings-without-rope", "scalings-of-another-seed", "unknown-run", "empty"])
def test_bench_tiny_split_refuses_what_would_lose_or_mislabel_a_row(runs, says, tmp_path) -> None:
    results = {"settings": {**DEFAULTS, "seeds": [0, 1]}, "runs": runs}
    with pytest.raises(SystemExit, match=says):
        bench_tiny_report.write_split(results, tmp_path / "parts", bench_tiny.RUNS)
    assert not (tmp_path / "parts").exists()


@pytest.mark.parametrize("extra, says", [
    (["--output-dir", "FILE"], "--output-dir"), (["--readme", "missing.md"], "--readme missing.md"),
    (["--readme", "plain.md"], "markers"), (["--device", "foo"], "--device foo"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "foo"], "--device"),
    (["--seeds", str(2**40)], "--seeds"), (["--length", "300000"], "holds no window"),
    (["--schemes", "alibi", "--scalings", "yarn"], "add rope to --schemes"),
    (["--decay-from", "nan"], "--decay-from nan"),
], ids=["output-dir-is-a-file", "readme-missing", "readme-without-markers", "device", "no-cuda", "seed",
        "length", "scalings-without-rope", "decay-from-nan"])
def test_bench_tiny_refuses_before_training_what_would_fail_after_it(extra, says, tmp_path, monkeypatch,
                                                                     capsys) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("x", encoding="utf-8")
    (tmp_path / "plain.md").write_text("# no markers\n", encoding="utf-8")
    with pytest.raises(SystemExit) as stopped:
        bench_tiny.main([*TINY, "--output-dir", "out", *extra])
    assert stopped.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "out" / "partial.json").exists()


def test_bench_tiny_keeps_an_earlier_runs_results_unless_told(tmp_path, capsys) -> None:
    """A rerun into the same --output-dir replaced a stopped run's partial.json (its rows lost); --report with its
    output as one of its inputs overwrote that input; --write-corpus replaced any file (a device too)."""
    out = tmp_path / "out"
    assert bench_tiny.main([*TINY, "--output-dir", str(out)]) == 0
    with pytest.raises(SystemExit) as stopped:
        bench_tiny.main([*TINY, "--output-dir", str(out)])
    assert stopped.value.code == 2 and "--overwrite-output-dir" in capsys.readouterr().err
    assert bench_tiny.main([*TINY, "--output-dir", str(out), "--overwrite-output-dir"]) == 0
    before = (out / "results.json").read_bytes()
    with pytest.raises(SystemExit) as stopped:
        bench_tiny.main(["--report", str(out / "results.json"), "--output-dir", str(out)])
    assert stopped.value.code == 2 and (out / "results.json").read_bytes() == before
    precious = tmp_path / "topics.txt"
    precious.write_text("carried from another Python", encoding="utf-8")
    with pytest.raises(SystemExit) as stopped:
        bench_tiny.main(["--write-corpus", str(precious)])
    assert stopped.value.code == 2 and precious.read_text(encoding="utf-8") == "carried from another Python"


def test_bench_tiny_weight_decay_reaches_the_optimizer_and_the_table(tmp_path, monkeypatch) -> None:
    seen = []
    adamw = torch.optim.AdamW

    def recording(params, **options):
        seen.append(options["weight_decay"])
        return adamw(params, **options)

    monkeypatch.setattr(torch.optim, "AdamW", recording)
    tiny = ["--quick", "--steps", "2", "--length", "16", "--trials", "1", "--scalings", "--schemes", "alibi",
            "--weight-decay", "0.2", "--output-dir", str(tmp_path)]
    assert bench_tiny.main(tiny) == 0
    assert seen == [0.2] and "lr 0.003, weight decay 0.2)" in (tmp_path / "results.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("labels, says", [
    (["none"], []), (["rope", "rope+yarn (zero-shot)"], ["RoPE scalings extend"]),
    (["learned+concat:share=0.5", "rope+ntk (fine-tuned)"], ["RoPE scalings extend", "tiling its table"]),
], ids=["no-extension", "scalings", "learned-and-scalings"])
def test_bench_tiny_caption_explains_only_the_rows_it_has(labels: list, says: list) -> None:
    row = {"windows": {"1": 4.0}, "tail": {}, "passkey": {"1": 1.0}}
    table = bench_tiny_report.markdown({"settings": {**DEFAULTS, "factors": [1], "seeds": [0]},
                                        "runs": {label: [row] for label in labels}})
    for sentence in ("RoPE scalings extend", "tiling its table"):
        assert (sentence in table) == (sentence in says), sentence
