"""Swap all-MiniLM-L6-v2 (BERT) from its learned position table to ALiBi, fine-tune it briefly, save, reload, check.

    python examples/finetune_bert_alibi.py [--steps 20] [--scheme alibi] [--output runs/minilm-alibi]

Two fine-tunes with ``hf_posswap.training`` from the same swapped start, on Python's documentation topics
(pydoc_data, no download), both with the masked-LM data pipeline: the masked-LM objective (what a BERT is
pretrained with; MiniLM ships no MLM head, so a new one is trained alongside), and distillation only (the swapped
model learns to reproduce the unswapped original's final hidden states). Each result is saved, reloaded with plain
``AutoModelForMaskedLM.from_pretrained`` (which works because hf_posswap is imported) and checked to carry the
scheme. MiniLM is a sentence-embedding model, so the example reports how close the embeddings of held-out topics
stay to the original's (mean cosine similarity), and the held-out masked-LM loss; for a scheme without a length
limit it then embeds a text twice as long as the original's 512 positions. ``--model`` takes any BERT checkpoint
with a tokenizer (the test runs a tiny one).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer

import hf_posswap as ps
from hf_posswap.persistence.offline_checkpoints import minilm_dir
from hf_posswap.training import FinetuneConfig, finetune

HELD_OUT = 8  # documentation topics kept out of training


def topics() -> list[str]:
    """Python's documentation topics (English prose), sorted by name for determinism."""
    from pydoc_data.topics import topics as all_topics

    return [all_topics[name] for name in sorted(all_topics)]


def write_corpus(directory: Path, texts: list[str]) -> str:
    """One text file per topic; returns the glob that ``FinetuneConfig.data`` takes."""
    directory.mkdir(parents=True, exist_ok=True)
    for index, text in enumerate(texts):
        (directory / f"topic{index:03d}.txt").write_text(text, encoding="utf-8")
    return str(directory / "*.txt")


@torch.no_grad()
def embed(model: torch.nn.Module, tokenizer, texts: list[str], max_length: int) -> torch.Tensor:
    """Mean-pooled last hidden states [len(texts), hidden], L2-normalised (how MiniLM is used)."""
    model.eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean cosine similarity of matching rows of two normalised embedding matrices."""
    return float((a * b).sum(-1).mean())


def long_text_check(model: torch.nn.Module, tokenizer, text: str, max_positions: int) -> str:
    """Embed a text twice as long as the original position table (only a scheme without a length limit can)."""
    target = 2 * max_positions
    ps.extend_context(model, target)  # 'lift' for ALiBi / T5 / NoPE: records the length, grows BERT's buffers
    ids = tokenizer(text, truncation=True, max_length=target, return_tensors="pt")
    with torch.no_grad():
        hidden = model.base_model(**ids).last_hidden_state
    if not torch.isfinite(hidden).all():
        raise RuntimeError(f"non-finite hidden states for a {ids['input_ids'].shape[1]}-token text")
    return f"embedded a {ids['input_ids'].shape[1]}-token text (the original table holds {max_positions})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a BERT checkpoint directory (default: the offline all-MiniLM-L6-v2)")
    parser.add_argument("--scheme", default="alibi", help="scheme to swap to: alibi, rope, t5, none, sinusoidal")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of each fine-tune")
    parser.add_argument("--seq-len", type=int, default=128, help="training sequence length in tokens")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    parser.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (AdamW, cosine schedule)")
    parser.add_argument("--topics", type=int, default=0, help="training topics to use (0: all but the held-out)")
    parser.add_argument("--output", default="runs/minilm-alibi", help="run directory (must be new or empty)")
    return parser.parse_args(argv)


def fine_tune(args: argparse.Namespace, checkpoint: Path, data: str, name: str, distill_weight: float) -> dict:
    """One masked-LM fine-tune of the swapped model; ``distill_weight`` of the loss matches the original's final
    hidden states instead (1: distillation only)."""
    return finetune(FinetuneConfig(
        model=str(checkpoint), data=[data], output=str(Path(args.output) / name), scheme=args.scheme,
        objective="mlm", distill=distill_weight > 0, distill_weight=distill_weight, seq_len=args.seq_len,
        batch_size=args.batch_size, steps=args.steps, lr=args.lr, warmup_steps=min(2, args.steps - 1),
        eval_every=0, save_every=args.steps, eval_fraction=0.1,
    ))


def reload_and_check(result: dict, scheme: str) -> torch.nn.Module:
    """The saved model through plain transformers (hf_posswap, imported, replays the swap before the weights load);
    the fine-tune saved a masked-LM model, whose encoder (``base_model``) gives the embeddings."""
    reloaded = AutoModelForMaskedLM.from_pretrained(result["output"])
    carried = ps.describe(reloaded).scheme
    if carried != scheme:
        raise RuntimeError(f"{result['output']} reloaded with scheme {carried!r}, not {scheme!r}")
    return reloaded


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run the example; returns its table as {row: {"similarity": ..., "mlm_loss": ...}} (the test reads it)."""
    args = parse_args(argv)
    started = time.perf_counter()
    checkpoint = Path(args.model) if args.model else minilm_dir()
    texts = topics()
    held_out, training = texts[:HELD_OUT], texts[HELD_OUT:]
    data = write_corpus(Path(args.output) / "corpus", training[: args.topics] if args.topics else training)

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    original = AutoModel.from_pretrained(checkpoint)
    max_positions = original.config.max_position_embeddings
    reference = embed(original, tokenizer, held_out, args.seq_len)
    ps.swap(original, args.scheme)
    rows = {"original (learned table)": {"similarity": 1.0, "mlm_loss": math.nan},
            f"swapped to {args.scheme}, no training": {
                "similarity": similarity(embed(original, tokenizer, held_out, args.seq_len), reference),
                "mlm_loss": math.nan}}
    del original

    reloaded = None
    for name, label, weight in (("mlm", "masked LM", 0.0), ("distill", "distillation only", 1.0)):
        result = fine_tune(args, checkpoint, data, name, weight)
        reloaded = reload_and_check(result, args.scheme)
        rows[f"{args.scheme} after {args.steps} steps, {label} (reloaded)"] = {
            "similarity": similarity(embed(reloaded.base_model, tokenizer, held_out, args.seq_len), reference),
            "mlm_loss": result["eval_loss"]}

    print(f"\nHeld-out: {len(held_out)} documentation topics ({args.seq_len} tokens each). Similarity: mean cosine "
          "similarity of their embeddings to the original's (1 = unchanged). Masked-LM loss: on the last 10 % of the "
          "training text (the MLM head is new: MiniLM ships none).\n")
    print(f"| {'model':<58} | similarity | masked-LM loss |")
    print(f"|{'-' * 60}|{'-' * 12}|{'-' * 16}|")
    for label, row in rows.items():
        loss = "" if math.isnan(row["mlm_loss"]) else f"{row['mlm_loss']:.3f}"
        print(f"| {label:<58} | {row['similarity']:10.3f} | {loss:>14} |")
    if args.scheme in ("alibi", "t5", "none", "sinusoidal"):
        print(long_text_check(reloaded, tokenizer, " ".join(held_out), max_positions))
    print(f"\nDone in {time.perf_counter() - started:.0f} s.")
    return rows


if __name__ == "__main__":
    main()
