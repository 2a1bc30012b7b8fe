"""Issue 3 acceptance on a real checkpoint: SmolLM2-135M (trained at 8,192) extended to 32,768 through
hf_posswap's API, perplexity on the 16,384-token reference window of docs/benchmarks.md.

Window: typing.py, argparse.py and tarfile.py of the running Python's standard library, concatenated in that
order, tokenized with the checkpoint's tokenizer as ``tokenizer(text)``, first 16,384 tokens, one forward pass;
perplexity = exp(mean NLL of the last 4,096 next-token predictions). References (docs/benchmarks.md, Python 3.11):
no scaling 466, YaRN factor 4: 5.29, dynamic NTK factor 4: 5.62. About 4 minutes per forward on 2 cores.

    python scripts/context_acceptance.py [--methods none yarn dynamic] [--output results.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_posswap as ps
from hf_posswap.persistence.offline_checkpoints import smollm2_dir

REFERENCE = {"none": 466.0, "yarn": 5.29, "dynamic": 5.62}
WINDOW, TAIL, TARGET = 16_384, 4_096, 32_768


def reference_ids(tokenizer) -> torch.Tensor:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / name).read_text(encoding="utf-8") for name in ("typing.py", "argparse.py", "tarfile.py"))
    print(f"Python {sys.version.split()[0]}, window text sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}")
    return torch.tensor([tokenizer(text)["input_ids"][:WINDOW]])


@torch.no_grad()
def tail_perplexity(model, input_ids: torch.Tensor) -> float:
    logits = model(input_ids=input_ids, logits_to_keep=TAIL + 1).logits[0, :-1].float()  # [TAIL, vocab]
    return math.exp(torch.nn.functional.cross_entropy(logits, input_ids[0, -TAIL:]).item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["none", "yarn", "dynamic"])
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args()
    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    input_ids = reference_ids(tokenizer)
    results = {}
    for method in args.methods:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if method != "none":
            ps.extend_context(model, TARGET, method)
        started = time.perf_counter()
        results[method] = tail_perplexity(model, input_ids)
        print(f"{method:8s} perplexity {results[method]:8.2f} (reference {REFERENCE.get(method, float('nan'))}, "
              f"{time.perf_counter() - started:.0f} s) rope_parameters={model.config.rope_parameters}", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
