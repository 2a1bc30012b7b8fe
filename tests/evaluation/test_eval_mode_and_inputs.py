"""The measurements run in eval mode and give the model its own mode back (also when they raise), and take token
ids in the shapes users of HF tooling hold ([N], [1, N], a list), refusing any other shape in one clear error."""

from __future__ import annotations

import pytest
import torch
from conftest import byte_tokenizer
from torch import nn

import hf_posswap as ps
from hf_posswap.evaluation import evaluate, passkey_accuracy, perplexity

TOKENS = torch.randint(0, 7, (200,), generator=torch.Generator().manual_seed(0))


class Output:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class ModeRecordingBigram(nn.Module):
    """A bigram table behind a dropout layer (which records the mode of every forward pass); with ``fail`` set, a
    forward pass raises after recording."""

    def __init__(self, vocab: int, fail: bool = False) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(1)))
        self.dropout = nn.Dropout(0.5)
        self.frozen = nn.Dropout(0.5).eval()  # a part the caller keeps in eval mode while training the rest
        self.fail, self.modes = fail, []

    def forward(self, input_ids: torch.Tensor) -> Output:
        self.modes.append(self.training or self.dropout.training)
        if self.fail:
            raise RuntimeError("forward failed")
        return Output(self.dropout(self.table[input_ids]))


def _measurements(model: nn.Module) -> list:
    """Each measurement as a call, with settings small enough for a bigram model."""
    tokenizer = byte_tokenizer()
    return [lambda: perplexity(model, TOKENS, 50),
            lambda: passkey_accuracy(model, tokenizer, 120, 0.5, trials=1),
            lambda: evaluate(model, tokenizer, [64], text="plain words " * 40, progress=False)]


@pytest.mark.parametrize("which", ["perplexity", "passkey_accuracy", "evaluate"])
def test_measurements_run_in_eval_mode_and_give_the_training_mode_back(which: str) -> None:
    """Dropout would make the numbers differ call to call; a training loop that evaluates mid-run must keep it."""
    model = ModeRecordingBigram(259).train()
    model.frozen.eval()
    _measurements(model)[["perplexity", "passkey_accuracy", "evaluate"].index(which)]()
    assert model.modes and not any(model.modes), "a forward pass ran in train mode"
    assert model.training and model.dropout.training and not model.frozen.training


def test_evaluate_gives_the_training_mode_back_when_a_forward_pass_raises() -> None:
    """evaluate switches the model to eval mode itself; an error half-way must not leave it there."""
    model = ModeRecordingBigram(259, fail=True).train()
    with pytest.raises(RuntimeError, match="forward failed"):
        evaluate(model, byte_tokenizer(), [64], text="plain words " * 40, progress=False)
    assert model.training and model.dropout.training


@pytest.mark.parametrize("shape", ["one row", "list"])
def test_a_one_row_tensor_and_a_list_are_the_same_stream_as_a_flat_tensor(shape: str) -> None:
    """``tokenizer(text, return_tensors="pt").input_ids`` is [1, N]; a tokenizer without it gives a list."""
    model = ModeRecordingBigram(7).eval()
    given = TOKENS[None] if shape == "one row" else TOKENS.tolist()
    for mode in ("windows", "sliding", "tail"):
        expected = perplexity(model, TOKENS, 50, mode, stride=20, tail_from=30)
        assert perplexity(model, given, 50, mode, stride=20, tail_from=30) == expected


@pytest.mark.parametrize(("token_ids", "described"), [
    (TOKENS.reshape(2, 100), r"got a tensor of dtype int64 and shape \[2, 100\]"),
    (TOKENS.float(), r"got a tensor of dtype float32 and shape \[200\]"),
    (TOKENS[:0], r"got a tensor of dtype int64 and shape \[0\]"),
    (TOKENS.reshape(1, 1, 200), r"got a tensor of dtype int64 and shape \[1, 1, 200\]"),
    ([1.5, 2.0], r"got a list holding 1.5"),
    ("some text", r"got a str"),
], ids=["two-rows", "float", "empty", "3-d", "list-of-floats", "text"])
def test_other_token_shapes_are_refused_in_one_clear_error(token_ids, described) -> None:
    with pytest.raises(ps.InvalidConfigError, match=r"token_ids must be a 1-D tensor of token ids \[N\], a \[1, N\] "
                       rf"tensor .* or a list of ints, {described}"):
        perplexity(ModeRecordingBigram(7), token_ids, 50)
