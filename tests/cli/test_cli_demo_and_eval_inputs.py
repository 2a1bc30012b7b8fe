"""``demo`` and ``eval`` on inputs their defaults do not expect: a demo checkpoint without RoPE or with a short
learned table, a demo output that cannot take the extended checkpoint (each refused before the first forward pass);
``eval`` of a checkpoint saved in bf16 (evaluated as saved unless ``--dtype`` says otherwise, and the results say
which), and ``--text`` given no files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_checkpoint
from transformers import AutoModelForCausalLM

import hf_posswap.cli.demo as demo
from hf_posswap.cli.main import main


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("demo_eval_inputs")
    for family in ("llama", "gpt2"):
        save_tiny_checkpoint(family, root / family)
    bf16 = AutoModelForCausalLM.from_pretrained(root / "llama").to(torch.bfloat16)
    bf16.save_pretrained(root / "llama-bf16")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / "llama-bf16" / name).write_bytes((root / "llama" / name).read_bytes())
    return root


@pytest.fixture
def no_forward_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the demo gets as far as its first measurement."""
    def refuse(*args, **kwargs):
        raise AssertionError("the demo measured before the bad input was refused")

    monkeypatch.setattr(demo, "scheme_rows", refuse)


def _one_line(capsys: pytest.CaptureFixture, code: int) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("hf-posswap")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_demo_checkpoint_without_rope_is_refused_before_measuring(checkpoints, tmp_path, capsys,
                                                                     no_forward_pass) -> None:
    code = main(["demo", "--checkpoint", str(checkpoints / "gpt2"), "--schemes", "alibi", "--length", "32",
                 "--extension-lengths", "128", "--output", str(tmp_path / "out"), "--no-progress"])
    line = _one_line(capsys, code)
    assert "the context-extension part cannot extend it with YaRN" in line and "needs a model with RoPE" in line
    assert "skip that part with --extension-lengths and no lengths" in line


def test_a_demo_length_past_a_learned_table_is_refused_before_measuring(checkpoints, tmp_path, capsys,
                                                                        no_forward_pass) -> None:
    code = main(["demo", "--checkpoint", str(checkpoints / "gpt2"), "--schemes", "alibi", "--length", "100",
                 "--extension-lengths", "--output", str(tmp_path / "out"), "--no-progress"])
    assert "Length 100 exceeds the model's learned position table (transformer.wpe: 64 positions)" in _one_line(
        capsys, code)


def test_a_demo_output_that_cannot_take_the_checkpoint_is_refused_before_loading(checkpoints, tmp_path, capsys,
                                                                                 monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the demo loaded its checkpoint before the bad output was refused")

    monkeypatch.setattr(demo, "run", refuse)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "llama-yarn-32k").write_text("a file of mine")  # where the extended checkpoint goes
    code = main(["demo", "--checkpoint", str(checkpoints / "llama"), "--output", str(tmp_path / "out")])
    assert "llama-yarn-32k' is an existing file, not a directory" in _one_line(capsys, code)
    assert (tmp_path / "out" / "llama-yarn-32k").read_text() == "a file of mine"
    assert demo.saved_name(None) == "smollm2-yarn-32k"  # the built-in checkpoint keeps its documented folder


def test_eval_runs_in_the_saved_dtype_unless_told_and_says_which(checkpoints, tmp_path, capsys) -> None:
    common = ["eval", "--model", str(checkpoints / "llama-bf16"), "--lengths", "32", "--corpus", "pydoc",
              "--max-windows", "1", "--no-progress"]
    assert main([*common, "--output", str(tmp_path / "auto.json")]) == 0
    assert main([*common, "--dtype", "float32", "--output", str(tmp_path / "fp32.json")]) == 0
    saved = json.loads((tmp_path / "auto.json").read_text())
    wide = json.loads((tmp_path / "fp32.json").read_text())
    assert (saved["dtype"], wide["dtype"]) == ("bfloat16", "float32")
    # the same bf16 weights, computed in float32: close to the bf16 run's number, and not the same run
    assert saved["perplexity"][0]["perplexity"] == pytest.approx(wide["perplexity"][0]["perplexity"], rel=0.05)


def test_eval_text_without_files_is_a_usage_error(checkpoints, capsys) -> None:
    """``--text`` with nothing after it (an empty shell variable) would otherwise evaluate the built-in corpus."""
    assert main(["eval", "--model", str(checkpoints / "llama"), "--lengths", "32", "--text"]) == 2
    assert "argument --text: expected at least one argument" in capsys.readouterr().err


def test_eval_tokenizes_its_text_once(checkpoints, tmp_path, capsys, monkeypatch) -> None:
    """The length check before loading and the evaluation after it read the same tokens: a corpus of a few MB is
    tokenized once (``--corpus stdlib`` with SmolLM2's tokenizer took 2.7 s a time)."""
    import hf_posswap.persistence.loading as loading
    from hf_posswap.evaluation.corpora import corpus_text

    text = corpus_text("pydoc")
    calls = []
    load_tokenizer = loading.load_tokenizer

    def counted(*args, **kwargs):
        tokenizer = load_tokenizer(*args, **kwargs)
        original = type(tokenizer).__call__

        def call(self, *call_args, **call_kwargs):
            calls.append(call_args[0] == text if call_args and isinstance(call_args[0], str) else False)
            return original(self, *call_args, **call_kwargs)

        monkeypatch.setattr(type(tokenizer), "__call__", call)
        return tokenizer

    monkeypatch.setattr(loading, "load_tokenizer", counted)
    assert main(["eval", "--model", str(checkpoints / "llama"), "--lengths", "32", "--corpus", "pydoc",
                 "--max-windows", "1", "--no-progress", "--output", str(tmp_path / "out.json")]) == 0
    assert calls.count(True) == 1, calls


def test_a_tokenizer_changed_between_two_evaluations_is_asked_again(checkpoints) -> None:
    """The tokens are remembered only within one CLI command: a library caller that changes the tokenizer between
    two ``evaluate`` calls gets the new tokens."""
    from transformers import AutoTokenizer

    from hf_posswap.evaluation.corpora import corpus_text, text_token_ids, tokenize_once

    tokenizer = AutoTokenizer.from_pretrained(checkpoints / "llama")
    text = corpus_text("pydoc")[:2000]
    before = text_token_ids(tokenizer, text)
    tokenizer.add_tokens(["the"])  # every "the" is now one new token: other ids, another count
    assert len(text_token_ids(tokenizer, text)) < len(before)
    with tokenize_once():
        assert text_token_ids(tokenizer, text) is text_token_ids(tokenizer, text)
        assert text_token_ids(tokenizer, text) is not text_token_ids(tokenizer, text[:-1])
