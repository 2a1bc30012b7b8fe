"""Issue 9 (items 8, 9, 11): evaluation settings are checked before any work; export and checkpoint writes never
lose files and are atomic."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import byte_tokenizer, make_model, swapped
from test_evaluation import TOKENS, UniformModel

import hf_posswap as ps
from hf_posswap.evaluation import evaluate, passkey_accuracy, passkey_prompt, perplexity
from hf_posswap.evaluation.plots import load_runs
from hf_posswap.persistence.saving import OutputError


class CountingModel(UniformModel):
    """A uniform model that counts its forward passes."""

    calls = 0

    def forward(self, input_ids: torch.Tensor):
        CountingModel.calls += 1
        return super().forward(input_ids)


# ---- item 8: evaluation -----------------------------------------------------------------------------------------

def test_max_windows_zero_means_all_windows_not_zero_tokens() -> None:
    every = perplexity(UniformModel(7), TOKENS, 50, max_windows=None)
    zero = perplexity(UniformModel(7), TOKENS, 50, max_windows=0)
    assert zero.windows == every.windows == 4 and zero.tokens == every.tokens > 0
    assert math.isclose(zero.perplexity, 7.0, rel_tol=1e-5)
    with pytest.raises(ps.InvalidConfigError, match=r"max_windows must be an integer >= 0 .*got -1"):
        perplexity(UniformModel(7), TOKENS, 50, max_windows=-1)


def test_evaluate_refuses_an_encoder() -> None:
    with pytest.raises(ps.InvalidConfigError, match=r"BertForMaskedLM is not a causal language model"):
        evaluate(make_model("bert"), byte_tokenizer(), [32], corpus="pydoc", progress=False)


@pytest.mark.parametrize(("length", "depth", "trials", "message"), [
    (0, 0.5, 1, r"passkey length must be a positive number of tokens, got 0"),
    (-5, 0.5, 1, r"passkey length must be a positive number of tokens, got -5"),
    (200, 1.5, 1, r"passkey depth must be in \[0, 1\] \(0 = start, 1 = end\), got 1.5"),
    (200, -0.1, 1, r"passkey depth must be in \[0, 1\].*got -0.1"),
    (200, 0.5, 0, r"Passkey trials must be an integer >= 1, got 0"),
])
def test_passkey_refuses_impossible_settings(length, depth, trials, message) -> None:
    with pytest.raises(ps.InvalidConfigError, match=message):
        passkey_accuracy(UniformModel(259), byte_tokenizer(), length, depth, trials)


@pytest.mark.parametrize(("settings", "message"), [
    ({"passkey_lengths": [0]}, r"Passkey lengths \(--passkey-lengths\) must be integers >= 1, got 0"),
    ({"passkey_lengths": [300], "depths": [2.0]}, r"depths \(--depths\) must be in \[0, 1\].*got 2.0"),
    ({"passkey_lengths": [300], "depths": [float("nan")]}, r"must be in \[0, 1\].*got nan"),
    ({"passkey_lengths": [300], "trials": 0}, r"Passkey trials \(--trials\) must be integers >= 1, got 0"),
    ({"passkey_lengths": [20]}, r"Passkey length 20 is shorter than the needle and the question alone"),
    ({"lengths": [32, 64], "modes": ["windows", "tail"], "tail_from": 48},
     r"every length must exceed it; length 32 does not"),
    ({"lengths": [32, 64], "modes": ["sliding"], "stride": 40}, r"The sliding stride 40 exceeds length 32"),
    ({"lengths": [1]}, r"must be integers >= 2, got 1"),
    ({"lengths": []}, r"Nothing to measure"),
    ({"lengths": [32, 10**7]}, r"Length 10000000 needs at least 10000000 tokens of text"),
])
def test_evaluate_checks_every_setting_before_the_first_forward(settings, message) -> None:
    CountingModel.calls = 0
    with pytest.raises(ps.InvalidConfigError, match=message):
        evaluate(CountingModel(259), byte_tokenizer(), **{"lengths": [32], "corpus": "pydoc", "progress": False,
                                                           **settings})
    assert CountingModel.calls == 0, "a bad setting was found only after measuring"


def test_lengths_past_a_learned_table_are_refused_before_running() -> None:
    model = make_model("gpt2")  # learned table of 64 positions
    with pytest.raises(ps.InvalidConfigError, match=r"Length 100 exceeds the model's learned position table "
                       r"\(transformer.wpe: 64 positions\).*hf-posswap extend --to 100"):
        evaluate(model, byte_tokenizer(), [100], corpus="pydoc", progress=False)


def test_evaluate_refuses_empty_text() -> None:
    with pytest.raises(ps.InvalidConfigError, match=r"The evaluation text is empty"):
        evaluate(UniformModel(259), byte_tokenizer(), [8], text="  \n", progress=False)


def test_passkey_prompt_refuses_a_bad_depth() -> None:
    with pytest.raises(ps.InvalidConfigError, match=r"got 3"):
        passkey_prompt(byte_tokenizer(), 200, 3, "12345")


@pytest.mark.slow
def test_evaluate_output_is_checked_first_and_written_atomically(tmp_path) -> None:
    CountingModel.calls = 0
    with pytest.raises(OutputError, match=r"the directory .*no-such-dir.* does not exist; create it first"):
        evaluate(CountingModel(259), byte_tokenizer(), [32], corpus="pydoc", output=tmp_path / "no-such-dir" / "r.json",
                 progress=False)
    assert CountingModel.calls == 0
    evaluate(CountingModel(259), byte_tokenizer(), [32], corpus="pydoc", max_windows=1, output=tmp_path / "r.json",
             progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left beside it


@pytest.mark.parametrize(("content", "message"), [
    (None, r"Results file .*missing.json' does not exist"),
    ("{not json", r"is not valid JSON \(Expecting property name"),
    ('{"passkey": []}', r"is not an hf-posswap eval results file"),
    ('{"perplexity": [{"length": 8, "mode": "sliding", "perplexity": 3.0}]}',
     r"has no perplexity rows of mode 'windows' \(it has: sliding\)"),
])
def test_load_runs_names_the_bad_file(tmp_path, content, message) -> None:
    path = tmp_path / "missing.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ps.PosSwapError, match=message):
        load_runs([f"run={path}"], mode="windows")


# ---- item 9: export never deletes what it did not write ---------------------------------------------------------

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
