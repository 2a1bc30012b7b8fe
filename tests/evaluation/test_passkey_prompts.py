"""Passkey prompts are as long as asked, counted as the model sees them (``tokenizer(prompt)``, special tokens
included), with the needle at its depth and one space between the pieces; a length that cannot hold the needle is
refused by the public functions as by ``evaluate``."""

from __future__ import annotations

import pytest
import torch
from conftest import byte_tokenizer
from torch import nn

import hf_posswap as ps
from hf_posswap.evaluation import passkey_accuracy, passkey_prompt
from hf_posswap.evaluation.passkey import FILLER, MAX_SHIFT, QUESTION, passkey_keys

LENGTHS = (120, 163, 200, 257, 400, 1000, 2048)
DEPTHS = (0.0, 0.1, 0.25, 0.5, 0.77, 1.0)


def _bpe_tokenizer():
    """A byte-level BPE tokenizer with real merges (words with their leading space, as GPT-2's and SmolLM2's),
    trained here on the filler and the needle so nothing is downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    text = [FILLER * 20, "The pass key is 12345. Remember it. 12345 is the pass key. " + QUESTION]
    backend.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def _bos_tokenizer():
    """The byte tokenizer, adding ``<s>`` in front of every text as LLaMA's tokenizers do."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    base = byte_tokenizer()
    backend = base.backend_tokenizer
    backend.add_special_tokens(["<s>"])
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<eos>")


def _check_prompt(tokenizer, ids: torch.Tensor, length: int, depth: float, key: str, tolerance: int) -> None:
    """The prompt's length, that it is what ``tokenizer(text)`` gives for its text, its spacing and its depth."""
    assert length - tolerance <= ids.numel() <= length, (length, depth, ids.numel())
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer(text)["input_ids"] == ids.tolist()  # the ids the model would get from the text
    assert "  " not in text and text.endswith(" " + QUESTION) and text.count(key) == 2
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    filler = len(text) - len(needle) - len(QUESTION)  # characters of filler (and the joining spaces)
    # the needle sits at its depth of the filler, give or take the few filler tokens it may move to fit the length
    assert abs(text.index(needle) - depth * filler) <= 0.02 * filler + MAX_SHIFT * 6


@pytest.mark.parametrize("length", LENGTHS)
def test_a_bpe_prompt_has_exactly_the_requested_tokens(length: int) -> None:
    """Filler repeats and the joins merge under BPE: counting the pieces apart made prompts several percent short."""
    tokenizer = _bpe_tokenizer()
    for depth in DEPTHS:
        for key in passkey_keys(length, depth, 2):
            _check_prompt(tokenizer, passkey_prompt(tokenizer, length, depth, key), length, depth, key, tolerance=0)


@pytest.mark.parametrize("length", LENGTHS)
def test_a_byte_prompt_is_exact_or_one_short_with_the_needle_first_or_last(length: int) -> None:
    """Byte tokens: the needle inside the filler hits the length exactly; first or last, a space the join strips can
    leave it one token short (the stated tolerance), never more, and never a double space before the question."""
    tokenizer = byte_tokenizer()
    for depth in DEPTHS:
        for key in passkey_keys(length, depth, 2):
            ids = passkey_prompt(tokenizer, length, depth, key)
            _check_prompt(tokenizer, ids, length, depth, key, tolerance=0 if 0 < depth < 1 else 1)


def test_a_prompt_starts_with_the_bos_token_that_tokenizer_text_adds() -> None:
    """Perplexity reads ``tokenizer(text)``, which adds BOS where the tokenizer does; the passkey prompt does too,
    and the BOS counts in the length."""
    tokenizer = _bos_tokenizer()
    for depth in (0.0, 0.5, 1.0):
        ids = passkey_prompt(tokenizer, 300, depth, "12345")
        assert ids[0] == tokenizer.bos_token_id and (ids == tokenizer.bos_token_id).sum() == 1
        _check_prompt(tokenizer, ids, 300, depth, "12345", tolerance=0 if 0 < depth < 1 else 1)


class _NoForward(nn.Module):
    """A model that must not run."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor):
        raise AssertionError("a forward pass ran for a prompt that cannot be built")


@pytest.mark.parametrize("length", [10, 95])
def test_passkey_accuracy_refuses_a_length_below_the_needle_and_question(length: int) -> None:
    """The prompt would be longer than the length it reports; evaluate and the CLI refuse it the same way."""
    with pytest.raises(ps.InvalidConfigError, match=rf"Passkey length {length} is shorter than the needle and the "
                       r"question alone \(96 tokens\); use passkey lengths >= 96"):
        passkey_accuracy(_NoForward(), byte_tokenizer(), length, 0.5, trials=2)
    with pytest.raises(ps.InvalidConfigError, match=rf"Passkey length {length} is shorter.*>= 96"):
        passkey_prompt(byte_tokenizer(), length, 0.5, "12345")


@pytest.mark.slow  # SmolLM2's tokenizer comes with its converted checkpoint (converted once, ~30 s)
def test_a_smollm2_prompt_has_exactly_the_requested_tokens() -> None:
    checkpoints = pytest.importorskip("hf_posswap.persistence.offline_checkpoints")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(checkpoints.smollm2_dir())
    except checkpoints.CheckpointNotInstalledError as error:
        pytest.skip(str(error))
    for length in (512, 2048, 2100, 8192):
        for depth in (0.0, 0.5, 1.0):
            key = passkey_keys(length, depth, 1)[0]
            _check_prompt(tokenizer, passkey_prompt(tokenizer, length, depth, key), length, depth, key, tolerance=0)
