"""A mixed model through the library's other steps: JSON and describe, unswap, context extension, checkpoints,
standalone export, peft, fine-tuning (function and command) and the iRoPE example."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_checkpoint, write_corpus
from mix_models import LAYERS, MIXES, cases, logits, make_model, mixed, tokens

import hf_posswap as ps
from hf_posswap.schemes import scheme_config_from_dict

ROOT = Path(__file__).resolve().parents[2]


def test_json_round_trip_and_layer_listing() -> None:
    mix = ps.LayerMix(default=ps.RopeConfig(rope_theta=500.0), overrides=[(ps.AlibiConfig(trainable_slopes=True), [0]),
                                                                          ("none", [2, 3])])
    assert scheme_config_from_dict(mix.to_dict()) == mix
    assert [s.name for s in mix.layer_schemes(LAYERS)] == ["alibi", "rope", "none", "none"]
    model = make_model("llama")
    ps.swap(model, mix)
    text = str(ps.describe(model))
    assert "rope(rope_theta=500.0" in text and "): 1\n" in text and "- none: 2, 3" in text
    assert "alibi(trainable_slopes=True): 0" in text


@pytest.mark.parametrize("key", cases(list(MIXES), {"llama-irope"}))
def test_unswap_restores_exactly(key: str) -> None:
    family, mix = MIXES[key]
    model = make_model(family)
    before, keys, config = logits(model, tokens(2, 20)), list(model.state_dict()), model.config.to_dict()
    modules = dict(model.named_modules())
    ps.swap(model, mix())
    ps.unswap(model)
    assert torch.equal(logits(model, tokens(2, 20)), before)
    assert list(model.state_dict()) == keys and model.config.to_dict() == config
    assert dict(model.named_modules()) == modules and "forward" not in vars(model.base_model)


def test_extend_context_scales_only_the_rope_layers() -> None:
    model = make_model("llama")
    ps.swap(model, ps.llama4_irope(model, no_rope_layer_interval=2))
    ps.extend_context(model, 256)
    mix = ps.describe(model)
    parts = model._posswap_state.config.parts(LAYERS)
    assert parts[0][0].scaling is not None and parts[0][0].scaling.factor == 4.0 and parts[0][1] == [0, 2]
    assert parts[1][0] == ps.NoPEConfig() and parts[1][1] == [1, 3]
    assert mix.context["max_position_embeddings"] == 256 and model.config.max_position_embeddings == 256
    rope = model.base_model.posswap_positions(0)
    assert rope.rope_type == "yarn"
    long = tokens(1, 200)
    assert torch.isfinite(logits(model, long)).all()
    nope_only = make_model("llama")
    ps.swap(nope_only, ps.LayerMix(default="none", overrides={"alibi": [0]}))
    with pytest.raises(ps.InvalidConfigError, match=r"needs a model with RoPE"):
        ps.extend_context(nope_only, 256, "yarn")
    ps.extend_context(nope_only, 256)  # no RoPE layer: 'lift' only records the length
    assert ps.describe(nope_only).context["method"] == "lift"
    head_mix = make_model("llama")
    ps.swap(head_mix, ps.HeadMix(bias="alibi", rotary="rope", bias_heads=[0, 1]))  # alone: on every layer
    ps.extend_context(head_mix, 256)  # the rotary heads' RoPE is scaled, the ALiBi heads need nothing
    scaled = head_mix._posswap_state.config.default
    assert scaled.rotary.scaling.factor == 4.0 and scaled.bias == ps.AlibiConfig()
    assert torch.isfinite(logits(head_mix, long)).all()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*holds no weights for this native position module")
@pytest.mark.parametrize("key", MIXES)
def test_checkpoint_round_trip_gives_identical_logits(tmp_path: Path, key: str) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    model = mixed(key)
    if key == "llama-irope":
        ps.extend_context(model, 256)
    model.save_pretrained(tmp_path)
    auto = AutoModelForMaskedLM if key.startswith("bert") else AutoModelForCausalLM
    loaded = auto.from_pretrained(tmp_path).eval()
    input_ids = tokens(2, 100 if key == "llama-irope" else 30)
    assert torch.equal(logits(loaded, input_ids), logits(model, input_ids))
    assert ps.describe(loaded).layers == ps.describe(model).layers
    ps.unswap(loaded)
    assert ps.describe(loaded).scheme == "native"


@pytest.mark.slow
@pytest.mark.parametrize("key", ["llama-irope", "llama-headmix-alibi-rope"])
def test_standalone_export_reloads_without_hf_posswap(tmp_path: Path, key: str) -> None:
    from test_export import load_without_hf_posswap

    model = mixed(key)
    ps.extend_context(model, 256)
    input_ids = tokens(1, 120)
    torch.save({"input_ids": input_ids, "expected": logits(model, input_ids)}, tmp_path / "io.pt")
    ps.export_standalone(model, tmp_path / "export")
    assert "EQUAL" in load_without_hf_posswap(tmp_path / "export", tmp_path / "io.pt", "AutoModelForCausalLM")


def test_peft_modules_to_save_copy_is_the_one_used() -> None:
    """LoRA with trainable ALiBi slopes in a mix: peft copies the mix's module; attention must read the copy."""
    from peft import get_peft_model

    model = make_model("llama")
    ps.swap(model, ps.LayerMix(default="rope", overrides=[(ps.AlibiConfig(trainable_slopes=True), [1, 2])]))
    peft_model = get_peft_model(model, ps.lora_config(model))
    input_ids = tokens(1, 16)
    before = logits(peft_model, input_ids)
    wrapper = peft_model.base_model.model.model.posswap_positions
    copy_slopes = wrapper.modules_to_save["default"].parts["1"].slopes
    with torch.no_grad():
        copy_slopes.mul_(4.0)
    assert not torch.allclose(logits(peft_model, input_ids), before, atol=1e-4)


FINETUNES = {"full": {}, "lora": {"lora": True}}


@pytest.mark.slow
@pytest.mark.parametrize("how", FINETUNES)
def test_finetune_trains_a_mixed_model_and_saves_its_position_parameters(tmp_path: Path, how: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_posswap.training import FinetuneConfig, finetune

    save_tiny_checkpoint("llama", tmp_path / "plain")
    start = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    mix = ps.LayerMix(default="rope", overrides=[(ps.AlibiConfig(trainable_slopes=True), [1])])
    ps.swap(start, mix)
    slopes = start.base_model.posswap_positions.parts["1"].slopes.detach().clone()
    start.save_pretrained(tmp_path / "start")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "start" / name).write_bytes((tmp_path / "plain" / name).read_bytes())
    (tmp_path / "corpus").mkdir()
    write_corpus(tmp_path / "corpus", documents=10)
    finetune(FinetuneConfig(model=str(tmp_path / "start"), data=[str(tmp_path / "corpus" / "*.txt")],
                            output=str(tmp_path / "run"), seq_len=64, batch_size=2, steps=3, lr=1e-2, eval_every=0,
                            save_every=3, progress=False, **FINETUNES[how]))
    if how == "lora":
        keys = load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors").keys()
        assert any("posswap_positions" in key and "slopes" in key for key in keys), sorted(keys)
        return
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert ps.describe(trained).layers == ps.describe(start).layers
    assert not torch.equal(trained.base_model.posswap_positions.parts["1"].slopes, slopes)


@pytest.mark.slow
def test_irope_example_runs(tmp_path: Path) -> None:
    """examples/irope_extend.py: iRoPE, 4x extension, fine-tuning, save and reload, on a tiny LLaMA."""
    script = ROOT / "examples" / "irope_extend.py"
    library_lines = [line for line in script.read_text().split("# --- the library part")[1].split("# ---")[0]
                     .splitlines()[1:] if line.strip() and not line.lstrip().startswith(("#", "seq_len"))]
    assert len(library_lines) <= 5, library_lines
    result = subprocess.run([sys.executable, str(script), "--tiny", "--steps", "2", "--seq-len", "64", "--output",
                             str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "layer_mix" in result.stdout and "none + attention temperature" in result.stdout
    assert "extended from 64 to 256 tokens with 'yarn'" in result.stdout


@pytest.mark.slow
def test_finetune_command_swaps_to_a_mix(tmp_path: Path) -> None:
    """``hf-posswap finetune --scheme layer_mix --scheme-option overrides=...`` (options are JSON)."""
    from transformers import AutoModelForCausalLM

    save_tiny_checkpoint("llama", tmp_path / "plain")
    (tmp_path / "corpus").mkdir()
    write_corpus(tmp_path / "corpus", documents=5)
    command = [sys.executable, "-m", "hf_posswap", "finetune", "--model", str(tmp_path / "plain"), "--data",
               str(tmp_path / "corpus" / "*.txt"), "--output", str(tmp_path / "run"), "--scheme", "layer_mix",
               "--scheme-option", 'overrides={"none": [1]}', "--scheme-option", "attn_temperature_tuning=true",
               "--steps", "2", "--seq-len", "32", "--batch-size", "2", "--no-progress"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    layers = ps.describe(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")).layers
    assert list(layers.values()) == [[0], [1]] and "attention temperature" in list(layers)[1]
