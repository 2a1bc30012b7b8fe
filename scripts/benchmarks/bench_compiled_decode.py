"""Cached greedy decoding under ``torch.compile`` (inductor): swapped models against the native model, compiled the
same way in the same run, and how many graphs each compiled into.

A small model of each family (hidden 256, 4 heads, 4 layers, random weights) decodes ``--new-tokens`` tokens after
a 32-token prompt over a dynamic cache, one token a step with explicit position ids (as ``generate`` feeds it), its
``forward`` compiled by ``torch.compile``. The first run compiles (its time is not counted); the runs after it are
timed in alternating pairs, native then swapped, swapped then native. Prints ms per token of each, the median
(min-max) of the per-pair ratios, and the graphs dynamo made (1: the whole step is one graph; more: graph breaks,
each a return to Python in every layer and step). The compiled tokens are checked against eager decoding's.

    python scripts/benchmarks/bench_compiled_decode.py                          # the default cases, 40 tokens
    python scripts/benchmarks/bench_compiled_decode.py --cases gpt2-rope --new-tokens 64 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import hf_posswap as ps
from hf_posswap.transformers_internals import CACHE_KWARG

SHAPE = {"hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 4, "vocab_size": 4096}
FAMILIES = {
    "gpt2": {"model_type": "gpt2", "n_embd": 256, "n_head": 4, "n_layer": 4, "vocab_size": 4096, "n_positions": 1024,
             "bos_token_id": 0, "eos_token_id": 0},
    "llama": {"model_type": "llama", **SHAPE, "num_key_value_heads": 2, "intermediate_size": 704,
              "max_position_embeddings": 1024},
}
SWAPS = {
    "rope": lambda model: ps.swap(model, "rope"),
    "xpos": lambda model: ps.swap(model, "xpos"),
    "learned": lambda model: ps.swap(model, "learned", max_positions=1024),
    "head_mix": lambda model: ps.swap(model, ps.HeadMix(bias="alibi", rotary="rope")),
    "alibi": lambda model: ps.swap(model, "alibi"),
}
DEFAULT_CASES = ["gpt2-rope", "gpt2-learned", "llama-xpos", "llama-head_mix", "llama-learned", "llama-alibi"]
PROMPT = 32


def build(family: str, scheme: str | None) -> torch.nn.Module:
    """The family's seeded model, swapped to ``scheme`` (None: native)."""
    torch.manual_seed(0)
    settings = dict(FAMILIES[family])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    if scheme is not None:
        SWAPS[scheme](model)
    return model


def decode(forward, config, new_tokens: int) -> tuple[float, torch.Tensor]:
    """Seconds per new token of greedy decoding through ``forward``, and the tokens [new_tokens]."""
    ids = torch.randint(3, 4096, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=config)
    tokens = []
    with torch.no_grad():
        logits = forward(input_ids=ids, **{CACHE_KWARG: cache}, use_cache=True).logits
        start = time.perf_counter()
        for step in range(new_tokens):
            token = logits[:, -1:].argmax(-1)
            tokens.append(token)
            logits = forward(input_ids=token, **{CACHE_KWARG: cache}, use_cache=True,
                             position_ids=torch.tensor([[PROMPT + step]])).logits
        seconds = time.perf_counter() - start
    return seconds / new_tokens, torch.cat(tokens, dim=-1)[0]


def compiled(model: torch.nn.Module, new_tokens: int) -> tuple[object, int]:
    """The model's compiled forward, after one decoding run that compiles it; the graphs it compiled into. (Models
    of one family share their forward's code, whose compiled graphs dynamo keeps side by side, guarded by the model:
    a reset would drop the native model's too.)"""
    before = counters["stats"]["unique_graphs"]
    forward = torch.compile(model.forward, backend="inductor")
    decode(forward, model.config, new_tokens)
    return forward, counters["stats"]["unique_graphs"] - before


def measure(case: str, new_tokens: int, repeats: int, native_cache: dict) -> dict:
    family, scheme = case.split("-", 1)
    if family not in native_cache:
        native = build(family, None)
        native_cache[family] = (native, *compiled(native, new_tokens))
    native, native_forward, native_graphs = native_cache[family]
    model = build(family, scheme)
    _, eager_tokens = decode(model.forward, model.config, new_tokens)
    forward, graphs = compiled(model, new_tokens)
    same = torch.equal(decode(forward, model.config, new_tokens)[1], eager_tokens)
    decode(native_forward, native.config, new_tokens)  # both warm before the pairs
    native_times, times = [], []
    for index in range(repeats):
        order = [(native_forward, native, native_times), (forward, model, times)]
        for fn, owner, into in order if index % 2 == 0 else order[::-1]:
            into.append(decode(fn, owner.config, new_tokens)[0])
    ratios = [b / a for a, b in zip(native_times, times, strict=True)]
    return {"case": case, "native_ms": 1e3 * statistics.median(native_times), "ms": 1e3 * statistics.median(times),
            "ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios), "graphs": graphs,
            "native_graphs": native_graphs, "same_tokens": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES,
                        help=f"FAMILY-SCHEME, family in {sorted(FAMILIES)}, scheme in {sorted(SWAPS)}")
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (alternating pairs)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    for case in args.cases:
        family, _, scheme = case.partition("-")
        if family not in FAMILIES or scheme not in SWAPS:
            parser.error(f"case {case!r}: use FAMILY-SCHEME with a family of {sorted(FAMILIES)} and a scheme of "
                         f"{sorted(SWAPS)}")
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = torch._dynamo.config.accumulated_cache_size_limit = 256
    print(f"torch {torch.__version__}, {args.threads} threads, inductor, {args.new_tokens} new tokens after "
          f"{PROMPT}, {args.repeats} pairs")
    print("| case | native ms/token | swapped ms/token | swapped / native | graphs (native) | tokens = eager |")
    print("| --- | --- | --- | --- | --- | --- |")
    natives: dict = {}
    for case in args.cases:
        row = measure(case, args.new_tokens, args.repeats, natives)
        print(f"| {row['case']} | {row['native_ms']:.2f} | {row['ms']:.2f} | {row['ratio']:.2f} "
              f"({row['low']:.2f}-{row['high']:.2f}) | {row['graphs']} ({row['native_graphs']}) | "
              f"{row['same_tokens']} |", flush=True)


if __name__ == "__main__":
    main()
