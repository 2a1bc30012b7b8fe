"""Fine-tuning: objectives, LoRA with position parameters, resume after a kill, atomic checkpoints, many
processes, the HF Trainer."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_checkpoint, write_corpus
from process_launch import run_again_if_killed, run_launcher
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

import hf_posswap as ps
from hf_posswap.persistence.adapters import load_adapter, trainable_position_modules
from hf_posswap.training import FinetuneConfig, finetune
from hf_posswap.training.losses import pose_position_ids
from hf_posswap.training.run_checkpoints import latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("finetune")
    for family in ("gpt2", "bert", "llama"):
        save_tiny_checkpoint(family, root / family)
    (root / "corpus").mkdir()
    write_corpus(root / "corpus")
    return root


def run(workspace: Path, family: str, output: Path, **options) -> dict:
    settings = {"seq_len": 64, "batch_size": 4, "steps": 6, "lr": 2e-3, "eval_every": 3, "save_every": 3, **options}
    config = FinetuneConfig(model=str(workspace / family), data=[str(workspace / "corpus" / "*.txt")],
                            output=str(output), **settings)
    return finetune(config)


def one_process_learning_rates(config: FinetuneConfig) -> list[float]:
    """The learning rate after each of ``config.steps`` updates, from transformers' scheduler stepped once each."""
    from transformers import get_scheduler

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
    scheduler = get_scheduler(config.lr_schedule, optimizer, config.warmup_steps, config.steps)
    rates = []
    for _ in range(config.steps):
        optimizer.step()
        scheduler.step()
        rates.append(scheduler.get_last_lr()[0])
    return rates


def losses(output: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (output / "loss_log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("family", "scheme", "auto"), [("gpt2", "alibi", AutoModelForCausalLM),
                                                        ("bert", "t5", AutoModelForMaskedLM),
                                                        ("llama", "sinusoidal", AutoModelForCausalLM)])
@pytest.mark.slow
def test_full_finetune_learns_and_saves_a_reloadable_model(workspace, tmp_path, family, scheme, auto) -> None:
    result = run(workspace, family, tmp_path, scheme=scheme, steps=10)
    curve = losses(tmp_path)
    assert len(curve) == 10 and curve[-1] < curve[0]
    assert result["eval_loss"] is not None and result["steps"] == 10
    reloaded = auto.from_pretrained(tmp_path / "final")
    assert ps.describe(reloaded).scheme == scheme
    assert (tmp_path / "final" / "model.safetensors").exists() and (tmp_path / "final" / "tokenizer.json").exists()


def test_lora_trains_and_saves_the_position_parameters(workspace, tmp_path) -> None:
    run(workspace, "llama", tmp_path, scheme="t5", lora=True, merge_lora=True)
    adapter = tmp_path / "adapter"
    from safetensors.torch import load_file

    keys = load_file(adapter / "adapter_model.safetensors").keys()
    assert any("posswap_positions" in key for key in keys), sorted(keys)
    assert any("lora_A" in key for key in keys)
    # the same swap on the base: the adapter loads with its tables
    base = AutoModelForCausalLM.from_pretrained(workspace / "llama")
    ps.swap(base, "t5")
    peft_model = load_adapter(base, adapter).eval()
    tables = peft_model.get_base_model().model.posswap_positions
    assert any(param.abs().sum() > 0 for param in tables.parameters()), "trained T5 tables were dropped"
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    input_ids = torch.randint(0, 250, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=input_ids).logits, peft_model(input_ids=input_ids).logits,
                                   atol=1e-4, rtol=1e-4)


def test_adapter_onto_a_base_swapped_differently_is_refused(workspace, tmp_path) -> None:
    run(workspace, "gpt2", tmp_path, scheme="learned", lora=True, steps=2)
    base = AutoModelForCausalLM.from_pretrained(workspace / "gpt2")
    with pytest.raises(ps.InvalidConfigError, match=r"was trained on a model swapped to \{'scheme': 'learned'.*but "
                       r"this base carries no swap\. Loading it would drop or misplace its position weights"):
        load_adapter(base, tmp_path / "adapter")


def test_trainable_position_modules() -> None:
    from conftest import make_model

    model = make_model("gpt2")
    ps.swap(model, "learned")
    assert trainable_position_modules(model) == ["wpe"]
    ps.swap(model, "alibi", replace=True)
    assert trainable_position_modules(model) == []
    ps.swap(model, "alibi", replace=True, trainable_slopes=True)
    assert trainable_position_modules(model) == ["posswap_positions"]


DRIVER = textwrap.dedent("""
    import os, sys
    from hf_posswap.training import FinetuneConfig, finetune
    import hf_posswap.training.loop as loop
    from hf_posswap.training.run_checkpoints import publish_checkpoint
    kill_at = int(os.environ.get("KILL_AT_STEP", "0"))

    def publish_then_die(output, step, state, keep=2):
        path = publish_checkpoint(output, step, state, keep)
        if step == kill_at:
            os._exit(9)  # killed right after a checkpoint: no cleanup, no final save
        return path

    loop.publish_checkpoint = publish_then_die
    finetune(FinetuneConfig(model=sys.argv[1], data=[sys.argv[2]], output=sys.argv[3], scheme="alibi", seq_len=64,
                            batch_size=4, steps=8, lr=2e-3, save_every=4, eval_every=0,
                            resume="--resume" in sys.argv))
    """)


@pytest.mark.slow
def test_killed_run_resumes_where_it_stopped(workspace, tmp_path) -> None:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    args = [sys.executable, str(driver), str(workspace / "gpt2"), str(workspace / "corpus" / "*.txt")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([*args, str(tmp_path / "straight")], check=True, env=env, capture_output=True, timeout=600)
    killed = subprocess.run([*args, str(tmp_path / "resumed")], env={**env, "KILL_AT_STEP": "4"},
                            capture_output=True, timeout=600)
    assert killed.returncode == 9
    assert len(losses(tmp_path / "resumed")) == 4 and not (tmp_path / "resumed" / "final").exists()
    subprocess.run([*args, str(tmp_path / "resumed"), "--resume"], check=True, env=env, capture_output=True,
                   timeout=600)
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert len(resumed) == 8
    assert resumed == pytest.approx(straight, rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_a_crash_during_a_save_keeps_the_last_good_checkpoint(workspace, tmp_path, monkeypatch) -> None:
    run(workspace, "gpt2", tmp_path, scheme="alibi", steps=3, save_every=3)
    good = latest_checkpoint(tmp_path)
    assert good is not None and good.name == "step-3"

    from accelerate import Accelerator

    original = Accelerator.save_state

    def crash(self, output_dir=None, **kwargs):
        original(self, output_dir, **kwargs)  # everything written to the staging directory ...
        raise KeyboardInterrupt("power cut")  # ... and the process dies before publishing it

    monkeypatch.setattr(Accelerator, "save_state", crash)
    with pytest.raises(KeyboardInterrupt):
        run(workspace, "gpt2", tmp_path, scheme="alibi", steps=6, save_every=3, resume=True)
    assert latest_checkpoint(tmp_path) == good
    assert (good / "trainer_state.json").exists()


@pytest.mark.slow
def test_two_processes_train_data_parallel(workspace, tmp_path) -> None:
    folder = run_again_if_killed(lambda folder: _train_two_processes(workspace, folder), tmp_path)
    reported = [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["processes"] for r in reported] == [2, 2], "the two processes did not form one data-parallel group"
    assert reported[0]["loss"] == reported[1]["loss"], "processes disagree on the (gathered) loss"
    assert reported[0]["checksum"] == reported[1]["checksum"], "the processes' weights diverged"
    assert len(losses(folder / "out")) == 4, "the loss log is written once, by the main process"
    # the schedule advances once per update in any number of processes (accelerate's default: once per process)
    logged = [json.loads(line)["lr"] for line in (folder / "out" / "loss_log.jsonl").read_text().splitlines()]
    assert logged == one_process_learning_rates(FinetuneConfig(model="m", data=["d"], output="o", steps=4, lr=2e-3))
    assert sorted(p.name for p in (folder / "out" / "checkpoints").iterdir()) == ["latest", "step-2", "step-4"]
    assert (folder / "out" / "final" / "model.safetensors").exists()


def _train_two_processes(workspace: Path, folder: Path) -> Path:
    script = folder / "two.py"
    script.write_text(textwrap.dedent(f"""
        import json
        from accelerate import PartialState
        from hf_posswap.training import FinetuneConfig, finetune
        result = finetune(FinetuneConfig(model={str(workspace / "gpt2")!r},
                                         data=[{str(workspace / "corpus" / "*.txt")!r}],
                                         output={str(folder / "out")!r}, scheme="t5", seq_len=64, batch_size=2,
                                         steps=4, lr=2e-3, save_every=2, eval_every=2))
        rank = PartialState().process_index
        with open({str(folder)!r} + f"/rank{{rank}}.json", "w") as handle:
            json.dump({{"rank": rank, "processes": PartialState().num_processes, "loss": result["train_loss"],
                       "checksum": result["parameter_checksum"]}}, handle)
        """))
    _launch_two_processes(script)
    return folder


def _launch_two_processes(script: Path) -> None:
    """``accelerate launch`` of ``script`` in 2 processes. accelerate's --cpu launcher goes multi-process only through
    mpirun; torchrun (--multi_gpu) works on CPU because finetune() asks accelerate for gloo when there is no CUDA."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script)]
    run_launcher(command, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
def test_two_processes_train_as_one_process_across_epochs(workspace, tmp_path) -> None:
    """2 processes x 2 rows against 1 process x 4 rows over 10 sequences (an epoch of 3 steps whose last batch is
    completed with repeated rows): the same loss at every step past the epoch's end, for masked LM (masks drawn in
    each process) and for causal LM with PoSE (skips drawn in each process)."""
    corpus = tmp_path / "small"
    corpus.mkdir()
    (corpus / "text.txt").write_text(sorted((workspace / "corpus").glob("*.txt"))[0].read_text()[:700])
    runs = {"mlm": {"family": "bert"}, "pose": {"family": "gpt2", "scheme": "rope", "pose_target": 256}}
    folder = run_again_if_killed(lambda folder: _two_processes(workspace, folder, corpus, runs), tmp_path)
    for name, options in runs.items():
        options = dict(options)
        one = finetune(FinetuneConfig(model=str(workspace / options.pop("family")), data=[str(corpus / "*.txt")],
                                      output=str(tmp_path / f"one-{name}"), seq_len=64, batch_size=4, steps=5,
                                      lr=2e-3, save_every=0, eval_fraction=0.0, **options))
        assert len(losses(folder / name)) == 5
        assert losses(folder / name) == pytest.approx(losses(tmp_path / f"one-{name}"), rel=1e-5), name
        assert json.loads((folder / f"{name}.json").read_text())["loss"] == pytest.approx(one["train_loss"], rel=1e-5)


def _two_processes(workspace: Path, folder: Path, corpus: Path, runs: dict) -> Path:
    script = folder / "epochs.py"
    script.write_text(textwrap.dedent(f"""
        import json
        import os
        from hf_posswap.training import FinetuneConfig, finetune

        for name, options in {runs!r}.items():
            options = dict(options)
            result = finetune(FinetuneConfig(model={str(workspace)!r} + "/" + options.pop("family"),
                                             data=[{str(corpus / "*.txt")!r}], output={str(folder)!r} + "/" + name,
                                             seq_len=64, batch_size=2, steps=5, lr=2e-3, save_every=0,
                                             eval_fraction=0.0, **options))
            if os.environ["RANK"] == "0":
                with open({str(folder)!r} + f"/{{name}}.json", "w") as handle:
                    json.dump({{"loss": result["train_loss"]}}, handle)
        """))
    _launch_two_processes(script)
    return folder


@pytest.mark.slow
def test_two_processes_refuse_together(workspace, tmp_path) -> None:
    """A refusal in one process of a run is the same one-line error in every process, before anything is written:
    processes started with different settings (another --lr in process 1), and an output folder another run holds
    (the lock is seen by the main process only; the others hear it from it)."""
    from hf_posswap.training.guards import OutputLock

    busy = tmp_path / "busy"
    busy.mkdir()
    held = OutputLock(busy).acquire()
    try:
        folder = run_again_if_killed(lambda folder: _refusals_in_two_processes(workspace, folder, busy), tmp_path)
    finally:
        held.release()
    reported = [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    settings, locked = reported[0]["settings"], reported[0]["locked"]
    assert [r["settings"] for r in reported] == [settings] * 2 and [r["locked"] for r in reported] == [locked] * 2
    assert "InvalidConfigError" in settings and "lr 0.002 in process 0, 0.001 in process 1" in settings
    assert "OutputDirError" in locked and "in use by another finetune run" in locked
    assert not (folder / "mismatched").exists()
    assert sorted(path.name for path in busy.iterdir()) == [".finetune.lock"]


def _refusals_in_two_processes(workspace: Path, folder: Path, busy: Path) -> Path:
    script = folder / "refusals.py"
    script.write_text(textwrap.dedent(f"""
        import json
        import os
        from hf_posswap.training import FinetuneConfig, finetune

        rank = int(os.environ["RANK"])  # torchrun's; finetune sets accelerate's state up itself
        common = dict(model={str(workspace / "gpt2")!r}, data=[{str(workspace / "corpus" / "*.txt")!r}],
                      seq_len=32, batch_size=2, steps=2)
        report = {{}}
        mismatched = dict(output={str(folder / "mismatched")!r}, lr=2e-3 if rank == 0 else 1e-3)
        for name, settings in (("settings", mismatched), ("locked", dict(output={str(busy)!r}))):
            try:
                finetune(FinetuneConfig(**common, **settings))
                report[name] = "ran"
            except Exception as error:
                report[name] = f"{{type(error).__name__}}: {{error}}"
        with open({str(folder)!r} + f"/rank{{rank}}.json", "w") as handle:
            json.dump(report, handle)
        """))
    _launch_two_processes(script)
    return folder


@pytest.mark.slow
def test_hf_trainer_runs_a_swapped_model(workspace, tmp_path) -> None:
    from transformers import Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(workspace / "llama")
    ps.swap(model, "alibi", trainable_slopes=True)
    data = [{"input_ids": torch.randint(0, 250, (32,)), "labels": None} for _ in range(8)]
    for item in data:
        item["labels"] = item["input_ids"].clone()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True, logging_steps=1, save_strategy="no")
    slopes_before = model.model.posswap_positions.slopes.detach().clone()
    Trainer(model=model, args=args, train_dataset=data).train()
    assert not torch.equal(model.model.posswap_positions.slopes, slopes_before)


@pytest.mark.slow
def test_distillation_and_pose_runs(workspace, tmp_path) -> None:
    run(workspace, "llama", tmp_path / "distill", scheme="alibi", distill=True, distill_weight=0.5, steps=3)
    run(workspace, "bert", tmp_path / "encoder", scheme="alibi", distill=True, steps=3)
    run(workspace, "gpt2", tmp_path / "pose", scheme="rope", pose_target=256, steps=3)
    for name in ("distill", "encoder", "pose"):
        assert len(losses(tmp_path / name)) == 3


def test_pose_position_ids_span_the_target() -> None:
    generator = torch.Generator().manual_seed(0)
    ids = pose_position_ids(64, 32, 256, generator)
    assert ids.shape == (64, 32) and int(ids.max()) < 256 and int(ids.max()) > 200
    steps = ids[:, 1:] - ids[:, :-1]
    assert ((steps == 1).sum(1) >= 30).all()  # one skip per row at most
    assert (ids[:, 0] == 0).all()


@pytest.mark.parametrize("scheme", ["native", "alibi", "t5", "xpos"])
def test_pose_rows_are_one_sequence_whose_positions_skip(scheme: str) -> None:
    """A PoSE row jumps in position once. transformers itself computes such a row as one sequence when it builds a KV
    cache (its packed-sequence detection runs only without a mask and without a cache): the training loss must be
    that one. Without a mask, training would mask attention across the jump (two sequences)."""
    from conftest import make_model, swapped

    from hf_posswap.training.loop import _loss

    torch.manual_seed(0)
    model = (make_model("llama") if scheme == "native" else swapped("llama", scheme)).train()
    tokens = torch.randint(3, 90, (2, 32))
    config = FinetuneConfig(model="m", data=["d"], output="o", seq_len=32, pose_target=512)
    loss = _loss(model, None, {"input_ids": tokens, "labels": tokens}, "causal", config,
                 torch.Generator().manual_seed(3))
    positions = pose_position_ids(2, 32, 512, torch.Generator().manual_seed(3))
    assert (positions.diff(dim=1) > 1).any(), "the drawn rows have no jump to test"
    one_sequence = model(input_ids=tokens, labels=tokens, position_ids=positions, use_cache=True).loss
    torch.testing.assert_close(loss, one_sequence, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", ["learned", "alibi"])
def test_pose_ids_follow_robertas_numbering(scheme: str) -> None:
    """RoBERTa numbers positions from padding_idx + 1 (its table's rows): PoSE's 0-based ids are shifted to it, so
    the kept table reads its own rows (it read the padding row for the first token) and attention counts them
    from 0 (it refuses 0-based ids)."""
    from conftest import swapped

    from hf_posswap.training.loop import _loss

    model = swapped("roberta", scheme).train()
    tokens = torch.randint(3, 90, (2, 32))
    config = FinetuneConfig(model="m", data=["d"], output="o", seq_len=32, pose_target=60, objective="mlm")
    loss = _loss(model, None, {"input_ids": tokens, "labels": tokens}, "mlm", config, torch.Generator().manual_seed(3))
    positions = pose_position_ids(2, 32, 60, torch.Generator().manual_seed(3)) + model.config.pad_token_id + 1
    expected = model(input_ids=tokens, labels=tokens, position_ids=positions, attention_mask=torch.ones_like(tokens))
    torch.testing.assert_close(loss, expected.loss, rtol=1e-5, atol=1e-6)


def test_finetune_config_errors() -> None:
    with pytest.raises(ps.InvalidConfigError, match=r"FinetuneConfig.steps must be a positive integer, got 0"):
        FinetuneConfig(model="m", data=["d"], output="o", steps=0)
    with pytest.raises(ps.InvalidConfigError, match=r"pose_target=100 must exceed seq_len=512"):
        FinetuneConfig(model="m", data=["d"], output="o", pose_target=100)
    with pytest.raises(ps.InvalidConfigError, match=r"No training data matches '/nonexistent/\*.txt'"):
        finetune(FinetuneConfig(model=str(ROOT), data=["/nonexistent/*.txt"], output="/tmp/x"))


def test_jsonl_and_datasets_directories_are_read(workspace, tmp_path) -> None:
    from hf_posswap.training.data import expand_paths, read_documents

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "first document"}\n\n{"text": "second"}\n', encoding="utf-8")
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": ["from a dataset", "on disk"]}).save_to_disk(str(tmp_path / "ds"))
    assert read_documents(expand_paths([str(jsonl)])) == ["first document", "second"]
    assert read_documents(expand_paths([str(tmp_path / "ds")]), text_field="body") == ["from a dataset", "on disk"]
    with pytest.raises(ps.InvalidConfigError, match=r"docs.jsonl:1 has no 'body' field; pass --text-field"):
        read_documents([jsonl], text_field="body")


def test_json_files_read_as_the_datasets_library_reads_them(tmp_path) -> None:
    """``.json`` as ``datasets`` writes it (JSON Lines by default, a list of records with ``lines=False``); text
    holding Unicode line separators (which JSON leaves unescaped) stays one record. The documents equal what
    ``datasets.load_dataset("json")`` reads from the same files."""
    from hf_posswap.training.data import read_documents

    datasets = pytest.importorskip("datasets")
    texts = ["plain", "a\u2028line separator", "next line\x85and paragraph\u2029separators", "tab\tand\nnewline"]
    table = datasets.Dataset.from_dict({"text": texts, "id": list(range(len(texts)))})
    files = {"lines.json": lambda path: table.to_json(str(path)),
             "records.json": lambda path: table.to_json(str(path), lines=False),
             "UPPER.JSONL": lambda path: table.to_json(str(path)),
             "unescaped.jsonl": lambda path: path.write_text(
                 "".join(json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in texts), encoding="utf-8")}
    for name, write in files.items():
        write(tmp_path / name)
        expected = datasets.load_dataset("json", data_files=str(tmp_path / name), split="train",
                                         cache_dir=str(tmp_path / "cache"))["text"]
        assert read_documents([tmp_path / name]) == expected == texts, name


@pytest.mark.slow
def test_cli_finetune(workspace, tmp_path) -> None:
    command = [sys.executable, "-m", "hf_posswap", "finetune", "--model", str(workspace / "gpt2"), "--data",
               str(workspace / "corpus" / "*.txt"), "--output", str(tmp_path), "--scheme", "t5", "--scheme-option",
               "num_buckets=16", "--seq-len", "64", "--steps", "2", "--batch-size", "2", "--eval-every", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "finished 2 steps" in result.stdout
    saved = json.loads((tmp_path / "final" / "config.json").read_text())
    assert saved["posswap"]["num_buckets"] == 16
    bad = subprocess.run([*command[:4], "--model", str(workspace / "gpt2"), "--data", "/nonexistent.txt", "--output",
                          str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1] == (
        "hf-posswap finetune: No training data matches '/nonexistent.txt'. Pass text/jsonl files or a directory.")


@pytest.mark.slow
def test_gradient_checkpointing_accumulation_and_bf16(workspace, tmp_path) -> None:
    result = run(workspace, "llama", tmp_path, scheme="t5", steps=2, gradient_checkpointing=True, grad_accum=2,
                 mixed_precision="bf16")
    assert result["steps"] == 2 and math.isfinite(result["train_loss"])
    assert len(losses(tmp_path)) == 2


def test_pathlib_paths_are_accepted_and_stored_as_strings(tmp_path) -> None:
    """``FinetuneConfig(model=Path(...), data=Path(...))`` as Python users write it; the record is JSON."""
    config = FinetuneConfig(model=tmp_path / "model", data=tmp_path / "corpus.txt", output=tmp_path / "out",
                            accelerate_config=tmp_path / "fsdp.yaml")
    assert (config.model, config.data, config.output, config.accelerate_config) == (
        str(tmp_path / "model"), [str(tmp_path / "corpus.txt")], str(tmp_path / "out"), str(tmp_path / "fsdp.yaml"))
    assert FinetuneConfig(model="m", data=[tmp_path / "a.txt", "b.txt"], output="o").data == [
        str(tmp_path / "a.txt"), "b.txt"]
