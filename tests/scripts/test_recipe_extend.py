"""``hf-posswap extend --train`` (extend, PoSE fine-tune, one checkpoint) and its script.

Fast: every bad value is refused on one line before a model loads. Slow: the command end to end on a tiny LLaMA
(the merged checkpoint reloads in vanilla transformers without hf_posswap, and equals the base extended by
hf_posswap plus the LoRA adapter run by peft), an interrupted run resumes to the same weights as an uninterrupted
one, and ``scripts/recipes/recipe_extend.py --quick`` writes its table in under 60 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_checkpoint, tiny_config, write_corpus
from safetensors.torch import load_file, save_file
from test_cli_wording import PYTHON_WORDS

import hf_posswap as ps
from hf_posswap.cli.main import main as cli
from hf_posswap.cli.recipe import check_run_output
from hf_posswap.training import loop

ROOT = Path(__file__).resolve().parents[2]
TRAINED = tiny_config("llama").max_position_embeddings  # 64
TO = 4 * TRAINED


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint("llama", tmp_path_factory.mktemp("base") / "llama")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_corpus(tmp_path_factory.mktemp("data"), documents=12)


def extend_argv(base: Path, data: list[str], output: Path, *extra: str) -> list[str]:
    return ["extend", "--model", str(base), "--to", str(TO), "--method", "yarn", "--train", "--data", *data,
            "--steps", "4", "--seq-len", "32", "--batch-size", "2", "--save-every", "2", "--lr", "1e-2",
            "--no-progress", "--output", str(output), *extra]


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any model load fails the test: a refusal must come before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(loop, "_load_model", refuse)


# --- fast: refusals before anything loads ------------------------------------------------------------------------

BAD = {  # id: (flags removed, arguments added, message fragment, exit status)
    "steps-without-train": (["--train"], [], "add --train", 2),
    "no-data": (["--data"], [], "--train needs --data", 1),
    "pose-past-to": ([], ["--pose-target", str(TO + 1)], f"--pose-target {TO + 1} is past --to {TO}", 1),
    "seq-len-not-below-pose": (["--seq-len"], ["--seq-len", str(TO)],
                               f"--pose-target {TO} must exceed --seq-len {TO}", 1),
    "resume-and-overwrite": ([], ["--resume", "--overwrite"], "--resume and --overwrite exclude each other", 1),
    "bad-lr": (["--lr"], ["--lr", "-1"], "--lr must be a finite number", 1),
    "bad-yarn-option": ([], ["--option", "beta_fast=-3"], "--option beta_fast must be a positive", 1),
    "to-shorter": (["--to"], ["--to", "16"], "--to 16 is shorter than the model's current length 64", 1),
    "pose-and-no-pose": ([], ["--pose-target", "128", "--no-pose"], "--pose-target and --no-pose exclude", 1),
    "adapter-as-model": (["--model"], ["--model", "ADAPTER"], "is a LoRA adapter directory", 1),
    "missing-data-file": (["--data"], ["--data", "/nonexistent/*.txt"], "No training data matches", 1),
    "full-with-lora-rank": ([], ["--full", "--lora-r", "4"], "--full and --lora-r exclude each other", 1),
    "to-the-current-length": (["--to"], ["--to", str(TRAINED)],
                              f"already has {TRAINED} positions; nothing to extend", 1),
    "repeated-option": ([], ["--steps", "5"], "argument --steps: given twice (--steps 4, then --steps 5)", 2),
}


def without(argv: list[str], flags: list[str]) -> list[str]:
    """``argv`` without each of ``flags`` and the values that follow it."""
    kept, skipping = [], False
    for item in argv:
        if item.startswith("--"):
            skipping = item in flags
        if not skipping:
            kept.append(item)
    return kept


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_values_are_refused_on_one_line_before_loading(case: str, base: Path, data: list[str], tmp_path: Path,
                                                          no_loading, capsys: pytest.CaptureFixture) -> None:
    removed, added, fragment, status = BAD[case]
    output = tmp_path / "out"
    if "ADAPTER" in added:  # a directory that holds an adapter_config.json
        adapter = tmp_path / "adapter"
        adapter.mkdir()
        (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base),
                                                                 "peft_type": "LORA"}), encoding="utf-8")
        save_file({"base_model.lora_A.weight": torch.zeros(1)}, adapter / "adapter_model.safetensors")
        added = [str(adapter) if item == "ADAPTER" else item for item in added]
    argv = without(extend_argv(base, data, output), removed) + added
    assert cli(argv) == status
    error = capsys.readouterr().err.strip()
    assert fragment in error and "\n" not in error, error
    assert error.startswith("hf-posswap extend: "), error
    assert not PYTHON_WORDS.search(error.split(":", 1)[1]), error  # options the user can type, not Python names
    assert not output.exists()  # nothing was written


def test_an_interrupted_run_is_refused_without_resume(base: Path, data: list[str], tmp_path: Path, no_loading,
                                                      capsys: pytest.CaptureFixture) -> None:
    output = tmp_path / "out"
    (output / "training").mkdir(parents=True)
    (output / "training" / "finetune_config.json").write_text("{}", encoding="utf-8")
    assert cli(extend_argv(base, data, output)) == 1
    error = capsys.readouterr().err
    assert "interrupted extend --train run" in error and "--resume" in error and "--overwrite" in error, error


def test_a_finished_run_is_called_finished_without_resume(base: Path, data: list[str], tmp_path: Path, no_loading,
                                                          capsys: pytest.CaptureFixture) -> None:
    """A finished run is not 'interrupted', and --resume (which would then say it finished) is not the fix."""
    output = tmp_path / "out"
    (output / "training").mkdir(parents=True)
    for name in ("config.json", "training/finetune_config.json", "training/result.json"):
        (output / name).write_text("{}", encoding="utf-8")
    assert cli(extend_argv(base, data, output)) == 1
    error = capsys.readouterr().err
    assert "holds a finished extend --train run" in error and "--overwrite" in error, error
    assert "interrupted" not in error and "--resume" not in error, error


def test_a_finished_run_is_not_resumed(base: Path, data: list[str], tmp_path: Path, no_loading,
                                       capsys: pytest.CaptureFixture) -> None:
    output = tmp_path / "out"
    (output / "training").mkdir(parents=True)
    for name in ("config.json", "training/finetune_config.json", "training/result.json"):
        (output / name).write_text("{}", encoding="utf-8")
    assert cli(extend_argv(base, data, output, "--resume")) == 1
    assert "finished" in capsys.readouterr().err


def test_help_shows_the_training_group(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        cli(["extend", "--help"])
    text = capsys.readouterr().out
    assert "extend and train (--train)" in text and "--pose-target" in text and "(default: 100)" in text


# --- slow: the command end to end ----------------------------------------------------------------------------------

VANILLA = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
with torch.no_grad():
    torch.save(model(input_ids=torch.arange(200)[None] % 250).logits, sys.argv[2])
assert not [name for name in sys.modules if name.startswith("hf_posswap")]
print(model.config.rope_parameters["rope_type"], model.config.rope_parameters["factor"])
"""


@pytest.mark.slow
def test_extend_and_train_writes_a_checkpoint_that_reloads_natively(base: Path, data: list[str],
                                                                     tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    output = tmp_path / "out"
    assert cli(extend_argv(base, data, output)) == 0
    config = json.loads((output / "config.json").read_text(encoding="utf-8"))
    assert config["model_type"] == "llama" and config["max_position_embeddings"] == TO
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["factor"] == TO / TRAINED
    run = output / "training"
    assert json.loads((run / "finetune_config.json").read_text())["pose_target"] == TO  # PoSE over the new length
    assert (run / "result.json").is_file() and (run / "adapter" / "adapter_config.json").is_file()
    assert not (run / "checkpoints").exists() and not (run / "merged").exists()  # published, then cleaned up
    assert not [p.name for p in output.parent.iterdir() if p.name.startswith(".")]  # no staging left behind

    # a fresh interpreter with plain transformers only (hf_posswap never imported)
    logits_file = tmp_path / "vanilla.pt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    process = subprocess.run([sys.executable, "-c", VANILLA, str(output), str(logits_file)], capture_output=True,
                             text=True, timeout=300, env=env, cwd=tmp_path)
    assert process.returncode == 0, process.stderr[-2000:]
    assert process.stdout.split() == ["yarn", str(float(TO // TRAINED))]
    vanilla = torch.load(logits_file)

    # the same model built another way: the base extended by hf_posswap, the LoRA adapter run (unmerged) by peft
    ids = torch.arange(200)[None] % 250
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    ps.extend_context(reference, TO, "yarn")
    with torch.no_grad():
        zero_shot = reference(input_ids=ids).logits
        adapted = ps.load_adapter(reference, run / "adapter").eval()
        unmerged = adapted(input_ids=ids).logits
    torch.testing.assert_close(vanilla, unmerged, atol=1e-5, rtol=1e-5)
    assert (vanilla - zero_shot).abs().max() > 1e-3  # training changed the model


@pytest.mark.slow
def test_full_fine_tune_publishes_the_trained_model(base: Path, data: list[str], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    output = tmp_path / "out"
    assert cli(extend_argv(base, data, output, "--full", "--no-pose")) == 0
    run = output / "training"
    assert not (run / "adapter").exists() and not (run / "final").exists()  # the model was moved, not copied
    assert json.loads((run / "finetune_config.json").read_text())["pose_target"] is None
    model = AutoModelForCausalLM.from_pretrained(output)
    assert model.config.rope_parameters["rope_type"] == "yarn" and model.config.max_position_embeddings == TO


@pytest.mark.slow
def test_an_interrupted_run_resumes_to_the_weights_of_an_uninterrupted_one(
    base: Path, data: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert cli(extend_argv(base, data, straight)) == 0
    original_log = loop._log

    def stop_after_step_3(output, record, accelerator):
        original_log(output, record, accelerator)
        if record["step"] == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(loop, "_log", stop_after_step_3)
    capsys.readouterr()
    assert cli(extend_argv(base, data, interrupted)) == 130
    error = capsys.readouterr().err
    assert "--resume" in error and "no new model was written" in error, error
    assert not (interrupted / "config.json").exists()  # nothing half-written where the model goes
    monkeypatch.setattr(loop, "_log", original_log)
    assert cli(extend_argv(base, data, interrupted)) == 1  # refused: it would start again over the run
    assert "pass --resume to continue it" in capsys.readouterr().err
    assert cli(extend_argv(base, data, interrupted, "--resume")) == 0
    assert "Resumed from" in capsys.readouterr().err
    log = (interrupted / "training" / "loss_log.jsonl").read_text(encoding="utf-8")
    steps = [json.loads(line)["step"] for line in log.splitlines()]
    assert steps == [1, 2, 3, 4]
    ours, theirs = load_file(interrupted / "model.safetensors"), load_file(straight / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=1e-6)
    assert cli(extend_argv(base, data, interrupted, "--resume")) == 1  # finished: nothing to continue
    assert "finished" in capsys.readouterr().err


@pytest.mark.slow
def test_recipe_script_quick_mode_writes_its_table(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts" / "recipes"))
    import recipe_extend

    readme = tmp_path / "README.md"
    readme.write_text("<!-- recipe-extend:start -->\nold\n<!-- recipe-extend:end -->\n", encoding="utf-8")
    recipe_extend.main(["--quick", "--work-dir", str(tmp_path), "--readme", str(readme)])
    written = json.loads((tmp_path / "recipe_extend.json").read_text(encoding="utf-8"))
    assert [row["model"] for row in written["rows"]] == ["native (no scaling)", "yarn, zero-shot",
                                                         "yarn + PoSE LoRA, 3 steps"]
    assert written["reload"]["ok"] and written["training"]["steps"] == 3
    assert "typing.py" not in written["training"]["files"] and written["training"]["tokens"] == 3 * 2 * 64
    table = (tmp_path / "recipe_extend.md").read_text(encoding="utf-8")
    assert "| yarn + PoSE LoRA, 3 steps |" in table and "passkey 512" in table
    section = readme.read_text(encoding="utf-8")
    assert "old" not in section and "`python scripts/recipes/recipe_extend.py --quick --readme README.md`" in section
    assert table in section
    # --report rewrites the table and the section from the JSON alone (no run)
    (tmp_path / "recipe_extend.md").unlink()
    readme.write_text("<!-- recipe-extend:start -->\nstale\n<!-- recipe-extend:end -->\n", encoding="utf-8")
    again = recipe_extend.main(["--report", str(tmp_path / "recipe_extend.json"), "--readme", str(readme)])
    assert again == written and (tmp_path / "recipe_extend.md").read_text(encoding="utf-8") == table
    assert table in readme.read_text(encoding="utf-8")


def test_recipe_times_a_resumed_training_over_the_steps_it_ran() -> None:
    sys.path.insert(0, str(ROOT / "scripts" / "recipes"))
    import recipe_extend

    resumed = recipe_extend.training_time({"steps": 144, "first_step": 75, "seconds": 966.0})
    assert resumed.startswith("resumed at step 75: its last 69 steps took 966 s (14.0 s per step")
    assert recipe_extend.training_time({"steps": 144, "seconds": 1440.0}).startswith("1440 s (10.0 s per step")


BAD_EXTENSION = {  # id: extension arguments that only the extension itself (after the output was locked) refuses
    "default-method-factor-0": (["--option", "factor=0"], "factor must be"),
    "rerope-window-past-length": (["--method", "rerope", "--option", "window=100"], "window=100"),
}


@pytest.mark.parametrize("case", list(BAD_EXTENSION), ids=list(BAD_EXTENSION))
def test_extend_train_refused_extension_writes_nothing(case: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    base = save_tiny_checkpoint("llama", tmp_path / "llama")
    data = write_corpus(tmp_path, documents=2)
    extra, fragment = BAD_EXTENSION[case]
    output = tmp_path / "out"
    argv = ["extend", "--model", str(base), "--to", str(TO), "--train", "--data", *data, "--steps", "1",
            "--seq-len", "32", "--no-progress", "--output", str(output), *extra]
    assert cli(argv) == 1
    err = capsys.readouterr().err
    error = err.strip().splitlines()[-1]  # before it: the run's plan line (and the tiny checkpoint's save bar)
    assert fragment in error and error.startswith("hf-posswap extend: ") and "Traceback" not in err, err
    assert not output.exists(), sorted(str(p.relative_to(output)) for p in output.rglob("*"))
    check_run_output(str(output), resume=False, overwrite=False)  # the corrected rerun needs no --overwrite


def test_extend_train_refused_extension_keeps_an_existing_empty_output(tmp_path: Path) -> None:
    base = save_tiny_checkpoint("llama", tmp_path / "llama")
    data = write_corpus(tmp_path, documents=2)
    output = tmp_path / "out"
    output.mkdir()
    argv = ["extend", "--model", str(base), "--to", str(TO), "--train", "--data", *data, "--steps", "1",
            "--seq-len", "32", "--no-progress", "--output", str(output), "--option", "factor=0"]
    assert cli(argv) == 1
    assert output.is_dir() and not any(output.iterdir())
