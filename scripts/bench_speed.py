"""Protocol B (BENCHMARKS.md): speed of patched models against native, measured in one process.

For each case (LLaMA -> alibi, LLaMA -> t5, GPT-2 -> rope by default) and each length, the native and the
patched model run alternately (A/B, A/B, ...) and the script reports medians and the patched/native ratio for a
forward pass and a training step (forward + backward). Absolute times on shared machines are noise; ratios
measured side by side are the result.

    python scripts/bench_speed.py                      # 512 and 2048 tokens, small models from configs
    python scripts/bench_speed.py --lengths 512 --repeats 3 --output bench.md
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import hf_posswap as ps

CASES = {"llama-alibi": ("llama", "alibi"), "llama-t5": ("llama", "t5"), "gpt2-rope": ("gpt2", "rope")}


def build(family: str, max_positions: int) -> torch.nn.Module:
    """Small models of the same shape family as the real ones: 4 layers, hidden 256, head_dim 32."""
    torch.manual_seed(0)
    if family == "llama":
        config = LlamaConfig(
            vocab_size=4096,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=max_positions,
        )
        return LlamaForCausalLM(config)
    config = GPT2Config(vocab_size=4096, n_embd=256, n_layer=4, n_head=8, n_positions=max_positions)
    return GPT2LMHeadModel(config)


def forward_step(model: torch.nn.Module, input_ids: torch.Tensor) -> None:
    with torch.no_grad():
        model(input_ids=input_ids)


def train_step(model: torch.nn.Module, input_ids: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(input_ids=input_ids, labels=input_ids).loss.backward()


def alternate(native: Callable[[], None], patched: Callable[[], None], repeats: int) -> tuple[float, float]:
    """Median seconds of each, measured alternately after one warm-up run each."""
    native(), patched()
    times: dict[str, list[float]] = {"native": [], "patched": []}
    for _ in range(repeats):
        for name, fn in (("native", native), ("patched", patched)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["native"]), statistics.median(times["patched"])


def run(cases: list[str], lengths: list[int], repeats: int) -> list[dict]:
    rows = []
    for case in cases:
        family, scheme = CASES[case]
        for length in lengths:
            native, patched = build(family, length), build(family, length)
            ps.swap(patched, scheme)
            input_ids = torch.randint(0, 4096, (1, length), generator=torch.Generator().manual_seed(length))
            for step_name, step in (("forward", forward_step), ("train step", train_step)):
                native.train(step is train_step), patched.train(step is train_step)
                t_native, t_patched = alternate(
                    functools.partial(step, native, input_ids), functools.partial(step, patched, input_ids), repeats
                )
                row = {
                    "case": case,
                    "tokens": length,
                    "step": step_name,
                    "native_ms": 1e3 * t_native,
                    "patched_ms": 1e3 * t_patched,
                    "ratio": t_patched / t_native,
                }
                print(
                    f"{case:12s} {length:6d} {step_name:10s} native {row['native_ms']:9.1f} ms  "
                    f"patched {row['patched_ms']:9.1f} ms  ratio {row['ratio']:.2f}",
                    flush=True,
                )
                rows.append(row)
    return rows


def markdown(rows: list[dict], repeats: int) -> str:
    lines = [
        f"Medians of {repeats} alternating runs, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        "fp32, sdpa, batch 1; models: 4 layers, hidden 256, 8 heads (LLaMA: 2 kv heads).",
        "",
        "| case | tokens | step | native ms | patched ms | patched / native |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['case']} | {r['tokens']} | {r['step']} | {r['native_ms']:.1f} | {r['patched_ms']:.1f} | "
        f"{r['ratio']:.2f} |"
        for r in rows
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", help="write the markdown table here")
    args = parser.parse_args()
    rows = run(args.cases, args.lengths, args.repeats)
    table = markdown(rows, args.repeats)
    print("\n" + table)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(table + "\n")


if __name__ == "__main__":
    main()
