"""A LLaMA-like model swapped to RoPE is plain transformers: it saves and reloads without hf_posswap."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, make_model

import hf_posswap as ps


@pytest.mark.slow
def test_rope_swap_is_written_into_rope_parameters_and_reloads_in_vanilla_transformers(tmp_path: Path) -> None:
    model = make_model("llama")
    ps.swap(model, ps.RopeConfig(rope_theta=2_500.0))
    assert model.config.rope_parameters == {"rope_type": "default", "rope_theta": 2_500.0}
    input_ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
    model.save_pretrained(tmp_path / "ckpt")
    torch.save({"input_ids": input_ids, "expected": expected}, tmp_path / "io.pt")
    # A fresh interpreter where hf_posswap cannot be imported at all.
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["hf_posswap"] = None  # any import of it fails
        import torch
        from transformers import AutoModelForCausalLM
        data = torch.load({str(tmp_path / "io.pt")!r})
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "ckpt")!r}).eval()
        assert model.config.rope_parameters["rope_theta"] == 2500.0, model.config.rope_parameters
        with torch.no_grad():
            logits = model(input_ids=data["input_ids"]).logits
        # another process may sum in another BLAS order: 1e-5, far below what a position change does
        torch.testing.assert_close(logits, data["expected"], rtol=0, atol=1e-5)
        print("VANILLA_OK")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "VANILLA_OK" in result.stdout, result.stderr[-3000:]


def test_different_theta_changes_logits() -> None:
    model = make_model("llama")
    input_ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=input_ids).logits
        ps.swap(model, ps.RopeConfig(rope_theta=50.0))
        after = model(input_ids=input_ids).logits
    assert not torch.allclose(before, after, atol=1e-4)
