"""Protocol B (docs/benchmarks.md): speed of patched models against native, measured in one process.

For each case (LLaMA -> alibi, LLaMA -> t5, GPT-2 -> rope by default) and each length, the native and the
patched model run alternately (A/B, A/B, ...) and the script reports medians and the patched/native ratio for a
forward pass, a training step (forward + backward) and cached decoding (tokens/s after a prompt of that length),
plus the peak resident memory of one forward, measured in a fresh subprocess per model (ru_maxrss). Absolute
times on shared machines are noise; ratios measured side by side are the result.

    python scripts/bench_speed.py                      # 512, 2048 and 8192 tokens, small models from configs
    python scripts/bench_speed.py --lengths 512 --repeats 3 --steps forward decode --output bench.md
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import hf_posswap as ps

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_section import replace_section  # noqa: E402

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
    # the table must also hold the tokens that the decode benchmark generates
    config = GPT2Config(vocab_size=4096, n_embd=256, n_layer=4, n_head=8, n_positions=max_positions + 64)
    return GPT2LMHeadModel(config)


def forward_step(model: torch.nn.Module, input_ids: torch.Tensor) -> None:
    with torch.no_grad():
        model(input_ids=input_ids)


def train_step(model: torch.nn.Module, input_ids: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(input_ids=input_ids, labels=input_ids).loss.backward()


def decode_step(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int = 16) -> None:
    """Greedy generation of ``new_tokens`` with the KV cache after the prompt (the prefill is included)."""
    with torch.no_grad():
        model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=0)


def peak_memory_mb(family: str, scheme: str | None, length: int) -> float:
    """Peak resident memory (MB, VmHWM) of a fresh process that builds the model and runs one forward of
    ``length`` tokens: the interpreter, torch and the weights are in it too, so compare the difference."""
    import subprocess
    import sys

    swap_line = f"ps.swap(m, {scheme!r})" if scheme else "pass"
    code = "\n".join([
        "import sys, torch",
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})",
        "import bench_speed as b, hf_posswap as ps",
        f"m = b.build({family!r}, {length}).eval()",
        swap_line,
        f"b.forward_step(m, torch.randint(0, 4096, (1, {length})))",
        # VmHWM: this process's own high-water mark (ru_maxrss would carry the parent's over fork + exec)
        "print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) / 1024)",
    ])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1])


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


STEPS = {"forward": forward_step, "train": train_step, "decode": decode_step}
LABELS = {"forward": "forward ms", "train": "train step ms", "decode": "prefill + 16 cached decode steps ms"}


def run(
    cases: list[str], lengths: list[int], repeats: int, steps: list[str], memory: bool, max_train_length: int
) -> list[dict]:
    rows = []
    for case in cases:
        family, scheme = CASES[case]
        for length in lengths:
            native, patched = build(family, length), build(family, length)
            ps.swap(patched, scheme)
            input_ids = torch.randint(0, 4096, (1, length), generator=torch.Generator().manual_seed(length))
            for step_name in steps:
                if step_name == "train" and length > max_train_length:
                    continue  # T5's bias gradient forces sdpa's math backward: tens of GB at 8,192 tokens
                step = STEPS[step_name]
                native.train(step is train_step), patched.train(step is train_step)
                t_native, t_patched = alternate(
                    functools.partial(step, native, input_ids), functools.partial(step, patched, input_ids), repeats
                )
                row = {
                    "case": case,
                    "tokens": length,
                    "step": LABELS[step_name],
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
            if memory:
                native_mb, patched_mb = peak_memory_mb(family, None, length), peak_memory_mb(family, scheme, length)
                rows.append({"case": case, "tokens": length, "step": "peak RSS MB",
                             "native_ms": native_mb, "patched_ms": patched_mb, "ratio": patched_mb / native_mb})
                print(f"{case:12s} {length:6d} memory     native {native_mb:9.1f} MB patched {patched_mb:9.1f} MB",
                      flush=True)
    return rows


def markdown(rows: list[dict], repeats: int, max_train_length: int) -> str:
    lines = [
        f"Medians of {repeats} alternating runs, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        "fp32, sdpa, batch 1; models: 4 layers, hidden 256, 8 heads (LLaMA: 2 kv heads).",
        "",
        "Memory rows: peak resident MB of a fresh process that builds the model and runs one forward (interpreter,",
        f"torch and weights included), instead of milliseconds. Training steps only up to {max_train_length} tokens.",
        "",
        "| case | tokens | measure | native | patched | patched / native |",
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
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 2048, 8192])
    parser.add_argument("--steps", nargs="+", default=list(STEPS), choices=list(STEPS))
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-train-length", type=int, default=2048, help="skip training steps above this length")
    parser.add_argument("--output", help="write the markdown table here")
    parser.add_argument("--readme", help="README to refresh between <!-- bench-speed:start/end --> markers")
    args = parser.parse_args()
    rows = run(args.cases, args.lengths, args.repeats, args.steps, not args.no_memory, args.max_train_length)
    table = markdown(rows, args.repeats, args.max_train_length)
    print("\n" + table)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(table + "\n")
    if args.readme:
        command = "python scripts/bench_speed.py " + " ".join(sys.argv[1:])
        replace_section(Path(args.readme), "bench-speed", f"`{command.strip()}`:\n\n{table}")


if __name__ == "__main__":
    main()
