"""What the command line refuses, on one line, instead of doing something else: config values of the wrong type,
unknown architectures, checkpoints written over adapters, bad adapter records, relative base paths, extreme
distillation temperatures, scheme options without a scheme; and written files get the usual permissions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import save_tiny_adapter, save_tiny_checkpoint, write_corpus

import hf_posswap as ps
from hf_posswap.cli import main
from hf_posswap.cli.finetune import main as finetune_main
from hf_posswap.persistence.loading import inspect_model_path


def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli_refusals")
    for family in ("llama", "gpt2"):
        save_tiny_checkpoint(family, root / family)
    (root / "corpus").mkdir()
    write_corpus(root / "corpus", documents=8)
    save_tiny_adapter(root)
    shutil.copytree(root / "llama", root / "typo_config")
    _edit_config(root / "typo_config", hidden_size="big")
    shutil.copytree(root / "llama", root / "odd_architecture")
    _edit_config(root / "odd_architecture", architectures=["Nope"])
    for name, value in {"no_architecture": None, "empty_architectures": []}.items():
        shutil.copytree(root / "llama", root / name)
        _edit_config(root / name, architectures=value)
    shutil.copytree(root / "llama", root / "bare_architecture")
    _edit_config(root / "bare_architecture", architectures=["LlamaModel"])  # the weights hold lm_head too
    assert main(["swap", "--model", str(root / "llama"), "--scheme", "alibi", "--output", str(root / "swapped")]) == 0
    _edit_config(root / "swapped", architectures=None)
    return root


def one_line(capsys: pytest.CaptureFixture, code: int, prefix: str = "hf-posswap") -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith(prefix)]
    assert code == 1 and len(lines) == 1 and "Traceback" not in captured.err, (code, captured.err[-2000:])
    return lines[0]


def tree(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


# --- a config.json value of the wrong type: one line naming it, before loading, for every command ---------------


@pytest.mark.parametrize("command", [
    ["eval", "--model", "{m}", "--lengths", "16"],
    ["swap", "--model", "{m}", "--scheme", "alibi", "--output", "{out}"],
    ["extend", "--model", "{m}", "--to", "128", "--output", "{out}"],
    ["inspect", "--model", "{m}", "--output", "{out}"],
], ids=["eval", "swap", "extend", "inspect"])
def test_a_config_value_of_the_wrong_type_is_one_line(ws, tmp_path, capsys, command) -> None:
    argv = [a.format(m=ws / "typo_config", out=tmp_path / "out") for a in command]
    line = one_line(capsys, main(argv))
    assert "hidden_size" in line and "'big'" in line and "config.json" in line


def test_finetune_with_a_config_value_of_the_wrong_type_is_one_line(ws, tmp_path, capsys) -> None:
    code = finetune_main(["--model", str(ws / "typo_config"), "--data", str(ws / "corpus" / "*.txt"),
                          "--output", str(tmp_path / "run")])
    assert "hidden_size" in one_line(capsys, code, "hf-posswap finetune:")


# --- an architecture the loader does not know is refused instead of loading a headless model --------------------


def test_an_unknown_architecture_is_refused_instead_of_dropping_the_head(ws, tmp_path, capsys) -> None:
    line = one_line(capsys, main(["swap", "--model", str(ws / "odd_architecture"), "--scheme", "alibi",
                                  "--output", str(tmp_path / "out")]))
    assert "'Nope'" in line and "LlamaForCausalLM" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [
    ["swap", "--model", "{m}", "--scheme", "alibi", "--output", "{out}"],
    ["extend", "--model", "{m}", "--to", "128", "--output", "{out}"],
    ["export", "{m}", "{out}"],
], ids=["swap", "extend", "export"])
@pytest.mark.parametrize("checkpoint", ["no_architecture", "empty_architectures"])
def test_a_config_naming_no_architecture_is_refused_instead_of_dropping_the_head(ws, tmp_path, capsys, command,
                                                                                checkpoint) -> None:
    """Without 'architectures' the loader once took the bare model, and the LM head's weights were not saved
    (export takes a swapped checkpoint, so it reads one whose 'architectures' is null)."""
    model = ws / ("swapped" if command[0] == "export" else checkpoint)
    line = one_line(capsys, main([a.format(m=model, out=tmp_path / "out") for a in command]))
    assert "names no architecture" in line and "LlamaForCausalLM" in line
    assert not (tmp_path / "out").exists()


def test_weights_the_named_class_has_no_place_for_are_refused(ws, tmp_path, capsys) -> None:
    """config.json names the bare LlamaModel, the weights hold a causal LM: loading would drop lm_head."""
    line = one_line(capsys, main(["swap", "--model", str(ws / "bare_architecture"), "--scheme", "alibi",
                                  "--output", str(tmp_path / "out")]))
    assert "lm_head.weight" in line and "would be dropped" in line and "'architectures'" in line
    assert not (tmp_path / "out").exists()


# --- a full checkpoint never goes over a LoRA adapter directory ---------------------------------------------------


@pytest.mark.parametrize("command", [
    ["swap", "--model", "{a}", "--scheme", "alibi", "--output", "{a}", "--overwrite"],
    ["extend", "--model", "{a}", "--to", "128", "--output", "{a}", "--overwrite"],
    ["export", "{a}", "{a}", "--overwrite"],
], ids=["swap", "extend", "export"])
def test_overwrite_refuses_to_write_a_checkpoint_over_an_adapter(ws, tmp_path, capsys, monkeypatch, command) -> None:
    adapter = tmp_path / "adapter"
    shutil.copytree(ws / "adapter", adapter)
    before = tree(adapter)
    import hf_posswap.persistence.loading

    monkeypatch.setattr(hf_posswap.persistence.loading, "load_model",
                        lambda *a, **k: pytest.fail("loaded before refusing"))
    line = one_line(capsys, main([a.format(a=adapter) for a in command]))
    assert "LoRA adapter" in line and str(adapter) in line
    assert tree(adapter) == before
    assert inspect_model_path(adapter).kind == "adapter"


def test_the_api_refuses_to_publish_a_checkpoint_over_an_adapter(ws, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from hf_posswap.persistence.saving import OutputError, publish

    adapter = tmp_path / "adapter"
    shutil.copytree(ws / "adapter", adapter)
    before = tree(adapter)
    model = AutoModelForCausalLM.from_pretrained(ws / "llama")
    ps.swap(model, "alibi")
    with pytest.raises(OutputError, match="LoRA adapter"):
        ps.export_standalone(model, adapter, overwrite=True)
    staging = tmp_path / "staging"
    model.save_pretrained(staging)
    with pytest.raises(OutputError, match="LoRA adapter"):
        publish(staging, adapter)  # the last line of defence, for callers that skipped check_output_dir
    assert tree(adapter) == before


def test_export_names_its_output_argument_as_it_is_spelled(ws, tmp_path, capsys) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    line = one_line(capsys, main(["export", str(ws / "adapter"), str(tmp_path / "full")]))
    assert "--output" not in line and f"output {str(tmp_path / 'full')!r} is not empty" in line


# --- adapters ---------------------------------------------------------------------------------------------------


def test_an_adapter_record_naming_an_unknown_scheme_names_the_file(ws, tmp_path, capsys) -> None:
    adapter = tmp_path / "adapter"
    shutil.copytree(ws / "adapter", adapter)
    (adapter / "posswap_adapter.json").write_text(json.dumps({"scheme": {"scheme": "zzz"}, "extension": None}))
    line = one_line(capsys, main(["eval", "--model", str(adapter), "--lengths", "16"]))
    assert "posswap_adapter.json" in line and "'zzz'" in line


@pytest.mark.slow
def test_a_lora_run_from_a_relative_model_path_records_an_absolute_base(ws, tmp_path, monkeypatch) -> None:
    """A relative base path would load only from the training directory, or load whatever has that name
    elsewhere: here a different model also called ``gpt2``."""
    monkeypatch.chdir(ws)
    code = finetune_main(["--model", "gpt2", "--data", "corpus/*.txt", "--output", str(tmp_path / "run"),
                          "--lora", "--scheme", "alibi", "--seq-len", "16", "--batch-size", "2", "--steps", "1",
                          "--eval-fraction", "0", "--eval-every", "0"])
    assert code == 0
    decoy = tmp_path / "elsewhere"
    save_tiny_checkpoint("gpt2", decoy / "gpt2", seed=1)
    monkeypatch.chdir(decoy)
    source = inspect_model_path(tmp_path / "run" / "adapter")
    assert Path(source.base.path).resolve() == (ws / "gpt2").resolve()


# --- fine-tuning settings that train nothing or diverge by construction --------------------------------------------


@pytest.mark.parametrize("temperature", ["1e-30", "1e-40", "1e30", "0.001", "1000"])
def test_distill_temperatures_that_underflow_or_overflow_are_refused(ws, tmp_path, capsys, monkeypatch,
                                                                     temperature) -> None:
    """1e-30: the T^2-scaled KL is exactly 0, so a 'successful' run trains nothing; 1e-40 and 1e30: NaN."""
    import hf_posswap.training.loop as loop

    monkeypatch.setattr(loop, "_load_model", lambda *a, **k: pytest.fail("loaded before refusing"))
    code = finetune_main(["--model", str(ws / "gpt2"), "--data", str(ws / "corpus" / "*.txt"), "--output",
                          str(tmp_path / "run"), "--scheme", "alibi", "--distill",
                          "--distill-temperature", temperature])
    line = one_line(capsys, code, "hf-posswap finetune:")
    assert f"distill_temperature must be a finite number in [0.01, 100], got {float(temperature)!r}" in line


def test_scheme_options_without_a_scheme_are_refused_not_ignored(ws, tmp_path, capsys, monkeypatch) -> None:
    """Before: the options were dropped and 100 steps of plain training reported success."""
    import hf_posswap.training.loop as loop

    monkeypatch.setattr(loop, "_load_model", lambda *a, **k: pytest.fail("loaded before refusing"))
    code = finetune_main(["--model", str(ws / "gpt2"), "--data", str(ws / "corpus" / "*.txt"), "--output",
                          str(tmp_path / "run"), "--scheme-option", "num_buckets=64"])
    line = one_line(capsys, code, "hf-posswap finetune:")
    assert "{'num_buckets': 64}" in line and "--scheme" in line


# --- written files and directories get the usual permissions, not the private ones of tempfile ------------------


@pytest.mark.slow
def test_written_checkpoints_and_results_get_the_usual_permissions(ws, tmp_path, capsys) -> None:
    import os
    import stat

    mask = os.umask(0o022)
    try:
        assert main(["swap", "--model", str(ws / "llama"), "--scheme", "alibi", "--output", str(tmp_path / "out")]) == 0
        assert main(["eval", "--model", str(tmp_path / "out"), "--lengths", "16", "--max-windows", "1",
                     "--output", str(tmp_path / "results.json")]) == 0
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755  # readable by the group, as save_pretrained
    assert stat.S_IMODE((tmp_path / "results.json").stat().st_mode) == 0o644
