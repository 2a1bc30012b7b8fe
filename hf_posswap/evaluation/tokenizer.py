"""A byte-level tokenizer built offline: 256 byte tokens + ``<eos>``, ``[MASK]``, ``[PAD]`` (259 ids). Used by the
tiny-model benchmark (docs/benchmarks.md Protocol A) and the tests, so nothing is downloaded."""

from __future__ import annotations

BYTE_VOCAB_SIZE = 259


def byte_tokenizer():
    """A ``PreTrainedTokenizerFast`` mapping each UTF-8 byte to one id; ``decode`` inverts ``encode`` exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    for special in ("<eos>", "[MASK]", "[PAD]"):
        vocab[special] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", mask_token="[MASK]", pad_token="[PAD]"
    )
