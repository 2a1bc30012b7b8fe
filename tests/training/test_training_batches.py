"""What each training step reads and reports: one process and several read the same rows at every step (past the end
of an epoch too), masked-LM masks depend on the row, the seed and the epoch alone (so a resumed run repeats the
unbroken one), an accumulated update logs the loss of all its micro-batches, and the held-out loss is the mean over
scored tokens."""

from __future__ import annotations

import json
from types import SimpleNamespace

import finetune_runs
import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from conftest import MODEL_CLASSES, tiny_config
from finetune_runs import run
from torch.utils.data import BatchSampler, DataLoader

from hf_posswap.errors import InvalidConfigError
from hf_posswap.evaluation import BYTE_VOCAB_SIZE, byte_tokenizer
from hf_posswap.training.loop import EpochShuffle
from hf_posswap.training.losses import CausalBatches, MaskedLMBatches, held_out_loss, pose_position_ids

workspace = finetune_runs.workspace  # the shared fixture (assigned: ruff reads an imported one as unused)


def _logged_losses(output) -> list[float]:
    return [json.loads(line)["loss"] for line in (output / "loss_log.jsonl").read_text().splitlines()]


# --- rows per step -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [11, 8, 3])
def test_one_process_and_two_read_the_same_rows_at_every_step(rows: int) -> None:
    """accelerate's own sharding (``BatchSamplerShard``, as ``prepare`` builds it) of 2 rows per process against one
    process reading 4: the same rows at every step of three epochs, with 11 rows (an epoch ending in a short batch),
    8 and 3 (fewer than one batch)."""
    one = BatchSampler(EpochShuffle(rows, seed=5, global_batch=4), batch_size=4, drop_last=False)
    base = BatchSampler(EpochShuffle(rows, seed=5, global_batch=4), batch_size=2, drop_last=False)
    shards = [BatchSamplerShard(base, num_processes=2, process_index=rank, split_batches=False, even_batches=True)
              for rank in (0, 1)]
    for epoch in range(3):
        one.sampler.set_epoch(epoch)
        base.sampler.set_epoch(epoch)
        single = list(one)
        together = [first + second for first, second in zip(*shards, strict=True)]
        assert together == single, f"epoch {epoch}"
        assert all(len(batch) == 4 for batch in single)
        assert set(sum(single, [])) == set(range(rows))  # every row read in every epoch


def test_pose_rows_of_two_processes_are_the_rows_one_process_draws() -> None:
    """Each process keeps its rows of the global batch's PoSE draw (one seed for all), not a copy of another's."""
    def draw(process):
        return pose_position_ids(2 if process else 4, 32, 256, torch.Generator().manual_seed(9), *process)

    halves = [draw([(rank, 2)]) for rank in (0, 1)]
    assert torch.equal(torch.cat(halves), draw([]))
    assert not torch.equal(halves[0], halves[1])


# --- masked LM ----------------------------------------------------------------------------------------------


def _rows(count: int, length: int = 64, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 250, (length,), generator=generator)} for _ in range(count)]


def test_masked_lm_masks_depend_on_the_row_the_seed_and_the_epoch_alone() -> None:
    tokenizer = byte_tokenizer()
    rows = _rows(4)
    masks = MaskedLMBatches(tokenizer, 0.3, seed=1)
    together = masks(rows)
    apart = [masks([row]) for row in reversed(rows)][::-1]  # other batches, another order
    for index, alone in enumerate(apart):
        assert torch.equal(together["input_ids"][index], alone["input_ids"][0])
        assert torch.equal(together["labels"][index], alone["labels"][0])
    assert torch.equal(MaskedLMBatches(tokenizer, 0.3, seed=1)(rows)["labels"], together["labels"])  # a new run
    masks.set_epoch(1)
    assert not torch.equal(masks(rows)["labels"], together["labels"])
    assert not torch.equal(MaskedLMBatches(tokenizer, 0.3, seed=2)(rows)["labels"], together["labels"])


def test_masked_lm_masks_follow_berts_rule() -> None:
    """15 % of the tokens chosen, never a special one; of the chosen, 80 % [MASK], 10 % another token, 10 % kept."""
    tokenizer = byte_tokenizer()
    rows = _rows(200, length=128)
    special = sorted(set(tokenizer.all_special_ids))
    for row in rows:
        row["input_ids"][::16] = special[0]
    batch = MaskedLMBatches(tokenizer, 0.15, seed=0)(rows)
    originals = torch.stack([row["input_ids"] for row in rows])
    chosen = batch["labels"] != -100
    assert torch.equal(batch["labels"][chosen], originals[chosen])
    assert not chosen[originals == special[0]].any()
    assert abs(chosen[originals != special[0]].float().mean().item() - 0.15) < 0.01
    masked = batch["input_ids"][chosen] == tokenizer.mask_token_id
    kept = batch["input_ids"][chosen] == originals[chosen]
    assert abs(masked.float().mean().item() - 0.8) < 0.02 and abs(kept.float().mean().item() - 0.1) < 0.02
    assert torch.equal(batch["input_ids"][~chosen], originals[~chosen])


def test_a_resumed_masked_lm_run_repeats_the_unbroken_run(workspace, tmp_path) -> None:
    """The batch accelerate reads ahead of the step-3 checkpoint is masked again when the run resumes; its masks
    must be the ones the unbroken run drew."""
    options = {"family": "bert", "lr_schedule": "constant", "save_every": 3}
    run(workspace, tmp_path / "unbroken", steps=5, **options)
    unbroken = _logged_losses(tmp_path / "unbroken")
    run(workspace, tmp_path / "resumed", steps=3, **options)
    run(workspace, tmp_path / "resumed", steps=5, resume=True, **options)
    assert _logged_losses(tmp_path / "resumed") == pytest.approx(unbroken, rel=1e-6)


# --- what a step reports ------------------------------------------------------------------------------------


def test_an_accumulated_update_logs_the_loss_of_all_its_micro_batches(workspace, tmp_path) -> None:
    """4 rows at once and 2 micro-batches of 2 are the same update: the same logged loss at every step."""
    whole = run(workspace, tmp_path / "whole", steps=3, batch_size=4, lr_schedule="constant")
    accumulated = run(workspace, tmp_path / "accumulated", steps=3, batch_size=2, grad_accum=2,
                      lr_schedule="constant")
    assert _logged_losses(tmp_path / "accumulated") == pytest.approx(_logged_losses(tmp_path / "whole"), rel=1e-5)
    assert accumulated["train_loss"] == pytest.approx(whole["train_loss"], rel=1e-5)


class _OneProcess:
    """The part of an Accelerator held_out_loss uses, for one process (nothing to gather)."""

    @staticmethod
    def gather_for_metrics(value):
        return value


@pytest.mark.parametrize("objective", ["causal", "mlm"])
def test_held_out_loss_is_the_mean_over_scored_tokens(objective: str) -> None:
    """Three held-out rows read two at a time (a short last batch): the mean over all scored tokens, which is the
    model's own loss over the three rows at once, not the mean of the two batches' means."""
    family = "gpt2" if objective == "causal" else "bert"
    config = tiny_config(family)
    config.vocab_size = BYTE_VOCAB_SIZE  # masked LM may put any of the tokenizer's ids in
    torch.manual_seed(0)
    model = MODEL_CLASSES[family](config).eval()
    tokenizer = byte_tokenizer()
    batches = CausalBatches() if objective == "causal" else MaskedLMBatches(tokenizer, 0.3, seed=0, epoch=-1)
    rows = _rows(3, length=24, seed=3)
    loader = DataLoader(rows, batch_size=2, collate_fn=batches)
    whole = batches(rows)
    with torch.no_grad():
        expected = model(**whole).loss.item()
    assert held_out_loss(model.train(), loader, objective, _OneProcess()) == pytest.approx(expected, rel=1e-5)
    assert model.training  # the caller's mode is restored


def test_a_row_without_a_drawn_mask_gets_one_of_its_own() -> None:
    """Short rows often draw no mask: each then gets one from its own generator, so rows batched together are masked
    as rows read alone (a batch-level fallback masked only the batch's first row)."""
    tokenizer = byte_tokenizer()
    masks = MaskedLMBatches(tokenizer, 0.15, seed=0)
    rows = _rows(400, length=8)
    together = [masks(rows[index:index + 2]) for index in range(0, len(rows), 2)]
    apart = [masks([row]) for row in rows]
    for index, batch in enumerate(together):
        for offset in (0, 1):
            assert torch.equal(batch["labels"][offset], apart[2 * index + offset]["labels"][0])
    assert all(bool((alone["labels"] != -100).any()) for alone in apart)


def test_a_tokenizer_without_a_mask_token_is_refused_for_masked_lm() -> None:
    tokenizer = byte_tokenizer()
    tokenizer.mask_token = None
    with pytest.raises(InvalidConfigError, match="has no mask token"):
        MaskedLMBatches(tokenizer, 0.15, seed=0)


def test_an_output_folder_that_cannot_be_made_is_raised_in_every_process(tmp_path, monkeypatch) -> None:
    """The main process makes and locks the folder; a failure there (here: no permission) reaches the others through
    the broadcast, instead of leaving them waiting at the barrier."""
    from hf_posswap.training import loop
    from hf_posswap.training.config import FinetuneConfig

    broadcast = []
    monkeypatch.setattr(loop, "from_main_process", lambda accelerator, value: broadcast.append(value) or value)
    monkeypatch.setattr(loop.OutputLock, "create_folder",
                        lambda self: (_ for _ in ()).throw(PermissionError(13, "Permission denied", str(tmp_path))))
    main = SimpleNamespace(is_main_process=True, num_processes=2)
    config = FinetuneConfig(model="m", data=["d"], output=str(tmp_path / "out"))
    with pytest.raises(PermissionError):
        loop._own_output(tmp_path / "out", main, config)
    assert isinstance(broadcast[0], PermissionError)
