"""The conversion recipe at tiny scale: ``scripts/recipes/recipe_convert_tiny.py`` (a RoPE model trained from
scratch, swapped after training, recalibrated): the swap each variant names, the distillation objective against
Hinton et al.'s formula written here, the verdict, and ``--quick`` end to end with a rerun that reuses what was done."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "recipes"))
import recipe_convert_tiny as tiny  # noqa: E402

import hf_posswap as ps  # noqa: E402

SETTINGS = tiny.QUICK.model


@pytest.mark.parametrize("run, scheme", [("none", "none"), ("alibi", "alibi"), ("nope-interleaved", "layer_mix")])
def test_convert_swaps_the_trained_rope_model(run: str, scheme: str) -> None:
    model = tiny.bench_tiny.build_model(SETTINGS, "rope", 0)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    tiny.convert(model, run)
    assert ps.describe(model).scheme == scheme
    kept = model.state_dict()
    assert all(torch.equal(weights[k], kept[k]) for k in weights)  # trained weights carried over unchanged


def test_convert_rope_is_the_control_and_changes_nothing() -> None:
    model = tiny.bench_tiny.build_model(SETTINGS, "rope", 0)
    ids = torch.randint(0, 200, (1, 12))
    before = model(input_ids=ids).logits
    assert torch.equal(tiny.convert(model, "rope")(input_ids=ids).logits, before)


@pytest.mark.parametrize("name, weight, temperature", [
    ("alibi-distill", 0.5, 2.0), ("alibi-distill-t1", 0.5, 1.0), ("alibi-distill-t4", 0.5, 4.0),
    ("alibi-distill-w09", 0.9, 2.0)])
def test_distillation_levers_set_what_their_names_say(name: str, weight: float, temperature: float) -> None:
    assert tiny.distillation(tiny.VARIANTS[name], tiny.FULL) == (weight, temperature)


@pytest.mark.slow  # trains; the objective itself is checked fast against Hinton et al.'s formula
def test_a_distillation_lever_reaches_the_loss_and_its_record(tmp_path, monkeypatch) -> None:
    """The variant's own T reaches the Distilled loss that trains it, and the row says which T and w it used."""
    seen = {}

    class Spy(tiny.Distilled):
        def __init__(self, student, teacher, weight, temperature):
            seen.update(weight=weight, temperature=temperature)
            super().__init__(student, teacher, weight, temperature)

    monkeypatch.setattr(tiny, "Distilled", Spy)
    settings = tiny.QUICK
    state, _ = tiny.rope_model(settings, tmp_path, "cpu")
    tokenizer = tiny.byte_tokenizer()
    data = (tokenizer, *tiny.bench_tiny.corpus_split(tokenizer))
    row = tiny.run_variant("alibi-distill-t4", settings, state, data, "cpu")
    assert seen == {"weight": 0.5, "temperature": 4.0}
    assert (row["distill_weight"], row["temperature"]) == (0.5, 4.0)


def test_distillation_loss_is_hintons_mix_and_trains_the_student_only() -> None:
    """(1 - w) CE + w T^2 KL(softmax(t / T) || softmax(s / T)), averaged over tokens, written out here."""
    student = tiny.bench_tiny.build_model(SETTINGS, "none", 0)
    teacher = tiny.bench_tiny.build_model(SETTINGS, "rope", 1)
    wrapped = tiny.Distilled(student, teacher, weight=0.3, temperature=2.0)
    ids = torch.randint(0, 200, (2, 12))
    loss = wrapped(input_ids=ids, labels=ids).loss
    s, t = student(input_ids=ids).logits / 2.0, teacher(input_ids=ids).logits / 2.0
    p_teacher = t.softmax(-1)
    kl = (p_teacher * (p_teacher.log() - s.log_softmax(-1))).sum(-1).mean() * 4.0
    ce = student(input_ids=ids, labels=ids).loss
    assert loss.item() == pytest.approx((0.7 * ce + 0.3 * kl).item(), rel=1e-5)
    assert {id(p) for p in wrapped.parameters()} == {id(p) for p in student.parameters()}
    frozen = {k: v.clone() for k, v in teacher.state_dict().items()}
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    loss.backward()
    optimizer.step()
    assert all(torch.equal(frozen[k], v) for k, v in teacher.state_dict().items())
    assert not torch.equal(student.model.embed_tokens.weight, teacher.model.embed_tokens.weight)


def test_verdict_reads_the_target() -> None:
    native = {"windows": {"1": 4.0, "8": 80.0}}
    assert tiny.verdict({"windows": {"1": 4.4, "8": 10.0}}, native) == (True, True)
    assert tiny.verdict({"windows": {"1": 4.41, "8": 80.0}}, native) == (False, False)


@pytest.mark.slow
def test_quick_mode_runs_every_variant_writes_its_table_and_reuses_finished_work(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- recipe-convert-tiny:start -->\nold\n<!-- recipe-convert-tiny:end -->\n",
                      encoding="utf-8")
    work = tmp_path / "work"
    results = tiny.main(["--quick", "--work-dir", str(work), "--readme", str(readme)])
    assert [row["variant"] for row in results["rows"]] == list(tiny.VARIANTS)
    every = tiny.QUICK.curve_every
    for row in results["rows"]:
        assert [point[0] for point in row["curve"]] == list(range(0, tiny.QUICK.recalibration_steps + 1, every))
        assert set(row["windows"]) == set(row["before"]["windows"]) == {"1", "2"}
    control = results["rows"][0]  # no swap: before recalibration it is the native model, measured the same way
    assert control["before"]["windows"] == results["native"]["windows"]
    assert control["windows"]["1"] != control["before"]["windows"]["1"]  # the recalibration trained it
    written = json.loads((work / "recipe_convert_tiny.json").read_text(encoding="utf-8"))
    assert written["rows"] == results["rows"] and written["corpus"] == tiny.bench_tiny.corpus_fingerprint()
    table = (work / "recipe_convert_tiny.md").read_text(encoding="utf-8")
    assert "| native RoPE |" in table and "| none-distill |" in table and "within 10 % at 1x" in table
    assert (work / "recipe_convert_tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    section = readme.read_text(encoding="utf-8")
    assert "old" not in section and "| alibi-plain |" in section and "recipe_convert_tiny.png" in section
    state = work / f"rope-seed{tiny.QUICK.seed}.pt"
    stamp = state.stat().st_mtime_ns
    again = tiny.main(["--quick", "--work-dir", str(work), "--variants", "none-plain"])
    assert state.stat().st_mtime_ns == stamp  # the RoPE model was reused, not trained again
    assert again["rows"] == [results["rows"][1]]
    (work / "none-plain.json").write_text('{"variant": "none-pl', encoding="utf-8")  # killed while writing
    redone = tiny.main(["--quick", "--work-dir", str(work), "--variants", "none-plain"])
    assert redone["rows"][0]["variant"] == "none-plain" and state.stat().st_mtime_ns == stamp
    with pytest.raises(SystemExit, match="other settings"):  # a quick run's models are not the full mode's
        tiny.claim_work_dir(work, tiny.FULL)


def test_full_settings_follow_protocol_a() -> None:
    """The RoPE model trains as bench_tiny's full mode does; the recalibration is a fifth of its steps."""
    full = tiny.FULL.model
    assert dataclasses.replace(full, seeds=tiny.bench_tiny.FULL.seeds) == tiny.bench_tiny.FULL
    assert tiny.FULL.recalibration_steps == full.steps // 5


@pytest.mark.parametrize("extra, says", [
    (["--results", "DIR"], "is a directory"), (["--results", "work/none-plain.json"], "records of the runs"),
    (["--readme", "plain.md"], "markers"), (["--readme", "missing.md"], "cannot read it"),
    (["--variants", "none-plain", "none-plain"], "given twice"), (["--work-dir", "FILE"], "FILE"),
], ids=["results-dir", "results-is-a-record", "readme-no-markers", "readme-missing", "variant-twice",
        "work-dir-is-a-file"])
def test_refuses_before_training_what_would_fail_or_overwrite_after_it(extra, says, tmp_path, monkeypatch) -> None:
    """Each of these is refused before any training, instead of failing with a traceback after it or overwriting a
    record."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "DIR").mkdir()
    (tmp_path / "FILE").write_text("x", encoding="utf-8")
    (tmp_path / "plain.md").write_text("# no markers\n", encoding="utf-8")
    argv = ["--quick", "--work-dir", "work", *extra] if "--work-dir" not in extra else ["--quick", *extra]
    with pytest.raises(SystemExit, match=says):
        tiny.main(argv)
    assert not (tmp_path / "work" / f"rope-seed{tiny.QUICK.seed}.pt").exists()


@pytest.mark.slow
def test_corrupt_records_are_redone_not_trusted(tmp_path: Path) -> None:
    """A truncated RoPE model (killed while saving) is trained again; a record that is JSON but not a record (a
    file put there by hand) is redone: both raised before."""
    work = tmp_path / "work"
    tiny.main(["--quick", "--work-dir", str(work), "--variants", "none-plain"])
    state = work / f"rope-seed{tiny.QUICK.seed}.pt"
    state.write_bytes(state.read_bytes()[:100])
    (work / "none-plain.json").write_text('{"a": 1}', encoding="utf-8")
    again = tiny.main(["--quick", "--work-dir", str(work), "--variants", "none-plain"])
    assert tiny.loads_state(state) and again["rows"][0]["variant"] == "none-plain"
