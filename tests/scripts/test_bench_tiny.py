"""bench_tiny (Protocol A) trains and measures tiny models: the byte tokenizer and the passkey filler it relies on,
its runs and their scheme options, the probes and bias profiles it records, its learning-rate schedule and length
curriculum, the threads of its workers, and a failed or diverged run."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from hf_posswap.evaluation import BYTE_VOCAB_SIZE, byte_tokenizer, passkey_prompt

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts" / "benchmarks"), str(ROOT / "scripts" / "maintenance")]

import bench_tiny  # noqa: E402
import bench_tiny_report  # noqa: E402

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


def test_bench_tiny_workers_share_the_cpu_threads() -> None:
    """Spawned workers each took every core: two workers of two threads on two cores trained 7-10x slower."""
    threads = torch.get_num_threads()
    assert bench_tiny.worker_threads("cpu", 1) == threads
    assert bench_tiny.worker_threads("cpu", 2) == max(1, threads // 2)
    assert bench_tiny.worker_threads("cpu", 64) == 1
    assert bench_tiny.worker_threads("cuda", 16) == 1


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
    """One failing task stops the run but keeps the results the others finished (in partial.json)."""
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
