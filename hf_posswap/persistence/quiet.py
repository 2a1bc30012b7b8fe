"""Hide library messages that are noise for hf_posswap's users: each by its exact text, only around the call that
triggers it, never globally (a user's own logging and warning settings stay as they are).

What is hidden, and why it is safe to hide:

- transformers 5.x deprecation warnings for ``is_gradient_checkpointing``, which peft reads in every
  ``PeftModel`` (hf_posswap itself calls the new ``activation_checkpointing_enable``);
- accelerate's "Removed shared tensor ... while saving" for tied weights (an LM head tied to the embeddings) in a
  training checkpoint: the tie is rebuilt when the checkpoint loads;
- transformers' "You are using a model of type gpt2 to instantiate a model of type hf_posswap_gpt2", logged when
  peft reads the unswapped base's config through the swapped model's config class to compare vocabulary sizes;
- transformers' "`loss_type=None` was set in the config but it is unrecognized", logged when a model whose class
  name has no known loss suffix (``GPT2LMHeadModel``) is trained, though nothing was set: the causal-LM loss it
  falls back to is the right one;
- DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
  logged when accelerate or transformers imports DeepSpeed (an optional extra) while a command saves or trains, on
  every machine where torch sees no CUDA: the command runs on the CPU there all the same, and ``hf-posswap doctor``
  says which devices torch sees. Hidden around a command the ``hf-posswap`` program runs, not in library calls.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator

#: peft reads the deprecated alias of ``is_activation_checkpointing`` (transformers 5.x)
GRADIENT_CHECKPOINTING_ALIAS = r"`is_gradient_checkpointing` is deprecated"
#: accelerate's note when it drops the second name of a tied tensor from a safetensors checkpoint
SHARED_TENSOR_NOTE = r"Removed shared tensor .* while saving"
#: transformers' note when a base model's config is read through the swapped model's config class
BASE_CONFIG_NOTE = r"model of type `(\w+)` to instantiate a model of type `hf_posswap_\1`"
#: transformers' note when a model class's name does not say its loss (GPT2LMHeadModel)
LOSS_TYPE_NOTE = r"^`loss_type=None` was set in the config but it is unrecognized"
#: DeepSpeed's note, when it is imported on a machine where torch sees no CUDA
DEEPSPEED_CPU_NOTE = r"^Setting accelerator to CPU\. If you have GPU or other accelerator, we were unable to detect it"


@contextlib.contextmanager
def hidden_logs(logger_name: str, *patterns: str) -> Iterator[list[logging.LogRecord]]:
    """Inside the block, drop the records of ``logger_name`` whose message matches one of ``patterns`` (regular
    expressions, searched). Yields the list of dropped records, so a caller can still let them through."""
    expressions = [re.compile(pattern) for pattern in patterns]
    dropped: list[logging.LogRecord] = []

    def keep(record: logging.LogRecord) -> bool:
        if any(expression.search(record.getMessage()) for expression in expressions):
            dropped.append(record)
            return False
        return True

    logger = logging.getLogger(logger_name)
    logger.addFilter(keep)
    try:
        yield dropped
    finally:
        logger.removeFilter(keep)


def release(records: list[logging.LogRecord]) -> None:
    """Let records that :func:`hidden_logs` held back through after all (to the handlers they were meant for)."""
    for record in records:
        logging.getLogger(record.name).handle(record)


@contextlib.contextmanager
def hidden_warnings(pattern: str, category: type[Warning] = FutureWarning) -> Iterator[None]:
    """Inside the block, ignore warnings of ``category`` whose message matches ``pattern`` (from its start)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=pattern, category=category)
        yield


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """Around ``get_peft_model`` / ``PeftModel.from_pretrained`` / ``save_pretrained`` of a peft model."""
    with hidden_warnings(GRADIENT_CHECKPOINTING_ALIAS), hidden_logs("transformers.configuration_utils",
                                                                     BASE_CONFIG_NOTE):
        yield
