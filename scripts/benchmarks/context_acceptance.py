"""Context extension measured on a real checkpoint: SmolLM2-135M (trained at 8,192) extended to 32,768 through
hf_posswap's API, perplexity on the 16,384-token reference window of docs/benchmarks.md, with each method's
forward time and peak memory.

Window: typing.py, argparse.py and tarfile.py of the running Python's standard library, concatenated in that
order, tokenized with the checkpoint's tokenizer as ``tokenizer(text)``, first 16,384 tokens, one forward pass;
perplexity = exp(mean NLL of the last 4,096 next-token predictions). References (docs/benchmarks.md, Python 3.11):
no scaling 466, YaRN factor 4: 5.29, dynamic NTK factor 4: 5.62. About 2-4 minutes per forward on 2 cores.

Each method runs in its own process, so its peak memory (the process's VmHWM: load + tokenize + forward) is its
own; the table gives time and peak memory also as ratios to ``none`` (the unscaled model) measured in the same
run. Self-Extend uses the library's defaults for factor 4, which follow the paper (Jin et al. 2024): neighbour
window = a quarter of the trained length (the paper's 1,024 for Llama-2's 4,096), the smallest group size whose
reach (L0 - W) * G + W covers the target: W = 2,048, G = 5 here. ReRoPE (``rerope``, Su 2023) uses its defaults
too: window w = a quarter of the trained length (2,048; the reference's ReRoPE-w1024 on 4k LLaMA 2), every key
farther than w at distance w, without the reference's log-n query scaling. A method may carry options:
``rerope:leaky_factor=16`` (Leaky ReRoPE with the reference's k = 16).

    python scripts/benchmarks/context_acceptance.py [--methods none yarn dynamic self_extend rerope] \
        [--output results.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_posswap as ps
from hf_posswap.persistence.offline_checkpoints import smollm2_dir
from hf_posswap.persistence.saving import write_file_atomic

REFERENCE = {"none": 466.0, "yarn": 5.29, "dynamic": 5.62}
WINDOW, TAIL, TARGET = 16_384, 4_096, 32_768
RESULT_PREFIX = "RESULT "


def reference_ids(tokenizer) -> torch.Tensor:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / name).read_text(encoding="utf-8") for name in ("typing.py", "argparse.py", "tarfile.py"))
    print(f"Python {sys.version.split()[0]}, window text sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}")
    return torch.tensor([tokenizer(text)["input_ids"][:WINDOW]])


@torch.no_grad()
def tail_perplexity(model, input_ids: torch.Tensor) -> float:
    logits = model(input_ids=input_ids, logits_to_keep=TAIL + 1).logits[0, :-1].float()  # [TAIL, vocab]
    return math.exp(torch.nn.functional.cross_entropy(logits, input_ids[0, -TAIL:]).item())


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM) in MiB; NaN where /proc is missing."""
    try:
        status = Path("/proc/self/status").read_text(encoding="utf-8")
    except OSError:
        return float("nan")
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def method_options(method: str) -> tuple[str, dict]:
    """``rerope:leaky_factor=16`` -> ("rerope", {"leaky_factor": 16}): a method with options (JSON values)."""
    name, _, rest = method.partition(":")
    options = dict(item.split("=", 1) for item in rest.split(",") if item)
    return name, {key: json.loads(value) for key, value in options.items()}


def measure(method: str) -> dict:
    """Perplexity, forward seconds and process peak memory of one method (run in a fresh process)."""
    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    input_ids = reference_ids(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if method != "none":
        name, options = method_options(method)
        ps.extend_context(model, TARGET, name, **options)
    settings = ps.describe(model).settings.get("scaling") if method != "none" else None
    before = peak_rss_mib()
    started = time.perf_counter()
    perplexity = tail_perplexity(model, input_ids)
    seconds = time.perf_counter() - started
    return {"perplexity": perplexity, "seconds": seconds, "peak_mib": peak_rss_mib(), "peak_before_forward_mib": before,
            "threads": torch.get_num_threads(), "settings": settings}


def run_child(method: str) -> dict:
    """``measure(method)`` in a subprocess; its output streams through, the result comes back as JSON."""
    process = subprocess.run([sys.executable, __file__, "--child", method], stdout=subprocess.PIPE, text=True)
    lines = process.stdout.splitlines()
    for line in lines:
        if not line.startswith(RESULT_PREFIX):
            print(f"  [{method}] {line}", flush=True)
    results = [json.loads(line[len(RESULT_PREFIX):]) for line in lines if line.startswith(RESULT_PREFIX)]
    if process.returncode != 0 or not results:
        return {"error": f"exit status {process.returncode}"}
    return results[-1]


def table(results: dict[str, dict]) -> str:
    """Markdown rows: perplexity, reference, forward time and peak memory, both also relative to ``none``."""
    base = results.get("none", {})
    lines = ["| method (8,192 -> 32,768) | perplexity | expected | forward s | time / none | peak MiB | peak / none |",
             "|---|---|---|---|---|---|---|"]
    for method, row in results.items():
        if "error" in row:
            lines.append(f"| {method} | failed: {row['error']} | | | | | |")
            continue
        time_ratio = row["seconds"] / base["seconds"] if "seconds" in base else float("nan")
        peak_ratio = row["peak_mib"] / base["peak_mib"] if "peak_mib" in base else float("nan")
        expected = REFERENCE.get(method, "")
        lines.append(f"| {method} | {row['perplexity']:.2f} | {expected} | {row['seconds']:.0f} | {time_ratio:.2f} | "
                     f"{row['peak_mib']:.0f} | {peak_ratio:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["none", "yarn", "dynamic", "self_extend"])
    parser.add_argument("--output", help="write the results as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: measure one method in this process
    args = parser.parse_args()
    if args.child:
        print(RESULT_PREFIX + json.dumps(measure(args.child)), flush=True)
        return
    results = {}
    for method in args.methods:
        results[method] = row = run_child(method)
        if "error" not in row:
            print(f"{method:12s} perplexity {row['perplexity']:8.2f} (reference {REFERENCE.get(method, '-')}), "
                  f"{row['seconds']:.0f} s, peak {row['peak_mib']:.0f} MiB, settings {row['settings']}", flush=True)
    print(table(results))
    if args.output:
        write_file_atomic(args.output, json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
