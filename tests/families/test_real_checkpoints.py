"""Real checkpoints from docs/benchmarks.md swap to every scheme and run forward (``pytest -m slow``)."""

from __future__ import annotations

import pytest
import torch
from conftest import SCHEMES, refuses

import hf_posswap as ps

pytestmark = pytest.mark.slow

checkpoints = pytest.importorskip("hf_posswap.persistence.offline_checkpoints")


@pytest.fixture(scope="module")
def minilm():
    from transformers import AutoModel, AutoTokenizer

    try:
        path = checkpoints.minilm_dir()
    except checkpoints.CheckpointNotInstalledError as error:
        pytest.skip(str(error))
    return AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        path = checkpoints.smollm2_dir()
    except checkpoints.CheckpointNotInstalledError as error:
        pytest.skip(str(error))
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_minilm_swaps_to_every_scheme(minilm, scheme: str) -> None:
    model, tokenizer = minilm
    batch = tokenizer(["Positions matter.", "A longer sentence about positional encodings in BERT."],
                      padding=True, return_tensors="pt")
    with torch.no_grad():
        before = model(**batch).last_hidden_state
        if refuses("bert", scheme):  # causal-only schemes (xpos): refused before any edit, model unchanged
            with pytest.raises(ps.InvalidConfigError, match="causal"):
                ps.swap(model, scheme)
            assert torch.equal(model(**batch).last_hidden_state, before)
            return
        ps.swap(model, scheme)
        try:
            after = model(**batch).last_hidden_state
            long_ids = torch.randint(1000, 2000, (1, 600))  # past the 512-position table
            if scheme != "learned":
                assert torch.isfinite(model(input_ids=long_ids).last_hidden_state).all()
        finally:
            ps.unswap(model)
    assert torch.isfinite(after).all() and after.shape == before.shape
    if scheme == "learned":
        assert torch.equal(after, before)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_smollm2_swaps_to_every_scheme(smollm2, scheme: str) -> None:
    model, tokenizer = smollm2
    input_ids = tokenizer("def add(a, b):\n    return a + b\n\nprint(add(2, 3))", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        before = model(input_ids=input_ids).logits
        ps.swap(model, scheme)
        try:
            after = model(input_ids=input_ids).logits
        finally:
            ps.unswap(model)
        assert torch.equal(model(input_ids=input_ids).logits, before)
    assert torch.isfinite(after).all()
    if scheme == "rope":  # its own theta: the identity
        assert torch.equal(after, before)


def test_converted_smollm2_matches_the_gguf_load(smollm2) -> None:
    from transformers import AutoModelForCausalLM

    model, tokenizer = smollm2
    gguf = checkpoints.smollm2_gguf()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    input_ids = tokenizer("The quick brown fox", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(input_ids=input_ids).logits, reference(input_ids=input_ids).logits)


def test_example_script_runs(minilm, smollm2) -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "swap_real_checkpoints.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MiniLM   none: cosine('the dog bit the man', 'the man bit the dog') = 1.0000" in result.stdout
    assert "identical logits: True" in result.stdout


def test_smollm2_extended_with_yarn_reloads_in_vanilla_transformers(smollm2, tmp_path) -> None:
    import subprocess
    import sys

    model, tokenizer = smollm2
    input_ids = tokenizer("def main():\n    return 0\n", return_tensors="pt")["input_ids"]
    ps.extend_context(model, 32_768, "yarn")
    try:
        assert model.config.rope_parameters["factor"] == 4.0
        with torch.no_grad():
            expected = model(input_ids=input_ids).logits
        model.save_pretrained(tmp_path / "ckpt")
    finally:
        ps.unswap(model)
    torch.save({"input_ids": input_ids, "expected": expected}, tmp_path / "io.pt")
    script = (
        "import sys; sys.modules['hf_posswap'] = None\n"
        "import torch\nfrom transformers import AutoModelForCausalLM\n"
        f"data = torch.load({str(tmp_path / 'io.pt')!r})\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'ckpt')!r}).eval()\n"
        "with torch.no_grad():\n    logits = model(input_ids=data['input_ids']).logits\n"
        "assert torch.equal(logits, data['expected'])\nprint('VANILLA_OK', model.config.rope_parameters['rope_type'])\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert "VANILLA_OK yarn" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("method", ["interpolate", "copy"])
def test_minilm_table_grows_past_512(minilm, method: str) -> None:
    model, _ = minilm
    ps.extend_context(model, 1024, method)
    try:
        with torch.no_grad():
            hidden = model(input_ids=torch.randint(1000, 2000, (1, 900))).last_hidden_state
        assert torch.isfinite(hidden).all() and hidden.shape[1] == 900
    finally:
        ps.unswap(model)
    assert model.config.max_position_embeddings == 512


def test_finetune_example_runs(smollm2, tmp_path) -> None:
    """examples/finetune_smollm2_alibi.py end to end, with 2 steps per run to keep CI short."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "finetune_smollm2_alibi.py"
    result = subprocess.run([sys.executable, str(script), "--steps", "2", "--seq-len", "64", "--output",
                             str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ALiBi after 2 steps, distill objective (reloaded)" in result.stdout


def test_demo_runs_with_short_lengths(smollm2, tmp_path) -> None:
    """The main job's code path (the README command runs it at full size)."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "hf_posswap", "demo", "--schemes", "alibi", "--length", "64",
               "--extension-lengths", "256", "512", "--output", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "plain transformers reloads it with identical logits: True" in result.stdout
    assert (tmp_path / "perplexity_vs_length.png").read_bytes().startswith(b"\x89PNG")
