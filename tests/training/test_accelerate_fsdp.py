"""``finetune`` with an FSDP accelerate config runs accelerate's own FSDP2 code (prepare, sharded ``save_state`` /
``load_state``, the gathered final save) and trains exactly as one process does.

Three launches of 2 gloo processes on CPU (``accelerate_fsdp_worker.py`` explains how accelerate's FSDP path is let
run on CPU) serve every slow test. The first trains a full LLaMA (grouped-query attention) with T5 tables, a full
GPT-2 with KERPLE, a full LLaMA with FIRE, a LoRA LLaMA with KERPLE and a bf16 LLaMA with ALiBi, and starts two runs
(one per checkpoint layout) that stop right after their step-2 checkpoint. The second repeats the T5 run until
process 1 is killed (SIGKILL) halfway through writing its shard of the step-4 checkpoint. The third resumes the
stopped and the killed runs in fresh processes. Each is compared with the same run in this one process (the global
batch of 4 rows equals 2 processes x 2 rows, in the same order)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_checkpoint, write_corpus
from process_launch import check_launch, run_again_if_killed, run_launcher
from transformers import AutoModelForCausalLM

import hf_posswap as ps
from hf_posswap.training import FinetuneConfig, finetune
from hf_posswap.training.accelerate_config import accelerate_has_fsdp2

#: accelerate before 1.6 (the floor, 1.0.1, is one) builds no FSDP2 plugin: finetune refuses those files up front
pytestmark = pytest.mark.skipif(not accelerate_has_fsdp2(), reason="the installed accelerate has no FSDP2 (1.6 on)")

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("accelerate_fsdp_worker.py")
WORLD, ROWS_PER_PROCESS = 2, 2
FSDP_FILE = """distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_state_dict_type: {state_dict_type}
  fsdp_reshard_after_forward: true
"""
#: accelerate's two FSDP2 checkpoint layouts: per-process shards (distributed checkpoint) or whole files
STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
#: process 1 loads the checkpoint onto the meta device and gets its shards from process 0
EFFICIENT_LOADING = "  fsdp_cpu_ram_efficient_loading: true\n"
#: name -> (family, FinetuneConfig settings); every run takes 4 steps with a checkpoint every 2
RUNS = {
    "llama-t5": ("llama", {"scheme": "t5"}),
    "gpt2-kerple": ("gpt2", {"scheme": "kerple"}),
    "llama-fire": ("llama", {"scheme": "fire"}),  # 0-dim parameters: their modules replicated, not sharded
    "llama-kerple-lora": ("llama", {"scheme": "kerple", "lora": True, "lora_r": 4, "merge_lora": True}),
    "llama-t5-efficient-loading": ("llama", {"scheme": "t5"}),
}
#: trained in bf16 (FSDP gathers bf16 parameters and keeps fp32 masters; one process autocasts): close, not equal
BF16_RUNS = {"llama-alibi-bf16": ("llama", {"scheme": "alibi", "mixed_precision": "bf16"})}
RESUMED = "llama-t5"
#: RESUMED again, with process 1 killed while it writes its shard of the step-4 checkpoint, then resumed
KILLED = "killed-during-save"


def _settings(workspace: Path, family: str, output: Path, rows: int, **extra) -> dict:
    return {"model": str(workspace / family), "data": [str(workspace / "corpus" / "*.txt")], "output": str(output),
            "seq_len": 48, "batch_size": rows, "steps": 4, "lr": 3e-3, "save_every": 2, "eval_every": 0,
            "progress": False, **extra}


def _launch(runs: list[dict], folder: Path, killed: bool = False) -> None:
    """Run ``runs`` in one launch of WORLD processes; ``killed``: a run kills process 1 by SIGKILL (checked)."""
    runs_file = folder / f"runs-{len(list(folder.glob('runs-*')))}.json"
    runs_file.write_text(json.dumps(runs))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(WORLD),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(WORKER), str(runs_file)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    if not killed:
        run_launcher(command, env=env)
        return
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    if not re.search(r"exitcode\s*:\s*-9\b", result.stderr):  # not the planned kill: gloo's crash runs it again
        check_launch(result)
        raise AssertionError(f"process 1 was not killed while it saved: {result.stderr[-2000:]}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every sharded run and its one-process reference: ``<root>/<name>/{sharded,alone}``."""
    return run_again_if_killed(_train, tmp_path_factory.mktemp("accelerate_fsdp"))


def _train(root: Path) -> Path:
    for family in ("llama", "gpt2"):
        save_tiny_checkpoint(family, root / family)
    (root / "corpus").mkdir()
    write_corpus(root / "corpus", documents=12)
    files = {kind: root / f"{kind}.yaml" for kind in STATE_DICT_TYPES}
    for kind, path in files.items():
        path.write_text(FSDP_FILE.format(state_dict_type=kind))
    fsdp_file = files["SHARDED_STATE_DICT"]
    efficient_file = root / "efficient.yaml"
    efficient_file.write_text(FSDP_FILE.format(state_dict_type="SHARDED_STATE_DICT") + EFFICIENT_LOADING)
    first = [{"config": _settings(root, family, root / name / "sharded", ROWS_PER_PROCESS,
                                  accelerate_config=str(efficient_file if "efficient" in name else fsdp_file),
                                  **extra),
              "report": str(root / name / "report.json")} for name, (family, extra) in {**RUNS, **BF16_RUNS}.items()]
    family, extra = RUNS[RESUMED]
    stopped = {kind: _settings(root, family, root / f"resumed-{kind}", ROWS_PER_PROCESS,
                               accelerate_config=str(path), **extra) for kind, path in files.items()}
    first += [{"config": config, "stop_after_checkpoint": 2} for config in stopped.values()]
    _launch(first, root)
    killed = _settings(root, family, root / KILLED, ROWS_PER_PROCESS, accelerate_config=str(fsdp_file), **extra)
    _launch([{"config": killed, "kill_during_save": 4}], root, killed=True)
    (root / f"{KILLED}-before-resume.json").write_text(json.dumps(sorted(_listing(root / KILLED / "checkpoints"))))
    resumed = {**stopped, KILLED: killed}
    _launch([{"config": {**config, "resume": True}, "report": str(root / f"resumed-{kind}-report.json")}
             for kind, config in resumed.items()], root)
    for name, (family, extra) in {**RUNS, **BF16_RUNS}.items():
        finetune(FinetuneConfig(**_settings(root, family, root / name / "alone", WORLD * ROWS_PER_PROCESS, **extra)))
    return root


def _listing(folder: Path) -> list[str]:
    return [str(path.relative_to(folder)) for path in folder.rglob("*")]


def _losses(output: Path, column: str = "loss") -> list[float]:
    return [json.loads(line)[column] for line in (output / "loss_log.jsonl").read_text().splitlines()]


def _logits(model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.arange(3, 43).reshape(2, 20)
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_sharded_run_trains_as_one_process(trained: Path, name: str) -> None:
    report = json.loads((trained / name / "report.json").read_text())
    assert report["sharded"] and report["processes"] == WORLD, "accelerate did not take its FSDP path"
    sharded, alone = _losses(trained / name / "sharded"), _losses(trained / name / "alone")
    assert len(sharded) == 4
    torch.testing.assert_close(torch.tensor(sharded), torch.tensor(alone), rtol=2e-5, atol=0)
    # the learning-rate schedule advances once per update, not once per process
    assert _losses(trained / name / "sharded", "lr") == _losses(trained / name / "alone", "lr")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BF16_RUNS))
def test_sharded_bf16_run_trains_close_to_one_process(trained: Path, name: str) -> None:
    report = json.loads((trained / name / "report.json").read_text())
    assert report["sharded"], "accelerate did not take its FSDP path"
    sharded, alone = _losses(trained / name / "sharded"), _losses(trained / name / "alone")
    torch.testing.assert_close(torch.tensor(sharded), torch.tensor(alone), rtol=2e-2, atol=0)
    reloaded = AutoModelForCausalLM.from_pretrained(trained / name / "sharded" / "final")
    assert ps.describe(reloaded).scheme == "alibi" and torch.isfinite(_logits(reloaded)).all()


@pytest.mark.slow
def test_checkpoints_hold_accelerates_sharded_files(trained: Path) -> None:
    step = trained / RESUMED / "sharded" / "checkpoints" / "step-4"
    assert (step / "pytorch_model_fsdp_0" / ".metadata").is_file()
    assert (step / "optimizer_0" / ".metadata").is_file()
    assert not (step / "model.safetensors").exists(), "the model was saved whole, not by FSDP"
    whole = trained / "resumed-FULL_STATE_DICT" / "checkpoints" / "step-4"
    assert (whole / "pytorch_model_fsdp.bin").is_file() and (whole / "optimizer.bin").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-t5", "gpt2-kerple", "llama-fire"])
def test_consolidated_model_reloads_with_the_logits_of_one_process(trained: Path, name: str) -> None:
    sharded = AutoModelForCausalLM.from_pretrained(trained / name / "sharded" / "final")
    alone = AutoModelForCausalLM.from_pretrained(trained / name / "alone" / "final")
    assert ps.describe(sharded).scheme == RUNS[name][1]["scheme"]
    torch.testing.assert_close(_logits(sharded), _logits(alone), rtol=0, atol=1e-4)


@pytest.mark.slow
def test_lora_adapter_under_fsdp_reloads_with_the_logits_of_one_process(trained: Path) -> None:
    from hf_posswap.persistence.loading import inspect_model_path, load_model

    name = "llama-kerple-lora"
    sharded = load_model(inspect_model_path(str(trained / name / "sharded" / "adapter")), "causal", merge=True)
    alone = load_model(inspect_model_path(str(trained / name / "alone" / "adapter")), "causal", merge=True)
    trained_slopes = [p for n, p in sharded.named_parameters() if "posswap_positions" in n]
    assert trained_slopes, "the adapter lost the KERPLE parameters"
    torch.testing.assert_close(_logits(sharded), _logits(alone), rtol=0, atol=1e-4)
    merged = AutoModelForCausalLM.from_pretrained(trained / name / "sharded" / "merged")
    torch.testing.assert_close(_logits(merged), _logits(alone), rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("kind", STATE_DICT_TYPES)
def test_run_stopped_after_a_sharded_checkpoint_resumes_with_the_same_losses(trained: Path, kind: str) -> None:
    resumed = json.loads((trained / f"resumed-{kind}-report.json").read_text())
    assert resumed["steps"] == 4 and resumed["sharded"]
    uninterrupted = _losses(trained / RESUMED / "sharded")
    torch.testing.assert_close(torch.tensor(_losses(trained / f"resumed-{kind}")), torch.tensor(uninterrupted),
                               rtol=1e-6, atol=0)
    again = AutoModelForCausalLM.from_pretrained(trained / f"resumed-{kind}" / "final")
    straight = AutoModelForCausalLM.from_pretrained(trained / RESUMED / "sharded" / "final")
    torch.testing.assert_close(_logits(again), _logits(straight), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_a_process_killed_while_writing_its_shard_loses_nothing(trained: Path) -> None:
    """The step-4 save died half-written in its staging folder: the step-2 checkpoint stayed the latest, and the
    resumed run continued from it with the uninterrupted run's losses and final weights."""
    before = json.loads((trained / f"{KILLED}-before-resume.json").read_text())
    assert "latest" in before and "step-2/trainer_state.json" in before
    assert ".staging-step-4/pytorch_model_fsdp_0/__1_0.distcp" in before and "step-4" not in before
    report = json.loads((trained / f"resumed-{KILLED}-report.json").read_text())
    assert report["first_step"] == 2 and report["steps"] == 4
    uninterrupted = _losses(trained / RESUMED / "sharded")
    torch.testing.assert_close(torch.tensor(_losses(trained / KILLED)), torch.tensor(uninterrupted), rtol=1e-6, atol=0)
    again = AutoModelForCausalLM.from_pretrained(trained / KILLED / "final")
    straight = AutoModelForCausalLM.from_pretrained(trained / RESUMED / "sharded" / "final")
    torch.testing.assert_close(_logits(again), _logits(straight), rtol=0, atol=1e-6)
    assert not any(name.startswith(".staging") for name in os.listdir(trained / KILLED / "checkpoints"))


def test_fsdp_config_in_a_process_started_without_a_launcher_is_refused(tmp_path, monkeypatch) -> None:
    """On a GPU, one process started without ``accelerate launch`` gets no process group and accelerate would train
    unsharded: refused right after the accelerator is built, before any model loads."""
    import hf_posswap.training.accelerate_config as accelerate_config

    monkeypatch.setattr(accelerate_config, "accelerate_can_shard", lambda: True)
    save_tiny_checkpoint("llama", tmp_path / "llama")
    (tmp_path / "corpus").mkdir()
    write_corpus(tmp_path / "corpus", documents=2)
    (tmp_path / "fsdp.yaml").write_text(FSDP_FILE.format(state_dict_type="SHARDED_STATE_DICT"))
    config = FinetuneConfig(**_settings(tmp_path, "llama", tmp_path / "out", 2, scheme="alibi",
                                        accelerate_config=str(tmp_path / "fsdp.yaml")))
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    with pytest.raises(ps.InvalidConfigError, match="accelerate launch --config_file"):
        finetune(config)
    assert not (tmp_path / "out").exists(), "the refused run wrote to its output"
    # accelerate set ACCELERATE_USE_FSDP=true for the process: a later run without the config would shard
    assert "ACCELERATE_USE_FSDP" not in os.environ
