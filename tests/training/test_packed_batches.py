"""Packed training batches as transformers' ``DataCollatorWithFlattening`` makes them (sequences end to end in one
row, position ids restarting at each, no attention mask): every sequence trains as if it were alone, and no
token's prediction sees the tokens after it."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, swapped
from packaging.version import Version

from hf_posswap.transformers_internals import RUNNING

SCHEMES = ["alibi", "t5", "fire", "kerple"]


def sequences() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    return [torch.randint(3, VOCAB, (length,), generator=generator) for length in (9, 15, 12)]


def flattened(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening()([{"input_ids": row.tolist()} for row in rows])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_flattened_batch_gives_every_sequence_its_own_loss(scheme: str) -> None:
    """With ``use_cache=False`` (as training runs) transformers finds the sequences from the restarting ids and
    masks between them; the loss then equals the token-weighted loss of the sequences alone."""
    model = swapped("llama", scheme)
    model.config.use_cache = False
    rows = sequences()
    batch = flattened(rows)
    assert "attention_mask" not in batch and batch["position_ids"][0, 9].item() == 0
    with torch.no_grad():
        packed = model(**batch).loss
        alone = [model(input_ids=row[None], labels=row[None]).loss * (len(row) - 1) for row in rows]
    torch.testing.assert_close(packed, torch.stack(alone).sum() / sum(len(row) - 1 for row in rows))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_flattened_batch_never_shows_a_token_the_tokens_after_it(scheme: str) -> None:
    """With the model's own KV cache (``use_cache=True``) transformers does not look for packed sequences and
    sdpa gets no mask: the sequences then see each other's earlier tokens, as in the native model, but never a
    later one (the bias schemes built causality from the restarting ids: 0.34 in ALiBi's logits)."""
    model = swapped("llama", scheme)
    rows = sequences()
    changed = [rows[0], torch.flip(rows[1], [0]), rows[2]]
    with torch.no_grad():
        first = model(**flattened(rows), use_cache=True).logits[:, :9]
        again = model(**flattened(changed), use_cache=True).logits[:, :9]
    torch.testing.assert_close(first, again, atol=0, rtol=0)


#: the first position id of a sequence: RoBERTa numbers tokens from padding_idx + 1
FIRST_POSITION = {"bert": 0, "roberta": 2}


@pytest.mark.skipif(RUNNING < Version("5.25.0"), reason="transformers masks packed encoder rows from 5.25 on")
@pytest.mark.parametrize("scheme", [*SCHEMES, "rope", "learned", "sinusoidal"])
@pytest.mark.parametrize("family", sorted(FIRST_POSITION))
def test_a_flattened_encoder_batch_gives_every_sequence_its_own_output(family: str, scheme: str) -> None:
    """From transformers 5.25 an encoder given restarting position ids and no mask masks attention between the
    sequences, as a decoder does; every scheme then gives each sequence the output it has alone (positions read
    from the ids, the block mask honoured by the bias and rotary paths)."""
    model = swapped(family, scheme)
    rows = sequences()
    batch = flattened(rows)
    batch["position_ids"] += FIRST_POSITION[family]
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        alone = torch.cat([model(input_ids=row[None]).logits for row in rows], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-4)
