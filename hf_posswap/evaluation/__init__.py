"""Measure what a swap or an extension did: perplexity against length and passkey retrieval.

``measure.evaluate`` runs both and returns the results; ``perplexity``, ``passkey`` and ``corpora`` hold the
protocols and the built-in texts, ``checks`` the input checks, ``plots`` the pictures.

>>> results = evaluate(model, tokenizer, [512, 1024], passkey_lengths=[512])  # doctest: +SKIP
"""

from __future__ import annotations

from ..progress import Progress
from .corpora import CORPORA, corpus_text
from .measure import ANSWER_TOKENS, check_passkey_lengths, evaluate
from .passkey import PasskeyResult, passkey_accuracy, passkey_prompt
from .perplexity import MODES, PerplexityResult, perplexity
from .tokenizer import BYTE_VOCAB_SIZE, byte_tokenizer

__all__ = [
    "ANSWER_TOKENS",
    "BYTE_VOCAB_SIZE",
    "CORPORA",
    "MODES",
    "PasskeyResult",
    "PerplexityResult",
    "Progress",
    "corpus_text",
    "byte_tokenizer",
    "check_passkey_lengths",
    "evaluate",
    "passkey_accuracy",
    "passkey_prompt",
    "perplexity",
]
