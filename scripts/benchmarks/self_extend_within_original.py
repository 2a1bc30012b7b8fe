"""What Self-Extend's ``exact_within_original`` buys: perplexity of SmolLM2-135M with Self-Extend as its authors
define it (every key at least W from its query grouped, at every length) and with queries before the original
length kept exact, against the unextended model.

SmolLM2 is trained at 8,192 tokens; the script declares a much shorter original length L0 (default 512) so that
the question can be asked in a few forwards on a CPU: Self-Extend's defaults for 4 x L0 (W = L0 / 4, G the smallest
group reaching 4 x L0). Text: the reference window of docs/benchmarks.md (typing.py, argparse.py and tarfile.py of
the running Python), cut into ``--segments`` consecutive pieces of ``--length`` tokens; one forward per piece and
setting. A causal query's logits depend only on its own and earlier positions under both rules, so the predictions
at positions below L0 of one long forward are those of a forward of L0 tokens. Perplexity = exp(mean NLL) of the
next-token predictions made at positions [W, L0) (below W the three settings are the same model) and [L0, length).

    python scripts/benchmarks/self_extend_within_original.py [--original 512] [--length 2048] [--segments 8]
        [--settings authors exact_within_original]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from context_acceptance import reference_ids
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_posswap as ps
from hf_posswap.persistence.offline_checkpoints import smollm2_dir

SETTINGS = ("plain", "authors", "exact_within_original")


@torch.no_grad()
def token_nll(model, input_ids: torch.Tensor) -> torch.Tensor:
    """NLL [L - 1] of each next-token prediction of one row [1, L]."""
    logits = model(input_ids=input_ids).logits[0, :-1].float()  # [L - 1, vocab]
    return torch.nn.functional.cross_entropy(logits, input_ids[0, 1:], reduction="none")


def build(path, setting: str, original: int, factor: float):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if setting != "plain":
        scaling = ps.SelfExtend(factor=factor, original_max_position_embeddings=original,
                                exact_within_original=setting == "exact_within_original")
        ps.swap(model, ps.RopeConfig(scaling=scaling))
    return model


def paired(nll: dict[str, list[torch.Tensor]], setting: str, span: slice) -> str:
    """Per-piece log perplexity ratio of ``setting`` to plain: mean +- standard error, and pieces where it is worse."""
    pairs = zip(nll[setting], nll["plain"], strict=True)
    ratios = torch.tensor([(ours[span].mean() - plain[span].mean()).item() for ours, plain in pairs])
    error = ratios.std().item() / math.sqrt(len(ratios)) if len(ratios) > 1 else float("nan")
    return (f"{100 * ratios.mean().item():+.2f} % +- {100 * error:.2f} % (worse in {int((ratios > 0).sum())} of "
            f"{len(ratios)} pieces)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--original", type=int, default=512, help="the declared original length L0")
    parser.add_argument("--length", type=int, default=2048, help="tokens per forward (the target length, >= L0)")
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                        help="plain is always run (the baseline)")
    args = parser.parse_args()
    settings = ["plain", *[s for s in args.settings if s != "plain"]]
    path = smollm2_dir()
    ids = reference_ids(AutoTokenizer.from_pretrained(path))[0]
    pieces = [ids[i * args.length:(i + 1) * args.length][None] for i in range(args.segments)]
    if any(piece.shape[1] < args.length for piece in pieces):
        parser.error(f"the text holds {ids.numel()} tokens, fewer than {args.segments} x {args.length}")
    factor = max(args.length / args.original, 4.0)  # the defaults for 4 x L0 (or the target, if longer)
    nll: dict[str, list[torch.Tensor]] = {}
    for setting in settings:
        model = build(path, setting, args.original, factor)
        if setting != "plain":
            print(f"{setting}: {ps.describe(model).settings['scaling']}", flush=True)
        started = time.perf_counter()
        nll[setting] = [token_nll(model, piece) for piece in pieces]
        print(f"{setting}: {time.perf_counter() - started:.0f} s for {args.segments} forwards", flush=True)
        del model
    window = ps.SelfExtend(factor=factor).with_original(args.original).neighbor_window
    # prediction k is made at position k (of the token at k + 1)
    spans = {f"[{window}, {args.original})": slice(window, min(args.original, args.length - 1)),
             f"[{args.original}, {args.length})": slice(args.original, args.length - 1)}
    print(f"\nSmolLM2-135M, declared L0 = {args.original}, W = {window}, {args.segments} pieces of "
          f"{args.length} tokens: perplexity, and per piece log(perplexity / plain)")
    print("| positions | " + " | ".join(settings) + " | " + " | ".join(f"{s} vs plain" for s in settings[1:]) + " |")
    print("|---|" + "---|" * (2 * len(settings) - 1))
    for name, span in spans.items():
        if span.stop <= span.start:
            continue
        perplexity = {s: math.exp(torch.cat([n[span] for n in nll[s]]).mean().item()) for s in settings}
        print(f"| {name} | " + " | ".join(f"{perplexity[s]:.3f}" for s in settings) + " | "
              + " | ".join(paired(nll, s, span) for s in settings[1:]) + " |")


if __name__ == "__main__":
    main()
