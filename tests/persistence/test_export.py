"""export_standalone: a trust_remote_code checkpoint that loads where hf_posswap cannot be imported."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, byte_tokenizer, make_model, swapped

import hf_posswap as ps
from hf_posswap.persistence.saving import OutputError

LOADER = textwrap.dedent("""
    import sys
    sys.modules["hf_posswap"] = None  # not importable at all
    import torch, transformers
    data = torch.load(sys.argv[2])
    model = getattr(transformers, sys.argv[3]).from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"]).logits
    # Another process: BLAS may sum in another order (thread count, buffer alignment), so bit equality is not
    # promised; a position bug moves logits by 1e-2 and more, far above this bound.
    gap = (logits - data["expected"]).abs().max().item()
    print("EQUAL" if gap <= 1e-5 else f"DIFFERENT by {gap}", type(model).__name__)
    """)


def load_without_hf_posswap(directory: Path, data: Path, auto: str) -> str:
    result = subprocess.run([sys.executable, "-c", LOADER, str(directory), str(data), auto], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize(("family", "scheme", "extend"), [("gpt2", "alibi", 200), ("llama", "t5", None),
                                                          ("bert", "rope", None), ("llama", "rope", None)],
                         ids=["gpt2-alibi-extended", "llama-t5", "bert-rope", "llama-self-extend"])
@pytest.mark.slow
def test_standalone_checkpoint_loads_without_hf_posswap(tmp_path: Path, family, scheme, extend) -> None:
    model = swapped(family, scheme)
    if extend:
        ps.extend_context(model, extend)
    if family == "llama" and scheme == "rope":
        ps.extend_context(model, 256, "self_extend")
    input_ids = torch.randint(3, VOCAB, (1, 120 if family != "bert" else 40))
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
    torch.save({"input_ids": input_ids, "expected": expected}, tmp_path / "io.pt")
    ps.export_standalone(model, tmp_path / "export")
    assert (tmp_path / "export" / "modeling_posswap.py").exists()
    source = (tmp_path / "export" / "modeling_posswap.py").read_text()
    assert not re.search(r"^\s*(import|from)\s+hf_posswap", source, re.MULTILINE)
    auto = "AutoModelForMaskedLM" if family == "bert" else "AutoModelForCausalLM"
    assert "EQUAL" in load_without_hf_posswap(tmp_path / "export", tmp_path / "io.pt", auto)


@pytest.mark.slow
def test_export_cli(tmp_path: Path) -> None:
    model = swapped("gpt2", "t5")
    model.save_pretrained(tmp_path / "saved")
    input_ids = torch.randint(3, VOCAB, (1, 30))
    with torch.no_grad():
        torch.save({"input_ids": input_ids, "expected": model(input_ids=input_ids).logits}, tmp_path / "io.pt")
    result = subprocess.run([sys.executable, "-m", "hf_posswap", "export", str(tmp_path / "saved"),
                             str(tmp_path / "export")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "PosSwapGPT2LMHeadModel" in result.stdout, result.stderr[-2000:]
    assert "EQUAL PosSwapGPT2LMHeadModel" in load_without_hf_posswap(tmp_path / "export", tmp_path / "io.pt",
                                                                     "AutoModelForCausalLM")


def test_exporting_a_native_swap_is_refused(tmp_path: Path) -> None:
    model = make_model("llama")
    ps.swap(model, "rope", rope_theta=5e4)  # written in config.rope_parameters: plain transformers reads it
    with pytest.raises(ps.InvalidConfigError, match="'rope' swap is written in transformers' own config"):
        ps.export_standalone(model, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_exporting_an_unswapped_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ps.InvalidConfigError, match=r"GPT2LMHeadModel carries no hf_posswap swap; save it with "
                       r"model.save_pretrained\(\) instead"):
        ps.export_standalone(make_model("gpt2"), tmp_path)


def test_exporting_a_peft_model_says_to_merge_first(tmp_path: Path) -> None:
    """The exported code carries the swap, not peft's adapters: refused with the fix, before anything is written."""
    from peft import get_peft_model

    model = swapped("llama", "alibi")
    peft_model = get_peft_model(model, ps.lora_config(model, r=2))
    with pytest.raises(ps.InvalidConfigError, match=r"holds peft adapters.*merge_and_unload\(\)"):
        ps.export_standalone(peft_model, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_export_refuses_a_non_empty_directory(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"is not empty\. Choose a new or empty directory, or pass --overwrite"):
        ps.export_standalone(swapped("gpt2", "alibi"), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_export_overwrite_replaces_only_checkpoint_files(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "corpus.txt").write_text("keep")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text("{}")  # a stale index would mislead loading
    ps.export_standalone(swapped("gpt2", "alibi"), tmp_path, overwrite=True, tokenizer=byte_tokenizer())
    names = sorted(p.name for p in tmp_path.iterdir())
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "data" / "corpus.txt").read_text() == "keep"
    assert "model.safetensors.index.json" not in names and "tokenizer.json" in names
    assert not [n for n in names if n.startswith(".")], names
    assert "auto_map" in json.loads((tmp_path / "config.json").read_text())  # the new config replaced the old


def test_export_failing_half_way_leaves_the_old_checkpoint(tmp_path, monkeypatch) -> None:
    model = swapped("gpt2", "alibi")
    ps.export_standalone(model, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}

    def full_disk(directory, *args, **kwargs):
        (tmp_path.joinpath(directory) / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model, "save_pretrained", full_disk)
    with pytest.raises(OutputError, match=r"Could not write .*out'.*No space left on device.*Nothing was changed"):
        ps.export_standalone(model, tmp_path / "out", overwrite=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the staging directory is gone


SAVE_AS_REMOTE_CODE = textwrap.dedent("""
    import sys, json
    sys.modules["hf_posswap"] = None
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
    model.save_pretrained(sys.argv[2])
    again = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[2], trust_remote_code=True)
    print(type(again).__name__, sorted(json.load(open(sys.argv[2] + "/config.json"))["auto_map"]))
    """)


@pytest.mark.slow  # a subprocess that loads remote code
def test_a_saved_export_points_at_code_only_when_it_carries_it(tmp_path: Path) -> None:
    """Loaded by hf_posswap, an export's model does not carry modeling_posswap.py, so its saves drop the auto_map
    naming it (a later trust_remote_code load would find no code); loaded as remote code, transformers copies the
    file and the auto_map stays."""
    from transformers import AutoModelForCausalLM

    ps.export_standalone(swapped("gpt2", "t5"), tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    ps.swap(loaded, "alibi", replace=True)
    loaded.save_pretrained(tmp_path / "resaved")
    assert "auto_map" not in json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert ps.describe(AutoModelForCausalLM.from_pretrained(tmp_path / "resaved")).scheme == "alibi"
    result = subprocess.run([sys.executable, "-c", SAVE_AS_REMOTE_CODE, str(tmp_path / "export"),
                             str(tmp_path / "remote")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "PosSwapGPT2LMHeadModel" in result.stdout and "AutoModelForCausalLM" in result.stdout
    assert (tmp_path / "remote" / "modeling_posswap.py").exists()
