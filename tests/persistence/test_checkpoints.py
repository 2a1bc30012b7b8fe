"""save_pretrained / from_pretrained of swapped models: exact round trips with hf_posswap, loud failure without."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import CAUSAL_FAMILIES, FAMILIES, NATIVE_PAIRS, SCHEMES, VOCAB, edit_config, swapped
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

import hf_posswap as ps

AUTO = {family: AutoModelForCausalLM if family in CAUSAL_FAMILIES else AutoModelForMaskedLM
        for family in FAMILIES}
INPUT = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))


def logits(model: torch.nn.Module, input_ids: torch.Tensor = INPUT) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


@pytest.mark.parametrize(("family", "scheme"), [pytest.param(f, s, id=f"{f}-{s}") for f in FAMILIES for s in SCHEMES])
def test_round_trip_through_auto_classes(tmp_path: Path, family: str, scheme: str) -> None:
    model = swapped(family, scheme)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (tmp_path / "model.safetensors").exists()
    assert saved["posswap"]["scheme"] == scheme
    native = ps.describe(model).native  # RoPE-like swaps a family's own rotary class expresses
    assert native == ((family, scheme) in NATIVE_PAIRS)
    assert saved["model_type"] == (family if native else f"hf_posswap_{family}")
    loaded = AUTO[family].from_pretrained(tmp_path).eval()
    # a native swap loads as plain transformers, which describe() reports as the model's native RoPE
    assert ps.describe(loaded).scheme == ("native" if native else scheme)
    assert torch.equal(logits(loaded), logits(model))


@pytest.mark.parametrize(
    ("family", "scheme", "length", "method"),
    [("gpt2", "rope", 256, "yarn"), ("gpt2", "rope", 256, "dynamic"), ("gpt2", "learned", 128, "copy"),
     ("bert", "alibi", 200, "lift"), ("bert", "learned", 160, "interpolate"), ("llama", "t5", 300, "lift"),
     ("llama", "rope", 256, "self_extend")],
    ids=lambda value: str(value),
)
def test_extended_models_round_trip(tmp_path: Path, family: str, scheme: str, length: int, method: str) -> None:
    model = swapped(family, scheme)
    ps.extend_context(model, length, method)
    model.save_pretrained(tmp_path)
    loaded = AUTO[family].from_pretrained(tmp_path).eval()
    assert ps.describe(loaded).context == ps.describe(model).context
    assert loaded.config.max_position_embeddings == model.config.max_position_embeddings
    long_input = torch.randint(3, VOCAB, (1, length - 10), generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits(loaded, long_input), logits(model, long_input))


@pytest.mark.slow
def test_without_hf_posswap_a_swapped_checkpoint_refuses_to_load(tmp_path: Path) -> None:
    swapped("gpt2", "alibi").save_pretrained(tmp_path)
    script = textwrap.dedent(f"""
        import sys
        sys.modules["hf_posswap"] = None
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
        except Exception as error:
            print("REFUSED:", error)
        else:
            print("LOADED SILENTLY")
        """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "REFUSED:" in result.stdout and "hf_posswap_gpt2" in result.stdout, result.stdout + result.stderr[-2000:]


def test_unswapped_model_saves_as_the_plain_family(tmp_path: Path) -> None:
    model = swapped("gpt2", "alibi")
    model.save_pretrained(tmp_path / "swapped")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "swapped")
    ps.unswap(loaded)
    assert type(loaded.config).__name__ == "GPT2Config"
    assert loaded.config.model_type == "gpt2" and not hasattr(loaded.config, "posswap")


def _saved(tmp_path: Path, family: str = "gpt2", scheme: str = "alibi") -> Path:
    swapped(family, scheme).save_pretrained(tmp_path)
    return tmp_path


def test_missing_weight_file(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(OSError, match=r"no file named model.safetensors"):
        AutoModelForCausalLM.from_pretrained(path)


def test_truncated_weight_file(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(Exception, match=r"(?i)incomplete|truncat|invalid|deserializ|header|metadata"):
        AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize(
    ("record", "message"),
    [("alibi", r"config.posswap record is malformed: expected a dict with a string 'scheme', got 'alibi'"),
     ({"scheme": "alibbi"}, r"Unknown position scheme 'alibbi'"),
     ({"scheme": "t5", "num_buckets": 1}, r"num_buckets must be an integer >= 2, got 1"),
     ({"scheme": "alibi", "version": "two"}, r"config.posswap.version must be an integer, got 'two'")],
    ids=["not-a-dict", "unknown-scheme", "bad-value", "bad-version"],
)
def test_malformed_records(tmp_path: Path, record, message: str) -> None:
    path = _saved(tmp_path)
    edit_config(path, lambda config: config.__setitem__("posswap", record))
    with pytest.raises(ps.PosSwapError, match=message):
        AutoModelForCausalLM.from_pretrained(path)


def test_shapes_that_do_not_match(tmp_path: Path) -> None:
    path = _saved(tmp_path, scheme="learned")
    edit_config(path, lambda config: config["posswap"].__setitem__("max_positions", 100))
    with pytest.raises(ps.InvalidConfigError, match=r"The checkpoint's weights do not match the swap recorded in "
                       r"its config.posswap \(see the loading report above for the keys\)"):
        AutoModelForCausalLM.from_pretrained(path)


def test_a_newer_record_warns_and_loads_what_is_known(tmp_path: Path) -> None:
    model = swapped("gpt2", "t5")
    model.save_pretrained(tmp_path)

    def newer(config: dict) -> None:
        config["posswap"].update(version=99, future_option=True)

    edit_config(tmp_path, newer)
    with pytest.warns(UserWarning, match=r"newer hf_posswap") as record:
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert any("future_option" in str(w.message) for w in record)
    assert torch.equal(logits(loaded.eval()), logits(model))
