"""Prefill speed of Self-Extend / ReRoPE against the native model: the merged path (two fused calls merged by
log-sum-exp) and the query-chunked one, each timed against native sdpa RoPE in alternating pairs (A B, B A, ...).

A LLaMA-shaped model (hidden 512, 8 heads, 2 kv heads, 2 layers: attention dominates at long context) with an
original length of a quarter of the prompt, extended to the prompt's length; forward under ``no_grad``, fp32,
2 threads by default. Prints the median ms of each and the median (min-max) of the per-pair ratios.

    python scripts/benchmarks/bench_self_extend.py                       # Self-Extend, 8,192 tokens, 3 pairs
    python scripts/benchmarks/bench_self_extend.py --methods self_extend rerope --lengths 2048 8192 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_posswap as ps
from hf_posswap.core import self_extend
from hf_posswap.core.paths import record_paths


def build(length: int, hidden: int, layers: int) -> LlamaForCausalLM:
    """A seeded fp32 LLaMA with sdpa attention (same weights for every call)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=length, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def forward_timer(model: torch.nn.Module, input_ids: torch.Tensor, chunked: bool = False) -> Callable[[], float]:
    """Seconds of one forward; ``chunked`` forces the chunked two-pass path (no merged call)."""

    def run() -> float:
        minimum = self_extend.MERGED_MIN_QUERIES
        self_extend.MERGED_MIN_QUERIES = dict.fromkeys(minimum, 1 << 60) if chunked else minimum
        try:
            start = time.perf_counter()
            with torch.no_grad():
                model(input_ids=input_ids)
            return time.perf_counter() - start
        finally:
            self_extend.MERGED_MIN_QUERIES = minimum

    return run


def pairs(native: Callable[[], float], patched: Callable[[], float], repeats: int) -> dict:
    """One warm-up each, then ``repeats`` pairs in alternating order; medians (ms) and ratio spread."""
    native(), patched()
    times = []
    for index in range(repeats):
        first, second = (native, patched) if index % 2 == 0 else (patched, native)
        a, b = first(), second()
        times.append((a, b) if index % 2 == 0 else (b, a))
    ratios = [p / n for n, p in times]
    return {"native": 1e3 * statistics.median(n for n, _ in times),
            "patched": 1e3 * statistics.median(p for _, p in times),
            "ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["self_extend"], choices=["self_extend", "rerope"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[8192])
    parser.add_argument("--paths", nargs="+", default=["merged", "chunked"], choices=["merged", "chunked"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for length in args.lengths:
        native = build(length, args.hidden, args.layers)
        input_ids = torch.randint(0, 4096, (1, length), generator=torch.Generator().manual_seed(length))
        for method in args.methods:
            patched = build(length // 4, args.hidden, args.layers)
            ps.extend_context(patched, length, method)
            for path in args.paths:
                with record_paths() as taken:
                    forward_timer(patched, input_ids, chunked=path == "chunked")()
                result = pairs(forward_timer(native, input_ids), forward_timer(patched, input_ids, path == "chunked"),
                               args.repeats)
                print(f"{method:11s} {length:6d} {path:8s} native {result['native']:8.0f} ms  patched "
                      f"{result['patched']:8.0f} ms  ratio {result['ratio']:.2f} ({result['low']:.2f}-"
                      f"{result['high']:.2f})  paths {sorted(set(taken))}", flush=True)


if __name__ == "__main__":
    main()
