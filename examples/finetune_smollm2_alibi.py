"""Swap SmolLM2-135M (LLaMA family) from RoPE to ALiBi, fine-tune it briefly, save, reload, compare losses.

    python examples/finetune_smollm2_alibi.py [--steps 30] [--seq-len 256] [--output runs/smollm2-alibi]

Training text: 40 files of Python's standard library (sorted, deterministic); held-out text: the first 8 x 256
tokens of argparse.py (not in the training files). Two runs from the same swapped start: the plain causal-LM
objective, and distillation from the unswapped original (KL on logits). Prints held-out loss: the native model,
right after the swap, and after each fine-tune (reloaded from its saved checkpoint with plain
AutoModelForCausalLM.from_pretrained, which works because hf_posswap is imported).
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_posswap as ps
from hf_posswap.persistence.offline_checkpoints import smollm2_dir
from hf_posswap.training import FinetuneConfig, finetune


def write_corpus(directory: Path, count: int = 40) -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(stdlib.glob("*.py")) if p.name != "argparse.py"][:count]
    directory.mkdir(parents=True, exist_ok=True)
    for path in files:
        (directory / f"{path.stem}.txt").write_text(path.read_text(encoding="utf-8"), encoding="utf-8")


@torch.no_grad()
def heldout_loss(model, eval_ids: torch.Tensor) -> float:
    """Mean next-token loss over the held-out blocks [N, seq_len]."""
    model.eval()
    return float(sum(model(input_ids=row[None], labels=row[None]).loss.item() for row in eval_ids) / len(eval_ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--output", default="runs/smollm2-alibi")
    args = parser.parse_args()
    started = time.perf_counter()
    output = Path(args.output)
    write_corpus(output / "corpus")
    checkpoint = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    argparse_text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")
    eval_ids = torch.tensor(tokenizer(argparse_text)["input_ids"][: 8 * args.seq_len]).view(8, args.seq_len)

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    rows = [("native (RoPE)", heldout_loss(model, eval_ids))]
    ps.swap(model, "alibi")
    rows.append(("swapped to ALiBi, no training", heldout_loss(model, eval_ids)))
    del model

    for name, options in (("plain", {}), ("distill", {"distill": True, "distill_weight": 1.0})):
        run_dir = output / name
        finetune(FinetuneConfig(model=str(checkpoint), data=[str(output / "corpus" / "*.txt")], output=str(run_dir),
                                scheme="alibi", seq_len=args.seq_len, batch_size=4, steps=args.steps, lr=args.lr,
                                warmup_steps=min(2, args.steps), eval_every=0, save_every=args.steps,
                                eval_fraction=0.0, **options))
        reloaded = AutoModelForCausalLM.from_pretrained(run_dir / "final")
        assert ps.describe(reloaded).scheme == "alibi"
        rows.append((f"ALiBi after {args.steps} steps, {name} objective (reloaded)", heldout_loss(reloaded, eval_ids)))

    print(f"\nHeld-out loss on {eval_ids.numel()} tokens of argparse.py (lower is better):\n")
    print(f"| {'model':<52} | {'loss':>7} | {'perplexity':>10} |")
    print(f"|{'-' * 54}|{'-' * 9}|{'-' * 12}|")
    for label, loss in rows:
        print(f"| {label:<52} | {loss:7.3f} | {math.exp(loss):10.2f} |")
    print(f"\nDone in {time.perf_counter() - started:.0f} s.")


if __name__ == "__main__":
    main()
